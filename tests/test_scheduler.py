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
        s.on_results(work, {sw.seq_id: token for rw in work for sw in rw.seqs}, {})
    return work


def test_new_sequences_go_to_the_router_with_the_fewest_and_stay_there():
    s = sched(routers=2)
    a, b, c = s.submit(req()), s.submit(req()), s.submit(req())
    work = run_step(s)
    assert [len(w.seqs) for w in work] == [2, 1]
    routers = {sw.seq_id: r for r, w in enumerate(work) for sw in w.seqs}
    work = run_step(s)                                     # decode: same routers, one token each, from the cache
    for r, w in enumerate(work):
        for sw in w.seqs:
            assert routers[sw.seq_id] == r and len(sw.token_ids) == 1 and sw.start == 3
    assert {a.router, b.router, c.router} == {0, 1}


def test_max_num_seqs_and_max_num_batched_tokens_bound_each_router_per_step():
    s = sched(routers=1, max_num_seqs=2, max_num_batched_tokens=7)
    for _ in range(3):
        s.submit(req(n=3))
    work = run_step(s)
    assert len(work[0].seqs) == 2                          # 3 + 3 tokens fit, the third prompt waits
    assert s.counts() == dict(waiting=1, running=2)
    s = sched(routers=1, max_num_seqs=8, max_num_batched_tokens=7)
    for _ in range(3):
        s.submit(req(n=3))
    assert sum(len(sw.token_ids) for sw in s.schedule()[0].seqs) == 6


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
    assert s.schedule() is None                            # nothing left to run


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
    assert [sw.seq_id for sw in work[0].seqs] == [b.seq_id] and work[0].release == (a.seq_id,)
    assert a.finished == "cancelled" and isinstance(a.events.get_nowait(), Token)


def test_a_full_queue_refuses_new_requests():
    s = sched(routers=1, max_waiting=2)
    s.submit(req())
    s.submit(req())
    with pytest.raises(QueueFull, match="full"):
        s.submit(req())


@pytest.mark.parametrize("request_,match", [
    (GenerateRequest((), 4), "empty"),
    (GenerateRequest((1, 100), 4), "outside the vocabulary"),
    (GenerateRequest((1,), 0), "max_tokens"),
    (GenerateRequest((1,) * 10, 95), "max_model_len"),
    (GenerateRequest((1,), 4, stop_token_ids=(-1,)), "stop token"),
])
def test_invalid_requests_are_refused_with_what_is_allowed(request_, match):
    with pytest.raises(ValueError, match=match):
        validate_request(request_, VOCAB, max_model_len=100, max_num_batched_tokens=4096)
