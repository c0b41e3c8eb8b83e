"""Lazy checkpoint reading: one expert costs its own bytes; bad checkpoints say what is wrong and where."""

import json
import shutil

import hf_oracle as hf
import pytest
import torch
from safetensors import safe_open

from moeserve.models import CheckpointError, CheckpointReader, checkpoint, init_model, load_model


@pytest.fixture(scope="module")
def llama4_path(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("l4"), "llama4", seed=0, num_local_experts=8)


@pytest.fixture(scope="module")
def ernie_path(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("er"), "ernie45", seed=0)


@pytest.fixture(scope="module")
def per_expert_llama4_path(llama4_path, tmp_path_factory):
    return hf.rewrite(llama4_path, tmp_path_factory.mktemp("l4pe"), hf.llama4_per_expert(hf.read_all(llama4_path)))


@pytest.mark.parametrize("which", ["llama4_path", "per_expert_llama4_path", "ernie_path"])
def test_reading_one_expert_reads_exactly_that_experts_bytes(which, request):
    path = request.getfixturevalue(which)
    reader = CheckpointReader(path)
    assert reader.bytes_read == 0 and reader.tensors_read == 0, "opening reads headers only"
    w = reader.read_expert(1, 5)
    spec = reader.expert_spec()
    assert reader.bytes_read == spec.nbytes == (64 * 64 + 32 * 64) * 4
    assert reader.tensors_read == (2 if which == "llama4_path" else 3)
    assert {k: tuple(v.shape) for k, v in w.items()} == spec.shapes
    # the values are that expert's, in the canonical layout: gate_up [H, 2I] (gate first), down [I, H]
    if which == "ernie_path":
        t, p = hf.read_all(path), "model.layers.2.mlp.experts.5."
        assert torch.equal(w["gate_up"], torch.cat([t[p + "gate_proj.weight"].t(), t[p + "up_proj.weight"].t()], 1))
        assert torch.equal(w["down"], t[p + "down_proj.weight"].t())
    else:
        t, p = hf.read_all(request.getfixturevalue("llama4_path")), "model.layers.3.feed_forward.experts."
        assert torch.equal(w["gate_up"], t[p + "gate_up_proj"][5])
        assert torch.equal(w["down"], t[p + "down_proj"][5])


def test_read_experts_stacks_ids_in_order_and_reads_each_distinct_expert_once(llama4_path):
    reader = CheckpointReader(llama4_path)
    w = reader.read_experts(0, [3, 1, 3], dtype=torch.bfloat16)
    assert w["gate_up"].shape == (3, 64, 64) and w["down"].shape == (3, 32, 64)
    assert w["gate_up"].dtype == torch.bfloat16
    assert torch.equal(w["gate_up"][0], w["gate_up"][2])
    assert reader.bytes_read == 2 * reader.expert_spec().nbytes
    assert torch.equal(w["down"][1], reader.read_expert(0, 1, torch.bfloat16)["down"])


class RecordingSafeOpen:
    """A ``safe_open`` handle that logs what is read through it: (name, whole tensor?, bytes)."""

    def __init__(self, log, *args, **kwargs):
        self._handle, self._log = safe_open(*args, **kwargs), log

    def keys(self):
        return self._handle.keys()

    def get_tensor(self, name):
        t = self._handle.get_tensor(name)
        self._log.append((name, True, t.nbytes))
        return t

    def get_slice(self, name):
        return RecordingSlice(self._handle.get_slice(name), name, self._log)

    def __exit__(self, *exc):
        return self._handle.__exit__(*exc)


class RecordingSlice:
    """A safetensors slice that logs each read through ``[...]``."""

    def __init__(self, sl, name, log):
        self._slice, self._name, self._log = sl, name, log

    def get_shape(self):
        return self._slice.get_shape()

    def get_dtype(self):
        return self._slice.get_dtype()

    def __getitem__(self, key):
        t = self._slice[key]
        self._log.append((self._name, False, t.nbytes))
        return t


def test_a_fused_expert_is_asked_of_safetensors_as_one_row_of_each_fused_tensor(llama4_path, monkeypatch):
    reads = []
    monkeypatch.setattr(checkpoint, "safe_open", lambda *a, **kw: RecordingSafeOpen(reads, *a, **kw))
    reader = CheckpointReader(llama4_path)
    assert reader.expert_layout(1) == "fused" and reads == []
    reader.read_expert(1, 5)
    p = "model.layers.3.feed_forward.experts."
    assert reads == [(p + "gate_up_proj", False, 64 * 64 * 4), (p + "down_proj", False, 32 * 64 * 4)]
    assert reader.bytes_read == sum(n for *_, n in reads)


def test_tensors_read_are_the_callers_own(llama4_path):
    """safetensors may hand out views of its memory map of the file; a caller changing a tensor in
    place must not change what later reads return."""
    reader = CheckpointReader(llama4_path)
    name = "model.norm.weight"
    reader.read(name).add_(1)
    reader.read_expert(0, 2)["down"].add_(1)
    again = CheckpointReader(llama4_path)
    assert torch.equal(reader.read(name), again.read(name))
    assert torch.equal(reader.read_expert(0, 2)["down"], again.read_expert(0, 2)["down"])


def test_expert_ids_and_moe_layer_indices_are_checked(llama4_path):
    reader = CheckpointReader(llama4_path)
    with pytest.raises(ValueError, match="logical expert id 8 out of range 0..7"):
        reader.read_expert(0, 8)
    with pytest.raises(ValueError, match="MoE layer index 2 out of range 0..1"):
        reader.read_expert(2, 0)


@pytest.mark.slow  # long-running (several seconds on 2 cores): out of the fast loop
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoints_load_and_match_transformers(dtype, tmp_path):
    path = hf.save(hf.build_llama4(seed=6).to(getattr(torch, dtype)), tmp_path / dtype)
    reader = CheckpointReader(path)
    assert reader.stored_dtype("model.embed_tokens.weight") == getattr(torch, dtype)
    assert reader.expert_spec().nbytes == (64 * 64 + 32 * 64) * 2
    ids = hf.prompts(1, 16)
    with torch.no_grad():
        ref = hf.load_oracle(path, dtype=torch.float32)(ids).logits  # transformers upcasts on load too
    assert (load_model(path, dtype=torch.float32)(ids) - ref).abs().max() < 1e-4


# -- bad checkpoints: the error names the file and the tensor or field -------------------------


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_folder_and_missing_config_json(tmp_path, llama4_path):
    with pytest.raises(CheckpointError, match=r"nowhere/config.json: folder does not exist"):
        CheckpointReader(tmp_path / "nowhere")
    d = _copy(llama4_path, tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match=rf"{d}/config.json: no config.json in the folder"):
        load_model(d)


def test_unknown_model_type_lists_the_allowed_ones(tmp_path, llama4_path):
    d = _copy(llama4_path, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "deepseek_v3"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        CheckpointError,
        match=r"config.json: unknown model_type 'deepseek_v3'; allowed: llama4_text, llama4, ernie4_5_moe, "
        r"qwen3_moe, mixtral, gpt_oss",
    ):
        load_model(d)


def test_missing_tensor_names_the_file_and_the_tensor(tmp_path, ernie_path):
    t = hf.read_all(ernie_path)
    del t["model.layers.2.self_attn.k_proj.weight"]
    d = hf.rewrite(ernie_path, tmp_path / "m", t)
    with pytest.raises(
        CheckpointError, match=rf"{d}/model.safetensors: tensor 'model.layers.2.self_attn.k_proj.weight' is missing"
    ):
        load_model(d)


def test_missing_correction_bias_names_the_tensor(tmp_path, ernie_path):
    t = hf.read_all(ernie_path)
    del t["model.layers.1.mlp.moe_statics.e_score_correction_bias"]
    d = hf.rewrite(ernie_path, tmp_path / "m", t)
    with pytest.raises(
        CheckpointError, match=r"tensor 'model.layers.1.mlp.moe_statics.e_score_correction_bias' is missing"
    ):
        load_model(d)


def test_wrong_shape_names_the_file_the_tensor_and_both_shapes(tmp_path, llama4_path):
    t = hf.read_all(llama4_path)
    t["model.layers.1.feed_forward.router.weight"] = torch.zeros(7, 64)
    t["model.layers.3.feed_forward.experts.down_proj"] = torch.zeros(8, 31, 64)
    d = hf.rewrite(llama4_path, tmp_path / "m", t)
    with pytest.raises(
        CheckpointError,
        match=r"model.safetensors: tensor 'model.layers.1.feed_forward.router.weight' "
        r"has shape \[7, 64\], expected \[8, 64\]",
    ):
        load_model(d)
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'model.layers.3.feed_forward.experts.down_proj' "
        r"has shape \[8, 31, 64\], expected \[8, 32, 64\]",
    ):
        CheckpointReader(d).read_expert(1, 0)


@pytest.mark.parametrize(
    "damage, detail",
    [
        (lambda b: b[:5], "fewer than the 8-byte header length"),
        (lambda b: (10**9).to_bytes(8, "little") + b[8:], "header length 1000000000 does not fit"),
        (lambda b: b[:8] + b"{not json" + b[17:], "header is not valid JSON"),
        (lambda b: b[:-100], "do not hold"),  # truncated data section: offsets point past the end
    ],
)
def test_corrupt_safetensors_header_names_the_file(tmp_path, llama4_path, damage, detail):
    d = _copy(llama4_path, tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes(damage(f.read_bytes()))
    with pytest.raises(CheckpointError, match=rf"{f}: corrupt safetensors header: .*{detail}"):
        load_model(d)


def test_sharded_checkpoint_with_a_missing_shard_names_the_index_and_the_shard(tmp_path):
    path = hf.save(hf.build_ernie(seed=0), tmp_path / "m", max_shard_size="60KB")
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(
        CheckpointError, match=rf"model.safetensors.index.json: lists shard '{shard.name}', which does not exist"
    ):
        load_model(path)


def test_a_truncated_shard_is_named_when_first_read(tmp_path):
    path = hf.save(hf.build_ernie(seed=0), tmp_path / "m", max_shard_size="60KB")
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    shard = path / weight_map[name]
    shard.write_bytes(shard.read_bytes()[:-100])
    reader = CheckpointReader(path)  # shards are opened on first use
    with pytest.raises(CheckpointError, match=rf"{shard}: corrupt safetensors header: .*do not hold"):
        reader.read(name)


def test_no_weights_file_at_all(tmp_path, llama4_path):
    d = _copy(llama4_path, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=rf"{d}: no model.safetensors or model.safetensors.index.json"):
        CheckpointReader(d)
