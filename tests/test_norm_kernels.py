"""The fused RMS norm and rotary embedding kernels (moeserve/kernels/triton_norms.py), run by
Triton's interpreter on CPU tensors: each equals the torch sequence it replaces
(moeserve.models.layers), a row's result does not depend on the rest of the launch, and every
family's tiny model with its norms and RoPE on the kernels still equals transformers."""

import hf_oracle as hf
import pytest
import torch
from hf_oracle import FP32_LOGITS_ATOL
from triton_util import needs_triton

from moeserve import kernels
from moeserve.models import layers, load_model

pytestmark = needs_triton


def torch_rms(x, w, eps, weight_first=False):
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if w is None:
        return normed.to(x.dtype)
    return (w * normed).to(x.dtype) if weight_first else normed.to(x.dtype) * w


def torch_heads(x, w, cos, sin, interleaved, eps, post):
    if w is not None:
        x = torch_rms(x, w, eps)
    if cos is not None:
        x = layers.apply_rope(x, cos, sin, interleaved)
    if post:
        x = torch_rms(x, None, eps)
    return x


def close(got, ref, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    else:  # the interpreter truncates fp32 -> bf16 where the GPU rounds: a bf16 step per rounding
        assert (got.float() - ref.float()).abs().max() <= ref.float().abs().max() * 2**-6


@pytest.mark.parametrize("h", [64, 70, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["weight", "weight_first", "none", "residual"])
def test_rms_norm_equals_the_torch_sequence(h, dtype, mode):
    g = torch.Generator().manual_seed(h)
    x = (torch.randn(7, h, generator=g) * 3).to(dtype)
    w = (1 + 0.5 * torch.randn(h, generator=g)).to(torch.float32 if mode == "weight_first" else dtype)
    res = torch.randn(7, h, generator=g).to(dtype)
    weight = None if mode == "none" else w
    y, total = kernels.rms_norm(
        x, weight, 1e-5, weight_first=mode == "weight_first", residual=res if mode == "residual" else None
    )
    src = x
    if mode == "residual":
        assert total is not None
        close(total, x + res, dtype)  # torch's add, rounded once to the dtype (exact in fp32)
        assert dtype != torch.float32 or torch.equal(total, x + res)
        src = x + res
    else:
        assert total is None
    assert y.dtype == dtype and y.shape == x.shape
    close(y, torch_rms(src, weight, 1e-5, mode == "weight_first"), dtype)


def test_a_rows_norm_does_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(3)
    x, w, res = torch.randn(37, 96, generator=g), torch.randn(96, generator=g), torch.randn(37, 96, generator=g)
    y, s = kernels.rms_norm(x, w, 1e-6, residual=res)
    for lo, hi in [(0, 1), (5, 6), (3, 20), (36, 37)]:
        y1, s1 = kernels.rms_norm(x[lo:hi].clone(), w, 1e-6, residual=res[lo:hi].clone())
        assert torch.equal(y1, y[lo:hi]) and torch.equal(s1, s[lo:hi])
    assert kernels.rms_norm(x[:0], w, 1e-6)[0].shape == (0, 96)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize(
    "pre,rope,post",
    [(True, True, False), (False, True, True), (False, True, False), (True, False, False), (False, False, True)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_rope_equals_the_torch_sequence(interleaved, pre, rope, post, dtype):
    g = torch.Generator().manual_seed(int(pre) + 2 * int(post) + 4 * int(interleaved))
    t, heads, d = 5, 3, 32
    x = (torch.randn(t, heads, d, generator=g) * 2).to(dtype)
    w = (1 + 0.5 * torch.randn(d, generator=g)).to(dtype) if pre else None
    positions = torch.tensor([0, 3, 4, 17, 1000])
    inv = layers.rope_inv_freq(d, layers.RopeConfig(theta=10000.0)) if rope else None
    cos, sin = layers.rope_cos_sin(positions, inv, 1.3) if rope else (None, None)
    got = kernels.head_rope(x, cos, sin, interleaved, 1e-6, pre_weight=w, post_norm=post)
    ref = torch_heads(x, w, cos, sin, interleaved, 1e-6, post)
    assert got.shape == x.shape and got.dtype == dtype
    close(got, ref, dtype)
    if rope:  # the rotation acts (so the equality above covers it)
        assert not torch.allclose(got[1:], torch_heads(x, w, None, None, interleaved, 1e-6, post)[1:])


@pytest.mark.parametrize("pad", [64, 8])  # tokens 160 / 104 values apart: read in place / copied first
def test_head_rope_reads_q_or_k_in_place_from_a_merged_product(pad):
    """q or k as a view of a merged qkv output [T, (Hq + 2 Hkv) D]: a token's heads contiguous,
    tokens further apart. The kernel reads the view where its strides allow (no copy) and gives
    exactly what it gives on the same values made contiguous."""
    g = torch.Generator().manual_seed(pad)
    t, heads, d = 5, 3, 32
    merged = torch.randn(t, 32 + heads * d + pad, generator=g)  # [T, N]: 32 values before, pad after
    x = merged[:, 32 : 32 + heads * d].view(t, heads, d)
    assert not x.is_contiguous() and x.stride(0) == merged.shape[1]
    inv = layers.rope_inv_freq(d, layers.RopeConfig(theta=10000.0))
    cos, sin = layers.rope_cos_sin(torch.tensor([0, 3, 4, 17, 1000]), inv)
    w = 1 + 0.5 * torch.randn(d, generator=g)
    got = kernels.head_rope(x, cos, sin, True, 1e-6, pre_weight=w, post_norm=True)
    ref = kernels.head_rope(x.contiguous(), cos, sin, True, 1e-6, pre_weight=w, post_norm=True)
    assert got.is_contiguous() and got.shape == (t, heads, d)
    assert torch.equal(got, ref)
    close(got, torch_heads(x, w, cos, sin, True, 1e-6, True), torch.float32)


def test_head_rope_refuses_a_head_dim_it_cannot_tile():
    with pytest.raises(ValueError, match="power-of-two head dim, got 48"):
        kernels.head_rope(torch.zeros(2, 1, 48), None, None, True, 1e-6, post_norm=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mlp_activation_is_torchs_silu_times_up(dtype, monkeypatch):
    g = torch.Generator().manual_seed(2)
    gu = (torch.randn(9, 2 * 70, generator=g) * 4).to(dtype)
    ref = torch.nn.functional.silu(gu[:, :70]) * gu[:, 70:]
    assert torch.equal(layers.silu_mul(gu), ref)  # CPU: torch's
    monkeypatch.setattr(kernels, "NORM_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(kernels, "NORM_DTYPES", (torch.bfloat16, torch.float16, torch.float32))
    calls = []
    real = kernels.silu_mul
    monkeypatch.setattr(kernels, "silu_mul", lambda *a: calls.append(a) or real(*a))
    got = layers.silu_mul(gu)
    assert len(calls) == 1 and got.shape == (9, 70) and got.dtype == dtype
    close(got, ref, dtype)
    assert torch.equal(layers.silu_mul(gu[:, 1:-1]), torch.nn.functional.silu(gu[:, 1:70]) * gu[:, 70:-1])  # a view
    assert len(calls) == 1  # not contiguous: torch's
    with pytest.raises(ValueError, match="silu_mul: gu must be contiguous"):
        kernels.silu_mul(gu[:, 1:-1])


@pytest.mark.parametrize("programs", [None, 3, 64])
def test_the_activation_takes_every_row_below_the_total_whatever_its_grid(programs):
    """A worker's buffer holds far more rows than a decode step fills: a fixed grid of programs
    strides over the rows below the device total (3 programs here: each takes several) and
    writes each as torch would."""
    g = torch.Generator().manual_seed(4)
    gu = (torch.randn(40, 2 * 24, generator=g) * 4).to(torch.bfloat16)
    ref = torch.nn.functional.silu(gu[:, :24]) * gu[:, 24:]
    for total in (1, 17, 39):
        got = kernels.silu_mul(gu, torch.tensor([total], dtype=torch.int32), programs)
        close(got[:total], ref[:total], torch.bfloat16)
    close(kernels.silu_mul(gu, None, programs), ref, torch.bfloat16)  # every row (an MLP's)
    with pytest.raises(ValueError, match="silu_mul: programs must be >= 1, got 0"):
        kernels.silu_mul(gu, None, 0)


def test_the_models_keep_torch_for_what_the_kernels_do_not_serve(monkeypatch):
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    assert not kernels.fused_norms_take(x, torch.ones(8, dtype=torch.bfloat16))  # a CPU tensor: the torch path
    monkeypatch.setattr(kernels, "NORM_DEVICES", ("cuda", "cpu"))
    assert kernels.fused_norms_take(x, torch.ones(8, dtype=torch.bfloat16))
    assert kernels.fused_norms_take(x, torch.ones(8), weight_first=True)  # GPT-OSS: an fp32 weight, first
    assert not kernels.fused_norms_take(x, torch.ones(8))  # an fp32 weight last promotes in torch: not alike
    assert not kernels.fused_norms_take(x.float(), torch.ones(8))  # fp32, the exactness mode, keeps torch's
    assert not kernels.fused_norms_take(torch.zeros(2, 8, dtype=torch.int64), None)


BUILD = {
    "llama4": hf.build_llama4,  # interleaved RoPE, weightless qk-norm after it, NoPE layers
    "ernie4_5_moe": hf.build_ernie,  # interleaved RoPE, no qk-norm
    "qwen3_moe": hf.build_qwen3_moe,  # q_norm / k_norm before RoPE
    "gpt_oss": hf.build_gpt_oss,  # fp32 norm weights applied first, YaRN
}


@pytest.mark.parametrize("family", list(BUILD))
def test_each_family_on_the_fused_kernels_equals_transformers(family, tmp_path, monkeypatch):
    path = hf.save(BUILD[family](seed=1), tmp_path)
    oracle, model = hf.load_oracle(path), load_model(path)
    ids = hf.prompts(2, 12)
    torch_logits = model(ids)
    monkeypatch.setattr(kernels, "NORM_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(kernels, "NORM_DTYPES", (torch.bfloat16, torch.float16, torch.float32))
    calls = {"rms_norm": 0, "head_rope": 0, "silu_mul": 0}
    for name in calls:
        real = getattr(kernels, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(kernels, name, counted)
    fused = model(ids)
    n = model.config.num_layers
    assert calls["rms_norm"] == 2 * n + 1  # every residual add with its norm, and the final norm
    assert calls["head_rope"] == 2 * sum(1 for layer in model.layers if layer.attn.transforms_heads)
    mlps = [layer.mlp for layer in model.layers] + [block.shared_mlp for block in model.moe_blocks]
    merged = sum(1 for m in mlps if m is not None and m.merged_width is not None)
    assert calls["silu_mul"] == merged  # every dense MLP's and shared expert's
    assert merged > 0 or family == "gpt_oss"  # GPT-OSS has neither
    with torch.no_grad():
        ref = oracle(ids).logits
    assert (fused - ref).abs().max().item() < FP32_LOGITS_ATOL
    assert (fused - torch_logits).abs().max().item() < FP32_LOGITS_ATOL


def test_the_switch_takes_torch_everywhere_and_refuses_other_values(monkeypatch):
    monkeypatch.setenv("MOESERVE_FUSED_NORMS", "0")
    assert kernels._norm_devices() == ()
    monkeypatch.setenv("MOESERVE_FUSED_NORMS", "1")
    assert kernels._norm_devices() == ("cuda",)
    monkeypatch.setenv("MOESERVE_FUSED_NORMS", "yes")
    with pytest.raises(ValueError, match="MOESERVE_FUSED_NORMS='yes': allowed 1"):
        kernels._norm_devices()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--rows", "64,x"], "--rows must be a comma list of integers, got '64,x'"),
        (["--cases", "qwen3_qk,bogus"], "unknown cases ['bogus']: allowed scout_residual"),
        (["--models", "llama4,gpt5"], "unknown models ['gpt5']: allowed llama4"),
        (["--reps", "0"], "--reps must be 1 .. 1000, got 0"),
    ],
)
def test_the_benchmark_refuses_bad_options_by_name(args, message, monkeypatch, capsys):
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parent.parent / "benchmarks"
    monkeypatch.syspath_prepend(str(bench))
    spec = importlib.util.spec_from_file_location("norm_kernels_bench", bench / "norm_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["norm_kernels.py", *args])
    with pytest.raises(SystemExit) as exit_:
        module.main()
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_the_benchmarks_silu_quant_case_times_the_fused_launch_against_the_two_it_replaces(monkeypatch):
    """benchmarks/norm_kernels.py's ``<shape>_silu_quant``: the fused column runs
    ``silu_mul_quant``, the torch column ``quant_rows(silu_mul(gu))``, and both give the same
    codes and scales (what the benchmark requires bit for bit on the GPU)."""
    import importlib.util
    from pathlib import Path

    bench = Path(__file__).resolve().parent.parent / "benchmarks"
    monkeypatch.syspath_prepend(str(bench))
    spec = importlib.util.spec_from_file_location("norm_kernels_bench", bench / "norm_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert {"ernie_silu_quant", "scout_silu_quant"} <= set(module.CASES)
    monkeypatch.setattr(kernels, "NORM_DEVICES", ("cuda", "cpu"))
    calls = []
    for name in ("silu_mul_quant", "silu_mul", "quant_rows"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _n=name, _f=real, **k: calls.append(_n) or _f(*a, **k))
    fn, _ = module.case_fn("ernie_silu_quant", 3, torch.bfloat16, torch.device("cpu"), 2)
    got = fn(0)
    assert calls == ["silu_mul_quant"]
    calls.clear()
    with module.TorchPath():
        ref = fn(0)
    assert calls == ["silu_mul", "quant_rows"]
    assert got[0].shape == (3, 3072) and got[1].shape == (3,)
    assert module.agreement(got, ref)["bit_identical"] == 1
