"""MOESERVE_ATTENTION_PREFILL=sdpa through a cluster on the CPU: the rank processes read the
switch from their environment and say so in their logs, and DeepSeek-V3's latent attention
(whose fresh prompts then expand through torch's SDPA on any device) gives the single-process
model's tokens, prompts and a repeated prompt read from the prefix cache alike."""

from pathlib import Path

import hf_oracle as hf
import pytest
from cluster_util import prompts_for, reference_decode, reference_model

from moeserve.cluster import LocalCluster

pytestmark = pytest.mark.slow  # it starts processes


@pytest.mark.timeout(300)
def test_deepseek_fresh_prompts_through_sdpa_give_the_reference_tokens(tmp_path):
    path = hf.save(hf.build_deepseek_v3(seed=3), tmp_path / "ckpt")
    model = reference_model(path)
    prompts = prompts_for(model.config.vocab_size, lengths=(5, 11, 23, 9))
    want = [reference_decode(model, p, 12)[0] for p in prompts]
    logs = tmp_path / "logs"
    with LocalCluster(path, routers=1, workers=1, log_dir=str(logs), env={"MOESERVE_ATTENTION_PREFILL": "sdpa"}) as c:
        got = c.generate(prompts, max_tokens=12, ignore_eos=True)
        again = c.generate([prompts[2]], max_tokens=12, ignore_eos=True, details=True)
    assert got == want
    assert again[0].token_ids == want[2] and again[0].cached_tokens == 16  # a continuing chunk, not fresh
    text = "".join(p.read_text() for p in Path(logs).glob("rank*.log"))
    assert "MOESERVE_ATTENTION_PREFILL=sdpa" in text
