"""Late scheduling: the pacer's estimates and delays, the leader's use of them, and the step
driver's timings they come from (moeserve/router/engine/pacing.py; docs/dataplane.md, "Late
scheduling"). Times are made up (seconds on a perf_counter-like clock): nothing here sleeps
for what it asserts."""

import time

import numpy as np
import pytest

from moeserve.config import ClusterConfig
from moeserve.dataplane.protocol import RankResult, RouterWork, SeqWork, StepHeader
from moeserve.placement import Placement
from moeserve.router.engine.api import GenerateRequest
from moeserve.router.engine.leader import Engine, ModelShape
from moeserve.router.engine.pacing import StepPacer, learn_lead_setting

STEP, LEAD, MARGIN = 0.010, 0.003, 0.001


def steady(p: StepPacer, n: int, t0: float = 100.0, step: float = STEP, lead: float = LEAD) -> float:
    """n GPU-bound forward steps of ``step`` seconds each; returns the last tokens_at."""
    t = t0
    for _ in range(n):
        p.on_step(True, lead, t, 0.002)
        t += step
    return t - step


def test_a_gpu_bound_step_schedules_the_next_just_before_the_running_one_ends():
    p = StepPacer(MARGIN)
    at = steady(p, 5)
    # the GPU runs the latest step from `at` to `at + STEP`: enqueue by then, with the margin
    assert p.delay(at + 0.002) == pytest.approx(STEP - LEAD - MARGIN - 0.002)
    assert p.delay(at + STEP - LEAD - MARGIN) == 0.0  # already late enough: at once
    assert p.delay(at + 1.0) == 0.0
    # counted per delayed schedule: how far ahead of the estimated end, and the slack then left
    p.note_delay(0.004)
    p.on_step(True, LEAD, at + STEP, 0.0015)
    assert p.ahead_s == pytest.approx(LEAD + MARGIN) and p.slack_s == pytest.approx(0.0015)


def test_no_delay_without_two_waited_steps_in_a_row():
    p = StepPacer(MARGIN)
    p.on_step(True, LEAD, 100.0, 0.002)
    assert p.delay(100.0) == 0.0  # one step: no device time measured yet
    p.on_step(True, LEAD, 100.010, 0.002)
    assert p.delay(100.010) == 0.0  # one device time: still not enough
    p.on_step(True, LEAD, 100.020, 0.002)
    assert p.delay(100.020) > 0
    # a step whose tokens were there already: the GPU was idle when the host came (the host is
    # the bottleneck, or the last delay was too long): the next schedule is at once
    p.on_step(True, LEAD, 100.035, 0.0)
    assert p.delay(100.035) == 0.0
    # and the gap it hid is not taken for a device time: one waited step is not enough again
    p.on_step(True, LEAD, 100.045, 0.002)
    assert p.delay(100.045) == pytest.approx(STEP - LEAD - MARGIN)  # the older estimates stand
    assert min(p._device) == pytest.approx(STEP)


def test_a_step_that_runs_no_forward_pass_never_delays_the_next():
    p = StepPacer(MARGIN)
    at = steady(p, 4)
    p.on_step(False, LEAD, at + STEP, 0.002)  # a flush or migration step: the GPU is not busy with it
    assert p.delay(at + STEP) == 0.0


def test_long_steps_and_slow_hosts_make_the_estimate_earlier_never_later():
    p = StepPacer(MARGIN)
    at = steady(p, 4)
    p.on_step(True, LEAD, at + 0.040, 0.002)  # a 40 ms step (a prefill chunk): T stays the shortest
    at += 0.040
    p.on_step(True, 0.008, at + STEP, 0.002)  # one slow enqueue: H is the longest lead of the window
    at += STEP
    assert p.delay(at) == pytest.approx(STEP - 0.008 - MARGIN)
    # the window forgets: 16 steps later the slow lead is gone
    at = steady(p, 16, at + STEP)
    assert p.delay(at) == pytest.approx(STEP - LEAD - MARGIN)


def test_the_delay_is_capped_and_reset_forgets_the_estimates():
    p = StepPacer(0.0, max_delay_s=0.02)
    at = steady(p, 4, step=0.5, lead=0.001)
    assert p.delay(at) == 0.02
    p.reset()
    assert p.delay(at) == 0.0


def test_the_slack_a_delayed_schedule_left_corrects_the_next_delays():
    p = StepPacer(MARGIN)
    at = steady(p, 4)
    planned = p.delay(at)
    assert planned == pytest.approx(STEP - LEAD - MARGIN) and p.correction_s == 0.0
    # a delayed schedule, and then no wait for the running step's tokens: a bubble
    p.note_delay(planned)
    p.on_step(True, LEAD, at + STEP + 0.001, 0.0)
    assert p.bubbles == 1 and p.correction_s == pytest.approx(MARGIN + 2.5e-4)
    at = steady(p, 2, at + STEP + 0.002)  # two waited steps (undelayed) and the estimates stand again
    assert p.delay(at) == pytest.approx(STEP - LEAD - MARGIN - (MARGIN + 2.5e-4))
    # slack shorter than the margin: the correction grows by a quarter of the shortfall
    c = p.correction_s
    p.note_delay(p.delay(at))
    p.on_step(True, LEAD, at + STEP, MARGIN - 0.0006)
    assert p.correction_s == pytest.approx(c + 0.25 * 0.0006) and p.bubbles == 1
    # slack longer than the margin: it shrinks the same way, never below 0
    for _ in range(40):
        p.note_delay(0.001)
        p.on_step(True, LEAD, at + STEP, MARGIN + 0.004)
    assert p.correction_s == 0.0
    # a non-forward step leaves the slack pending for the next forward one
    p.note_delay(0.001)
    p.on_step(False, LEAD, at + STEP, 0.0)
    assert p.bubbles == 1
    p.on_step(True, LEAD, at + 2 * STEP, 0.0)
    assert p.bubbles == 2
    p.reset()
    assert p.correction_s == 0.0 and p.delay(at) == 0.0


def test_learn_lead_lets_the_slack_take_back_the_longest_lead_never_the_margin(monkeypatch):
    """MOESERVE_PACER_LEARN_LEAD=1: a slack above the margin moves the schedule later, past the
    window's longest lead if the slack says so, but never closer to the estimated end than the
    margin; a bubble pushes it back at once. Without it the correction stops at 0."""
    slow = 0.006  # one mixed step's lead sets H for the window
    plain, learning = StepPacer(MARGIN), StepPacer(MARGIN, learn_lead=True)
    for p in (plain, learning):
        at = steady(p, 3)
        p.on_step(True, slow, at + STEP, 0.002)
        at += STEP
        for _ in range(12):  # (within the window) every delayed schedule left 4 ms of slack
            p.note_delay(p.delay(at))
            at += STEP
            p.on_step(True, LEAD, at, MARGIN + 0.004)
    assert plain.correction_s == 0.0 and plain.ahead() == pytest.approx(slow + MARGIN)
    assert learning.correction_s == pytest.approx(-slow) and learning.ahead() == pytest.approx(MARGIN)
    assert learning.delay(at) == pytest.approx(STEP - MARGIN)
    assert plain.delay(at) == pytest.approx(STEP - slow - MARGIN)
    # a bubble: back by the margin and a quarter of a millisecond at once
    learning.note_delay(learning.delay(at))
    learning.on_step(True, LEAD, at + STEP, 0.0)
    assert learning.bubbles == 1 and learning.ahead() == pytest.approx(MARGIN + MARGIN + 2.5e-4)
    for value, want in (("", False), ("0", False), ("1", True)):
        monkeypatch.setenv("MOESERVE_PACER_LEARN_LEAD", value)
        assert learn_lead_setting() is want
    monkeypatch.setenv("MOESERVE_PACER_LEARN_LEAD", "yes")
    with pytest.raises(ValueError, match="MOESERVE_PACER_LEARN_LEAD='yes': allowed 0 .* or 1"):
        learn_lead_setting()


def test_bad_pacer_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="margin_s must be >= 0"):
        StepPacer(-0.001)
    with pytest.raises(ValueError, match="window must be >= 2"):
        StepPacer(0.001, window=1)
    with pytest.raises(ValueError, match=r"late_scheduling_margin_ms must be in \[0, 100\]"):
        ClusterConfig(model_dir="unused", late_scheduling_margin_ms=-1)


# -- the leader --------------------------------------------------------------------------------

L, E, W = 2, 4, 1


def engine(**kw) -> Engine:
    cfg = ClusterConfig(model_dir="unused", routers=1, workers=W, **kw)
    shape = ModelShape(L, E, 1, 100, (2,), 16, (1, 3), 4)
    return Engine(cfg, shape, Placement(np.tile(np.arange(E), (L, 1)), E, W, version=1))


def forward(eng: Engine, tokens_at: float, wait: float = 0.002, enqueue: float = 0.001) -> None:
    """A forward step whose results carry the leader rank's timings (rank 0) and a worker's."""
    header = StepHeader(eng.step, forward=True, work=(RouterWork((SeqWork(seq_id=1, token_ids=(5,), start=0),)),))
    eng._sched_t = tokens_at - 0.004  # its schedule began 4 ms before its tokens came
    mine = RankResult(0, started_at=tokens_at - 0.003, enqueue_s=enqueue, tokens_at=tokens_at, tokens_wait_s=wait)
    eng.on_results(header, [mine, RankResult(1, enqueue_s=0.0005)])


def waits(eng: Engine, monkeypatch) -> list[float]:
    asked: list[float] = []
    monkeypatch.setattr(eng._stop, "wait", lambda t=None: asked.append(t) or False)
    return asked


def test_the_leader_waits_what_its_pacer_says_and_counts_it(monkeypatch):
    eng = engine()
    asked = waits(eng, monkeypatch)
    now = time.perf_counter()
    for k in range(4):  # 10 ms steps, the last one's tokens just now
        forward(eng, now - (3 - k) * STEP)
    eng.pace()
    # lead: schedule + broadcast 1 ms (started_at - _sched_t) + the slowest enqueue 1 ms
    expected = STEP - 0.002 - MARGIN - (time.perf_counter() - now)
    assert len(asked) == 1 and asked[0] == pytest.approx(expected, abs=1e-3)
    st = eng.status()
    assert st.late_schedules == 1 and st.late_schedule_delay_s == pytest.approx(asked[0])
    # a request submitted meanwhile is in the header scheduled after the wait
    seq = eng.submit(GenerateRequest((3, 4), 2))
    header = eng.next_header()
    assert header.forward and [sw.seq_id for sw in header.work[0].seqs] == [seq.seq_id]


def test_the_slowest_rank_sets_the_lead(monkeypatch):
    eng = engine()
    asked = waits(eng, monkeypatch)
    now = time.perf_counter()
    for k in range(4):
        forward(eng, now - (3 - k) * STEP, enqueue=0.004)  # the leader's rank enqueues for 4 ms
    eng.pace()
    assert asked[0] == pytest.approx(STEP - 0.001 - 0.004 - MARGIN - (time.perf_counter() - now), abs=1e-3)


@pytest.mark.parametrize("why", ["late_scheduling off", "async_scheduling off", "replay", "regroup", "stop", "idle"])
def test_the_leader_never_waits_where_it_must_not(monkeypatch, why):
    kw = {"late_scheduling off": {"late_scheduling": False}, "async_scheduling off": {"async_scheduling": False}}
    eng = engine(**kw.get(why, {}))
    asked = waits(eng, monkeypatch)
    now = time.perf_counter()
    for k in range(4):
        forward(eng, now - (3 - k) * STEP, wait=0.0 if why == "idle" else 0.002)
    if why == "replay":
        eng._replay = StepHeader(eng.step, forward=True)
    elif why == "regroup":
        eng.request_regroup()
    elif why == "stop":
        eng.request_stop()
    eng.pace()
    assert asked == [] and eng.status().late_schedules == 0


def test_the_leader_never_waits_while_every_router_runs_max_num_seqs(monkeypatch):
    from moeserve.config import Limits

    eng = engine(limits=Limits(max_num_seqs=1, max_model_len=64, max_num_batched_tokens=64))
    asked = waits(eng, monkeypatch)
    eng.submit(GenerateRequest((3, 4), 8))
    assert eng.next_header().forward  # the one sequence is admitted: no room for another
    now = time.perf_counter()
    for k in range(4):  # 100 ms steps: the estimate still delays after a slow CPU's ~10 ms here
        forward(eng, now - (3 - k) * 0.1)
    assert eng.pacer.delay(time.perf_counter()) > 0  # the estimates would delay ...
    eng.pace()
    assert asked == [] and eng.status().late_schedules == 0  # ... but an arrival could not join


def test_the_world_re_forming_clears_the_estimates(monkeypatch):
    eng = engine()
    asked = waits(eng, monkeypatch)
    now = time.perf_counter()
    for k in range(4):
        forward(eng, now - (3 - k) * STEP)
    eng.on_regroup(set(), failed=False)
    eng.pace()
    assert asked == []


# -- the step driver's timings --------------------------------------------------------------------


class _Runner:
    """A router that enqueues in ``enqueue`` seconds and whose tokens come ``device`` seconds
    after: what run_step reports of it."""

    graphs = None

    def __init__(self, enqueue: float, device: float):
        self.enqueue, self.device = enqueue, device

    def run(self, work, step):
        time.sleep(self.enqueue)

    def deliver(self, step):
        time.sleep(self.device)
        return -1, {}, {}, {}

    def grammar_reports(self):
        return {}

    def take_load_snapshot(self):
        return None


def test_run_step_reports_its_enqueue_and_its_wait_for_tokens():
    from moeserve.dataplane.step import RankState, run_step

    st = RankState(0, None, None, None, 1, 8, None, runner=_Runner(0.02, 0.03), router=0)
    header = StepHeader(0, forward=True, work=(RouterWork(()),))
    before = time.perf_counter()
    res = run_step(st, header)
    after = time.perf_counter()
    assert before <= res.started_at and res.started_at + res.enqueue_s + res.tokens_wait_s <= res.tokens_at + 1e-6
    assert res.enqueue_s >= 0.02 and res.tokens_wait_s >= 0.03 and res.tokens_at <= after
