"""FP8 checkpoints (moeserve.models.quant): the published formats, computed weight-only in fp32,
equal transformers on the dequantized weights; ``--quantization fp8`` quantizes a bf16 checkpoint
at load; an expert slot is its codes and scales as one unit; dummy FP8 weights are made as FP8;
every quantization moeserve does not serve is refused by name."""

import json
import shutil
import subprocess
import sys

import fp8_util
import hf_oracle as hf
import numpy as np
import pytest
import torch
from hf_oracle import FP32_LOGITS_ATOL

from moeserve.models import CheckpointError, CheckpointReader, load_config, load_model
from moeserve.models import quant as Q
from moeserve.models.dummy import DummyReader
from moeserve.models.moe import ExpertQuant, ExpertSpec, expert_forward

pytestmark = pytest.mark.timeout(300)

# (format, strategy, layers): compressed-tensors as the published FP8 Llama 4 (per channel, MLPs
# and experts), per tensor, block-wise with attention too, and DeepSeek-style block-wise fp8.
FORMATS = [
    ("compressed-tensors", "channel", "mlp"),
    ("compressed-tensors", "tensor", "mlp"),
    ("compressed-tensors", "block", "all"),
    ("fp8-block", "block", "all"),
]
FAMILIES = {
    "llama4": hf.build_llama4,
    "ernie45": hf.build_ernie,
    "qwen3_moe": hf.build_qwen3_moe,
    "mixtral": hf.build_mixtral,
    "deepseek_v3": hf.build_deepseek_v3,  # block-wise FP8 is its published format
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def source(request, tmp_path_factory):
    return request.param, hf.save(FAMILIES[request.param](), tmp_path_factory.mktemp("fp8") / request.param)


@pytest.fixture(scope="module", params=FORMATS, ids=lambda f: "-".join(f))
def checkpoints(request, source, tmp_path_factory):
    """(family, FP8 folder, its dequantized float32 twin); blocks of 16 x 16 cut the tiny
    shapes (hidden 64, expert width 32) into several blocks each way."""
    family, src = source
    fmt, strategy, layers = request.param
    fp8, deq = fp8_util.quantize(src, tmp_path_factory.mktemp("fp8ckpt"), fmt, strategy, (16, 16), layers)
    return family, fp8, deq, src


def test_fp8_logits_equal_transformers_on_the_dequantized_weights(checkpoints):
    family, fp8, deq, src = checkpoints
    ids = hf.prompts(2, 24, seed=1)
    model = load_model(fp8, dtype=torch.float32)
    assert model.moe_info.expert_spec.quant is not None
    with torch.no_grad():
        want = hf.load_oracle(deq)(ids).logits
    got = model(ids)
    assert (got - want).abs().max().item() < FP32_LOGITS_ATOL
    # the oracle is informative: the quantized weights move the logits well past the bound
    assert (got - load_model(src, dtype=torch.float32)(ids)).abs().max().item() > 100 * FP32_LOGITS_ATOL


def test_fp8_greedy_tokens_equal_transformers(checkpoints):
    family, fp8, deq, _ = checkpoints
    ids = hf.prompts(2, 6, seed=2)
    want = hf.hf_greedy(hf.load_oracle(deq), ids, 16)[:, 6:]
    model = load_model(fp8, dtype=torch.float32)
    from moeserve.sampling import SamplingParams

    got = model.generate_ids([r.tolist() for r in ids], [SamplingParams()] * 2, 16, ignore_eos=True)
    assert [list(g) for g in got] == want.tolist()


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_a_checkpoint_written_by_the_compressed_tensors_library_equals_transformers_on_its_decompression(
    source, tmp_path, strategy
):
    """A writer and a reader of one project could share one misreading: here the library writes
    the codes, the scales and the quantization_config, and decompresses the oracle's weights."""
    family, src = source
    fp8, deq = fp8_util.compressed_tensors_checkpoint(src, tmp_path, strategy)
    ids = hf.prompts(2, 24, seed=5)
    model = load_model(fp8, dtype=torch.float32)
    assert model.moe_info.expert_spec.quant is not None
    with torch.no_grad():
        want = hf.load_oracle(deq)(ids).logits
    assert (model(ids) - want).abs().max().item() < FP32_LOGITS_ATOL
    greedy = hf.hf_greedy(hf.load_oracle(deq), ids[:, :6], 12)[:, 6:]
    from moeserve.sampling import SamplingParams

    got = model.generate_ids([r.tolist() for r in ids[:, :6]], [SamplingParams()] * 2, 12, ignore_eos=True)
    assert [list(g) for g in got] == greedy.tolist()


def test_quantization_fp8_quantizes_a_bf16_checkpoint_at_load_per_output_channel(source, tmp_path):
    """--quantization fp8 equals the checkpoint quantized per channel by another writer (the
    routed experts, shared experts and dense MLPs; attention, routers and the LM head as stored)."""
    family, src = source
    _, deq = fp8_util.quantize(src, tmp_path, "compressed-tensors", "channel", layers="mlp")
    ids = hf.prompts(2, 20, seed=3)
    model = load_model(src, dtype=torch.float32, quantization="fp8")
    spec = model.moe_info.expert_spec
    assert spec.quant == ExpertQuant(gate_up_block=(64, 1), down_block=(32, 1))  # weight-only by default
    with torch.no_grad():
        want = hf.load_oracle(deq)(ids).logits
    assert (model(ids) - want).abs().max().item() < FP32_LOGITS_ATOL


def test_the_reader_never_casts_fp8_codes_and_reads_experts_with_their_scales(checkpoints):
    family, fp8, _, _ = checkpoints
    r = CheckpointReader(fp8)
    name = next(n for n in r.names() if r.stored_dtype(n) == Q.FP8)
    with pytest.raises(CheckpointError, match="never cast"):
        r.read(name, torch.float32)
    e = r.read_expert(0, 3)
    spec = r.expert_spec()
    assert set(e) == set(spec.shapes) and e["gate_up"].dtype == Q.FP8 and e["gate_up_scale"].dtype == torch.float32
    assert {k: tuple(v.shape) for k, v in e.items()} == spec.shapes


def test_an_expert_slot_holds_codes_and_scales_as_one_row_of_bytes():
    spec = ExpertSpec(64, 32, quant=ExpertQuant((16, 16), (16, 16)))
    assert spec.storage_dtype == torch.uint8
    # codes 64*64 + 32*64 bytes, scales (4*4 + 2*4) * 4 bytes, each at a 16-byte offset
    assert spec.nbytes == 64 * 64 + 16 * 4 + 32 * 64 + 8 * 4 == spec.numel
    g = torch.Generator().manual_seed(0)
    w = {"gate_up": torch.randn(64, 64, generator=g), "down": torch.randn(32, 64, generator=g)}
    rows = torch.stack([spec.flat(w), spec.flat({k: 2 * v for k, v in w.items()})])  # [2, n] bytes
    views = spec.views(rows)
    assert views["gate_up"].dtype == Q.FP8 and views["gate_up_scale"].shape == (2, 4, 4)
    # the scales travel in the row: the second expert's codes equal the first's, its scales are doubled
    assert torch.equal(views["gate_up"][0].view(torch.uint8), views["gate_up"][1].view(torch.uint8))
    assert torch.allclose(views["down_scale"][1], 2 * views["down_scale"][0])
    x = torch.randn(5, 64, generator=g)
    dense = spec.dense({k: v[0] for k, v in views.items()}, torch.float32)
    ref = ExpertSpec(64, 32)
    assert torch.allclose(expert_forward(spec, x, {k: v[0] for k, v in views.items()}), expert_forward(ref, x, dense))


@pytest.mark.parametrize(
    "qc,message",
    [
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
        ({"quant_method": "mxfp4"}, "quant_method 'mxfp4' is not supported"),
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme 'static'"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "without a weight_block_size"),
        (
            {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {}},
            "format 'int-quantized'",
        ),
        ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {}}, "nvfp4"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {
                    "g": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                        "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
                    }
                },
            },
            "dynamic False",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {
                    "g": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
                    }
                },
            },
            "weights of type 'int' with 4 bits",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "kv_cache_scheme": {"num_bits": 8, "type": "float"},
                "config_groups": {
                    "g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}
                },
            },
            "kv_cache_scheme",
        ),
    ],
)
def test_a_quantization_moeserve_does_not_serve_is_refused_by_name(source, tmp_path, qc, message):
    _, src = source
    shutil.copytree(src, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    with pytest.raises(CheckpointError) as e:
        load_config(tmp_path / "m")
    assert message in str(e.value) and "moeserve serves FP8" in str(e.value)


def test_fp8_tensors_without_a_quantization_config_are_refused(checkpoints, tmp_path):
    """The silent failure this guards against: codes read as values, without their scales."""
    family, fp8, _, _ = checkpoints
    shutil.copytree(fp8, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="declares no quantization_config"):
        load_model(tmp_path / "m", dtype=torch.float32)
    from moeserve.cluster.launcher import LocalCluster

    with pytest.raises(CheckpointError, match="declares no quantization_config"):
        LocalCluster(tmp_path / "m", routers=1, workers=1)
    with pytest.raises(CheckpointError, match="declares no quantization_config"):
        load_model(tmp_path / "m", dtype=torch.float32, quantization="fp8")


def test_an_ignore_list_that_contradicts_the_tensors_is_refused(checkpoints, tmp_path):
    family, fp8, _, _ = checkpoints
    shutil.copytree(fp8, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    qc = cfg["quantization_config"]
    key = "ignore" if "ignore" in qc else "modules_to_not_convert"
    qc[key] = [*qc[key], "re:.*experts.*"]  # says the experts are unquantized; they are FP8
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises((CheckpointError, Q.QuantizationError), match="unquantized"):
        load_model(tmp_path / "m", dtype=torch.float32)


def test_dummy_fp8_weights_are_made_as_fp8_with_no_nan_code(tmp_path):
    from moeserve.models import init_model

    path = init_model(tmp_path / "m", family="llama4", seed=1)
    r = DummyReader(path, quantization="fp8")
    spec = r.expert_spec(torch.bfloat16)
    assert spec.quant is not None and r.expert_layout(0) == "per_expert"
    e = r.read_expert(0, 1)
    codes = e["gate_up"].view(torch.uint8)
    assert e["gate_up"].dtype == Q.FP8 and not ((codes == 0x7F) | (codes == 0xFF)).any()
    assert torch.isfinite(spec.dense(e, torch.float32)["gate_up"]).all()
    assert r.read_expert(0, 1)["gate_up"].view(torch.uint8).equal(codes)  # seeded: the same on every rank
    # attention, the router and the LM head stay in the model dtype; the shared expert is FP8
    assert r.stored_dtype("model.layers.0.self_attn.q_proj.weight") != Q.FP8
    assert r.stored_dtype("model.layers.1.feed_forward.shared_expert.up_proj.weight") == Q.FP8
    model = load_model(path, dtype=torch.float32, load_format="dummy", quantization="fp8")
    out = model(torch.tensor([[5, 6, 7, 8]]))
    assert torch.isfinite(out).all()


def test_dummy_fp8_weights_quantize_rows_where_quantization_fp8_on_real_weights_does(tmp_path, monkeypatch):
    """--load-format dummy with --quantization fp8 declares what quantizing real weights gives
    (dynamic per-token activations), so MOESERVE_FP8_ACTIVATIONS=dynamic turns W8A8 on for the
    experts and the quantized MLPs of both (the default), and weight-only turns it off for both."""
    from moeserve.models import init_model

    path = init_model(tmp_path / "m", family="llama4", seed=1)
    shared = "model.layers.1.feed_forward.shared_expert.up_proj"
    for mode, want in (("weight-only", False), ("dynamic", True), (None, True)):
        if mode is None:
            monkeypatch.delenv("MOESERVE_FP8_ACTIVATIONS", raising=False)
        else:
            monkeypatch.setenv("MOESERVE_FP8_ACTIVATIONS", mode)
        for reader in (DummyReader(path, quantization="fp8"), CheckpointReader(path, quantization="fp8")):
            assert reader.expert_spec(torch.bfloat16).quant.act_quant is want, (mode, type(reader).__name__)
            shape = tuple(reader.shape(f"{shared}.weight"))
            lin = Q.read_weight(reader, shared, shape, torch.bfloat16, "cpu")
            assert isinstance(lin, Q.QuantLinear) and lin.act_quant is want, (mode, type(reader).__name__)
            assert not reader.expert_spec(torch.float32).quant.act_quant  # fp32: weight-only
            assert not Q.read_weight(reader, shared, shape, torch.float32, "cpu").act_quant


@pytest.mark.slow
def test_quantization_flags_on_the_command_line(source, tmp_path):
    _, src = source
    p = subprocess.run(
        [sys.executable, "-m", "moeserve", "up", "--model", str(src), "--quantization", "awq"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "invalid choice: 'awq' (choose from 'fp8')" in p.stderr
    shutil.copytree(src, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "awq"}}))
    p = subprocess.run(
        [sys.executable, "-m", "moeserve", "up", "--model", str(tmp_path / "m")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "quant_method 'awq' is not supported" in p.stderr, p.stderr


@pytest.mark.slow
@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[3]], ids=lambda f: "-".join(f))
def test_a_cluster_with_redundant_slots_serves_fp8_exactly_through_a_live_random_placement(source, tmp_path, fmt):
    """2 workers, redundant slots, a random placement applied live: tokens and logits equal the
    single-process model, and every slot holds its expert's codes and scales."""
    from cluster_util import assert_workers_hold, expert_digests, random_placement, redundant_for, reference_decode

    from moeserve.cluster.launcher import LocalCluster

    family, src = source
    fp8, _ = fp8_util.quantize(src, tmp_path, *fmt[:2], (16, 16), fmt[2])
    ref = load_model(fp8, dtype=torch.float32)
    info = ref.moe_info
    r = redundant_for(info.num_logical_experts, 2, 2)
    prompt = [5, 9, 17, 33, 40]
    want_t, want_l = reference_decode(ref, prompt, 10)
    with LocalCluster(fp8, routers=1, workers=2, num_redundant_experts=r, enable_eplb=True, max_model_len=256) as c:
        assert c.moe_info.expert_bytes == info.expert_spec.nbytes  # codes and scales, what a move costs
        place = random_placement(info.num_moe_layers, info.num_logical_experts, info.num_logical_experts + r, seed=4)
        for phase in ("start", "migrated"):
            g = c.generate([prompt], max_tokens=10, temperature=0.0, details=True, return_logits=True, ignore_eos=True)[
                0
            ]
            assert g.token_ids == want_t, phase
            np.testing.assert_allclose(g.logits, want_l, atol=FP32_LOGITS_ATOL, rtol=0)
            if phase == "start":
                c.apply_placement(place, wait=True)
        assert_workers_hold(c, place, expert_digests(fp8))


def test_which_fp8_products_quantize_their_rows_on_the_gpu(monkeypatch):
    """W8A8 by default (rows quantized per row, FP8 tensor cores) where the checkpoint declares
    dynamic per-token activations with channel or tensor weight scales, and for --quantization
    fp8, as vLLM does; never for block scales or undeclared activations;
    MOESERVE_FP8_ACTIVATIONS=weight-only turns it off everywhere; any other value refused by name."""
    from moeserve.models import quant as Q

    ct = Q.QuantScheme("compressed-tensors", "channel", None, "token")
    for mode in (None, "dynamic"):
        if mode is None:
            monkeypatch.delenv("MOESERVE_FP8_ACTIVATIONS", raising=False)
        else:
            monkeypatch.setenv("MOESERVE_FP8_ACTIVATIONS", mode)
        assert Q.activations_quantized(ct) and Q.activations_quantized(Q.online_scheme())
        assert Q.activations_quantized(Q.QuantScheme("compressed-tensors", "tensor", None, "token"))
        assert not Q.activations_quantized(Q.QuantScheme("compressed-tensors", "channel", None, "none"))
        assert not Q.activations_quantized(Q.QuantScheme("fp8-block", "block", (128, 128), "token"))
        assert not Q.activations_quantized(None)
        assert ExpertQuant.from_scheme(ct, 64, 32).act_quant
        assert ExpertQuant.from_scheme(ct, 64, 32, torch.bfloat16).act_quant
        # fp32 compute is the exactness dtype: weight-only, experts and linears alike
        assert not Q.activations_quantized(ct, torch.float32)
        assert not ExpertQuant.from_scheme(ct, 64, 32, torch.float32).act_quant
    monkeypatch.setenv("MOESERVE_FP8_ACTIVATIONS", "weight-only")
    assert not Q.activations_quantized(ct) and not Q.activations_quantized(Q.online_scheme())
    assert not ExpertQuant.from_scheme(ct, 64, 32).act_quant
    monkeypatch.setenv("MOESERVE_FP8_ACTIVATIONS", "w8a8")
    with pytest.raises(Q.QuantizationError, match="allowed dynamic \\(the default\\), weight-only"):
        Q.activations_quantized(ct)


def test_fp8_codes_are_stored_output_channel_major_and_viewed_canonically():
    """A slot's FP8 codes lie in its buffer as [N, K] (each output channel's inputs contiguous,
    the layout FP8 tensor cores read) and its views are the canonical [K, N]: flat then views
    gives back the tensors put in."""
    spec = ExpertSpec(64, 32, quant=ExpertQuant((16, 16), (16, 16)))
    g = torch.Generator().manual_seed(2)
    t = spec.canonical({"gate_up": torch.randn(64, 64, generator=g), "down": torch.randn(32, 64, generator=g)})
    w = spec.views(spec.flat(t))
    for k in t:
        assert w[k].shape == t[k].shape and torch.equal(w[k].float(), t[k].float()), k
    assert w["gate_up"].stride() == (1, 64) and w["down"].stride() == (1, 32)
