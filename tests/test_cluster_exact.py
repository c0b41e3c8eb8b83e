"""The correctness contract across processes: any layout of routers and workers, any
placement with redundant slots, gives the single-process logits (fp32, 1e-4) and tokens."""

import numpy as np
import pytest
from cluster_util import (
    moe_info,
    prompts_for,
    random_placement,
    redundant_for,
    reference_decode,
    reference_generate,
    reference_logits,
    reference_model,
    tiny_checkpoint,
)

from moeserve.cluster import LocalCluster

pytestmark = pytest.mark.slow  # every test here starts processes

LAYOUTS = [  # routers, workers, co-located
    (1, 1, False),
    (1, 2, False),
    (2, 2, False),
    (1, 3, False),
    (2, 2, True),
    (3, 3, True),
]
FAMILIES = ["llama4", "ernie45"]
MAX_TOKENS = 32


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    path = tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    model = reference_model(path)
    prompts = prompts_for(model.config.vocab_size)
    tokens = [reference_generate(model, p, MAX_TOKENS) for p in prompts]
    decoded = [reference_decode(model, p, MAX_TOKENS) for p in prompts]
    assert [t for t, _ in decoded] == tokens  # the two single-process paths agree
    logits = [lg for _, lg in decoded]
    return dict(path=path, model=model, prompts=prompts, tokens=tokens, logits=logits, info=moe_info(path))


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda l: f"r{l[0]}w{l[1]}{'-colocated' if l[2] else ''}")
def cluster(request, family_model):
    routers, workers, colocated = request.param
    info = family_model["info"]
    r = redundant_for(info.num_logical_experts, workers, at_least=2)
    placement = random_placement(
        info.num_moe_layers, info.num_logical_experts, info.num_logical_experts + r, seed=routers * 10 + workers
    )
    with LocalCluster(
        family_model["path"],
        routers=routers,
        workers=workers,
        colocated=colocated,
        num_redundant_experts=r,
        placement=placement,
    ) as c:
        yield c


@pytest.mark.timeout(300)
def test_generated_tokens_and_their_logits_equal_the_single_process_model(cluster, family_model):
    gens = cluster.generate(
        family_model["prompts"], max_tokens=MAX_TOKENS, ignore_eos=True, return_logits=True, details=True
    )
    for g, want_tokens, want_logits in zip(gens, family_model["tokens"], family_model["logits"]):
        assert g.token_ids == want_tokens
        assert g.finish_reason == "length"
        assert g.logits.shape == want_logits.shape
        np.testing.assert_allclose(g.logits, want_logits, atol=1e-4, rtol=0)


@pytest.mark.timeout(300)
def test_prompt_logits_at_every_position_equal_the_single_process_model(cluster, family_model):
    prompt = family_model["prompts"][1]
    np.testing.assert_allclose(
        cluster.prompt_logits(prompt), reference_logits(family_model["model"], prompt), atol=1e-4, rtol=0
    )
