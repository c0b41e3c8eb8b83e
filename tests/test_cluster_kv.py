"""The paged KV cache across processes: more concurrent long requests than KV blocks complete
through preemption, with the tokens a run without preemption gives (greedy and seeded). The
run without preemption has synchronous steps, the tight one asynchronous steps (the default):
a preempted sequence with a token in flight is recomputed with it, and the tokens agree."""

import pytest
from cluster_util import prompts_for, reference_generate, reference_model, tiny_checkpoint

from moeserve.cluster import LocalCluster

pytestmark = pytest.mark.slow  # every test here starts processes

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tiny_checkpoint(tmp_path_factory.mktemp("kv"), "llama4")
    model = reference_model(path)
    prompts = prompts_for(model.config.vocab_size, lengths=(9, 13, 6, 11, 8, 12), seed=5)
    return dict(path=path, prompts=prompts, greedy=[reference_generate(model, p, MAX_TOKENS) for p in prompts])


@pytest.mark.timeout(300)
def test_kv_exhaustion_completes_every_request_through_preemption_with_unchanged_tokens(setup):
    seeded = dict(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)
    with LocalCluster(
        setup["path"], routers=1, workers=2, block_size=4, num_gpu_blocks_override=64, async_scheduling=False
    ) as roomy:
        want_seeded = roomy.generate(setup["prompts"], **seeded)
        assert roomy.status().preemptions == 0
    # Each request needs 5 to 10 blocks of 4 tokens; 18 blocks hold two or three at a time.
    with LocalCluster(
        setup["path"], routers=1, workers=2, block_size=4, num_gpu_blocks_override=18, max_num_batched_tokens=16
    ) as tight:
        assert tight.generate(setup["prompts"], max_tokens=MAX_TOKENS, ignore_eos=True) == setup["greedy"]
        first = tight.status().preemptions
        assert tight.generate(setup["prompts"], **seeded) == want_seeded
        status = tight.status()
        assert first > 0 and status.preemptions > first  # both runs preempted and recomputed
        assert status.kv_blocks_total == 18 and status.kv_blocks_used == 0
        with pytest.raises(ValueError, match="never fit"):
            tight.generate([[5] * 60], max_tokens=20)  # 80 tokens > 18 blocks x 4
