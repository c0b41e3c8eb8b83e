"""Prefix caching without processes: the block accounting (hashes, reference counts, the idle
blocks' least-recently-used order), the scheduler's use of it (hits, the last token always
computed, blocks filled by decodes, preemption of a sequence that shares blocks, salts,
requests that need every prompt logit), cache-aware routing against round robin, and a router
that starts a sequence on cached blocks computing what the whole prompt gives."""

import numpy as np
import pytest

from moeserve.config import Limits
from moeserve.router.engine.api import FirstToken, GenerateRequest
from moeserve.router.engine.blocks import BlockAllocator, extend_hashes, prefix_root
from moeserve.router.engine.scheduler import Scheduler

EOS = 2
BS = 4


def hashes_of(tokens, salt=""):
    out: list[bytes] = []
    extend_hashes(out, tokens, BS, prefix_root(salt))
    return out


def feed(s, work, token=7):
    s.on_results(work, {sid: token for rw in work for sid in rw.sampled_ids()}, {})


def drain(s, token=7, steps=200):
    """Run every step until nothing is left, each answered at once with ``token``."""
    for _ in range(steps):
        work = s.schedule()
        if work is None:
            if not s.counts()["running"] and not s.counts()["waiting"]:
                return
            continue
        feed(s, work, token)
    raise AssertionError("the scheduler did not drain")


def fresh_work(work, seq):
    return next(sw for rw in work for sw in rw.seqs if sw.seq_id == seq.seq_id)


def req(tokens, max_tokens=2, **kw):
    return GenerateRequest(tuple(tokens), max_tokens, ignore_eos=True, **kw)


P = tuple(range(10, 23))  # 13 tokens: 3 full blocks of 4 and one token


# -- the hashes and the allocator ------------------------------------------------------------


def test_a_block_hash_names_its_whole_prefix_and_the_salt():
    a, b = hashes_of(P), hashes_of(P[:8] + (99,) + P[9:])
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]  # block 2 differs, and so names a different prefix
    assert hashes_of((99,) + P[1:])[1] != a[1]  # a change in block 0 changes every later hash
    assert hashes_of(P, salt="tenant-a")[0] not in (a[0], hashes_of(P, salt="tenant-b")[0])
    grown = a[:1]
    extend_hashes(grown, P, BS, prefix_root())
    assert grown == a


def test_freed_cached_blocks_stay_findable_count_as_free_and_are_evicted_least_recently_used():
    al = BlockAllocator(4, BS)
    x = al.allocate(2)
    y = al.allocate(2)
    hx, hy = [b"x0", b"x1"], [b"y0", b"y1"]
    for b, h in zip(x + y, hx + hy):
        al.cache(b, h)
    al.free(x)
    al.free(y)
    assert al.num_free == 4 and al.num_used == 0 and al.num_cached == 4
    assert al.match(hx) == x and al.match(hy) == y and al.match([b"y0", b"zz"]) == y[:1]
    al.share(al.match(hy))  # y used again: x is now the least recently used
    assert al.num_free == 2 and al.num_idle(y) == 0 and al.num_idle(x) == 2
    new = al.allocate(1)  # evicts x's tail first (the end of a prompt is shared least)
    assert new == [x[1]] and al.match(hx) == x[:1] and al.evictions == 1
    al.free(y)
    al.free(new)
    assert al.num_free == 4 and al.match(hy) == y  # an unnamed block comes back empty


def test_a_second_block_with_a_cached_hash_stays_unnamed_and_caching_off_finds_nothing():
    al = BlockAllocator(4, BS)
    a, b = al.allocate(2)
    al.cache(a, b"h")
    al.cache(b, b"h")  # computed twice at once: the first keeps the name
    assert al.match([b"h"]) == [a] and al.num_cached == 1
    off = BlockAllocator(4, BS, caching=False)
    c = off.allocate(1)[0]
    off.cache(c, b"h")
    assert off.match([b"h"]) == [] and off.num_cached == 0


# -- the scheduler ---------------------------------------------------------------------------


def sched(routers=1, blocks=64, **kw):
    limits = {k: kw.pop(k) for k in list(kw) if k in ("max_num_seqs", "max_num_batched_tokens")}
    return Scheduler(routers, Limits(**limits), [EOS], block_size=BS, num_blocks=blocks, **kw)


def test_a_repeated_prompt_starts_on_the_cached_blocks_and_computes_only_its_tail():
    s = sched()
    s.submit(req(P))
    drain(s)
    second = s.submit(req(P))
    work = s.schedule()
    sw = fresh_work(work, second)
    assert sw.fresh and sw.start == 12 and sw.token_ids == P[12:]
    assert sw.new_blocks[:3] == tuple(second.blocks[:3]) and len(sw.new_blocks) == 4 and sw.sample
    assert second.prefix_hit == 12
    feed(s, work)
    ev = second.events.get_nowait()
    assert isinstance(ev, FirstToken) and ev.cached_tokens == 12
    assert s.counts()["prefix_cache_queries"] == 26 and s.counts()["prefix_cache_hits"] == 12


def test_a_prompt_cached_whole_still_computes_its_last_block_to_sample_from_it():
    s = sched()
    s.submit(req(P[:12]))  # 3 full blocks
    drain(s)
    again = s.submit(req(P[:12]))
    sw = fresh_work(s.schedule(), again)
    assert sw.start == 8 and sw.token_ids == P[8:12] and sw.sample  # the shared block 2 is never written


def test_a_shared_prefix_is_read_by_a_request_admitted_later_in_the_same_step():
    """Every layer writes the step's keys and values before any sequence attends, so the blocks
    a prompt fills in a step can be read by a sequence admitted after it in that step."""
    s = sched()
    a, b = s.submit(req(P)), s.submit(req(P[:8] + (50, 51, 52)))
    work = s.schedule()
    wa, wb = fresh_work(work, a), fresh_work(work, b)
    assert wa.start == 0 and wb.start == 8 and wb.new_blocks[:2] == wa.new_blocks[:2]
    assert s.counts()["kv_blocks_used"] == 4 + 1


def test_blocks_filled_by_decodes_are_cached_once_their_tokens_are_known():
    """A conversation's next turn (its prompt, the answer, new tokens) finds the answer cached."""
    s = sched()
    turn1 = s.submit(req(P[:6], max_tokens=6))
    works, out = 0, None
    while True:  # tokens one step late, as with asynchronous steps
        work = s.schedule()
        if out is not None:
            feed(s, out, token=40 + works)
        out, works = work, works + 1
        if work is None and not s.counts()["running"]:
            break
    answer = turn1.output
    assert len(answer) == 6
    turn2 = s.submit(req(P[:6] + tuple(answer) + (90, 91, 92)))
    sw = fresh_work(s.schedule(), turn2)
    # block 1 holds prompt tokens 4-5 and answer tokens 0-1, fed by decodes; block 2 is not full
    # in the cache (the answer's last token was sampled, never fed)
    assert sw.start == 8


@pytest.mark.parametrize("wants", [dict(return_logits="all"), dict(prompt_logprobs=0), dict(prompt_logprobs=5)])
def test_a_request_that_needs_every_prompt_logit_or_logprob_computes_its_whole_prompt(wants):
    s = sched()
    s.submit(req(P))
    drain(s)
    echo = s.submit(req(P, **wants))
    sw = fresh_work(s.schedule(), echo)
    assert sw.start == 0 and sw.token_ids == P and echo.prefix_hit == 0
    plain = s.submit(req(P))  # the same prompt without them still reads the cache
    assert fresh_work(s.schedule(), plain).start == 12


def test_a_penalized_requests_fresh_record_carries_the_ids_of_its_cached_prefix():
    """A penalized sequence on cached blocks: its first record carries the ids it reads from
    them (its router's penalty state counts every prompt token), later records none; an
    unpenalized one carries none."""
    from moeserve.sampling import SamplingParams

    s = sched()
    s.submit(req(P))
    drain(s)
    pen = s.submit(req(P, sampling=SamplingParams(repetition_penalty=1.3)))
    plain = s.submit(req(P))
    work = s.schedule()
    sw = fresh_work(work, pen)
    assert (sw.start, sw.prefix_ids, sw.token_ids) == (12, P[:12], P[12:])
    assert fresh_work(work, plain).prefix_ids == ()
    feed(s, work)
    later = [x for w in s.schedule() for x in w.seqs if x.seq_id == pen.seq_id]
    assert all(x.prefix_ids == () for x in later)


def test_a_cache_salt_keeps_requests_apart_and_the_cache_can_be_off():
    s = sched()
    s.submit(req(P, cache_salt="tenant-a"))
    drain(s)
    other = s.submit(req(P, cache_salt="tenant-b"))
    same = s.submit(req(P, cache_salt="tenant-a"))
    work = s.schedule()
    assert fresh_work(work, other).start == 0 and fresh_work(work, same).start == 12
    off = sched(prefix_caching=False)
    off.submit(req(P))
    drain(off)
    again = off.submit(req(P))
    assert fresh_work(off.schedule(), again).start == 0 and off.counts()["kv_blocks_cached"] == 0


def test_a_small_pool_evicts_the_least_recently_used_prefix_first():
    s = sched(blocks=6)
    prompts = [tuple(range(100 * i, 100 * i + 9)) for i in range(1, 4)]  # 2 full blocks and a token: 3 blocks
    for p in prompts[:2]:
        s.submit(req(p))
        drain(s)
    s.submit(req(prompts[0]))  # uses prompt 0's blocks again: prompt 1's are now the least recent
    drain(s)
    s.submit(req(prompts[2]))  # needs 3 blocks: the 2 empty ones, then prompt 1's tail block
    drain(s)
    assert s._blocks[0].evictions == 1
    hits = []
    for p in prompts[:2]:
        seq = s.submit(req(p))
        hits.append(fresh_work(s.schedule(), seq).start)
    assert hits == [8, 4]


@pytest.mark.parametrize("late", [False, True], ids=["sync", "tokens-one-step-late"])
def test_a_preempted_sequence_that_shares_blocks_frees_only_its_references(late):
    """Two sequences share a 2-block prefix; the pool runs out, the newer is preempted: the
    shared blocks stay with the older one, and the newer is recomputed on them."""
    s = sched(blocks=6)
    old = s.submit(req(P[:9], max_tokens=12))
    new = s.submit(req(P[:8] + (60,), max_tokens=12))
    out, starts = None, []
    for _ in range(80):
        work = s.schedule()
        if out is not None:
            feed(s, out, token=30)
            out = None
        if work is None:
            if not s.counts()["running"] and not s.counts()["waiting"]:
                break
            continue
        starts += [sw.start for rw in work for sw in rw.seqs if sw.fresh and sw.seq_id == new.seq_id]
        assert s.counts()["kv_blocks_used"] <= 6
        if late:
            out = work
        else:
            feed(s, work, token=30)
    assert s.counts()["preemptions"] >= 1 and starts[0] == 8 and len(starts) >= 2
    assert starts[1] >= 8  # recomputed on the shared prefix (and on its own blocks still cached)
    assert old.output == [30] * 12 and new.output == [30] * 12
    assert s.counts()["kv_blocks_used"] == 0


def test_a_lost_routers_sequences_start_on_the_blocks_cached_on_the_router_they_move_to():
    """A lost router's pool and its cache go with it: its sequences are recomputed on another
    router, from that router's cached blocks of their prefix, and the router's replacement
    starts with an empty pool that caches as the others do (or not, with the cache off)."""
    s = sched(routers=2, routing="round_robin")
    a, b = s.submit(req(P, max_tokens=6)), s.submit(req(P, max_tokens=6))
    feed(s, s.schedule())
    feed(s, s.schedule())
    assert (a.router, b.router) == (0, 1) and len(b.output) == 2
    queries = s.counts()["prefix_cache_queries"]
    replay = s.router_lost(1, s.schedule())  # the step router 1 dies in
    feed(s, replay)
    work = s.schedule()
    sw = fresh_work(work, b)
    assert b.router == 0 and sw.start == 12 and sw.new_blocks[:3] == tuple(a.blocks[:3])  # P: 3 full blocks
    assert s.counts()["prefix_cache_queries"] == queries  # a recomputation is not a first admission
    feed(s, work)
    drain(s)
    assert a.output == b.output == [7] * 6
    s.router_joined(1, 64)
    assert s.counts()["kv_blocks_cached"] == s._blocks[0].num_cached  # the new pool holds nothing yet
    for caching in (True, False):
        t = sched(routers=2, prefix_caching=caching)
        t.router_lost(1)
        t.router_joined(1, 64)
        assert [x.caching for x in t._blocks] == [caching, caching]


def conversations(routers, routing, turns=3, convs=3):
    """``convs`` conversations of ``turns`` turns, each turn sent after the previous answers:
    its prompt is the conversation so far and 5 new tokens. Returns (hit tokens, computed
    tokens) over every turn after the first."""
    s = sched(routers=routers, routing=routing)
    history = [tuple(range(200 * c, 200 * c + 9)) for c in range(convs)]
    hit = computed = 0
    for t in range(turns):
        seqs = []
        for c in range(convs):  # one conversation after the other, as a client sends them
            seqs.append(s.submit(req(history[c], max_tokens=3)))
            work = s.schedule()
            feed(s, work, token=70 + t)
        drain(s, token=70 + t)
        for c, seq in enumerate(seqs):
            if t:
                hit += seq.prefix_hit
                computed += len(seq.req.prompt_ids) - seq.prefix_hit
            history[c] = history[c] + tuple(seq.output) + tuple(range(200 * c + 100 + 5 * t, 200 * c + 105 + 5 * t))
    return hit, computed


def test_cache_aware_routing_sends_a_conversation_to_the_router_that_holds_it():
    aware, robin = conversations(2, "cache_aware"), conversations(2, "round_robin")
    one = conversations(1, "cache_aware")
    assert aware == one  # two routers find as much as one shared cache
    assert aware[0] > robin[0] and aware[1] < robin[1]


def test_cache_aware_routing_balances_against_the_routers_running_sequences():
    s = sched(routers=2, max_num_seqs=8, routing="cache_aware")  # slack: max(1, 8 // 8) = 1
    placed = [s.submit(req(P, max_tokens=50)) for _ in range(6)]
    s.schedule()
    on = [q.router for q in placed]
    assert on.count(0) == 3 and on.count(1) == 3  # the prefix pulls, but at most one sequence apart
    assert sum(q.prefix_hit > 0 for q in placed) == 4  # each router computed the prompt once


def test_a_bad_routing_policy_is_refused():
    with pytest.raises(ValueError, match="round_robin"):
        sched(routing="random")


# -- the router --------------------------------------------------------------------------------


def test_a_router_sequence_started_on_cached_blocks_computes_what_the_whole_prompt_gives(tmp_path):
    """The runner's view: a fresh sequence whose table starts with another's full blocks and whose
    first computed token is at the cached length samples the tokens, within 1e-5 the logits, of
    the same prompt computed from its first token."""
    from test_router_runner import LocalExperts

    from moeserve.dataplane.protocol import RouterWork, SeqWork
    from moeserve.models import init_model, load_model
    from moeserve.router.runner import RouterRunner
    from moeserve.sampling import SamplingParams

    model = load_model(init_model(tmp_path, "llama4", seed=5))
    greedy = SamplingParams(temperature=0.0, seed=0)
    shared, tail = (5, 9, 13, 2, 7, 11, 3, 8), (21, 4, 17)

    def make():
        return RouterRunner(model, LocalExperts(model), num_blocks=16, block_size=BS, async_outputs=False)

    cached = make()
    cached.run(
        RouterWork((SeqWork(seq_id=1, token_ids=shared + (6,), start=0, sampling=greedy, new_blocks=(0, 1, 2)),)), 0
    )
    cached.deliver(0)
    work = SeqWork(seq_id=2, token_ids=tail, start=8, sampling=greedy, return_logits="last", new_blocks=(0, 1, 3))
    cached.run(RouterWork((work,), release=(1,)), 1)
    _, toks, logits, _ = cached.deliver(1)
    whole = make()
    whole.run(
        RouterWork(
            (
                SeqWork(
                    seq_id=2,
                    token_ids=shared + tail,
                    start=0,
                    sampling=greedy,
                    return_logits="last",
                    new_blocks=(4, 5, 6),
                ),
            )
        ),
        0,
    )
    _, want_toks, want_logits, _ = whole.deliver(0)
    assert toks == want_toks
    np.testing.assert_allclose(logits[2], want_logits[2], atol=1e-5, rtol=0)


# -- the doors ---------------------------------------------------------------------------------


def test_the_http_api_reports_cached_tokens_as_openai_does_and_checks_the_salt():
    from types import SimpleNamespace

    from moeserve.services.admission import AdmissionLimits
    from moeserve.services.http.encode import ApiError, usage
    from moeserve.services.http.params import parse_sampling

    choices = [SimpleNamespace(tokens=3, cached_tokens=c) for c in (16, 16, 0, 0)]  # 2 prompts x n = 2
    assert usage(40, choices, n=2) == {
        "prompt_tokens": 40,
        "completion_tokens": 12,
        "total_tokens": 52,
        "prompt_tokens_details": {"cached_tokens": 16},
    }
    lim = AdmissionLimits(max_stop_ids=8)
    assert parse_sampling({"cache_salt": "tenant-a"}, False, lim).cache_salt == "tenant-a"
    assert parse_sampling({}, True, lim).cache_salt == ""
    for bad in ("", 7, "x" * 1025):
        with pytest.raises(ApiError, match="cache_salt"):
            parse_sampling({"cache_salt": bad}, False, lim)


def test_the_engine_refuses_a_salt_over_its_limit():
    from moeserve.router.engine.api import InvalidRequest, validate_request

    with pytest.raises(InvalidRequest, match="cache_salt"):
        validate_request(req(P, cache_salt="é" * 600), 100, 4096, 4096)  # 1,200 bytes of UTF-8
    validate_request(req(P, cache_salt="é" * 512), 100, 4096, 4096)


def test_prefix_caching_and_the_routing_policy_are_flags_and_cluster_keywords(tmp_path):
    from moeserve.cli import build_parser
    from moeserve.cli.flags import cluster_kwargs
    from moeserve.cluster.launcher import configure

    cfg, _ = configure(tmp_path, enable_prefix_caching=False, routing_policy="round_robin")
    assert cfg.cache.enable_prefix_caching is False and cfg.routing_policy == "round_robin"
    assert configure(tmp_path)[0].cache.enable_prefix_caching is True
    for argv, want in (
        ([], (True, "cache_aware")),
        (["--no-enable-prefix-caching", "--routing-policy", "round_robin"], (False, "round_robin")),
    ):
        kw = cluster_kwargs(build_parser().parse_args(["up", "--model", str(tmp_path), *argv]))
        assert (kw["enable_prefix_caching"], kw["routing_policy"]) == want


def test_the_leader_keeps_the_prefix_cache_it_is_given(caplog):
    """The leader takes the setting as it is and logs nothing about it: sliding-window layers
    read the cache as full ones do (a cached block holds every layer's keys), so the leader is
    not told the window at all (tests/test_cluster_families.py: GPT-OSS and a windowed Mixtral
    read it)."""
    import logging

    from moeserve.config import CacheConfig, ClusterConfig
    from moeserve.placement import Placement
    from moeserve.router.engine.api import ModelShape
    from moeserve.router.engine.leader import Engine

    placement = Placement(np.tile(np.arange(4), (2, 1)), 4, 1, version=1)
    for cache in (True, False):
        cfg = ClusterConfig(model_dir="unused", cache=CacheConfig(enable_prefix_caching=cache))
        with caplog.at_level(logging.WARNING, logger="moeserve.leader"):
            caplog.clear()
            eng = Engine(cfg, ModelShape(2, 4, 1, 100, (2,), 16, (0, 1), 2), placement)
        assert eng.scheduler.prefix_caching == cache
        assert "prefix caching" not in caplog.text
