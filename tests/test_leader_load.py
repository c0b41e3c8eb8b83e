"""The leader's load window, without processes: the window sum (kept as a running sum), its
last N steps, and the forward steps since the placement last changed."""

import numpy as np

from moeserve.config import ClusterConfig, EplbConfig
from moeserve.dataplane.protocol import RankResult, RouterWork, SeqWork, StepHeader
from moeserve.placement import Placement
from moeserve.router.engine.api import GenerateRequest
from moeserve.router.engine.leader import Engine, ModelShape

L, E, W = 2, 4, 2


def engine(window=3):
    cfg = ClusterConfig(model_dir="unused", routers=1, workers=W, eplb=EplbConfig(enable_eplb=True, window_size=window))
    shape = ModelShape(L, E, 1, 100, (2,), 16, (1, 3), 4)
    return Engine(cfg, shape, Placement(np.tile(np.arange(E), (L, 1)), E, W, version=1))


def step(eng, k: int):
    """One forward step whose load is k everywhere (logical [L, E], worker [L, W])."""
    header = StepHeader(eng.step, forward=True, work=(RouterWork((SeqWork(seq_id=1, token_ids=(5,), start=0),)),))
    res = RankResult(
        0, tokens={}, logical_load=np.full((L, E), k, dtype=np.int64), worker_load=np.full((L, W), k, dtype=np.int64)
    )
    eng.on_results(header, [res, RankResult(1), RankResult(2)])


def test_the_window_keeps_the_last_window_size_steps_and_their_last_n_on_request():
    eng = engine(window=3)
    for k in range(1, 6):  # steps with load 1..5
        step(eng, k)
    rep = eng.expert_load()
    assert rep.steps == 3 and rep.total_steps == 5
    assert (rep.load == 3 + 4 + 5).all() and (rep.worker_load == 12).all()
    assert (eng.expert_load(2).load == 4 + 5).all() and eng.expert_load(2).steps == 2
    assert (eng.expert_load(10).load == 12).all()  # more than the window: the window
    assert (eng.total_load() == 15).all()


def test_steps_since_the_placement_changed_count_from_the_last_committed_version():
    eng = engine()
    for _ in range(4):
        step(eng, 1)
    assert eng.expert_load().steps_since_placement_change == 4
    eng.migrator.start(eng.migrator.plan(np.tile(np.arange(E)[::-1], (L, 1))))
    while eng.migrator.active is not None:  # drive the migration through its headers
        ops = eng.migrator.header_ops()
        if ops is not None and ops.begin_staging_slots:
            eng.migrator.on_staging(ops.migration_id, [])
        eng.on_results(StepHeader(eng.step, migration=ops), [RankResult(0)])
    eng.on_results(StepHeader(eng.step), [RankResult(0)])
    step(eng, 1)
    assert eng.placement().version > 1
    assert eng.expert_load().steps_since_placement_change == 1


# ---- reads of the routers' device-side load (asynchronous steps) -------------------------------


class Routers:
    """Stands in for one router: every forward step adds 1 pair to every expert on the device;
    a header with ``read_load`` reads what accumulated before the step (as ``run_step`` does)."""

    def __init__(self, eng):
        self.eng, self.unread, self.reads = eng, 0, []

    def step(self, header):
        res = RankResult(0)
        if header.read_load:
            res.logical_load = np.full((L, E), self.unread, dtype=np.int64)
            res.worker_load = np.full((L, W), self.unread * E // W, dtype=np.int64)
            res.load_steps = self.unread
            self.reads.append((header.step, self.unread, header.forward))
            self.unread = 0
        self.unread += header.forward
        self.eng.on_results(header, [res, RankResult(1), RankResult(2)])


def test_routers_send_the_load_every_load_read_steps_and_when_the_cluster_goes_idle():
    eng = engine(window=1000)
    r = Routers(eng)
    seq = eng.submit(GenerateRequest((5, 6), 40, ignore_eos=True))
    for _ in range(200):
        h = eng.next_header()
        r.step(h)
        if h.work:  # answer every sampled token, one step late
            for w in [eng._awaiting.pop(s) for s in sorted(eng._awaiting) if s < h.step]:
                eng.scheduler.on_results(w, {sid: 7 for rw in w for sid in rw.sampled_ids()}, {})
        if seq.finished and not eng._awaiting and not r.unread:
            break
    forward_reads = [n for _, n, fwd in r.reads if fwd]
    assert forward_reads and set(forward_reads) == {eng.cfg.load_read_steps}  # a read per 16 forward steps
    assert r.reads[-1][2] is False and r.reads[-1][1] > 0  # the rest when idle
    assert sum(n for _, n, _ in r.reads) == eng.forward_steps == 40
    assert (eng.total_load() == 40).all() and eng.expert_load().steps == 40


def test_a_commit_reads_the_load_first_and_the_window_keeps_whole_reads():
    eng = engine(window=20)
    r = Routers(eng)
    for _ in range(3):  # three reads of 16 steps
        for _ in range(16):
            r.step(
                StepHeader(
                    eng.step,
                    forward=True,
                    work=(RouterWork((SeqWork(seq_id=1, token_ids=(5,), start=0),)),),
                    read_load=r.unread >= 16,
                )
            )
    r.step(StepHeader(eng.step, read_load=True))
    rep = eng.expert_load()
    assert rep.steps == 32 and (rep.load == 32).all()  # the fewest recent reads that cover 20 steps
    assert eng.expert_load(5).steps == 16 and eng.expert_load(17).steps == 32
    # a migration under traffic: every header is a forward step, and each commit's header reads first
    seq = eng.submit(GenerateRequest((5, 6), 30, ignore_eos=True))
    eng.migrator.start(eng.migrator.plan(np.tile(np.arange(E)[::-1], (L, 1))))
    commits = 0
    while not seq.finished or eng._awaiting or r.unread:
        h = eng.next_header()
        if h.migration is not None and h.migration.commits:
            commits += 1
            assert h.read_load and h.forward  # counted with the maps before the commit
        if h.migration is not None and h.migration.begin_staging_slots:
            eng.migrator.on_staging(h.migration.migration_id, [])
        r.step(h)
        for w in [eng._awaiting.pop(s) for s in sorted(eng._awaiting) if s < h.step]:
            eng.scheduler.on_results(w, {sid: 7 for rw in w for sid in rw.sampled_ids()}, {})
    assert commits >= 1 and eng.migrator.active is None
    assert (eng.total_load() == eng.forward_steps).all() and eng.forward_steps == 48 + 30


def test_an_admin_load_call_asks_the_step_loop_for_a_read_and_waits_for_it():
    import threading
    import time

    eng = engine(window=1000)
    r = Routers(eng)
    stop = threading.Event()

    def driver():  # idle heartbeats, as rank 0's step loop
        while not stop.is_set():
            r.step(eng.next_header())

    for _ in range(5):  # 5 forward steps, not read yet
        r.step(StepHeader(eng.step, forward=True, work=(RouterWork((SeqWork(seq_id=1, token_ids=(5,), start=0),)),)))
    eng._unread_steps = 5
    eng._last_step_t = time.monotonic()
    t = threading.Thread(target=driver, daemon=True)
    t.start()
    try:
        assert (eng.total_load() == 5).all()  # fresh: the call waited for a read
    finally:
        eng.request_stop()
        stop.set()
        t.join(5)


def test_warm_up_steps_come_first_each_key_twice_then_the_requests():
    eng = engine()
    eng.warm_up([(1, 5), (16, 600)])
    seq = eng.submit(GenerateRequest((5, 6), 2, ignore_eos=True))
    headers = []
    for _ in range(5):
        h = eng.next_header()
        headers.append(h)
        eng.on_results(h, [RankResult(0), RankResult(1), RankResult(2)])
    assert [h.warmup for h in headers[:4]] == [(1, 5), (1, 5), (16, 600), (16, 600)]
    assert not any(h.forward for h in headers[:4])
    assert headers[4].warmup is None and headers[4].forward and headers[4].work[0].seqs[0].seq_id == seq.seq_id
