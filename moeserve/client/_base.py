"""What the sync and async clients share: channels, metadata, retries, request builders."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import numpy as np

from moeserve.client.types import MoeserveError
from moeserve.rpc import admin_pb2, balancer_pb2, serving_pb2
from moeserve.wire import SERVER_METADATA_KEY, int64_matrix

DEFAULT_TIMEOUT_S = 60.0
WAIT_TIMEOUT_S = 600.0
RETRY_DELAYS_S = (0.1, 0.3, 1.0)  # pauses between attempts of a call that reached no server
FILE_FORMATS = {
    "moeserve": admin_pb2.PlacementFile.MOESERVE_JSON,
    "sglang-json": admin_pb2.PlacementFile.SGLANG_JSON,
    "sglang-pt": admin_pb2.PlacementFile.SGLANG_PT,
}


def channel_args(address: str, token: str | None, tls: bool, ca_file: str | None, max_message_bytes: int):
    """(target, credentials or None, options, metadata)."""
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"address must be 'host:port', got {address!r}")
    # A server that was down and came up is reconnected to within a second (gRPC's default
    # backoff grows to two minutes, during which calls fail fast without trying the server).
    opts = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", -1),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]
    creds = None
    if tls or ca_file:
        root = Path(ca_file).read_bytes() if ca_file else None
        creds = grpc.ssl_channel_credentials(root_certificates=root)
    token = token if token is not None else (os.environ.get("MOESERVE_ADMIN_TOKEN") or None)
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    return address, creds, opts, metadata


def generate_request(
    prompt, prompt_token_ids, max_tokens, temperature, top_p, top_k, seed, stop_token_ids, ignore_eos, cache_salt=""
) -> serving_pb2.GenerateRequest:
    r = serving_pb2.GenerateRequest(
        prompt=prompt or "",
        prompt_token_ids=list(prompt_token_ids or ()),
        max_tokens=int(max_tokens),
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=bool(ignore_eos),
        cache_salt=str(cache_salt or ""),
    )
    if seed is not None:
        r.seed = int(seed)
    return r


def file_format(path: str, fmt: str | None) -> admin_pb2.PlacementFile.Format:
    if fmt is None:
        fmt = "sglang-pt" if str(path).endswith(".pt") else None
        if fmt is None:
            text = Path(path).read_text(errors="replace")
            fmt = "moeserve" if '"moeserve.placement/' in text else "sglang-json"
    if fmt not in FILE_FORMATS:
        raise ValueError(f"placement file format must be one of {sorted(FILE_FORMATS)}, got {fmt!r}")
    return FILE_FORMATS[fmt]


def apply_request(
    phy2log, expected_version, dry_run, file, file_format_name, breakeven=None
) -> admin_pb2.ApplyPlacementRequest:
    if (phy2log is None) == (file is None):
        raise ValueError("give either phy2log [L, P] or file=PATH")
    r = admin_pb2.ApplyPlacementRequest(dry_run=bool(dry_run))
    if breakeven is not None:
        r.breakeven.CopyFrom(int64_matrix(np.asarray(breakeven)))
    if phy2log is not None:
        r.phy2log.CopyFrom(int64_matrix(np.asarray(phy2log)))
    else:
        r.file.CopyFrom(
            admin_pb2.PlacementFile(format=file_format(file, file_format_name), content=Path(file).read_bytes())
        )
    if expected_version is not None:
        r.expected_version = int(expected_version)
    return r


def balancer_config(window_steps, step_interval, min_balancedness) -> balancer_pb2.BalancerConfig:
    c = balancer_pb2.BalancerConfig()
    if window_steps is not None:
        c.window_steps = int(window_steps)
    if step_interval is not None:
        c.step_interval = int(step_interval)
    if min_balancedness is not None:
        c.min_balancedness = float(min_balancedness)
    return c


def reached_no_server(e: grpc.RpcError) -> bool:
    """Whether a failed call reached no moeserve server, so that repeating it is safe whatever
    the method (Generate, ApplyPlacement and Rebalance must not run twice): UNAVAILABLE without
    the trailing metadata every moeserve server sets on the calls its handlers answer, i.e. the
    transport failed (a connection refused or unreachable, a TLS mismatch). A connection cut
    after the request went out lacks the mark too: the one case where a repeat may run twice."""
    if e.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    return not any(key == SERVER_METADATA_KEY for key, _ in e.trailing_metadata() or ())


def retry_pause(e: grpc.RpcError, pauses: list[float]) -> float | None:
    """The pause before the next attempt of a call that failed with ``e`` (taken from
    ``pauses``, a copy of RETRY_DELAYS_S per call), or None: give up and raise :func:`error`."""
    return pauses.pop(0) if pauses and reached_no_server(e) else None


def error(e: grpc.RpcError) -> MoeserveError:
    return MoeserveError(e.code(), e.details() or "")
