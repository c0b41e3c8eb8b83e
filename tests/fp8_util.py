"""FP8 checkpoints for tests, in the published formats, made from a tiny transformers checkpoint:
the FP8 folder (what moeserve serves) and the same weights dequantized in float32 (what
transformers serves as the oracle: codes * scales, exactly).

Two writers, so that a writer and the reader cannot share one misreading: this module's own
(``quantize``: any format, strategy and block), and the compressed-tensors library's compressor
and config (``compressed_tensors_checkpoint``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import hf_oracle as hf
import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0

# Which linear layers the published FP8 checkpoints quantize: routed and shared experts and dense
# MLPs (Llama 4: attention, router and lm_head stay bf16); "all" also takes attention.
MLP = re.compile(r".*\.(gate_proj|up_proj|down_proj|w1|w2|w3)$")  # w1, w3, w2: Mixtral's experts
ATTENTION = re.compile(r".*self_attn\.(q|k|v|o)_proj$")


def _blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [O, I] -> (codes [O, I] fp8, scales [ceil(O/bo), ceil(I/bi)]), absmax / 448 per block."""
    o, i = weight.shape
    bo, bi = block
    ob, ib = -(-o // bo), -(-i // bi)
    pad = torch.zeros(ob * bo, ib * bi)
    pad[:o, :i] = weight.float()
    scale = pad.abs().view(ob, bo, ib, bi).amax(dim=(1, 3)) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    full = scale.repeat_interleave(bo, 0)[:o].repeat_interleave(bi, 1)[:, :i]
    return (weight.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    o, i = codes.shape
    full = scale.repeat_interleave(block[0], 0)[:o].repeat_interleave(block[1], 1)[:, :i]
    return codes.float() * full


def _fuse_llama4_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert Llama 4 linears -> the fused experts.gate_up_proj [E, H, 2I] / down_proj transformers loads."""
    out, groups = {}, {}
    for k, v in tensors.items():
        m = re.match(r"(.*\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$", k)
        if m:
            groups.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = v
        else:
            out[k] = v
    for base, g in groups.items():
        n = 1 + max(e for e, _ in g)
        out[base + "gate_up_proj"] = torch.stack(
            [torch.cat([g[(e, "gate")].t(), g[(e, "up")].t()], 1) for e in range(n)]
        )
        out[base + "down_proj"] = torch.stack([g[(e, "down")].t() for e in range(n)])
    return out


def quantize(
    src: Path,
    dst: Path,
    fmt: str = "compressed-tensors",
    strategy: str = "channel",
    block: tuple[int, int] = (16, 16),
    layers: str = "mlp",
    activations: bool = True,
) -> tuple[Path, Path]:
    """Write ``dst/fp8`` (the FP8 checkpoint) and ``dst/dequantized`` (its weights in float32)
    from the checkpoint at ``src``. fmt: "compressed-tensors" (strategy channel, tensor or block)
    or "fp8-block" (quant_method fp8, weight_scale_inv per ``block``). layers: "mlp" (experts,
    shared experts, dense MLPs, as the published FP8 Llama 4) or "all" (attention too)."""
    cfg = json.loads((Path(src) / "config.json").read_text())
    tensors = hf.read_all(src)
    llama = cfg.get("model_type", "").startswith("llama4")
    if llama:
        tensors = hf.llama4_per_expert(tensors)  # FP8 Llama 4 checkpoints store one Linear per expert
    fp8, deq, kept = {}, {}, []
    for name, t in tensors.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        quantized = (
            module is not None and t.dim() == 2 and (MLP.match(module) or (layers == "all" and ATTENTION.match(module)))
        )
        if not quantized:
            fp8[name] = deq[name] = t
            if module is not None and t.dim() == 2 and not module.startswith("model.embed"):
                kept.append(module)
            continue
        o, i = t.shape
        b = {"channel": (1, i), "tensor": (o, i)}.get(strategy, block) if fmt == "compressed-tensors" else block
        codes, scale = _blocks(t, b)
        fp8[name] = codes
        if fmt == "fp8-block":
            fp8[f"{module}.weight_scale_inv"] = scale
        elif strategy == "channel":
            fp8[f"{module}.weight_scale"] = scale.reshape(o, 1)
        elif strategy == "tensor":
            fp8[f"{module}.weight_scale"] = scale.reshape(1)
        else:
            fp8[f"{module}.weight_scale"] = scale
        deq[name] = _dequantize(codes, scale, b)
    if fmt == "compressed-tensors":
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy}
        if strategy == "block":
            weights["block_structure"] = list(block)
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
        qc = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": weights,
                    "input_activations": acts if activations else None,
                }
            },
            "ignore": sorted(kept),
            "kv_cache_scheme": None,
        }
    else:
        qc = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": list(block),
            "modules_to_not_convert": sorted(kept),
        }
    out = Path(dst)
    fp8_dir = hf.rewrite(src, out / "fp8", fp8, {**cfg, "quantization_config": qc})
    deq_dir = hf.rewrite(src, out / "dequantized", _fuse_llama4_experts(deq) if llama else deq, cfg)
    return fp8_dir, deq_dir


def compressed_tensors_checkpoint(src: Path, dst: Path, strategy: str = "channel") -> tuple[Path, Path]:
    """As ``quantize``, but written by the compressed-tensors library itself: its scales
    (``calculate_qparams``), its compressor (``float-quantized``), its ``QuantizationConfig``
    serialized as it serializes it, and its own decompression for the dequantized twin. The
    experts, shared experts and dense MLPs (per-expert Linears for Llama 4), per ``strategy``
    (channel or tensor), with dynamic per-token input activations."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False)
    acts = QuantizationArgs(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=acts)
    compressor = BaseCompressor.load_from_registry("float-quantized")
    cfg = json.loads((Path(src) / "config.json").read_text())
    tensors = hf.read_all(src)
    llama = cfg.get("model_type", "").startswith("llama4")
    if llama:
        tensors = hf.llama4_per_expert(tensors)
    fp8, deq, kept = {}, {}, []
    for name, t in tensors.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module is None or t.dim() != 2 or not MLP.match(module):
            fp8[name] = deq[name] = t
            if module is not None and t.dim() == 2 and not module.startswith("model.embed"):
                kept.append(module)
            continue
        dims = dict(dim=1, keepdim=True) if strategy == "channel" else {}
        lo, hi = (t.amin(**dims), t.amax(**dims)) if dims else (t.amin(), t.amax())
        scale, zero = calculate_qparams(lo, hi, args)
        packed = compressor.compress({"weight": t, "weight_scale": scale, "weight_zero_point": zero}, scheme)
        unpacked = compressor.decompress(dict(packed), scheme)
        fp8[name] = packed["weight"]
        fp8[f"{module}.weight_scale"] = packed["weight_scale"]
        deq[name] = unpacked["weight"].float()
    qc = QuantizationConfig(
        config_groups={"group_0": scheme},
        format="float-quantized",
        ignore=sorted(kept),
        quantization_status="compressed",
    ).model_dump()
    out = Path(dst)
    fp8_dir = hf.rewrite(src, out / "fp8", fp8, {**cfg, "quantization_config": qc})
    deq_dir = hf.rewrite(src, out / "dequantized", _fuse_llama4_experts(deq) if llama else deq, cfg)
    return fp8_dir, deq_dir
