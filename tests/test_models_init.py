"""init_model: a random checkpoint that transformers loads and agrees with, deterministic per seed."""

import hashlib
from collections import Counter

import hf_oracle as hf
import pytest
import torch

from moeserve.models import StepBatch, init_model, load_config, load_model


@pytest.fixture(scope="module", params=["llama4", "ernie45", "qwen3_moe", "mixtral", "gpt_oss"])
def written(request, tmp_path_factory):
    return request.param, init_model(tmp_path_factory.mktemp(request.param), request.param, seed=7)


def test_transformers_loads_it_and_agrees(written):
    _, path = written
    oracle, model = hf.load_oracle(path), load_model(path)
    ids = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(ids) - oracle(ids).logits).abs().max() < 1e-4
    ref = hf.hf_greedy(oracle, ids[:, :4], 32)
    got = model.generate(ids[:, :4], max_new_tokens=32, ignore_eos=True)
    assert torch.equal(got, ref)
    assert len(set(got[0, 4:].tolist())) > 8, "greedy output is not one repeated token"


def test_the_defaults_exercise_every_feature(written):
    family, path = written
    cfg = load_config(path)
    if family == "llama4":
        assert cfg.moe_layer_ids == (1, 3) and cfg.use_rope == (True, True, True, False)
        assert cfg.attention_chunk_size == 8 and cfg.floor_scale == 4 and cfg.rope.type == "llama3"
    elif family == "qwen3_moe":
        assert cfg.moe_layer_ids == (1, 2, 3) and cfg.qk_rms_norm and cfg.routing.renormalize
    elif family == "mixtral":
        assert cfg.moe_layer_ids == (0, 1, 2, 3) and (cfg.num_experts, cfg.top_k) == (8, 2)
    elif family == "gpt_oss":
        assert cfg.sliding_layers == (True, False, True, False) and cfg.window(0) == 8
        assert cfg.rope.type == "yarn" and cfg.attention_sinks and cfg.expert_bias and cfg.swiglu_limit == 2.0
    else:
        assert cfg.moe_layer_ids == (1, 2, 3) and (cfg.num_experts, cfg.top_k, cfg.num_shared_experts) == (16, 4, 2)
        bias = hf.read_all(path)["model.layers.1.mlp.moe_statics.e_score_correction_bias"]
        assert bias.abs().min() > 0


def test_the_tokenizer_matches_the_model_and_transformers(written):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    _, path = written
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.get_vocab_size() == load_config(path).vocab_size
    ids = tok.encode("Hello experts, how are you?").ids
    assert ids[0] == 1, "encode prepends <s>"
    assert AutoTokenizer.from_pretrained(path)("Hello experts, how are you?").input_ids == ids
    assert tok.decode(ids, skip_special_tokens=True) == "Hello experts, how are you?"


def _digest(path):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_deterministic_for_a_seed(tmp_path):
    a = init_model(tmp_path / "a", "ernie45", seed=3)
    b = init_model(tmp_path / "b", "ernie45", seed=3)
    c = init_model(tmp_path / "c", "ernie45", seed=4)
    assert _digest(a) == _digest(b)
    assert _digest(a)["model.safetensors"] != _digest(c)["model.safetensors"]


def test_overrides_change_the_config_and_unknown_fields_are_refused(tmp_path):
    path = init_model(tmp_path / "m", "llama4", num_hidden_layers=6, num_local_experts=16, dtype="bfloat16")
    model = load_model(path, load_experts=False)
    assert model.moe_info.moe_layer_ids == (1, 3, 5) and model.moe_info.num_logical_experts == 16
    assert model.config.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"unknown config field\(s\) \['num_expert'\] for llama4; allowed: "):
        init_model(tmp_path / "x", "llama4", num_expert=4)
    with pytest.raises(ValueError, match="unknown family 'deepseek_v3'; allowed: llama4, ernie45, qwen3_moe, mixtral"):
        init_model(tmp_path / "x", "deepseek_v3")


def _hot_share(model, n_hot):
    counts = [Counter() for _ in model.moe_blocks]

    class Count:
        def dispatch(self, m, hidden, routing):
            counts[m].update(routing.ids.flatten().tolist())
            return model.experts.dispatch(m, hidden, routing)

        def combine(self, handle):
            return model.experts.combine(handle)

    ids = torch.randint(3, 512, (4 * 48,), generator=torch.Generator().manual_seed(123))  # not the calibration prompts
    model.step(ids, StepBatch.prefill(range(4), [48] * 4), model.new_cache(), experts=Count())
    return [sum(sorted(c.values(), reverse=True)[:n_hot]) / sum(c.values()) for c in counts]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama4", "ernie45", "qwen3_moe", "mixtral", "gpt_oss"])
def test_hot_experts_receive_most_tokens(tmp_path, family):
    hot = _hot_share(load_model(init_model(tmp_path / "hot", family, seed=1, hot_experts=2)), 2)
    flat = _hot_share(load_model(init_model(tmp_path / "flat", family, seed=1)), 2)
    if family != "ernie45":
        cap = min(1.0, 2 / load_config(tmp_path / "hot").top_k)  # every token picks both hot experts
        assert min(hot) > 0.6 * cap and max(flat) < 0.6 * cap, (hot, flat)
    else:
        assert hot == [0.5] * 3, "with top-4, the 2 hot experts are chosen for every token: half of all pairs"
        assert max(flat) < 0.4, flat
