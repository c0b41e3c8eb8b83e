"""Merged projections (moeserve.models.layers.merge_linears): q, k, v as one qkv product and a
SwiGLU's gate and up as one gate_up, bf16/fp32 and FP8, each part's outputs the same values as
its own product; what cannot be joined is left as it was; the models load merged and still equal
transformers, in bf16/fp32 and from an FP8 checkpoint whose attention is FP8 too."""

import fp8_util
import hf_oracle as hf
import pytest
import torch
from hf_oracle import FP32_LOGITS_ATOL

from moeserve.models import load_model
from moeserve.models.layers import Linear, SwiGLU, merge_linears, split_outputs
from moeserve.models.quant import QuantLinear, dequantize, quantize


def _w(g, out, inp):
    return torch.randn(out, inp, generator=g)


def test_linears_merge_into_one_product_with_each_parts_outputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 24, generator=g)
    for bias in (False, True):
        parts = [Linear(_w(g, n, 24), torch.randn(n, generator=g) if bias else None) for n in (16, 8, 8)]
        merged = merge_linears(parts)
        assert isinstance(merged, Linear) and merged.weight.shape == (32, 24)
        for got, part in zip(split_outputs(merged(x), (16, 8, 8)), parts):
            torch.testing.assert_close(got, part(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "blocks",
    [
        [(1, 24)] * 3,  # per output channel
        [(16, 24), (8, 24), (8, 24)],  # per tensor: repeated per channel first
        [(8, 8)] * 3,  # block-wise, rows filling whole blocks
    ],
)
def test_fp8_linears_merge_codes_and_scales_into_the_same_weight(blocks):
    g = torch.Generator().manual_seed(1)
    parts = []
    for n, block in zip((16, 8, 8), blocks):
        codes, scale = quantize(_w(g, n, 24), block)
        parts.append(QuantLinear(codes, scale, block))
    merged = merge_linears(parts)
    assert isinstance(merged, QuantLinear)
    want = torch.cat([p.weight(torch.float32) for p in parts])
    assert torch.equal(dequantize(merged.codes, merged.scale, merged.block, torch.float32), want)
    x = torch.randn(5, 24, generator=g)
    for got, part in zip(split_outputs(merged(x), (16, 8, 8)), parts):
        torch.testing.assert_close(got, part(x), rtol=1e-6, atol=1e-6)


def test_what_cannot_be_joined_stays_apart():
    g = torch.Generator().manual_seed(2)
    lin = Linear(_w(g, 8, 24))
    codes, scale = quantize(_w(g, 8, 24), (1, 24))
    q = QuantLinear(codes, scale, (1, 24))
    assert merge_linears([lin, q]) is None  # one kept in bf16 by an ignore list, one FP8
    assert merge_linears([lin, Linear(_w(g, 8, 24), torch.zeros(8))]) is None  # a bias on one only
    assert merge_linears([lin, Linear(_w(g, 8, 16))]) is None  # different inputs
    c2, s2 = quantize(_w(g, 12, 24), (8, 8))
    assert merge_linears([QuantLinear(c2, s2, (8, 8)), q]) is None  # rows 12 do not fill blocks of 8
    assert merge_linears([q, QuantLinear(codes, scale, (1, 24), act_quant=True)]) is None  # W8A8 and not
    assert merge_linears([lin]) is None
    mlp = SwiGLU(lin, q, lin)
    assert mlp.merged() is mlp and mlp.linears() == (lin, q, lin)


def test_a_swiglu_merged_computes_the_same_mlp():
    g = torch.Generator().manual_seed(3)
    mlp = SwiGLU(Linear(_w(g, 16, 8)), Linear(_w(g, 16, 8)), Linear(_w(g, 8, 16)))
    merged = mlp.merged()
    assert merged.gate is None and merged.up is None and merged.gate_up is not None
    assert len(merged.linears()) == 2
    x = torch.randn(4, 8, generator=g)
    torch.testing.assert_close(merged(x), mlp(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", ["llama4", "ernie4_5_moe"])
def test_models_load_merged_and_equal_transformers(family, tmp_path):
    build = {"llama4": hf.build_llama4, "ernie4_5_moe": hf.build_ernie}[family]
    path = hf.save(build(seed=4), tmp_path)
    model = load_model(path)
    assert all(layer.attn.qkv is not None and layer.attn.q_proj is None for layer in model.layers)
    mlps = [layer.mlp for layer in model.layers if layer.mlp is not None]
    mlps += [b.shared_mlp for b in model.moe_blocks if b.shared_mlp is not None]
    assert mlps and all(m.gate_up is not None and m.gate is None for m in mlps)
    ids = hf.prompts(2, 10)
    with torch.no_grad():
        ref = hf.load_oracle(path)(ids).logits
    assert (model(ids) - ref).abs().max().item() < FP32_LOGITS_ATOL


def test_an_fp8_checkpoint_loads_its_projections_merged_and_equals_transformers(tmp_path):
    src = hf.save(hf.build_ernie(seed=5), tmp_path / "src")
    fp8, deq = fp8_util.quantize(src, tmp_path / "q", layers="all")
    model = load_model(fp8)
    assert all(isinstance(layer.attn.qkv, QuantLinear) for layer in model.layers)
    shared = [b.shared_mlp for b in model.moe_blocks if b.shared_mlp is not None]
    assert shared and all(isinstance(m.gate_up, QuantLinear) for m in shared)
    ids = hf.prompts(2, 10)
    with torch.no_grad():
        ref = hf.load_oracle(deq)(ids).logits
    assert (model(ids) - ref).abs().max().item() < 1e-4


def test_the_switch_keeps_projections_apart_and_refuses_other_values(monkeypatch):
    from moeserve.models import layers

    monkeypatch.setenv("MOESERVE_MERGED_PROJECTIONS", "0")
    assert layers._merge_projections() is False
    monkeypatch.setattr(layers, "MERGE_PROJECTIONS", False)
    g = torch.Generator().manual_seed(6)
    assert merge_linears([Linear(_w(g, 8, 4)), Linear(_w(g, 8, 4))]) is None
    monkeypatch.setenv("MOESERVE_MERGED_PROJECTIONS", "yes")
    with pytest.raises(ValueError, match="MOESERVE_MERGED_PROJECTIONS='yes': allowed 1 .* or 0"):
        layers._merge_projections()
