"""Prefix caching across processes (fp32, gloo): repeated and shared-prefix prompts read their
cached blocks and give transformers' tokens, with 1 and 2 routers; a small pool evicts and
preempts sequences that share cached blocks without changing a token; a live migration and a
lost expert worker while cached blocks are in use change none either; two routers with
cache-aware routing find more of a multi-turn load in their caches, and compute fewer tokens,
than with round robin."""

import os
import signal
import threading
import time

import hf_oracle as hf
import numpy as np
import pytest
import torch
from cluster_util import (
    moe_info,
    prompts_for,
    random_placement,
    redundant_for,
    reference_decode,
    reference_generate,
    reference_model,
    tiny_checkpoint,
)

from moeserve.cluster import LocalCluster

pytestmark = pytest.mark.slow  # every test here starts processes

BS = 4
MAX_TOKENS = 12
SYSTEM = 22  # tokens of the shared system prompt: 5 full blocks of 4, and 2 tokens


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tiny_checkpoint(tmp_path_factory.mktemp("prefix"), "llama4")
    model = reference_model(path)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(7)
    system = rng.integers(3, vocab, SYSTEM).tolist()
    prompts = [system + rng.integers(3, vocab, n).tolist() for n in (5, 3, 7, 4)]
    oracle = hf.load_oracle(path)
    want = [hf.hf_greedy(oracle, torch.tensor([p]), MAX_TOKENS)[0, len(p) :].tolist() for p in prompts]
    assert want == [reference_generate(model, p, MAX_TOKENS) for p in prompts]  # the oracles agree
    return dict(path=path, model=model, vocab=vocab, prompts=prompts, want=want)


def run(c, prompts, **kw):
    return c.generate(prompts, max_tokens=MAX_TOKENS, ignore_eos=True, details=True, **kw)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("routers", [1, 2])
def test_repeated_and_shared_prefix_prompts_read_the_cache_and_give_the_tokens_of_transformers(setup, routers):
    prompts, want = setup["prompts"], setup["want"]
    with LocalCluster(setup["path"], routers=routers, workers=2, block_size=BS) as c:
        first = run(c, prompts[:1])[0]
        assert first.cached_tokens == 0 and first.token_ids == want[0]
        out = run(c, prompts, return_logits=True)
        assert [g.token_ids for g in out] == want
        # the repeated prompt: all but its last block (27 tokens: 6 blocks); the others: the
        # system prompt's 5 full blocks (its last 2 tokens share a block with their own)
        assert [g.cached_tokens for g in out] == [24, 20, 20, 20]
        for g, p in zip(out, prompts):
            _, logits = reference_decode(setup["model"], p, MAX_TOKENS)
            np.testing.assert_allclose(g.logits, logits, atol=hf.FP32_LOGITS_ATOL, rtol=0)
        apart = run(c, prompts[:2], cache_salt="another tenant")  # computed in full
        assert [g.cached_tokens for g in apart] == [0, 20] and [g.token_ids for g in apart] == want[:2]
        s = c.status()
        assert s.prefix_cache_queries == 2 * len(prompts[0]) + sum(map(len, prompts)) + len(prompts[1])
        assert s.prefix_cache_hits == 24 + 3 * 20 + 20 and s.kv_blocks_used == 0 and s.kv_blocks_cached > 0
    with LocalCluster(setup["path"], routers=routers, workers=1, block_size=BS, enable_prefix_caching=False) as off:
        out = run(off, prompts[:1] + prompts)
        assert [g.token_ids for g in out] == want[:1] + want and not any(g.cached_tokens for g in out)
        assert off.status().prefix_cache_hits == 0 == off.status().kv_blocks_cached


@pytest.mark.timeout(300)
def test_a_small_pool_evicts_and_preempts_sequences_that_share_cached_blocks_with_unchanged_tokens(setup):
    prompts, want = setup["prompts"], setup["want"]
    # 20 blocks of 4: each request ends with 9 or 10, 5 of them the system prompt's shared by all
    # four (24 at once): the newest is preempted
    with LocalCluster(
        setup["path"], routers=1, workers=2, block_size=BS, num_gpu_blocks_override=20, max_num_batched_tokens=16
    ) as c:
        out = run(c, prompts)
        assert [g.token_ids for g in out] == want
        s = c.status()
        assert s.preemptions > 0 and s.prefix_cache_hits > 0 and s.kv_blocks_used == 0
        others = prompts_for(setup["vocab"], lengths=(30, 27, 29, 26), seed=9)
        run(c, others)  # fills the pool many times over: evicts idle cached blocks
        again = run(c, prompts[:1])[0]
        assert again.token_ids == want[0] and again.cached_tokens < 24
        assert c.status().kv_blocks_used == 0


@pytest.mark.timeout(300)
def test_a_live_migration_and_a_lost_worker_while_cached_blocks_are_read_change_no_token(setup):
    prompts, want = setup["prompts"], setup["want"]
    info = moe_info(setup["path"])
    redundant = redundant_for(info.num_logical_experts, 2, 2)
    with LocalCluster(
        setup["path"],
        routers=1,
        workers=2,
        block_size=BS,
        num_redundant_experts=redundant,
        migration_bytes_per_step=info.expert_bytes,  # one expert per worker per step: many steps
    ) as c:
        assert run(c, prompts[:1])[0].token_ids == want[0]

        def while_generating(action):
            box = {}
            th = threading.Thread(target=lambda: box.update(out=run(c, prompts * 2)))
            steps = c.status().forward_steps
            th.start()
            while c.status().forward_steps < steps + 3:
                time.sleep(0.01)
            action()
            th.join(240)
            assert not th.is_alive()
            return box["out"]

        target = random_placement(
            info.num_moe_layers, info.num_logical_experts, info.num_logical_experts + redundant, seed=3
        )
        out = while_generating(lambda: c.apply_placement(target, wait=True))
        assert [g.token_ids for g in out] == want * 2 and min(g.cached_tokens for g in out) >= 20
        np.testing.assert_array_equal(c.placement().phy2log, target)
        out = while_generating(lambda: os.kill(c.procs[2].pid, signal.SIGKILL))  # rank 2: a worker
        assert [g.token_ids for g in out] == want * 2 and min(g.cached_tokens for g in out) >= 20
        assert len(c.replaced) == 1


def conversations(c, vocab, turns=3, convs=3):
    """``convs`` conversations of ``turns`` turns, one request at a time: each turn's prompt is
    the conversation so far (its earlier prompts and answers) and 6 new tokens. Returns every
    turn's (prompt, answer) and the status counters' growth (hits, tokens computed)."""
    rng = np.random.default_rng(11)
    history = [rng.integers(3, vocab, 10).tolist() for _ in range(convs)]
    before = c.status()
    turns_out = []
    for _ in range(turns):
        for k in range(convs):
            answer = c.generate([history[k]], max_tokens=6, ignore_eos=True)[0]
            turns_out.append((list(history[k]), answer))
            history[k] = history[k] + answer + rng.integers(3, vocab, 6).tolist()
    s = c.status()
    hits = s.prefix_cache_hits - before.prefix_cache_hits
    return turns_out, hits, s.prefix_cache_queries - before.prefix_cache_queries - hits


@pytest.mark.timeout(300)
def test_two_routers_with_cache_aware_routing_find_more_and_compute_less_than_with_round_robin(setup):
    got = {}
    for policy in ("cache_aware", "round_robin"):
        with LocalCluster(setup["path"], routers=2, workers=1, block_size=BS, routing_policy=policy) as c:
            got[policy] = conversations(c, setup["vocab"])
    (aware, aware_hits, aware_computed), (robin, robin_hits, robin_computed) = got["cache_aware"], got["round_robin"]
    assert aware == robin  # the same tokens either way
    for prompt, answer in aware:
        assert answer == reference_generate(setup["model"], prompt, 6)
    assert aware_hits > robin_hits and aware_computed < robin_computed
    print(f"cache_aware: {aware_hits} hit, {aware_computed} computed; round_robin: {robin_hits}, {robin_computed}")


@pytest.mark.timeout(300)
def test_penalized_requests_give_the_tokens_they_give_without_the_cache(setup):
    """A penalized request reads its cached prompt blocks: a repetition penalty needs every
    prompt token on the router, which its fresh record's cached-prefix ids bring
    (``SeqWork.prefix_ids``); presence and frequency penalties count outputs only. Either way its
    tokens are those it gets with the cache off, which differ from the unpenalized ones."""
    p = setup["prompts"][0]
    kinds = [dict(repetition_penalty=1.8), dict(presence_penalty=1.5, frequency_penalty=1.0)]
    with LocalCluster(setup["path"], routers=1, workers=1, block_size=BS, enable_prefix_caching=False) as off:
        want = [run(off, [p], **kw)[0].token_ids for kw in kinds]
    assert want[0] != setup["want"][0]  # the penalty changes the greedy tokens, so a lost prompt token shows
    with LocalCluster(setup["path"], routers=1, workers=1, block_size=BS) as c:
        assert run(c, [p])[0].cached_tokens == 0
        rep, pres = (run(c, [p], **kw)[0] for kw in kinds)
        assert (rep.token_ids, rep.cached_tokens) == (want[0], 24)
        assert (pres.token_ids, pres.cached_tokens) == (want[1], 24)
