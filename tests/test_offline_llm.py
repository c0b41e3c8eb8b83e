"""vLLM's offline API (moeserve.llm): the ERNIE seed's offline script, with its import line
changed and its model path swapped for a tiny local ERNIE checkpoint (2 CPU ranks, a short
max_tokens), runs and rebalances; in process, ``LLM`` with the same keywords gives the
single-process reference's greedy tokens while the balancer rearranges the experts, and vLLM's
result shapes (text and token prompts, logprobs, prompt logprobs, stop strings, n with seeds,
chat)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from cluster_util import reference_model

from moeserve.models import init_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# The seed's script as vLLM users wrote it; the two changes are marked.
SEED_SCRIPT = """
from moeserve import LLM, SamplingParams  # was: from vllm import LLM, SamplingParams


def main():
    llm = LLM(
        model={model!r},  # was: the ERNIE-4.5-21B-A3B folder
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        enable_eplb=True,
        num_redundant_experts=32,
        eplb_window_size=1000,
        eplb_step_interval=100,
        enforce_eager=True,
        trust_remote_code=True,
    )
    prompt = "Explain expert parallelism in one paragraph."
    sampling_params = SamplingParams(temperature=0.0, top_p=1.0, top_k=1, max_tokens={max_tokens})  # was: 4096
    outputs = llm.generate([prompt], sampling_params)
    for output in outputs:
        print(f"Prompt: {{output.prompt!r}}, Generated text: {{output.outputs[0].text!r}}")
        print("generated", len(output.outputs[0].token_ids), "tokens")


if __name__ == "__main__":
    main()
"""
MAX_TOKENS = 400
PROMPT = "Explain expert parallelism in one paragraph."


@pytest.fixture(scope="module")
def ernie(tmp_path_factory):
    """A tiny ERNIE-4.5-MoE checkpoint (16 experts, two hot: a load worth rebalancing) whose
    greedy text for PROMPT runs past MAX_TOKENS without EOS."""
    return init_model(tmp_path_factory.mktemp("ernie") / "ernie", "ernie45", hot_experts=2)


def test_the_seeds_offline_script_runs_and_rebalances(ernie, tmp_path):
    script = tmp_path / "seed.py"
    script.write_text(SEED_SCRIPT.format(model=str(ernie), max_tokens=MAX_TOKENS))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"generated {MAX_TOKENS} tokens" in p.stdout, p.stdout
    assert re.search(r"EPLB rearranged the experts: placement version [2-9]", p.stderr), p.stderr
    assert "2 co-located ranks on the CPU" in p.stderr


@pytest.fixture(scope="module")
def llm(ernie):
    from moeserve import LLM

    m = LLM(
        model=str(ernie),
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        enable_eplb=True,
        num_redundant_experts=32,
        eplb_window_size=1000,
        eplb_step_interval=100,
        enforce_eager=True,
    )
    yield m
    m.shutdown()


@torch.inference_mode()
def test_greedy_tokens_equal_the_reference_while_the_experts_are_rearranged(llm, ernie):
    from moeserve import SamplingParams

    ref = reference_model(ernie)
    ids = llm.get_tokenizer().encode(PROMPT)
    want = ref.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, temperature=0.0)[0, len(ids) :].tolist()
    before = llm.placement_version()
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, top_k=1, max_tokens=MAX_TOKENS))
    assert out[0].prompt == PROMPT and out[0].prompt_token_ids == ids
    assert out[0].outputs[0].token_ids == want
    assert out[0].outputs[0].finish_reason == "length"
    assert llm.placement_version() > before
    # the same prompt as token ids gives the same tokens
    again = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=16))
    assert again[0].outputs[0].token_ids == want[:16]


@torch.inference_mode()
def test_logprobs_prompt_logprobs_stop_strings_n_and_chat_have_vllms_shapes(llm, ernie):
    from moeserve import SamplingParams

    ref = reference_model(ernie)
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPT)
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, prompt_logprobs=1))[0]
    full = torch.log_softmax(ref(torch.tensor([ids + out.outputs[0].token_ids]))[0].float(), -1).numpy()
    c = out.outputs[0]
    assert len(c.logprobs) == 6 and all(len(d) >= 2 for d in c.logprobs)
    for i, (t, d) in enumerate(zip(c.token_ids, c.logprobs)):
        assert abs(d[t].logprob - full[len(ids) - 1 + i, t]) < 1e-3 and d[t].rank == 1  # greedy: the top token
        assert d[t].decoded_token == tok.token_text(t)
    assert abs(c.cumulative_logprob - sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs))) < 1e-6
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i, d in enumerate(out.prompt_logprobs[1:]):
        assert abs(d[ids[i + 1]].logprob - full[i, ids[i + 1]]) < 1e-3
    # a stop string taken from the greedy text ends it there
    text = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=40))[0].outputs[0].text
    stop = text[10:13]
    cut = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]))[0].outputs[0]
    assert cut.text == text[: text.index(stop)] and (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    # n choices with a seed: choice j samples with seed + j, the same on every call
    sp = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=12)
    a, b = llm.generate(PROMPT, sp)[0].outputs, llm.generate(PROMPT, sp)[0].outputs
    assert [x.token_ids for x in a] == [x.token_ids for x in b] and a[0].token_ids != a[1].token_ids
    assert [x.index for x in a] == [0, 1]
    chat = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0.0, max_tokens=4))
    want = tok.encode(tok.render_chat([{"role": "user", "content": "Hi"}]), False)
    assert chat[0].prompt_token_ids == want and len(chat[0].outputs[0].token_ids) == 4


def test_vllm_keywords_moeserve_cannot_honour_say_what_to_do(ernie):
    from moeserve import LLM, SamplingParams

    with pytest.raises(ValueError, match="without enable_expert_parallel"):
        LLM(model=str(ernie), tensor_parallel_size=2)
    with pytest.raises(TypeError, match="does not take"):
        LLM(model=str(ernie), speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="KV cache is kept in the model's dtype"):
        LLM(model=str(ernie), kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"presence_penalty must be a number in \[-2.0, 2.0\]"):
        SamplingParams(presence_penalty=3)
    assert np.isclose(SamplingParams().temperature, 1.0) and SamplingParams().max_tokens == 16
