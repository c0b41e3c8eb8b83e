"""The one mapping from the engine's exceptions (``moeserve.router.engine.api``) to gRPC status
codes, for every service. Most specific first: the first class an exception is an instance of
wins."""

from __future__ import annotations

from typing import NoReturn

import grpc

from moeserve.router.engine.api import (
    EngineError,
    EplbDisabled,
    InvalidRequest,
    NotFound,
    QueueFull,
    StaleVersion,
    Unavailable,
)

STATUS_OF = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (StaleVersion, grpc.StatusCode.FAILED_PRECONDITION),
    (EplbDisabled, grpc.StatusCode.FAILED_PRECONDITION),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (EngineError, grpc.StatusCode.UNAVAILABLE),
    (OSError, grpc.StatusCode.UNAVAILABLE),
)


def status_of(e: BaseException) -> grpc.StatusCode:
    for cls, code in STATUS_OF:
        if isinstance(e, cls):
            return code
    return grpc.StatusCode.INTERNAL


def message_of(e: BaseException) -> str:
    if isinstance(e, StaleVersion):
        return f"stale placement version: {e}"
    if isinstance(e, Unavailable):
        return f"the cluster is unavailable: {e}"
    if status_of(e) is grpc.StatusCode.INTERNAL:
        return f"{type(e).__name__}: {e}"
    return str(e)


async def abort_for(context, e: BaseException) -> NoReturn:
    """End the call with ``e``'s status and message."""
    await context.abort(status_of(e), message_of(e))
    raise AssertionError("context.abort returned")  # never: grpc's abort raises (AbortError)
