"""Fuzz the three gRPC services (Serving, Admin, Balancer) of one live ``moeserve up`` cluster
(1 router + 2 workers, gloo, a tiny Llama 4 checkpoint, EPLB with redundant slots) with
hypothesis: random and mutated requests of every method, with and without the admin token,
and raw random bytes to every method through a generic channel. No answer may be UNKNOWN or
INTERNAL (nor UNAVAILABLE or DEADLINE_EXCEEDED: the cluster must stay up); afterwards the
cluster serves a known prompt with the single-process reference's tokens, and the placement in
force equals the one the last accepted ApplyPlacement (or applied Rebalance) set.

Bounded: a few hundred examples in all (``max_examples`` per test), no per-example deadline,
no example database; about a minute on 2 cores. The balancer's loop cannot apply a plan of its
own (``--eplb-min-gain 2``: no plan gains that much), so every placement change is one the test
sees accepted; after each accepted one the test waits for its migration to end. Between the
admin fuzz and the balancer fuzz one valid placement is applied on purpose, so that the final
check always has an accepted placement to hold through the fuzz after it.
"""

from __future__ import annotations

import math
import time

import grpc
import numpy as np
import pytest
from cluster_util import prompts_for, random_placement, reference_generate, reference_model, tiny_checkpoint
from control_util import TOKEN, Up
from google.protobuf import message_factory
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeserve.rpc import admin_pb2, balancer_pb2, common_pb2, serving_pb2

WORKERS, REDUNDANT, MAX_MODEL_LEN = 2, 2, 64
FORBIDDEN = {
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
CALL_TIMEOUT_S = 60.0
FUZZ = settings(
    deadline=None,
    database=None,
    derandomize=False,
    print_blob=True,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

SERVICES = {
    "serving": serving_pb2.DESCRIPTOR.services_by_name["Serving"],
    "admin": admin_pb2.DESCRIPTOR.services_by_name["Admin"],
    "balancer": balancer_pb2.DESCRIPTOR.services_by_name["Balancer"],
}
# "/moeserve.v1.Admin/ApplyPlacement" -> (service key, request class, response class, server streaming)
METHODS = {
    f"/{svc.full_name}/{m.name}": (
        key,
        message_factory.GetMessageClass(m.input_type),
        message_factory.GetMessageClass(m.output_type),
        m.server_streaming,
    )
    for key, svc in SERVICES.items()
    for m in svc.methods
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path = str(tiny_checkpoint(tmp_path_factory.mktemp("fuzz"), "llama4"))
    model = reference_model(path)
    prompt = prompts_for(model.config.vocab_size, lengths=(6,), seed=8)[0]
    want = reference_generate(model, prompt, 8)
    up = Up(
        path,
        "--workers",
        str(WORKERS),
        "--enable-eplb",
        "--num-redundant-experts",
        str(REDUNDANT),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--eplb-step-interval",
        "1000000000",
        "--eplb-min-gain",
        "2",
        "--balancer-poll-interval",
        "0.2",
    )
    channels = {
        "serving": grpc.insecure_channel(up.serving),
        "admin": grpc.insecure_channel(up.admin),
        "balancer": grpc.insecure_channel(up.balancer),
    }
    serving, admin, balancer = up.clients()
    p = admin.placement()
    state = dict(
        up=up,
        channels=channels,
        admin=admin,
        serving=serving,
        balancer=balancer,
        prompt=prompt,
        want=want,
        vocab=model.config.vocab_size,
        layers=p.phy2log.shape[0],
        slots=p.phy2log.shape[1],
        experts=p.num_logical,
        expected=p.phy2log.copy(),
        accepted=0,
        codes={},
        calls=0,
    )
    yield state
    for ch in channels.values():
        ch.close()
    up.stop()


# -- calling ------------------------------------------------------------------------------------


def call(c, method: str, payload: bytes, token: str | None):
    """Send ``payload`` (bytes) to ``method``; returns (code, decoded response or None). Fails the
    test on a forbidden code, and follows an accepted placement change to the end of its migration."""
    key, _, resp_cls, streaming = METHODS[method]
    ch = c["channels"][key]
    md = (("authorization", f"Bearer {token}"),) if token else ()
    try:
        if streaming:
            raw = list(ch.unary_stream(method)(payload, timeout=CALL_TIMEOUT_S, metadata=md))
            out = [resp_cls.FromString(r) for r in raw]
        else:
            out = resp_cls.FromString(ch.unary_unary(method)(payload, timeout=CALL_TIMEOUT_S, metadata=md))
        code = grpc.StatusCode.OK
    except grpc.RpcError as e:
        code, out = e.code(), None
        assert code not in FORBIDDEN, f"{method} answered {code.name}: {e.details()} (request {payload[:200]!r})"
        assert "Unexpected <class" not in (e.details() or ""), e.details()
    c["calls"] += 1
    c["codes"][(method, code.name)] = c["codes"].get((method, code.name), 0) + 1
    if code == grpc.StatusCode.OK:
        _track(c, method, out)
    return code, out


def _track(c, method: str, out) -> None:
    """An accepted change of the placement: remember its target and wait for its migration to end."""
    if method == "/moeserve.v1.Admin/ApplyPlacement" and not out.dry_run and out.migration_id:
        target, mid = out.phy2log, out.migration_id
    elif method == "/moeserve.v1.Balancer/Rebalance" and out.applied:
        target, mid = out.phy2log, out.migration_id
    else:
        return
    mig = c["admin"].wait_migration(mid, timeout=120)
    assert mig.state == "done", mig
    c["expected"] = np.asarray(target.values, dtype=np.int64).reshape(target.rows, target.cols)
    c["accepted"] += 1


# -- strategies ---------------------------------------------------------------------------------

I64 = st.integers(-(2**63), 2**63 - 1)
SMALL = st.integers(-3, 70)
FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(
        [0.0, -0.0, 1e-320, 5e-324, 1e-6, 1e-5, 0.5, 1.0, 2.0, 1e30, 1e300, -1.0, math.nan, math.inf, -math.inf]
    ),
)
TOKENS = st.sampled_from([TOKEN, TOKEN, TOKEN, TOKEN, None, "wrong", ""])  # mostly the admin token


def _maybe(strategy):
    return st.one_of(st.none(), strategy)


def _mostly(valid, wild):
    """``valid`` three times in four, else ``wild``."""
    return st.integers(0, 3).flatmap(lambda i: wild if i == 0 else valid)


@st.composite
def generate_requests(draw, vocab: int):
    r = serving_pb2.GenerateRequest()
    kind = draw(st.sampled_from(["ids", "ids", "ids", "ids", "text", "text", "both", "none"]))
    if kind in ("ids", "both"):
        ids = draw(
            _mostly(
                st.lists(st.integers(0, vocab - 1), min_size=1, max_size=24),
                st.lists(st.one_of(I64, SMALL, st.integers(0, vocab - 1)), max_size=24),
            )
        )
        r.prompt_token_ids.extend(ids)
    if kind in ("text", "both"):
        r.prompt = draw(st.text(max_size=200))
    for name, strat in (
        ("max_tokens", _mostly(st.integers(1, 8), st.one_of(SMALL, I64))),
        ("top_p", _mostly(st.floats(0.05, 1.0), FLOATS)),
        ("seed", _mostly(st.integers(0, 2**63 - 1), I64)),
    ):
        v = draw(_maybe(strat))
        if v is not None:
            setattr(r, name, v)
    r.temperature = draw(
        _mostly(st.one_of(st.just(0.0), st.floats(0.0, 3.0), st.sampled_from([1e-320, 5e-324, 1e-6])), FLOATS)
    )
    r.top_k = draw(_mostly(st.integers(0, 10), st.one_of(SMALL, I64)))
    r.stop_token_ids.extend(
        draw(
            _mostly(
                st.lists(st.integers(0, vocab - 1), max_size=4),
                st.lists(st.one_of(I64, st.integers(0, vocab - 1)), max_size=8),
            )
        )
    )
    r.ignore_eos = draw(st.booleans())
    return r


@st.composite
def placements(draw, c):
    """phy2log: a valid random placement, sometimes mutated (a wrong id, a missing expert, a
    wrong shape, values that do not fill the shape)."""
    seed = draw(st.integers(0, 2**32 - 1))
    p = random_placement(c["layers"], c["experts"], c["slots"], seed)
    how = draw(st.sampled_from(["valid", "valid", "valid", "id", "missing", "shape", "values", "random"]))
    m = common_pb2.Int64Matrix(rows=p.shape[0], cols=p.shape[1], values=p.ravel().tolist())
    if how == "id":
        m.values[draw(st.integers(0, len(m.values) - 1))] = draw(st.one_of(I64, st.integers(-2, c["experts"] + 2)))
    elif how == "missing":
        row = draw(st.integers(0, p.shape[0] - 1))
        p[row] = 0
        del m.values[:]
        m.values.extend(p.ravel().tolist())
    elif how == "shape":
        m.rows, m.cols = draw(st.integers(-2, 6)), draw(st.integers(-2, 14))
    elif how == "values":
        del m.values[draw(st.integers(0, len(m.values) - 1)) :]
    elif how == "random":
        m = common_pb2.Int64Matrix(rows=draw(I64), cols=draw(I64), values=draw(st.lists(I64, max_size=30)))
    return m


@st.composite
def admin_requests(draw, c):
    name = draw(
        st.sampled_from(
            [
                "GetPlacement",
                "ApplyPlacement",
                "ApplyPlacement",
                "ApplyPlacement",
                "GetMigration",
                "AbortMigration",
                "GetExpertLoad",
                "DumpLoad",
                "GetStatus",
                "GetBalancerSettings",
                "PutBalancerSettings",
                "PutBalancerSettings",
            ]
        )
    )
    if name == "ApplyPlacement":
        r = admin_pb2.ApplyPlacementRequest(dry_run=draw(st.booleans()))
        if draw(st.integers(0, 3)):
            r.phy2log.CopyFrom(draw(placements(c)))
        else:
            content = draw(
                st.one_of(
                    st.binary(max_size=300),
                    st.sampled_from(
                        [
                            b'{"physical_to_logical_map": [[0, 1], [2]]}',
                            b'{"format": "moeserve.placement/1"}',
                            b"{}",
                            b"[]",
                            b'{"physical_to_logical_map": "x"}',
                        ]
                    ),
                )
            )
            r.file.CopyFrom(admin_pb2.PlacementFile(format=draw(st.integers(0, 5)), content=content))
        if draw(st.integers(0, 3)) == 0:
            r.expected_version = draw(st.one_of(st.integers(-1, 10), I64))
    elif name == "GetMigration":
        r = admin_pb2.GetMigrationRequest(
            migration_id=draw(st.text(max_size=20)),
            wait_s=draw(st.one_of(st.floats(-1, 0.5), st.sampled_from([math.nan, -math.inf, 1e-300, 0.0]))),
        )
    elif name == "GetExpertLoad":
        r = admin_pb2.GetExpertLoadRequest(window_steps=draw(st.one_of(st.integers(-2, 1002), I64)))
    elif name == "PutBalancerSettings":
        r = admin_pb2.BalancerSettings()
        for field, strat in (
            ("window_steps", _mostly(st.integers(0, 1000), st.one_of(st.integers(-2, 1002), I64))),
            ("step_interval", _mostly(st.integers(1, 10**9), st.one_of(st.integers(-2, 10), I64))),
            ("min_balancedness", _mostly(st.floats(0.0, 1.0), FLOATS)),
            ("paused", st.booleans()),
        ):
            v = draw(_maybe(strat))
            if v is not None:
                setattr(r, field, v)
    else:
        r = METHODS[f"/moeserve.v1.Admin/{name}"][1]()
    return f"/moeserve.v1.Admin/{name}", r


@st.composite
def balancer_requests(draw):
    name = draw(
        st.sampled_from(["Rebalance", "Rebalance", "SetConfig", "SetConfig", "Pause", "Resume", "GetBalancerStatus"])
    )
    if name == "Rebalance":
        r = balancer_pb2.RebalanceRequest(dry_run=draw(st.booleans()), wait=draw(st.booleans()))
    elif name == "SetConfig":
        r = balancer_pb2.BalancerConfig()
        for field, strat in (
            ("window_steps", _mostly(st.integers(0, 1000), st.one_of(st.integers(-2, 1002), I64))),
            ("step_interval", _mostly(st.integers(1, 10**9), st.one_of(st.integers(-2, 10), I64))),
            ("min_balancedness", _mostly(st.floats(0.0, 1.0), FLOATS)),
        ):
            v = draw(_maybe(strat))
            if v is not None:
                setattr(r, field, v)
    else:
        r = METHODS[f"/moeserve.v1.Balancer/{name}"][1]()
    return f"/moeserve.v1.Balancer/{name}", r


def _token(draw_value):
    return TOKEN if draw_value is True else None if draw_value in (None, False) else draw_value


def _mutate(data: bytes, draw) -> bytes:
    """A serialized request with some bytes flipped, cut, or spliced with random ones."""
    if not data:
        return draw(st.binary(min_size=1, max_size=64))
    b = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(["flip", "cut", "insert"]))
        i = draw(st.integers(0, max(0, len(b) - 1)))
        if how == "flip" and b:
            b[i] ^= draw(st.integers(1, 255))
        elif how == "cut":
            del b[i:]
        else:
            b[i:i] = draw(st.binary(min_size=1, max_size=16))
    return bytes(b)


# -- the fuzz -----------------------------------------------------------------------------------


@settings(FUZZ, max_examples=70)
@given(data=st.data())
def test_fuzz_serving(cluster, data):
    c = cluster
    r = data.draw(generate_requests(c["vocab"]))
    method = data.draw(st.sampled_from(["/moeserve.v1.Serving/Generate", "/moeserve.v1.Serving/GenerateStream"]))
    payload = r.SerializeToString()
    if data.draw(st.integers(0, 4)) == 0:
        payload = _mutate(payload, data.draw)
    call(c, method, payload, _token(data.draw(TOKENS)))


@settings(FUZZ, max_examples=90)
@given(data=st.data())
def test_fuzz_admin(cluster, data):
    c = cluster
    method, r = data.draw(admin_requests(c))
    payload = r.SerializeToString()
    if data.draw(st.integers(0, 5)) == 0:
        payload = _mutate(payload, data.draw)
    call(c, method, payload, _token(data.draw(TOKENS)))


def test_between_the_fuzz_rounds_a_valid_placement_is_accepted_and_moved(cluster):
    """One authenticated ApplyPlacement of a valid random placement, after the admin fuzz and
    before the balancer and raw-bytes fuzz: it is accepted and its migration ends (``call``
    follows it), whatever the fuzz before did to the settings. The fuzz alone reaches an accepted
    change only by chance (a valid, authenticated, unversioned, non-dry-run draw: a few in a
    hundred), so without this call the final test would sometimes have nothing to hold."""
    c = cluster
    before = c["accepted"]
    p = random_placement(c["layers"], c["experts"], c["slots"], seed=int(c["calls"]) + 1)
    m = common_pb2.Int64Matrix(rows=p.shape[0], cols=p.shape[1], values=p.ravel().tolist())
    r = admin_pb2.ApplyPlacementRequest(phy2log=m)
    code, out = call(c, "/moeserve.v1.Admin/ApplyPlacement", r.SerializeToString(), TOKEN)
    assert code == grpc.StatusCode.OK, code
    assert c["accepted"] == before + 1
    np.testing.assert_array_equal(c["admin"].placement().phy2log, p)


@settings(FUZZ, max_examples=50)
@given(data=st.data())
def test_fuzz_balancer(cluster, data):
    c = cluster
    method, r = data.draw(balancer_requests())
    payload = r.SerializeToString()
    if data.draw(st.integers(0, 5)) == 0:
        payload = _mutate(payload, data.draw)
    call(c, method, payload, _token(data.draw(TOKENS)))


@settings(FUZZ, max_examples=110)
@given(method=st.sampled_from(sorted(METHODS)), payload=st.binary(max_size=200), token=TOKENS)
def test_fuzz_raw_bytes_to_every_method(cluster, method, payload, token):
    call(cluster, method, payload, _token(token))


def test_after_the_fuzz_the_cluster_serves_the_reference_tokens_and_holds_the_accepted_placement(cluster):
    c = cluster
    print("calls by method and code:", *(f"{m} {code}: {n}" for (m, code), n in sorted(c["codes"].items())), sep="\n  ")
    assert c["calls"] >= 300, c["calls"]
    codes = {code for (_, code) in c["codes"]}
    assert {"OK", "INVALID_ARGUMENT", "UNAUTHENTICATED"} <= codes, c["codes"]
    assert c["accepted"] >= 1, c["codes"]  # some placement change was accepted and done
    deadline = time.monotonic() + 60
    while c["admin"].status().migration is not None:  # nothing left running
        assert time.monotonic() < deadline
        time.sleep(0.1)
    st_ = c["admin"].status()
    assert st_.error == ""
    np.testing.assert_array_equal(c["admin"].placement().phy2log, c["expected"])
    out = c["serving"].generate(prompt_token_ids=c["prompt"], max_tokens=8, ignore_eos=True)
    assert out.token_ids == c["want"], c["up"].logs()
    streamed = [
        t
        for ch in c["serving"].generate_stream(prompt_token_ids=c["prompt"], max_tokens=8, ignore_eos=True)
        for t in ch.token_ids
    ]
    assert streamed == c["want"]
