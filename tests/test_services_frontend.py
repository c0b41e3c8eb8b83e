"""The serving front end's own answers, with a stand-in for the leader's local channel: a full
queue is RESOURCE_EXHAUSTED, a leader gone is UNAVAILABLE, input only the front end can judge
is INVALID_ARGUMENT with what is allowed."""

import grpc
import pytest

from moeserve.client import Client, MoeserveError
from moeserve.router.engine.api import Finished, FinishReason, FirstToken, InvalidRequest, QueueFull, Token
from moeserve.router.engine.channel import ClusterError
from moeserve.rpc import serving_pb2_grpc
from moeserve.services.frontend import ServingService
from moeserve.services.server import SERVING, ServerOptions, ServiceServer, ThreadedServer


class StandInLeader:
    """As AsyncEngineClient: ``generate`` raises ``error`` or streams two tokens and "length"."""

    def __init__(self):
        self.error = None
        self.seen = []

    async def generate(self, reqs):
        self.seen.extend(reqs)
        if self.error:
            raise self.error
        yield 0, FirstToken(11, cached_tokens=8)  # says how much of the prompt was cached
        yield 0, Token(12)
        yield 0, Finished(FinishReason.LENGTH)


@pytest.fixture(scope="module")
def front():
    leader = StandInLeader()
    service = ServingService(leader, tokenizer=None)
    srv = ThreadedServer(
        ServiceServer(SERVING, lambda s: serving_pb2_grpc.add_ServingServicer_to_server(service, s), ServerOptions())
    )
    srv.start()
    yield leader, Client(f"127.0.0.1:{srv.server.port}", timeout=10)
    srv.stop()


def test_requests_reach_the_leader_as_engine_requests(front):
    leader, c = front
    leader.error = None
    out = c.generate(
        prompt_token_ids=[5, 6],
        max_tokens=2,
        temperature=0.5,
        top_p=0.9,
        top_k=4,
        seed=3,
        stop_token_ids=[9],
        ignore_eos=True,
        cache_salt="tenant-a",
    )
    assert out.token_ids == [11, 12] and out.finish_reason == "length" and out.text == ""
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.cached_tokens) == (2, 2, 8)
    req = leader.seen[-1]
    assert (req.prompt_ids, req.max_tokens, req.stop_token_ids, req.ignore_eos) == ((5, 6), 2, (9,), True)
    assert req.cache_salt == "tenant-a"
    last = list(c.generate_stream(prompt_token_ids=[5, 6], max_tokens=2))[-1]
    assert last.usage is not None and last.usage.cached_tokens == 8 and leader.seen[-1].cache_salt == ""
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.top_k, req.sampling.seed) == (0.5, 0.9, 4, 3)


@pytest.mark.parametrize(
    "error,code,message",
    [
        (
            QueueFull("the admission queue is full (1 waiting requests); retry later"),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "admission queue is full",
        ),
        (ClusterError("rank 2 exited with signal SIGKILL"), grpc.StatusCode.UNAVAILABLE, "rank 2 exited"),
        (
            InvalidRequest("prompt token id 999 is outside the vocabulary [0, 512)"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "outside the vocabulary",
        ),
    ],
)
def test_what_the_leader_refuses_maps_to_a_status(front, error, code, message):
    leader, c = front
    leader.error = error
    try:
        for call in (lambda: c.generate(prompt_token_ids=[5]), lambda: list(c.generate_stream(prompt_token_ids=[5]))):
            with pytest.raises(MoeserveError) as e:
                call()
            assert e.value.code == code and message in e.value.message
    finally:
        leader.error = None


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(prompt="hi", prompt_token_ids=[1]), "not both"),
        (dict(prompt="hi"), "no tokenizer"),
        (dict(prompt_token_ids=[1], top_p=0.0), "top_p must be in (0, 1]"),
        (dict(prompt_token_ids=[1], top_k=-2), "top_k must be in -1.."),  # -1 is no top-k, as on HTTP
        (dict(prompt_token_ids=[1], seed=-5), "seed must be in 0.."),
        (dict(prompt_token_ids=[1], top_k=2**62), "top_k must be in -1..2147483647"),
        (dict(prompt_token_ids=[1, 2**62]), "prompt token ids: "),
        (dict(prompt_token_ids=[1], stop_token_ids=[2**62]), "stop token ids: "),
        (dict(prompt_token_ids=[1], max_tokens=2**62), "max_tokens must be in 1.."),
    ],
)
def test_input_the_front_end_judges_is_invalid_with_what_is_allowed(front, kw, message):
    _, c = front
    with pytest.raises(MoeserveError) as e:
        c.generate(**kw)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.message


@pytest.mark.timeout(60)
def test_a_generation_the_front_end_answered_unavailable_is_not_repeated(front):
    """The leader gone: the front end's own UNAVAILABLE carries the server's mark, so the SDK
    does not send the (not idempotent) generation again."""
    import asyncio

    from moeserve.client import AsyncClient

    leader, c = front
    leader.error = ClusterError("the leader exited")

    async def aio(address):
        async with AsyncClient(address, timeout=10) as a:

            async def stream():
                return [x async for x in a.generate_stream(prompt_token_ids=[5])]

            for call in (lambda: a.generate(prompt_token_ids=[5]), stream):
                with pytest.raises(MoeserveError) as e:
                    await call()
                assert e.value.code == grpc.StatusCode.UNAVAILABLE

    try:
        for call in (lambda: c.generate(prompt_token_ids=[5]), lambda: list(c.generate_stream(prompt_token_ids=[5]))):
            n = len(leader.seen)
            with pytest.raises(MoeserveError) as e:
                call()
            assert e.value.code == grpc.StatusCode.UNAVAILABLE and len(leader.seen) == n + 1
        n = len(leader.seen)
        asyncio.run(aio(c.address))
        assert len(leader.seen) == n + 2
    finally:
        leader.error = None


class BacklogLeader:
    """As AsyncEngineClient's ``generate_batches``: hands out ``batches`` as they are, as the
    channel does to a front end that fell behind the leader (several steps' events at once)."""

    def __init__(self, batches):
        self.batches = batches

    async def generate_batches(self, reqs):
        for b in self.batches:
            yield [(0, ev) for ev in b]


def _serve(leader):
    service = ServingService(leader, tokenizer=None)
    srv = ThreadedServer(
        ServiceServer(SERVING, lambda s: serving_pb2_grpc.add_ServingServicer_to_server(service, s), ServerOptions())
    )
    srv.start()
    return srv, Client(f"127.0.0.1:{srv.server.port}", timeout=10)


def test_a_backlog_of_tokens_leaves_as_one_message_in_order():
    """Tokens that arrived together (the front end behind the leader) go out in one stream
    message, in order; the finish message and the usage count every token; the unary call
    gets them all."""
    leader = BacklogLeader(
        [
            [FirstToken(11, cached_tokens=3), Token(12), Token(13)],
            [Token(14)],
            [Token(15), Finished(FinishReason.LENGTH)],
        ]
    )
    srv, c = _serve(leader)
    try:
        chunks = list(c.generate_stream(prompt_token_ids=[5, 6], max_tokens=5))
        assert [list(m.token_ids) for m in chunks] == [[11, 12, 13], [14], [15], []]
        last = chunks[-1]
        assert last.finish_reason == "length" and last.usage.completion_tokens == 5 and last.usage.cached_tokens == 3
        out = c.generate(prompt_token_ids=[5, 6], max_tokens=5)
        assert out.token_ids == [11, 12, 13, 14, 15] and out.usage.completion_tokens == 5
    finally:
        srv.stop()


def test_a_failure_behind_tokens_of_the_same_backlog_comes_after_them():
    """A backlog of tokens then the cluster's failure: the tokens are sent, then the call ends
    UNAVAILABLE with the failure's message."""
    from moeserve.router.engine.api import Failed

    srv, c = _serve(BacklogLeader([[FirstToken(11), Token(12), Failed("rank 1 was lost")]]))
    got = []
    try:
        with pytest.raises(MoeserveError) as e:
            for m in c.generate_stream(prompt_token_ids=[5], max_tokens=4):
                got.append(list(m.token_ids))
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and "rank 1 was lost" in e.value.message
        assert got == [[11, 12]]
    finally:
        srv.stop()


def test_a_coalescing_switch_the_front_end_does_not_know_fails_its_start(monkeypatch, capsys):
    from moeserve.cli import main
    from moeserve.services.admission import stream_coalescing

    monkeypatch.setenv("MOESERVE_CONTROL_KEY", "00" * 16)
    for v, on in (("1", True), ("0", False)):
        monkeypatch.setenv("MOESERVE_STREAM_COALESCE", v)
        assert stream_coalescing() is on
    monkeypatch.delenv("MOESERVE_STREAM_COALESCE")
    assert stream_coalescing() is True  # the default
    monkeypatch.setenv("MOESERVE_STREAM_COALESCE", "yes")
    assert main(["frontend", "--control-address", "127.0.0.1:1", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "$MOESERVE_STREAM_COALESCE must be 1" in err and "or 0 (one message per token), got 'yes'" in err


def test_a_log_level_no_process_knows_is_refused_by_name_before_anything_starts(monkeypatch, capsys, tmp_path):
    """MOESERVE_LOG_LEVEL: the logging level of every process, any case, INFO unless set; a
    level logging does not know fails a service's start with exit 2 and a cluster's
    construction (before any rank is spawned), naming the variable and the levels."""
    from cluster_util import tiny_checkpoint

    from moeserve.cli import main
    from moeserve.cluster import LocalCluster
    from moeserve.config import log_level

    monkeypatch.setenv("MOESERVE_CONTROL_KEY", "00" * 16)
    monkeypatch.delenv("MOESERVE_LOG_LEVEL", raising=False)
    assert log_level() == "INFO" and log_level({"MOESERVE_LOG_LEVEL": ""}) == "INFO"
    assert log_level({"MOESERVE_LOG_LEVEL": "debug"}) == "DEBUG"
    monkeypatch.setenv("MOESERVE_LOG_LEVEL", "verbose")
    assert main(["frontend", "--control-address", "127.0.0.1:1", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "MOESERVE_LOG_LEVEL='verbose': allowed DEBUG, INFO, WARNING, ERROR, CRITICAL" in err
    path = str(tmp_path / "m")
    tiny_checkpoint(path, "llama4")
    monkeypatch.setenv("MOESERVE_LOG_LEVEL", "warning")
    with pytest.raises(ValueError, match="MOESERVE_LOG_LEVEL='loud': allowed DEBUG"):
        LocalCluster(path, routers=1, workers=2, env={"MOESERVE_LOG_LEVEL": "loud"})  # the ranks' own
    assert LocalCluster(path, routers=1, workers=2).procs == []  # warning: accepted, nothing started


def test_with_coalescing_off_a_backlog_leaves_one_message_per_token(monkeypatch):
    monkeypatch.setenv("MOESERVE_STREAM_COALESCE", "0")
    srv, c = _serve(BacklogLeader([[FirstToken(11), Token(12), Token(13)], [Finished(FinishReason.LENGTH)]]))
    try:
        chunks = list(c.generate_stream(prompt_token_ids=[5], max_tokens=3))
        assert [list(m.token_ids) for m in chunks] == [[11], [12], [13], []]
    finally:
        srv.stop()
