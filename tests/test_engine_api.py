"""The engine's one typed API through both front doors, without rank processes: the local
channel (as the front end and the launcher use it) and the gRPC admin service, on an engine
whose steps a stand-in step driver answers. A prompt is validated once between the serving
handler and the step; a placement once between the ApplyPlacement handler and the workers."""

import socket
import threading
import time

import grpc
import numpy as np
import pytest

from moeserve.client import Client, MoeserveError
from moeserve.config import ClusterConfig, EplbConfig, Limits
from moeserve.dataplane import header_wire
from moeserve.dataplane.protocol import RankResult
from moeserve.placement import MigrationState, Placement
from moeserve.router.engine import leader as leader_module
from moeserve.router.engine.api import (
    Finished,
    FinishReason,
    FirstToken,
    GenerateRequest,
    InvalidRequest,
    ModelShape,
    NotFound,
    QueueFull,
    StaleVersion,
    Token,
)
from moeserve.router.engine.channel import AsyncEngineClient, ChannelServer, ClusterError, EngineClient
from moeserve.router.engine.leader import Engine
from moeserve.rpc import serving_pb2_grpc
from moeserve.sampling import SamplingParams
from moeserve.services.admin import start_admin
from moeserve.services.frontend import ServingService
from moeserve.services.server import SERVING, ServerOptions, ServiceServer, ThreadedServer

L, E, W, VOCAB, TOKEN = 2, 4, 2, 100, 7


class StandInRanks:
    """The step driver of a cluster whose every router samples TOKEN and whose workers stage
    and report without fault: it calls ``next_header`` / ``on_results`` as rank 0 does, and
    like routers with asynchronous steps it returns a step's tokens with the next step's
    results. Steps wait while ``gate`` is clear."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.world = engine.cfg.world_size
        self._stop = False
        self.gate = threading.Event()
        self.gate.set()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        outputs = None  # (step, tokens) not returned yet
        while not self._stop:
            self.gate.wait()
            h = self.engine.next_header()
            header_wire.encode(h)  # as the leader broadcasts it
            if h.stop:
                return
            results = [RankResult(r) for r in range(self.world)]
            if outputs is not None:
                results[0].tokens_step, results[0].tokens = outputs
            outputs = (h.step, {sid: TOKEN for sid in h.work[0].sampled_ids()}) if h.forward else None
            if h.read_load:
                results[0].logical_load = np.zeros((L, E), dtype=np.int64)
                results[0].worker_load = np.zeros((L, W), dtype=np.int64)
            if h.report:
                for r in self.engine.cfg.worker_ranks:
                    results[r].slot_digest = np.zeros((L, (E + 2) // W, 2))
            self.engine.on_results(h, results)

    def stop(self):
        self.engine.request_stop()
        self.thread.join(5)


@pytest.fixture()
def engine():
    cfg = ClusterConfig(
        model_dir="unused",
        routers=1,
        workers=W,
        eplb=EplbConfig(enable_eplb=True, num_redundant_experts=2),
        limits=Limits(max_model_len=64, max_waiting=4),
    )
    shape = ModelShape(L, E, 1, VOCAB, (2,), 16, (1, 3), 4)
    eng = Engine(cfg, shape, Placement(np.tile(np.arange(E + 2) % E, (L, 1)), E, W, version=1))
    ranks = StandInRanks(eng)
    eng.stand_in = ranks
    yield eng
    ranks.stop()


@pytest.fixture()
def channel(engine):
    key = b"k" * 16
    server = ChannelServer(engine, key)
    server.start()
    yield server, key
    server.close()


def test_the_channel_serves_the_typed_api_and_its_errors(engine, channel):
    server, key = channel
    c = EngineClient(server.address, key)
    assert c.placement() == engine.placement()
    events = list(c.generate_stream([GenerateRequest((1, 2, 3), 2, ignore_eos=True)]))
    assert events == [(0, FirstToken(TOKEN)), (0, Token(TOKEN)), (0, Finished(FinishReason.LENGTH))]
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        list(c.generate_stream([GenerateRequest((1, VOCAB), 2)]))
    with pytest.raises(NotFound):
        c.migration("nope")
    target = engine.placement().phy2log[:, ::-1].copy()
    with pytest.raises(StaleVersion):
        c.apply_placement(target, expected_version=99)
    mig = c.apply_placement(target)
    assert c.wait_migration(mig.migration_id, 10).state == MigrationState.DONE
    assert (c.placement().phy2log == target).all()
    assert c.status().placement_version == mig.target_version
    with pytest.raises(ClusterError, match="handshake"):
        EngineClient(server.address, b"wrong key 123456").placement()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "req,fragment",
    [
        (GenerateRequest((1, 10**30), 2), "prompt token id 1000000000000000000000000000000 is outside"),
        (GenerateRequest((-(10**30), 1), 2), "is outside the vocabulary"),
        (GenerateRequest((1,), 2, stop_token_ids=(10**30,)), "stop token id 1000000000000000000000000000000 is"),
        (GenerateRequest((1,), 2, SamplingParams(temperature=1.0, top_k=2**63)), "top_k must be in 0..100"),
        (GenerateRequest((1,), 2, SamplingParams(temperature=1.0, top_k=VOCAB + 1)), "top_k must be in 0..100"),
    ],
)
def test_a_request_a_step_header_could_not_carry_is_invalid_and_the_engine_serves_on(engine, channel, req, fragment):
    server, key = channel
    c = EngineClient(server.address, key)
    with pytest.raises(InvalidRequest, match=fragment):
        list(c.generate_stream([req]))
    events = list(c.generate_stream([GenerateRequest((1, 2), 2, ignore_eos=True)]))
    assert events[-1] == (0, Finished(FinishReason.LENGTH))


def test_a_silent_connection_does_not_stop_the_channel(engine, channel):
    server, key = channel
    idle = socket.create_connection(server.address)  # connects, never answers the handshake
    closed = socket.create_connection(server.address)
    closed.close()
    try:
        out = EngineClient(server.address, key).generate_stream([GenerateRequest((1,), 1, ignore_eos=True)])
        assert [ev for _, ev in out][-1] == Finished(FinishReason.LENGTH)
    finally:
        idle.close()


def test_a_prompt_is_validated_once_between_the_serving_handler_and_the_step(engine, channel, monkeypatch):
    calls = []
    real = leader_module.validate_request
    monkeypatch.setattr(leader_module, "validate_request", lambda *a: calls.append(a) or real(*a))
    server, key = channel
    service = ServingService(AsyncEngineClient(server.address, key))
    front = ThreadedServer(
        ServiceServer(SERVING, lambda s: serving_pb2_grpc.add_ServingServicer_to_server(service, s), ServerOptions())
    )
    front.start()
    try:
        client = Client(f"127.0.0.1:{front.server.port}", timeout=20)
        out = client.generate(prompt_token_ids=[1, 2], max_tokens=3, ignore_eos=True)
        assert out.token_ids == [TOKEN] * 3 and len(calls) == 1
        chunks = list(client.generate_stream(prompt_token_ids=[3], max_tokens=2, ignore_eos=True))
        assert [t for ch in chunks for t in ch.token_ids] == [TOKEN] * 2 and len(calls) == 2
        with pytest.raises(MoeserveError) as e:
            client.generate(prompt_token_ids=[VOCAB + 5], max_tokens=2)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and len(calls) == 3
    finally:
        front.stop()


def test_a_placement_is_validated_once_between_apply_placement_and_the_workers(engine, monkeypatch):
    checks = []
    real = Placement.__post_init__
    monkeypatch.setattr(Placement, "__post_init__", lambda self: checks.append(1) or real(self))
    admin = start_admin(engine, ServerOptions())
    try:
        client = Client(f"127.0.0.1:{admin.server.port}", timeout=20)
        target = engine.placement().phy2log[:, ::-1].copy()
        res = client.apply_placement(target)
        deadline = time.monotonic() + 10
        while engine.migration(res.migration_id).state != MigrationState.DONE and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.migration(res.migration_id).layers_committed == L  # every layer committed
        assert (engine.placement().phy2log == target).all()
        assert len(checks) == 1
        bad = target.copy()
        bad[0, 0] = E  # no such logical expert
        with pytest.raises(MoeserveError) as e:
            client.apply_placement(bad)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "out of range" in e.value.message
        assert (engine.placement().phy2log == target).all()
    finally:
        admin.stop()


def test_a_full_queue_is_queue_full_through_the_channel(engine, channel):
    server, key = channel
    engine.request_stop()  # no step runs: requests wait
    time.sleep(0.2)
    engine._stop.clear()
    c = EngineClient(server.address, key)
    streams = [c.open_stream([GenerateRequest((1,), 1)]) for _ in range(4)]
    try:
        time.sleep(0.2)
        with pytest.raises(QueueFull):
            list(c.generate_stream([GenerateRequest((1,), 1)]))
    finally:
        for s in streams:
            s.cancel()
            s.close()


def _count_connections(monkeypatch) -> list:
    opened = []
    real = AsyncEngineClient._connect

    async def counting(self):
        opened.append(1)
        return await real(self)

    monkeypatch.setattr(AsyncEngineClient, "_connect", counting)
    return opened


def test_a_step_delivery_defers_each_consumers_wake_up_to_its_end():
    """Sinks called inside step_delivery defer their consumer's wake-up (once per consumer) to
    the block's end, so a step's events are taken as one batch; outside one they wake at once."""
    import threading

    from moeserve.router.engine.api import after_delivery, step_delivery

    woken = []
    assert not after_delivery("a", lambda: woken.append("a"))  # no delivery runs: wake now
    with step_delivery():
        assert after_delivery("a", lambda: woken.append("a"))
        assert after_delivery("a", lambda: woken.append("a again"))  # one wake-up per consumer
        assert after_delivery("b", lambda: woken.append("b"))
        other = []  # another thread runs no delivery of its own
        t = threading.Thread(target=lambda: other.append(after_delivery("c", lambda: None)))
        t.start()
        t.join()
        assert other == [False] and woken == []
    assert woken == ["a", "b"]
    assert not after_delivery("a", lambda: None)  # the block ended


def test_streams_of_a_front_end_share_one_session_and_a_step_leaves_as_one_frame(engine, channel, monkeypatch):
    import asyncio

    from moeserve.router.engine import channel as channel_module

    server, key = channel
    opened = _count_connections(monkeypatch)
    frames = []
    real_frame = channel_module._frame
    monkeypatch.setattr(
        channel_module, "_frame", lambda msg: frames.append(len(msg[1]) if msg[0] == "events" else 0) or real_frame(msg)
    )

    async def main():
        client = AsyncEngineClient(server.address, key)

        async def one(n):
            return [ev async for _, ev in client.generate([GenerateRequest((1, 2), n, ignore_eos=True)])]

        async def release_when_all_wait():  # one batch: every step has a token of each stream
            while (lambda c: c["waiting"] + c["running"])(engine.scheduler.counts()) < 4:
                await asyncio.sleep(0.01)
            engine.stand_in.gate.set()

        engine.stand_in.gate.clear()
        outs, _ = await asyncio.gather(
            asyncio.gather(*(one(12) for _ in range(4))),  # max_waiting is 4
            release_when_all_wait(),
        )
        await client.close()
        return outs

    outs = asyncio.run(main())
    assert outs == [[FirstToken(TOKEN)] + [Token(TOKEN)] * 11 + [Finished(FinishReason.LENGTH)]] * 4
    assert len(opened) == 1  # one connection for 4 streams
    events = [n for n in frames if n]
    assert sum(events) == 4 * 13
    assert len(events) <= sum(events) / 2  # events leave a step together, not one by one


def test_a_first_token_carries_each_hop_in_order_through_both_clients_and_the_leader_sends_at_once(
    engine, channel, monkeypatch
):
    """The hops of ``api.HopTimes`` are stamped on the way (the front end's write, the leader's
    read, the engine's arrival and first token, the leader's write, the front end's read), in
    that order, through the session (AsyncEngineClient) and a stream of its own (EngineClient);
    every connection the leader accepts sends without Nagle's delay (TCP_NODELAY)."""
    import asyncio

    server, key = channel
    delays = []
    real = ChannelServer._handshake

    async def handshake(self, reader, writer):
        delays.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        return await real(self, reader, writer)

    monkeypatch.setattr(ChannelServer, "_handshake", handshake)

    async def session():
        client = AsyncEngineClient(server.address, key)
        t0 = time.time()
        evs = [ev async for _, ev in client.generate([GenerateRequest((1, 2), 3, ignore_eos=True)])]
        await client.close()
        return t0, evs, time.time()

    def stream():
        t0 = time.time()
        evs = [ev for _, ev in EngineClient(server.address, key).generate_stream([GenerateRequest((1, 2), 3)])]
        return t0, evs, time.time()

    for t0, evs, t1 in (asyncio.run(session()), stream()):
        first = evs[0]
        assert isinstance(first, FirstToken) and not any(isinstance(ev, FirstToken) for ev in evs[1:])
        h = first.hops
        eps = 1e-4  # ``arrived`` is the engine's monotonic clock moved onto the wall's
        assert t0 <= h.sent <= h.received <= h.arrived + eps and h.arrived <= h.known <= h.written <= h.read <= t1
        assert h.known - h.arrived == pytest.approx(first.queued_s + first.prefill_s, abs=1e-5)
    assert delays and all(delays)  # TCP_NODELAY on every connection


def test_leaving_one_stream_cancels_only_it_and_closing_the_session_cancels_the_rest(engine, channel, monkeypatch):
    import asyncio

    server, key = channel
    opened = _count_connections(monkeypatch)
    engine.request_stop()  # no step runs until the streams are set up
    time.sleep(0.2)
    engine._stop.clear()

    async def main():
        client = AsyncEngineClient(server.address, key)
        started = asyncio.Event()

        async def long_stream():
            async for _ in client.generate([GenerateRequest((1,), 50, ignore_eos=True)]):
                started.set()

        keep = asyncio.ensure_future(long_stream())
        gen = client.generate([GenerateRequest((1,), 50, ignore_eos=True)])
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.3)
        assert engine.status().waiting == 2  # both submitted on the one session
        StandInRanks(engine)  # steps start
        await first
        await gen.aclose()  # leave the second stream: cancels it alone
        await started.wait()
        short = [ev async for _, ev in client.generate([GenerateRequest((1,), 2, ignore_eos=True)])]
        assert short[-1] == Finished(FinishReason.LENGTH)
        await client.close()  # closing the session cancels the long stream
        keep.cancel()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (engine.status().running or engine.status().waiting):
            await asyncio.sleep(0.05)
        return engine.status()

    status = asyncio.run(main())
    assert status.running == 0 and status.waiting == 0
    assert len(opened) == 1


def test_a_frame_hands_its_first_tokens_out_before_the_running_streams_next_tokens():
    from moeserve.router.engine.api import Finished, FirstToken, Token
    from moeserve.router.engine.channel import _first_tokens_first

    done = Finished("length")
    events = [(1, 5, Token(9)), (2, 0, FirstToken(4)), (1, 6, done), (3, 7, Token(8)), (4, 0, FirstToken(3))]
    out = _first_tokens_first(events)
    # the new streams first, then the others, each stream's own events in their order
    assert [e[0] for e in out] == [2, 4, 1, 1, 3] and sorted(out, key=events.index) == events
    assert [e[1] for e in out if e[0] == 1] == [5, 6]
    plain = [(1, 5, Token(9)), (3, 7, Token(8))]
    assert _first_tokens_first(plain) == plain


def test_a_session_stream_read_late_gets_its_backlog_as_one_batch_in_order(engine, channel):
    """``generate_batches``: a reader that fell behind the leader gets every event that arrived
    meanwhile in one list, in order, the same events ``generate`` gives one at a time."""
    import asyncio

    server, key = channel

    async def main():
        client = AsyncEngineClient(server.address, key)
        batches = []
        async for b in client.generate_batches([GenerateRequest((1, 2), 20, ignore_eos=True)]):
            batches.append([ev for _, ev in b])
            if len(batches) == 1:
                await asyncio.sleep(0.5)  # behind: the other 19 steps run meanwhile
        one_by_one = [ev async for _, ev in client.generate([GenerateRequest((1, 2), 20, ignore_eos=True)])]
        await client.close()
        return batches, one_by_one

    batches, one_by_one = asyncio.run(main())
    events = [ev for b in batches for ev in b]
    assert events == one_by_one == [FirstToken(TOKEN)] + [Token(TOKEN)] * 19 + [Finished(FinishReason.LENGTH)]
    # the backlog in one list: whatever the first list held (the stand-in's steps are fast, and
    # on a loaded machine several ran before the reader first asked: it may hold them all), every
    # event that arrived while the reader slept came as the one list after it
    # (one event a list, as ``generate`` reads them, would make 21)
    assert len(batches) <= 2


def test_a_frames_plain_tokens_travel_as_ids_and_arrive_as_tokens(engine, channel, monkeypatch):
    """The session's frames carry a plain token as its id (cheaper to read) and a first token as
    itself (its hops, cached count); the stream still gets Token events."""
    import asyncio

    from moeserve.router.engine import channel as channel_module

    server, key = channel
    sent = []
    real_frame = channel_module._frame
    monkeypatch.setattr(
        channel_module, "_frame", lambda msg: (sent.extend(msg[1]) if msg[0] == "events" else None) or real_frame(msg)
    )

    async def main():
        client = AsyncEngineClient(server.address, key)
        evs = [ev async for _, ev in client.generate([GenerateRequest((1, 2), 4, ignore_eos=True)])]
        await client.close()
        return evs

    evs = asyncio.run(main())
    assert evs == [FirstToken(TOKEN), Token(TOKEN), Token(TOKEN), Token(TOKEN), Finished(FinishReason.LENGTH)]
    assert all(type(e) is Token for e in evs[1:4]) and evs[0].hops is not None and evs[0].hops.read > 0
    kinds = [type(ev) for _, _, ev in sent]
    assert kinds == [FirstToken, int, int, int, Finished]


def test_closing_the_async_client_leaves_no_task_of_its_session_pending(channel):
    # A front end that stopped left its session's reader pending when the loop closed ("Task
    # was destroyed but it is pending!" at exit).
    import asyncio

    server, key = channel

    async def main():
        client = AsyncEngineClient(server.address, key)
        evs = [ev async for _, ev in client.generate([GenerateRequest((1, 2), 2, ignore_eos=True)])]
        assert len(evs) == 3  # two tokens, then the end
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert others and not any(t.done() for t in others)  # the session's reader runs
        await client.close()
        assert all(t.done() for t in others)
        # a client whose session never started closes at once too
        await AsyncEngineClient(server.address, key).close()

    asyncio.run(main())
