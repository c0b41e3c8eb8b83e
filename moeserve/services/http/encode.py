"""What the OpenAI-compatible HTTP API (``moeserve.services.http``) writes: JSON bodies, errors
in OpenAI's shape with their HTTP status, server-sent events, and the parts of a response built
from a choice's state (logprobs, usage, token ids).

Errors: ``{"error": {"message", "type", "param", "code"}}``; :func:`api_error` maps the
engine's exceptions to a status (400 bad request, 404 not found, 429 queue full, 503
unavailable, 500 anything else).
"""

from __future__ import annotations

import asyncio
import json
import math

from moeserve.router.engine.api import EngineError, InvalidRequest, NotFound, QueueFull, Unavailable

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}

# -- errors -----------------------------------------------------------------------------------

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """An answer in OpenAI's error shape with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self):
        return json_response(self.body(), self.status)


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def api_error(e: BaseException) -> ApiError:
    """The engine's exceptions (and anything else) as an HTTP answer."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, (InvalidRequest, ValueError)):
        return ApiError(400, str(e), getattr(e, "param", None))
    if isinstance(e, QueueFull):
        return ApiError(429, str(e), code="queue_full")
    if isinstance(e, NotFound):
        return ApiError(404, str(e))
    if isinstance(e, (Unavailable, EngineError, OSError)):
        return ApiError(503, f"the cluster is unavailable: {e}", code="unavailable")
    return ApiError(500, f"{type(e).__name__}: {e}")


# -- JSON and server-sent events --------------------------------------------------------------


def dumps(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def json_response(obj, status: int = 200, headers: dict | None = None):
    from starlette.responses import Response

    return Response(dumps(obj), status_code=status, media_type="application/json", headers=headers)


def sse(obj) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def disconnected(receive) -> None:
    """Returns when the client has gone (call only once the request's body was read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class EventStream:
    """A server-sent-events response from an async iterator of bytes; the client going away
    cancels it and closes the iterator (which cancels its requests)."""

    def __init__(self, chunks, headers: dict | None = None):
        self.chunks = chunks
        self.headers = [(b"content-type", b"text/event-stream; charset=utf-8")] + [
            (k.encode(), v.encode()) for k, v in {**SSE_HEADERS, **(headers or {})}.items()
        ]

    async def __call__(self, scope, receive, send) -> None:
        async def pump():
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        work = asyncio.ensure_future(pump())
        gone = asyncio.ensure_future(disconnected(receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            work.cancel()
            gone.cancel()
            await asyncio.wait({work, gone})
            await self.chunks.aclose()
        if work.done() and not work.cancelled():
            exc = work.exception()
            if exc is not None and not isinstance(exc, OSError):
                raise exc


# -- the parts of a response ------------------------------------------------------------------


def finite(x: float | None) -> float | None:
    """A logprob as JSON can carry it (-inf: -9999, as vLLM writes it); None stays None."""
    return None if x is None else x if math.isfinite(x) else -9999.0


def usage(prompt_tokens: int, choices, n: int = 1) -> dict:
    """OpenAI's usage of a request's choices, ``n`` per prompt (each prompt counted once, the
    cached tokens of its first choice with it)."""
    done = sum(c.tokens for c in choices)
    cached = sum(c.cached_tokens for c in choices[::n])
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": done,
        "total_tokens": prompt_tokens + done,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion_logprobs(tokenizer, entries) -> dict:
    """/v1/completions' logprobs of (token id, logprob, [(id, logprob)], text offset) entries;
    echo's first prompt token has None for its logprob and top logprobs."""
    text = tokenizer.token_text if tokenizer is not None else str
    return {
        "tokens": [text(t) for t, _, _, _ in entries],
        "token_logprobs": [finite(lp) for _, lp, _, _ in entries],
        "top_logprobs": [
            None if top is None else {**{text(i): finite(v) for i, v in top}, text(t): finite(lp)}
            for t, lp, top, _ in entries
        ],
        "text_offset": [off for _, _, _, off in entries],
    }


def prompt_logprobs_part(tokenizer, prompt_ids, plp, k: int) -> list:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, then an object of token
    id -> {logprob, rank, decoded_token} holding the token itself and the ``k`` most likely."""
    text = tokenizer.token_text if tokenizer is not None else str
    out: list = [None]
    for i, t in enumerate(list(prompt_ids)[1:]):
        entry = {
            str(int(a)): {"logprob": finite(float(b)), "rank": r + 1, "decoded_token": text(int(a))}
            for r, (a, b) in enumerate(zip(plp.top_ids[i][:k], plp.top_logprobs[i][:k]))
        }
        entry[str(int(t))] = {
            "logprob": finite(float(plp.logprob[i])),
            "rank": int(plp.rank[i]),
            "decoded_token": text(int(t)),
        }
        out.append(entry)
    return out


def chat_logprobs(tokenizer, entries) -> dict:
    """/v1/chat/completions' logprobs: tokens named by their text and bytes."""

    def one(t, lp):
        if tokenizer is None:
            return {"token": str(t), "logprob": finite(lp), "bytes": None}
        return {"token": tokenizer.token_text(t), "logprob": finite(lp), "bytes": list(tokenizer.token_bytes(t))}

    return {
        "content": [{**one(t, lp), "top_logprobs": [one(i, v) for i, v in top]} for t, lp, top, _ in entries],
        "refusal": None,
    }


def logprobs_part(tokenizer, entries, chat: bool) -> dict:
    return chat_logprobs(tokenizer, entries) if chat else completion_logprobs(tokenizer, entries)


__all__ = [
    "ApiError",
    "api_error",
    "bad",
    "dumps",
    "json_response",
    "sse",
    "SSE_DONE",
    "EventStream",
    "disconnected",
    "usage",
    "completion_logprobs",
    "chat_logprobs",
    "logprobs_part",
    "prompt_logprobs_part",
    "finite",
    "ERROR_TYPES",
    "SSE_HEADERS",
]
