"""``moeserve serve <Hugging Face id>`` serves every family: a checkpoint ``moeserve init-model
--family`` wrote, laid out in an offline hub cache, answers an HTTP completion with the
single-process model's greedy tokens."""

import signal

import openai
import pytest
import test_hub as H
from cluster_util import reference_generate, reference_model
from test_cli_serve import Serve, offline_env

from moeserve.cli import main
from moeserve.services.tokenizer import ModelTokenizer

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_serve_takes_each_family_by_hub_id(tmp_path, family, capsys):
    folder = tmp_path / family
    assert main(["init-model", str(folder), "--family", family, "--seed", "2"]) == 0
    assert f"wrote a random {family} checkpoint" in capsys.readouterr().out
    repo = f"tiny-org/tiny-{family}"
    H.make_hub_cache(tmp_path / "hf" / "hub", repo, folder)
    want = reference_generate(reference_model(folder), [1, 5, 6, 7], 8)
    s = Serve([repo, "--max-model-len", "256"], offline_env(tmp_path / "hf"))
    try:
        c = openai.OpenAI(base_url=s.base, api_key="none", max_retries=0, timeout=60)
        got = c.completions.create(
            model=repo, prompt=[1, 5, 6, 7], max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        assert got.choices[0].text == ModelTokenizer.load(folder).decode(want)
    finally:
        assert s.stop(signal.SIGINT) == 0, s.output()
