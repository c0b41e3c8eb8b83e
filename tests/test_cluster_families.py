"""Qwen3-MoE, Mixtral, GPT-OSS and DeepSeek-V3 through a cluster (fp32, CPU ranks): checkpoints transformers
built and saved, two routers and two workers (co-located or not), redundant slots, a random
placement and a live migration while generating. Tokens and their logits equal the
single-process model's (which equals transformers: tests/test_models_families.py), and the
workers end up holding exactly the new placement's experts. Every family reads the prefix cache,
the sliding-window layers of GPT-OSS and this Mixtral included."""

import threading
import time

import hf_oracle as hf
import numpy as np
import pytest
from cluster_util import (
    assert_workers_hold,
    expert_digests,
    moe_info,
    prompts_for,
    random_placement,
    redundant_for,
    reference_decode,
    reference_logits,
    reference_model,
)
from hf_oracle import FP32_LOGITS_ATOL

from moeserve.cluster import LocalCluster

pytestmark = pytest.mark.slow  # every test here starts processes

MAX_TOKENS = 24
CASES = {  # family: (builder, overrides, co-located)
    "qwen3_moe": (hf.build_qwen3_moe, dict(num_experts=8), False),
    "mixtral": (hf.build_mixtral, dict(sliding_window=8), True),
    "gpt_oss": (hf.build_gpt_oss, dict(), False),
    # MLA on the latent paged cache, 4 groups with 2 picked, a dense first layer
    "deepseek_v3": (hf.build_deepseek_v3, dict(), False),
}
WINDOWED = {"mixtral", "gpt_oss"}  # the cases whose checkpoints have sliding-window layers


@pytest.fixture(scope="module", params=list(CASES))
def setup(request, tmp_path_factory):
    build, overrides, colocated = CASES[request.param]
    path = hf.save(build(seed=3, **overrides), tmp_path_factory.mktemp(request.param))
    model = reference_model(path)
    prompts = prompts_for(model.config.vocab_size, lengths=(5, 11, 3, 9))
    decoded = [reference_decode(model, p, MAX_TOKENS) for p in prompts]
    info = moe_info(path)
    r = redundant_for(info.num_logical_experts, 2, at_least=2)
    slots = info.num_logical_experts + r
    return dict(
        family=request.param,
        path=path,
        model=model,
        prompts=prompts,
        tokens=[t for t, _ in decoded],
        logits=[lg for _, lg in decoded],
        info=info,
        redundant=r,
        start=random_placement(info.num_moe_layers, info.num_logical_experts, slots, seed=1),
        target=random_placement(info.num_moe_layers, info.num_logical_experts, slots, seed=2),
        colocated=colocated,
        digests=expert_digests(path),
    )


@pytest.fixture(scope="module")
def cluster(setup):
    with LocalCluster(
        setup["path"],
        routers=2,
        workers=2,
        colocated=setup["colocated"],
        num_redundant_experts=setup["redundant"],
        placement=setup["start"],
        migration_bytes_per_step=setup["info"].expert_bytes,  # one expert per worker per step
    ) as c:
        yield c


def _check(gens, setup):
    for g, tokens, logits in zip(gens, setup["tokens"], setup["logits"]):
        assert g.token_ids == tokens
        np.testing.assert_allclose(g.logits, logits, atol=FP32_LOGITS_ATOL, rtol=0)


@pytest.mark.timeout(300)
def test_tokens_and_logits_equal_the_single_process_model_through_a_live_migration(cluster, setup):
    kw = dict(max_tokens=MAX_TOKENS, ignore_eos=True, return_logits=True, details=True)
    _check(cluster.generate(setup["prompts"], **kw), setup)
    assert_workers_hold(cluster, setup["start"], setup["digests"])
    result = {}
    t = threading.Thread(target=lambda: result.update(out=cluster.generate(setup["prompts"], **kw)))
    t.start()
    time.sleep(0.2)
    mid = cluster.apply_placement(setup["target"], wait=True)
    t.join(120)
    _check(result["out"], setup)
    assert cluster.migration(mid).state == "done"
    np.testing.assert_array_equal(cluster.placement().phy2log, setup["target"])
    assert_workers_hold(cluster, setup["target"], setup["digests"])  # biases moved with their weights


@pytest.mark.timeout(300)
def test_prompt_logits_at_every_position_equal_the_single_process_model(cluster, setup):
    prompt = list(range(3, 40))  # longer than GPT-OSS's and Mixtral's window of 8
    np.testing.assert_allclose(
        cluster.prompt_logits(prompt), reference_logits(setup["model"], prompt), atol=FP32_LOGITS_ATOL, rtol=0
    )


@pytest.mark.timeout(300)
def test_every_family_reads_the_prefix_cache_sliding_window_layers_included(cluster, setup):
    """A repeated prompt and one that shares its first two blocks then goes on differently: the
    later requests read 32 cached tokens and give the single-process model's tokens. The prompts
    are longer than GPT-OSS's and this Mixtral's window of 8, so a windowed layer's new tokens
    attend to keys of cached blocks."""
    prompt = list(range(3, 40))  # two full blocks of 16 and more
    other = prompt[:34] + [7, 5, 11, 2, 9, 4]
    want = reference_decode(setup["model"], prompt, 8)[0]
    want_other = reference_decode(setup["model"], other, 8)[0]
    out = cluster.generate([prompt], max_tokens=8, ignore_eos=True, details=True)
    hits = cluster.status().prefix_cache_hits
    out += cluster.generate([prompt, other], max_tokens=8, ignore_eos=True, details=True)
    assert [g.token_ids for g in out] == [want, want, want_other]
    assert (setup["model"].config.attention_window > 0) == (setup["family"] in WINDOWED)
    assert [g.cached_tokens for g in out[1:]] == [32, 32]
    assert cluster.status().prefix_cache_hits - hits >= 64
