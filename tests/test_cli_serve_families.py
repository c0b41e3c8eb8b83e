"""``moeserve serve <Hugging Face id> --enable-eplb`` serves each of the five families with no
per-family glue: a skewed checkpoint ``moeserve init-model --family`` wrote, laid out in an offline hub
cache, served by 2 co-located ranks with redundant slots, answers HTTP completions with the
single-process model's greedy tokens before and after the balancer moved its experts live."""

import signal

import numpy as np
import openai
import pytest
import test_hub as H
from cluster_util import prompts_for, reference_generate, reference_model
from control_util import TOKEN
from test_cli_serve import Serve, offline_env

from moeserve.cli import main
from moeserve.client import Client
from moeserve.services.tokenizer import ModelTokenizer

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

MAX_TOKENS = 8


@pytest.mark.parametrize("family", ["llama4", "ernie45", "qwen3_moe", "mixtral", "gpt_oss"])
def test_serve_takes_each_family_by_hub_id_and_rebalances_it_live_with_enable_eplb(tmp_path, family, capsys):
    folder = tmp_path / family
    assert main(["init-model", str(folder), "--family", family, "--seed", "2", "--hot-experts", "2"]) == 0
    assert f"wrote a random {family} checkpoint" in capsys.readouterr().out
    repo = f"tiny-org/tiny-{family}"
    H.make_hub_cache(tmp_path / "hf" / "hub", repo, folder)
    model = reference_model(folder)
    prompts = prompts_for(model.config.vocab_size, lengths=(4, 9, 6, 12), seed=5)
    tokenizer = ModelTokenizer.load(folder)
    want = [tokenizer.decode(reference_generate(model, p, MAX_TOKENS)) for p in prompts]
    s = Serve(
        [
            repo,
            "--data-parallel-size",
            "2",
            "--enable-expert-parallel",
            "--enable-eplb",
            "--eplb-config",
            '{"num_redundant_experts": 2, "step_interval": 1000000}',  # rebalanced below, not by the loop
            "--max-model-len",
            "256",
        ],
        offline_env(tmp_path / "hf"),
    )
    try:
        c = openai.OpenAI(base_url=s.base, api_key="none", max_retries=0, timeout=60)

        def texts():
            got = c.completions.create(
                model=repo, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
            )
            return [ch.text for ch in sorted(got.choices, key=lambda ch: ch.index)]

        assert texts() == want
        admin = Client(f"127.0.0.1:{s.admin}", TOKEN, timeout=60)
        balancer = Client(f"127.0.0.1:{s.balancer}", TOKEN, timeout=60)
        start = admin.placement()
        e = model.config.num_experts
        assert admin.status().eplb.enable_eplb and start.phy2log.shape[1] == e + 2
        # the redundant slots copy two cold experts: the hot experts 0 and 1 sit on worker 0 alone
        cold = np.tile(np.r_[np.arange(e), e - 2, e - 1], (start.phy2log.shape[0], 1))
        admin.apply_placement(cold, wait=True)
        assert texts() == want  # the skewed load is counted under it
        before = admin.placement()
        res = balancer.rebalance(wait=True)
        assert res.applied and res.migration.state == "done", res.note
        assert res.balancedness_after.mean > res.balancedness_before.mean
        after = admin.placement()
        assert after.version > before.version and not np.array_equal(after.phy2log, before.phy2log)
        assert texts() == want  # the same tokens from the moved experts
    finally:
        assert s.stop(signal.SIGINT) == 0, s.output()
