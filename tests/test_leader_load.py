"""The leader's load window, without processes: the window sum (kept as a running sum), its
last N steps, and the forward steps since the placement last changed."""
import numpy as np

from moeserve.config import ClusterConfig, EplbConfig
from moeserve.dataplane.protocol import RankResult, RouterWork, SeqWork, StepHeader
from moeserve.placement import Placement
from moeserve.router.engine.leader import Engine, ModelShape

L, E, W = 2, 4, 2


def engine(window=3):
    cfg = ClusterConfig(model_dir="unused", routers=1, workers=W, eplb=EplbConfig(enable_eplb=True, window_size=window))
    shape = ModelShape(L, E, 1, 100, (2,), 16, (1, 3), 4)
    return Engine(cfg, shape, Placement(np.tile(np.arange(E), (L, 1)), E, W, version=1))


def step(eng, k: int):
    """One forward step whose load is k everywhere (logical [L, E], worker [L, W])."""
    header = StepHeader(eng.step, forward=True, work=(RouterWork((SeqWork(1, (5,), 0),)),))
    res = RankResult(0, tokens={}, logical_load=np.full((L, E), k, dtype=np.int64),
                     worker_load=np.full((L, W), k, dtype=np.int64))
    eng.on_results(header, [res, RankResult(1), RankResult(2)])


def test_the_window_keeps_the_last_window_size_steps_and_their_last_n_on_request():
    eng = engine(window=3)
    for k in range(1, 6):                                   # steps with load 1..5
        step(eng, k)
    rep = eng.expert_load()
    assert rep.steps == 3 and rep.total_steps == 5
    assert (rep.load == 3 + 4 + 5).all() and (rep.worker_load == 12).all()
    assert (eng.expert_load(2).load == 4 + 5).all() and eng.expert_load(2).steps == 2
    assert (eng.expert_load(10).load == 12).all()           # more than the window: the window
    assert (eng.total_load() == 15).all()


def test_steps_since_the_placement_changed_count_from_the_last_committed_version():
    eng = engine()
    for _ in range(4):
        step(eng, 1)
    assert eng.expert_load().steps_since_placement_change == 4
    eng.migrator.start(eng.migrator.plan(np.tile(np.arange(E)[::-1], (L, 1))))
    while eng.migrator.active is not None:                  # drive the migration through its headers
        ops = eng.migrator.header_ops()
        if ops is not None and ops.begin_staging_slots:
            eng.migrator.on_staging(ops.migration_id, [])
        eng.on_results(StepHeader(eng.step, migration=ops), [RankResult(0)])
    eng.on_results(StepHeader(eng.step), [RankResult(0)])
    step(eng, 1)
    assert eng.placement().version > 1
    assert eng.expert_load().steps_since_placement_change == 1
