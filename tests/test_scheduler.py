"""Continuous batching on the leader, without processes: limits, placement of sequences on
routers, finishing, cancelling and the admission queue."""

import pytest

from moeserve.config import Limits
from moeserve.router.engine.api import GenerateRequest, QueueFull, Token, validate_request
from moeserve.router.engine.scheduler import Scheduler

VOCAB = 100
EOS = 2


def sched(routers=2, **limits):
    return Scheduler(routers, Limits(**limits), [EOS])


def req(n=3, max_tokens=4, **kw):
    return GenerateRequest(tuple(range(10, 10 + n)), max_tokens, **kw)


def run_step(s, token=7):
    """Schedule a step and answer it with ``token`` for every sequence."""
    work = s.schedule()
    if work is not None:
        s.on_results(work, {sid: token for rw in work for sid in rw.sampled_ids()}, {})
    return work


def test_new_sequences_go_to_the_router_with_the_fewest_and_stay_there():
    s = sched(routers=2)
    a, b, c = s.submit(req()), s.submit(req()), s.submit(req())
    work = run_step(s)
    assert [len(w.seqs) for w in work] == [2, 1]
    routers = {sw.seq_id: r for r, w in enumerate(work) for sw in w.seqs}
    work = run_step(s)  # decode: same routers, by id (the router holds the token and position)
    for r, w in enumerate(work):
        assert w.seqs == () and len(w.decodes) > 0 and len(w.blocks) == 0
        for sid in w.decodes.tolist():
            assert routers[sid] == r
    assert {a.router, b.router, c.router} == {0, 1}


def test_max_num_seqs_and_max_num_batched_tokens_bound_each_router_per_step():
    s = sched(routers=1, max_num_seqs=2, max_num_batched_tokens=7)
    for _ in range(3):
        s.submit(req(n=3))
    work = run_step(s)
    assert len(work[0].seqs) == 2  # 3 + 3 tokens fit, the third prompt waits
    assert (s.counts()["waiting"], s.counts()["running"]) == (1, 2)
    s = sched(routers=1, max_num_seqs=8, max_num_batched_tokens=7)
    for _ in range(3):
        s.submit(req(n=3))
    work = s.schedule()[0].seqs  # chunked prefill fills the budget: 3 + 3 + 1
    assert sum(len(sw.token_ids) for sw in work) == 7 and [sw.sample for sw in work] == [True, True, False]


def test_a_router_out_of_budget_does_not_stop_admission_to_another():
    s = sched(routers=2, max_num_batched_tokens=4)
    a, b, c = s.submit(req(n=4)), s.submit(req(n=1)), s.submit(req(n=1))
    work = s.schedule()  # a fills router 0's budget; router 0 and 1 then run one each, c goes to 1
    assert [len(w.seqs) for w in work] == [1, 2]
    assert (a.router, b.router, c.router) == (0, 1, 1) and s.counts()["waiting"] == 0


def test_sequences_finish_at_max_tokens_or_eos_and_are_released_on_their_router():
    s = sched(routers=1)
    long, short = s.submit(req(max_tokens=3)), s.submit(req(max_tokens=10))
    run_step(s)
    run_step(s)
    work = s.schedule()
    s.on_results(work, {long.seq_id: 7, short.seq_id: EOS}, {})
    assert long.finished == "length" and short.finished == "stop"
    assert long.output == [7, 7, 7] and short.output == [7, 7, EOS]
    assert sorted(s.schedule()[0].release) == sorted([long.seq_id, short.seq_id])
    assert s.schedule() is None  # nothing left to run


def test_ignore_eos_and_stop_ids():
    s = sched(routers=1)
    a = s.submit(req(max_tokens=2, ignore_eos=True))
    b = s.submit(req(max_tokens=5, stop_token_ids=(9,)))
    work = s.schedule()
    s.on_results(work, {a.seq_id: EOS, b.seq_id: 9}, {})
    assert a.finished is None and b.finished == "stop"
    run_step(s, token=EOS)
    assert a.finished == "length" and a.output == [EOS, EOS]


def test_cancelled_sequences_leave_and_are_released():
    s = sched(routers=1)
    a, b = s.submit(req()), s.submit(req())
    run_step(s)
    s.cancel(a)
    work = s.schedule()
    assert work[0].sampled_ids() == [b.seq_id] and work[0].release == (a.seq_id,)
    assert a.finished == "cancelled" and isinstance(a.events.get_nowait(), Token)


def test_a_full_queue_refuses_new_requests():
    s = sched(routers=1, max_waiting=2)
    s.submit(req())
    s.submit(req())
    with pytest.raises(QueueFull, match="full"):
        s.submit(req())


@pytest.mark.parametrize(
    "request_,match",
    [
        (GenerateRequest((), 4), "empty"),
        (GenerateRequest((1, 100), 4), "outside the vocabulary"),
        (GenerateRequest((1,), 0), "max_tokens"),
        (GenerateRequest((1,) * 10, 95), "max_model_len"),
        (GenerateRequest((1,), 4, stop_token_ids=(-1,)), "stop token"),
    ],
)
def test_invalid_requests_are_refused_with_what_is_allowed(request_, match):
    with pytest.raises(ValueError, match=match):
        validate_request(request_, VOCAB, max_model_len=100, max_kv_tokens=4096)


def feed(s, work, token=7):
    """Answer a scheduled step: every sequence that samples gets ``token``."""
    s.on_results(work, {sid: token for rw in work for sid in rw.sampled_ids()}, {})


def test_a_long_prompt_is_prefilled_in_chunks_after_the_decodes_and_samples_once():
    s = Scheduler(1, Limits(max_num_batched_tokens=4), [EOS], block_size=4, num_blocks=64)
    short = s.submit(req(n=2, max_tokens=5))
    feed(s, s.schedule())  # short: prefill, first token
    long = s.submit(req(n=10, max_tokens=2))
    chunks = []
    while long.cached < 10:
        work = s.schedule()
        mine = {sw.seq_id: sw for sw in work[0].seqs}
        assert work[0].decodes.tolist() == [short.seq_id]  # the decode goes first, every step
        sw = mine[long.seq_id]
        chunks.append((sw.start, len(sw.token_ids), sw.sample))
        feed(s, work)
    assert chunks == [(0, 3, False), (3, 3, False), (6, 3, False), (9, 1, True)]
    assert long.output == [7] and len(long.blocks) == 3  # 11 tokens known, 10 cached: blocks for 10


def test_admission_waits_for_free_blocks_and_blocks_come_back_when_a_sequence_finishes():
    s = Scheduler(1, Limits(), [EOS], block_size=4, num_blocks=4, prefix_caching=False)  # no block shared
    a, b, c = (s.submit(req(n=7, max_tokens=1)) for _ in range(3))  # 2 blocks each
    work = s.schedule()
    assert [sw.seq_id for sw in work[0].seqs] == [a.seq_id, b.seq_id]
    assert sorted(sw.new_blocks for sw in work[0].seqs) == [(0, 1), (2, 3)]
    assert s.counts()["kv_blocks_used"] == 4 and s.counts()["waiting"] == 1
    feed(s, work)  # max_tokens 1: both finish, blocks free
    work = s.schedule()
    assert [sw.seq_id for sw in work[0].seqs] == [c.seq_id] and set(work[0].release) == {a.seq_id, b.seq_id}


@pytest.mark.parametrize("late", [False, True], ids=["sync", "tokens-one-step-late"])
def test_when_blocks_run_out_the_newest_sequence_is_preempted_and_recomputed_later(late):
    s = Scheduler(1, Limits(), [EOS], block_size=4, num_blocks=3)
    old = s.submit(req(n=4, max_tokens=6, ignore_eos=True))
    new = s.submit(req(n=3, max_tokens=6, ignore_eos=True))
    released, recomputed = [], []
    out = None  # (work, token) whose results are still out
    for step in range(40):
        work = s.schedule()
        if out is not None:
            feed(s, *out)
            out = None
        if work is None:
            if s.counts()["running"] + s.counts()["waiting"] == 0:
                break
            continue
        released += work[0].release
        for sw in work[0].seqs:
            if sw.seq_id == new.seq_id and sw.start == 0 and new.output:  # recomputed after its preemption
                recomputed.append((sw.token_ids, sw.out_pos, list(new.output)))
                assert not sw.pending
        assert s.counts()["kv_blocks_used"] <= 3
        if late:
            out = (work, 20 + step)
        else:
            feed(s, work, token=20 + step)
    assert s.counts()["preemptions"] >= 1 and new.seq_id in released and old.seq_id not in released[:1]
    tokens, out_pos, before = recomputed[0]
    assert tokens == tuple(new.req.prompt_ids) + tuple(before) and out_pos == len(before)
    assert old.finished == "length" and new.finished == "length" and len(new.output) == 6
    assert s.counts()["kv_blocks_used"] == 0


def test_a_request_that_can_never_fit_the_kv_cache_is_refused():
    with pytest.raises(ValueError, match="can never fit"):
        validate_request(GenerateRequest((1,) * 10, 10), VOCAB, max_model_len=100, max_kv_tokens=16)


def late_steps(s, answer, steps=50):
    """Drive ``s`` as the leader does with asynchronous steps: a step's results come back after
    the next step was scheduled. ``answer(sw)`` is the token a sampling sequence gets. Returns
    the works scheduled."""
    works, out = [], None
    for _ in range(steps):
        work = s.schedule()
        if out is not None:
            s.on_results(out, {seq.seq_id: answer(seq) for seq in outputs_of(s, out)}, {})
        out = work
        if work is None:
            if not s.counts()["running"] and not s.counts()["waiting"]:
                break
            continue
        works.append(work)
    return works


def outputs_of(s, work):
    """The sequences that sample in ``work``, as the scheduler recorded them when it scheduled it."""
    return [seq for w, entries in s._issued if w is work for seq, _, samples in entries if samples]


def test_with_tokens_one_step_late_a_decode_is_sent_by_id_and_max_tokens_counts_the_token_in_flight():
    s = sched(routers=1)
    a = s.submit(req(n=3, max_tokens=4, ignore_eos=True))
    positions = []

    def answer(seq):  # the token of output index i is 30 + i (tokens come back in order)
        positions.append(seq.num_output)
        return 30 + positions[-1]

    works = late_steps(s, answer)
    # the prompt is sent; then 3 decodes by id, each scheduled before the token before it came back
    assert [(w[0].seqs[0].token_ids if w[0].seqs else None, w[0].decodes.tolist()) for w in works] == [
        ((10, 11, 12), []),
        (None, [a.seq_id]),
        (None, [a.seq_id]),
        (None, [a.seq_id]),
    ]
    assert positions == [0, 1, 2, 3]
    assert a.output == [30, 31, 32, 33] and a.finished == "length" and a.pending == 0
    assert s.counts()["kv_blocks_used"] == 0


def test_a_decode_that_crosses_a_block_boundary_gets_its_block_in_the_header():
    s = Scheduler(1, Limits(), [EOS], block_size=4, num_blocks=8)
    a = s.submit(req(n=3, max_tokens=6, ignore_eos=True))
    works = late_steps(s, lambda seq: 7)
    got = [(w[0].decodes.tolist(), w[0].blocks.tolist()) for w in works if len(w[0].decodes)]
    # positions 3, 4, 5, 6, 7: the decode at position 4 starts the second block
    assert [b for _, b in got] == [[], [[a.seq_id, 1]], [], [], []]
    assert a.output == [7] * 6


def test_a_stop_token_seen_one_step_late_costs_one_extra_step_whose_token_is_dropped():
    s = sched(routers=1)
    a = s.submit(req(n=2, max_tokens=10))
    got = []
    a.sink = got.append
    works = late_steps(s, lambda seq: EOS if seq.num_output == 1 else 7)  # output index 1 is EOS
    runs = [w for w in works if w[0].runs]
    assert len(runs) == 3  # index 2 ran before EOS at 1 was known
    assert a.output == [7, EOS] and a.finished == "stop"
    assert [type(e).__name__ for e in got] == ["FirstToken", "Token", "Finished"]  # the first: cached tokens
    assert not works[-1][0].runs and works[-1][0].release == (a.seq_id,)  # released once EOS is known


def test_a_cancel_with_a_token_in_flight_drops_that_token():
    s = sched(routers=1)
    a = s.submit(req(n=2, max_tokens=10, ignore_eos=True))
    first = s.schedule()
    s.cancel(a)
    assert s.schedule()[0].release == (a.seq_id,)
    s.on_results(first, {a.seq_id: 7}, {})  # the prompt's token arrives after the cancel
    assert a.output == [] and a.finished == "cancelled"


def test_a_request_held_at_the_head_of_the_queue_says_why_once(caplog):
    """A request that cannot be admitted for longer than LONG_WAIT_S is logged once with the
    routers' room, token budget and free blocks (what held it), not on every step."""
    import logging

    from moeserve.router.engine import scheduler as sched_mod

    s = sched(routers=1, max_num_seqs=1)
    first = s.submit(req(3, 8))
    second = s.submit(req(2, 8))
    assert s.schedule() is not None  # the first is admitted; max_num_seqs=1 holds the second
    with caplog.at_level(logging.WARNING, logger=sched_mod.__name__):
        s.schedule()  # held, but not for long yet: nothing said
        second.queued_at -= 5.0  # as if it had waited 5 s
        s.schedule()
        s.schedule()
    lines = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"request {second.seq_id} has waited" in lines[0] and "running/max_num_seqs ['1/1']" in lines[0]
    assert first.seq_id != second.seq_id


def test_a_lost_routers_sequences_are_recomputed_on_another_with_their_known_tokens():
    s = sched(routers=2)
    seqs = [s.submit(req(max_tokens=6)) for _ in range(4)]
    run_step(s)
    run_step(s)  # two tokens each, on routers 0 and 1
    on_1 = [q for q in seqs if q.router == 1]
    assert on_1 and all(q.output == [7, 7] for q in on_1)
    in_flight = s.schedule()  # a step whose results never come from router 1: it dies
    replay = s.router_lost(1, in_flight)
    assert not replay[1].runs and replay[1].release == () and replay[0] is in_flight[0]  # router 1's part emptied
    assert s.counts()["readmitted"] == len(on_1) and s.routers_open == [True, False]
    # The failed step runs again; router 0 answers it, router 1's tokens never come.
    s.on_results(replay, {sid: 7 for sid in replay[0].sampled_ids()}, {})
    work = s.schedule()
    assert not work[1].runs and not work[1].release  # nothing goes to the lost router
    moved = {sw.seq_id: sw for sw in work[0].seqs}
    for q in on_1:  # recomputed from the start on router 0: prompt plus the tokens it knows
        assert q.router == 0 and moved[q.seq_id].start == 0
        assert moved[q.seq_id].token_ids == tuple(q.req.prompt_ids) + (7, 7)
        assert moved[q.seq_id].out_pos == 2  # its next token is its third output, as before
    s.on_results(work, {sid: 7 for sid in work[0].sampled_ids()}, {})
    while any(q.finished is None for q in seqs):
        run_step(s)
    assert all(q.output == [7] * 6 for q in seqs)


def test_a_router_that_joins_again_takes_new_sequences():
    s = sched(routers=2)
    s.router_lost(1)
    first = [s.submit(req()) for _ in range(3)]
    run_step(s)
    assert {q.router for q in first} == {0}
    s.router_joined(1, 64)
    later = s.submit(req())
    run_step(s)
    assert later.router == 1 and s.routers_open == [True, True]


def test_the_first_token_carries_the_leaders_queue_and_prefill_times():
    import time

    from moeserve.router.engine.api import FirstToken

    s = sched(routers=1, max_num_seqs=1)
    a, b = s.submit(req(max_tokens=2)), s.submit(req(max_tokens=1))
    got: dict = {"a": [], "b": []}
    a.sink, b.sink = got["a"].append, got["b"].append
    time.sleep(0.02)  # both wait for the first step; b waits until a is done too
    work = s.schedule()
    time.sleep(0.03)  # the step runs
    s.on_results(work, {sid: 7 for rw in work for sid in rw.sampled_ids()}, {})
    while a.finished is None or b.finished is None:
        run_step(s)
    fa, fb = got["a"][0], got["b"][0]
    assert isinstance(fa, FirstToken) and isinstance(fb, FirstToken)
    assert fa.queued_s >= 0.02 > fa.queued_s - 0.02 and fa.prefill_s >= 0.03
    assert fb.queued_s >= 0.05 > fb.prefill_s  # admitted once a left, its token in that same step
    assert fa == FirstToken(fa.token_id)  # timings are not what the event says
    for f in (fa, fb):  # the hops the engine stamps: its arrival and the first token, on the wall clock
        assert f.hops is not None and f.hops.arrived < f.hops.known <= time.time()
        assert f.hops.known - f.hops.arrived == pytest.approx(f.queued_s + f.prefill_s, abs=1e-5)
        assert not (f.hops.sent or f.hops.received or f.hops.written or f.hops.read)  # the channel's
