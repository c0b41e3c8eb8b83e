"""A cluster started by `moeserve up` generates, through the SDK, exactly what
transformers generates greedily on the same checkpoint, for both families."""

import subprocess
import sys

import hf_oracle
import pytest
import torch
from control_util import Up

pytestmark = pytest.mark.slow  # every test here starts processes

FAMILIES = {"llama4": hf_oracle.build_llama4, "ernie45": hf_oracle.build_ernie}
MAX_TOKENS = 16


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    model = FAMILIES[request.param](seed=5)
    path = hf_oracle.save(model, tmp_path_factory.mktemp(request.param))
    prompts = hf_oracle.prompts(3, 6, seed=1).tolist() + [[7, 8, 9]]
    want = [hf_oracle.hf_greedy(model, torch.tensor([p]), MAX_TOKENS)[0, len(p) :].tolist() for p in prompts]
    eos = model.config.eos_token_id
    with_eos = [
        hf_oracle.hf_greedy(model, torch.tensor([p]), MAX_TOKENS, eos=eos, pad=0)[0, len(p) :].tolist() for p in prompts
    ]
    up = Up(path, "--routers", "1", "--workers", "2", "--enable-eplb", "--num-redundant-experts", "2")
    yield dict(name=request.param, up=up, prompts=prompts, want=want, with_eos=with_eos, eos=eos)
    up.stop()


@pytest.mark.timeout(300)
def test_sdk_greedy_generation_equals_transformers(family):
    serving, _, _ = family["up"].clients()
    for p, want in zip(family["prompts"], family["want"]):
        out = serving.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        assert out.token_ids == want
        assert out.finish_reason == "length"
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(p), MAX_TOKENS)


@pytest.mark.timeout(300)
def test_generation_stops_at_eos_like_transformers_unless_ignore_eos(family):
    serving, _, _ = family["up"].clients()
    for p, want in zip(family["prompts"], family["with_eos"]):
        out = serving.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=False)
        stop = want.index(family["eos"]) + 1 if family["eos"] in want else len(want)
        assert out.token_ids == want[:stop]
        assert out.finish_reason == ("stop" if stop < len(want) or want[-1] == family["eos"] else "length")


@pytest.mark.timeout(300)
def test_streamed_tokens_equal_the_unary_answer(family):
    serving, _, _ = family["up"].clients()
    p = family["prompts"][0]
    chunks = list(serving.generate_stream(prompt_token_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [t for c in chunks for t in c.token_ids] == family["want"][0]
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert all(c.finish_reason is None for c in chunks[:-1])


@pytest.mark.timeout(300)
def test_the_cli_generates_against_the_running_server(family):
    p = family["prompts"][1]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "moeserve",
            "generate",
            "--address",
            family["up"].serving,
            "--prompt-ids",
            ",".join(map(str, p)),
            "--max-tokens",
            str(MAX_TOKENS),
            "--ignore-eos",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert f"generated ids: {','.join(map(str, family['want'][1]))}" in out.stdout
