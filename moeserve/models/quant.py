"""FP8 weights: the checkpoint formats moeserve serves, how a quantized weight is held, and the
dequantizing torch path every device can run.

Dimension letters: O a linear layer's output features, I its input features; a block of a
weight covers ``bo`` x ``bi`` of them, Ob = ceil(O / bo), Ib = ceil(I / bi).

A quantized weight is FP8 e4m3 codes and float32 scales, one scale per block:
``w[o, i] = codes[o, i] * scale[o // bo, i // bi]``. One block shape covers the three
strategies checkpoints use: per output channel (``bo = 1, bi = I``), per tensor (``O, I``) and
block-wise (``128, 128`` in DeepSeek-V3, Qwen3 and Kimi K2 FP8 checkpoints). Routed experts
hold the same in the canonical x @ W layout of ``moe.py`` (transposed: blocks of
``bk = bi`` inputs by ``bn = bo`` outputs).

What is read (``quantization_config`` of config.json; :func:`parse_quantization`):

- compressed-tensors (``quant_method: compressed-tensors``, format ``float-quantized`` or
  ``naive-quantized``): FP8 weights with static scales ``weight_scale`` (strategy ``channel``
  [O, 1], ``tensor`` [1] or ``block`` with ``block_structure``), input activations dynamic per
  token or none, ``ignore`` (module names and ``re:`` patterns): the format of the published
  FP8 Llama 4 checkpoints (experts one Linear per expert);
- block-wise FP8 (``quant_method: fp8``, ``weight_block_size: [bo, bi]``, ``weight_scale_inv``
  [Ob, Ib], which multiplies despite its name; ``modules_to_not_convert``);
- ``--quantization fp8`` (vLLM's name; :func:`online_scheme`): a bf16 checkpoint quantized at
  load, per output channel: the routed experts and the MLPs beside them (shared experts, dense
  layers); attention, routers, embeddings and the LM head keep the checkpoint's dtype.

Anything else (another method or format, integer or 4-bit weights, static activation scales,
an FP8 KV cache) is refused by name with what is supported: never read as if it were bf16.
Which tensors are quantized is what the checkpoint stores: a weight in FP8 with its scale
beside it; a checkpoint's ignore list must agree.

The torch path is weight-only: :func:`dequantize` makes ``codes * scale`` in float32, then the
compute dtype (exact in fp32, so an FP8 checkpoint computed in fp32 equals transformers on the
dequantized weights). The GPU kernels read the codes and apply the scales in registers
(``moeserve.kernels``), and where :func:`activations_quantized` says so (dynamic per-token
activations declared, or ``--quantization fp8``) unless ``MOESERVE_FP8_ACTIVATIONS=weight-only``
quantize each product's rows per row too and run it on FP8 tensor cores (W8A8).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from moeserve.models.errors import QuantizationError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
# QuantLinear runs the Triton kernel up to this many rows (decode; it streams the codes once per
# pass of rows), and dequantizes the weight for cuBLAS above (prefill is bound by the product).
KERNEL_MAX_ROWS = 512
FORMATS = ("compressed-tensors", "fp8-block", "online")
MLP_LEAVES = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")  # w1, w3, w2: Mixtral's experts
STRATEGIES = ("channel", "tensor", "block")
SUPPORTED = (
    "moeserve serves FP8 (e4m3) weights from compressed-tensors checkpoints (format float-quantized or "
    "naive-quantized; weight strategy channel, tensor or block; input activations dynamic per token or none), "
    "block-wise FP8 checkpoints (quant_method 'fp8' with weight_block_size), and bf16 checkpoints quantized at "
    "load with --quantization fp8"
)


@dataclass(frozen=True)
class QuantScheme:
    """How a checkpoint's weights are quantized.

    format:      "compressed-tensors", "fp8-block" or "online" (--quantization fp8).
    strategy:    "channel", "tensor" or "block" (the weights' scale granularity).
    block:       (bo, bi) of a "block" strategy, as the checkpoint writes it ([out, in]).
    activations: "token" (dynamic per-token FP8 activations declared) or "none" (weight-only).
    ignore:      module names and ``re:`` patterns kept unquantized (compressed-tensors'
                 ``ignore``, fp8's ``modules_to_not_convert``).
    scale_name:  the scale tensor beside ``weight``: "weight_scale" or "weight_scale_inv".
    """

    format: str
    strategy: str
    block: tuple[int, int] | None = None
    activations: str = "none"
    ignore: tuple[str, ...] = ()
    scale_name: str = "weight_scale"

    def __post_init__(self):
        if self.format not in FORMATS:
            raise QuantizationError(f"quantization format must be one of {FORMATS}, got {self.format!r}")
        if self.strategy not in STRATEGIES:
            raise QuantizationError(f"weight strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if (self.strategy == "block") != (self.block is not None):
            raise QuantizationError("a block strategy needs its block shape, and only it has one")
        if self.block is not None and (len(self.block) != 2 or min(self.block) < 1):
            raise QuantizationError(f"block shape must be two positive sizes [out, in], got {list(self.block)}")

    @property
    def name(self) -> str:
        """A short description for logs and status: "fp8 compressed-tensors channel"."""
        block = f" {self.block[0]}x{self.block[1]}" if self.block else ""
        return f"fp8 {self.format} {self.strategy}{block}"

    def block_of(self, out_features: int, in_features: int) -> tuple[int, int]:
        """(bo, bi) of a weight [out, in] under this scheme."""
        if self.strategy == "channel":
            return (1, in_features)
        if self.strategy == "tensor":
            return (out_features, in_features)
        assert self.block is not None
        return self.block

    def ignores(self, module: str) -> bool:
        """Whether ``module`` (a checkpoint name without ``.weight``, with or without the
        multimodal ``language_model.`` prefix) is kept unquantized by the ignore list."""
        names = {module, module.removeprefix("language_model."), "language_model." + module}
        for entry in self.ignore:
            if entry.startswith("re:"):
                pattern = re.compile(entry[3:])
                if any(pattern.match(n) for n in names):
                    return True
            elif self.format == "fp8-block":  # HF's fp8 quantizer matches by containment
                if any(entry in n for n in names):
                    return True
            elif entry in names:
                return True
        return False

    def online_quantizes(self, module: str) -> bool:
        """With --quantization fp8: whether a bf16 ``module`` is quantized at load (the MLPs:
        routed and shared experts, dense layers; never attention, routers or the LM head)."""
        if self.format != "online" or self.ignores(module):
            return False
        leaf = module.rsplit(".", 1)[-1]
        return leaf in MLP_LEAVES and ".self_attn." not in module


def activations_quantized(scheme: QuantScheme | None, dtype: torch.dtype | None = None) -> bool:
    """Whether the GPU kernels quantize a product's rows too (W8A8: FP8 per row, dynamic, the
    product on FP8 tensor cores): where the checkpoint declares dynamic per-token activations
    with per-channel or per-tensor weight scales, and for ``--quantization fp8`` (vLLM's
    behaviour for both). Block-wise weight scales stay weight-only (their checkpoints'
    activations are per 128-group). ``MOESERVE_FP8_ACTIVATIONS=weight-only`` (read in each
    process) forces every FP8 product weight-only, for exactness checks; ``dynamic`` is the
    default. A float32 compute ``dtype`` (the exactness dtype) and the torch path (CPU) are always
    weight-only (docs/engine.md, "FP8 activations")."""
    mode = os.environ.get("MOESERVE_FP8_ACTIVATIONS", "dynamic") or "dynamic"
    if mode not in ("weight-only", "dynamic"):
        raise QuantizationError(f"MOESERVE_FP8_ACTIVATIONS={mode!r}: allowed dynamic (the default), weight-only")
    if scheme is None or mode == "weight-only" or scheme.strategy == "block" or dtype == torch.float32:
        return False
    return scheme.format == "online" or scheme.activations == "token"


def online_scheme() -> QuantScheme:
    """``--quantization fp8``: per-output-channel FP8 weights quantized at load."""
    return QuantScheme(format="online", strategy="channel")


def parse_quantization(raw: Any, source: str = "config.json") -> QuantScheme:
    """config.json's ``quantization_config`` -> a QuantScheme, or QuantizationError naming what
    is not supported and what is."""
    if not isinstance(raw, dict):
        raise QuantizationError(f"{source}: quantization_config must be an object, got {type(raw).__name__}")
    method = raw.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(raw, source)
    if method == "fp8":
        return _fp8_block(raw, source)
    raise QuantizationError(f"{source}: quantization_config.quant_method {method!r} is not supported; {SUPPORTED}")


def _refuse(source: str, what: str) -> QuantizationError:
    return QuantizationError(f"{source}: quantization_config {what} is not supported; {SUPPORTED}")


def _compressed_tensors(raw: dict, source: str) -> QuantScheme:
    fmt = raw.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _refuse(source, f"format {fmt!r}")
    if raw.get("kv_cache_scheme") not in (None, {}):
        raise _refuse(source, "kv_cache_scheme (FP8 KV cache scales)")
    if raw.get("sparsity_config") not in (None, {}) and (raw["sparsity_config"] or {}).get("format") not in (
        None,
        "dense",
    ):
        raise _refuse(source, f"sparsity_config format {raw['sparsity_config'].get('format')!r}")
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantizationError(f"{source}: compressed-tensors quantization_config needs config_groups")
    schemes = set()
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise QuantizationError(f"{source}: config_groups.{name} must be an object")
        targets = group.get("targets") or []
        if any(t != "Linear" and not str(t).startswith("re:") for t in targets):
            raise _refuse(source, f"config_groups.{name}.targets {targets} (only Linear layers are quantized)")
        schemes.add(_ct_group(group, f"{source}: config_groups.{name}"))
    if len(schemes) != 1:
        raise _refuse(source, f"{len(schemes)} different schemes in config_groups (moeserve serves one)")
    strategy, block, activations = schemes.pop()
    ignore = raw.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        raise QuantizationError(
            f"{source}: quantization_config.ignore must be a list of module names or 're:' patterns"
        )
    return QuantScheme("compressed-tensors", strategy, block, activations, tuple(ignore), "weight_scale")


def _ct_group(group: dict, where: str) -> tuple[str, tuple[int, int] | None, str]:
    w = group.get("weights")
    if not isinstance(w, dict):
        raise _refuse(where, "without weights")
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise _refuse(where, f"weights of type {w.get('type')!r} with {w.get('num_bits')} bits (FP8 is float, 8)")
    if w.get("dynamic") not in (False, None) or w.get("symmetric") is False:
        raise _refuse(where, "weights with dynamic or asymmetric scales")
    if w.get("group_size") is not None or w.get("actorder") not in (None, False):
        raise _refuse(where, f"weights with group_size {w.get('group_size')} / actorder")
    strategy = w.get("strategy")
    block = None
    if strategy == "block":
        bs = w.get("block_structure")
        if not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(x, int) and x > 0 for x in bs)):
            raise _refuse(where, f"block strategy with block_structure {bs!r} (needs [out, in])")
        block = (bs[0], bs[1])
    elif strategy not in ("channel", "tensor"):
        raise _refuse(where, f"weight strategy {strategy!r}")
    a = group.get("input_activations")
    if a is None:
        activations = "none"
    elif not isinstance(a, dict):
        raise _refuse(where, "input_activations that are not an object")
    elif (
        a.get("type") == "float"
        and a.get("num_bits") == 8
        and a.get("dynamic") is True
        and a.get("strategy") == "token"
    ):
        activations = "token"
    else:
        raise _refuse(
            where,
            f"input_activations {{type {a.get('type')!r}, num_bits {a.get('num_bits')}, strategy "
            f"{a.get('strategy')!r}, dynamic {a.get('dynamic')!r}}} (served: FP8 dynamic per token, or none)",
        )
    if group.get("output_activations") is not None:
        raise _refuse(where, "output_activations")
    return strategy, block, activations


def _fp8_block(raw: dict, source: str) -> QuantScheme:
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse(source, f"fp8 fmt {fmt!r} (served: e4m3)")
    if raw.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse(source, f"fp8 activation_scheme {raw.get('activation_scheme')!r} (served: dynamic)")
    bs = raw.get("weight_block_size")
    if not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(x, int) and x > 0 for x in bs)):
        raise _refuse(source, f"fp8 without a weight_block_size [out, in] (got {bs!r}): per-tensor fp8")
    ignore = raw.get("modules_to_not_convert") or raw.get("ignored_layers") or []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        raise QuantizationError(f"{source}: quantization_config.modules_to_not_convert must be a list of names")
    return QuantScheme("fp8-block", "block", (bs[0], bs[1]), "token", tuple(ignore), "weight_scale_inv")


def resolve(declared: QuantScheme | None, requested: str | None, source: str = "config.json") -> QuantScheme | None:
    """The scheme a model runs with: the checkpoint's, or with ``requested`` ("fp8", vLLM's
    ``--quantization``) a bf16 checkpoint quantized at load. A request that contradicts the
    checkpoint's own quantization is refused."""
    if requested in (None, "", "none"):
        return declared
    if requested != "fp8":
        raise QuantizationError(f"--quantization {requested!r} is not supported; allowed: fp8")
    return declared if declared is not None else online_scheme()


# -- codes and scales ---------------------------------------------------------------------------


def _expand(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """scale [R/b0, C/b1] (rounded up) -> [R, C]: each block's scale over its elements."""
    r, c = shape
    return scale.repeat_interleave(block[0], 0)[:r].repeat_interleave(block[1], 1)[:, :c]


def dequantize(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """codes (FP8) [R, C] and float32 scales [ceil(R/b0), ceil(C/b1)] -> the weight [R, C] in
    ``dtype``: codes * scale in float32, rounded once."""
    rows, cols = codes.shape
    return (codes.float() * _expand(scale.float(), block, (rows, cols))).to(dtype)


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [R, C] -> (FP8 codes [R, C], float32 scales [ceil(R/b0), ceil(C/b1)]): each block's
    scale is its largest magnitude / 448, codes round to nearest (an all-zero block gets scale 1)."""
    rows, cols = weight.shape
    b0, b1 = block
    rb, cb = -(-rows // b0), -(-cols // b1)
    w = weight.float()
    padded = torch.zeros(rb * b0, cb * b1, dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = w
    amax = padded.abs().view(rb, b0, cb, b1).amax(dim=(1, 3))  # [rb, cb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (w / _expand(scale, block, (rows, cols))).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale


def check_scale(name: str, scale: torch.Tensor, codes_shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """A scale as stored (channel [O, 1] or [O], tensor [] or [1], block [Ob, Ib]) -> float32
    [ceil(O/bo), ceil(I/bi)], or QuantizationError naming the tensor and the shape expected."""
    want = (-(-codes_shape[0] // block[0]), -(-codes_shape[1] // block[1]))
    s = scale.float()
    if s.numel() == want[0] * want[1] and (s.dim() <= 1 or tuple(s.shape) in (want, (want[0], 1))):
        s = s.reshape(want)
    if tuple(s.shape) != want:
        raise QuantizationError(
            f"tensor '{name}' has shape {list(scale.shape)}; for a weight of shape {list(codes_shape)} in blocks of "
            f"{list(block)} it must hold {list(want)} scales"
        )
    if not torch.isfinite(s).all() or (s <= 0).any():
        raise QuantizationError(f"tensor '{name}': scales must be finite and > 0")
    return s.contiguous()


@dataclass
class QuantLinear:
    """y = x @ W.T (+ bias) with W held as FP8 codes [out, in] and float32 scales per
    (bo, bi) block: weight-only, activations in x's dtype. On CUDA with up to
    ``KERNEL_MAX_ROWS`` rows the Triton kernel reads the codes and scales them in registers
    (``moeserve.kernels.fp8_linear``); otherwise the weight is dequantized for the call (CPU,
    exactness checks, prefill), so it is held in one byte per weight either way. With
    ``act_quant`` (W8A8, the default where declared) and one scale over K, every call on CUDA quantizes its rows and
    runs cuBLAS's FP8 GEMM (``kernels.fp8_scaled_linear``)."""

    codes: torch.Tensor  # FP8 [out, in]
    scale: torch.Tensor  # float32 [ceil(out/bo), ceil(in/bi)]
    block: tuple[int, int]
    bias: torch.Tensor | None = None
    act_quant: bool = False  # W8A8 on CUDA (``activations_quantized``)
    _kn: torch.Tensor | None = field(default=None, repr=False)  # codes as [in, out], for the kernel
    _skn: torch.Tensor | None = field(default=None, repr=False)
    _srow: torch.Tensor | None = field(default=None, repr=False)
    _gemm_ok: bool | None = field(default=None, repr=False)  # the weight fits kernels.fp8_scaled_linear

    @property
    def nbytes(self) -> int:
        """The bytes a forward pass reads: codes, scales and bias."""
        b = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.codes.numel() + self.scale.numel() * 4 + b

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight [out, in] in ``dtype``."""
        return dequantize(self.codes, self.scale, self.block, dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.takes_codes(x):
            from moeserve import kernels

            y = kernels.fp8_scaled_linear(x, self.codes_kn(), self.scale_row())
            return y if self.bias is None else y + self.bias
        if x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= KERNEL_MAX_ROWS and self._kernel_ok(x):
            from moeserve import kernels

            y = kernels.fp8_linear(x, self.codes_kn(), self.scale_kn(), (self.block[1], self.block[0]), self.act_quant)
            return y if self.bias is None else y + self.bias
        return torch.nn.functional.linear(x, self.weight(x.dtype), self.bias)

    def takes_codes(self, x: torch.Tensor) -> bool:
        """Whether a call on x quantizes its rows per row and runs cuBLAS's FP8 GEMM (W8A8 on
        CUDA with one scale over K), so that a caller may hand it the rows' codes and scales
        instead (``call_codes``), quantized where they were made (``kernels.silu_mul_quant``)."""
        return x.is_cuda and x.dim() == 2 and x.shape[0] > 0 and self.act_quant and self._scaled_mm_ok(x)

    def call_codes(self, xq: torch.Tensor, xs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """The call on rows x that ``takes_codes``, given x's per-row codes xq [M, K] and scales
        xs [M] (``kernels.quant_rows(x)``, bitwise): the output in ``out_dtype``, x's dtype."""
        from moeserve import kernels

        y = kernels.fp8_scaled_codes_linear(xq, xs, self.codes_kn(), self.scale_row(), out_dtype)
        return y if self.bias is None else y + self.bias

    def _scaled_mm_ok(self, x: torch.Tensor) -> bool:
        """W8A8 with one scale over each output channel's inputs: cuBLAS's FP8 GEMM
        (``kernels.fp8_scaled_linear``) at every row count, prefill included. What the weight
        allows is decided once (``_gemm_takes_weight``), not on every call of a step."""
        return x.dtype in (torch.bfloat16, torch.float16) and self._gemm_takes_weight()

    def _gemm_takes_weight(self) -> bool:
        if self._gemm_ok is None:
            from moeserve import kernels

            kn = self.codes_kn()
            self._gemm_ok = kernels.available() and kernels.fp8_scaled_linear_supported(
                kn.shape[0], kn.shape[1], (self.block[1], self.block[0]), kn
            )
        return self._gemm_ok

    def prepared(self) -> QuantLinear:
        """On CUDA, the kernel's layouts made now (at load), not in a step (maybe one being
        captured in a CUDA graph)."""
        if self.codes.is_cuda:
            self.codes_kn()
            self.scale_kn()
            if self._gemm_takes_weight():
                self.scale_row()
        return self

    def _kernel_ok(self, x: torch.Tensor) -> bool:
        from moeserve import kernels

        return (
            x.dtype in (torch.bfloat16, torch.float16)
            and kernels.available()
            and kernels.fp8_blocks_supported(self.codes.shape[1], (self.block[1], self.block[0]))
        )

    def codes_kn(self) -> torch.Tensor:
        """The codes as an [in, out] view (x @ W) of the [out, in] bytes: each output channel's
        inputs contiguous, the layout the kernel streams onto FP8 tensor cores."""
        if self._kn is None:
            self._kn = self.codes.contiguous().t()
            self.codes = self._kn.t()
        return self._kn

    def scale_kn(self) -> torch.Tensor:
        if self._skn is None:
            self._skn = self.scale.t().contiguous()
        return self._skn

    def scale_row(self) -> torch.Tensor:
        """float32 [1, out]: each output channel's scale (a per-tensor scale repeated), as
        ``torch._scaled_mm`` takes a weight's row-wise scales; only for one scale over K."""
        if self._srow is None:
            out = self.codes.shape[0]
            self._srow = _expand(self.scale.float(), (self.block[0], 1), (out, 1)).reshape(1, out).contiguous()
        return self._srow


def merge_quant(parts: list[QuantLinear]) -> QuantLinear | None:
    """FP8 linears [out_i, in] joined along their outputs (``moeserve.models.layers.merge_linears``):
    codes concatenated, and scales too where every part has the same blocks and its rows fill
    whole blocks of rows. Otherwise, with one scale over the inputs (per channel and per tensor
    mixed, or per tensor of different sizes), each part's scales are first repeated per output
    channel, which is the same weight (code x scale unchanged). None when the parts' inputs,
    input blocks or activation schemes differ, when biases are on some only, or when block-wise
    scales do not line up."""
    ins = {p.codes.shape[1] for p in parts}
    if len(ins) != 1 or len({p.act_quant for p in parts}) != 1 or len({p.block[1] for p in parts}) != 1:
        return None
    biases = [p.bias for p in parts if p.bias is not None]
    if biases and len(biases) != len(parts):
        return None
    codes = [p.codes for p in parts]
    block, scales = parts[0].block, [p.scale for p in parts]
    lined_up = len({p.block for p in parts}) == 1 and not any(c.shape[0] % block[0] for c in codes[:-1])
    if not lined_up:
        if parts[0].block[1] < ins.pop():
            return None  # block-wise: only whole blocks of rows join
        # one scale over the inputs (per channel or per tensor): each part's per output channel
        block = (1, parts[0].block[1])
        scales = [_expand(p.scale, (p.block[0], 1), (c.shape[0], 1)) for p, c in zip(parts, codes)]
    bias = torch.cat(biases) if biases else None
    merged = QuantLinear(
        torch.cat(codes).contiguous(), torch.cat(scales).contiguous(), block, bias=bias, act_quant=parts[0].act_quant
    )
    return merged.prepared()


def read_weight(reader, module: str, shape: tuple[int, int], dtype: torch.dtype, device) -> torch.Tensor | QuantLinear:
    """``{module}.weight`` [out, in] of a linear layer: a tensor in ``dtype`` on ``device``, or
    a :class:`QuantLinear` (without bias) when the checkpoint stores it in FP8 with its scale,
    or when ``--quantization fp8`` quantizes it at load. An FP8 weight without a
    quantization_config, or where the config's ignore list keeps the module unquantized, is
    refused."""
    scheme: QuantScheme | None = reader.config.quantization
    name = f"{module}.weight"
    stored = reader.stored_dtype(name)
    if stored == FP8:
        if scheme is None or scheme.format == "online":
            raise QuantizationError(
                f"tensor '{name}' is stored in float8_e4m3fn but config.json declares no quantization_config: "
                f"moeserve does not guess its scales; {SUPPORTED}"
            )
        if scheme.ignores(module):
            raise QuantizationError(
                f"tensor '{name}' is stored in float8_e4m3fn although quantization_config's ignore list keeps "
                f"'{module}' unquantized"
            )
        block = scheme.block_of(*shape)
        codes = reader.read(name, FP8, shape=shape)
        scale_name = f"{module}.{scheme.scale_name}"
        if not reader.has(scale_name):
            raise QuantizationError(f"tensor '{name}' is FP8 but its scale '{scale_name}' is missing")
        scale = check_scale(scale_name, reader.read(scale_name, torch.float32), shape, block)
        return QuantLinear(
            codes.to(device), scale.to(device), block, act_quant=activations_quantized(scheme, dtype)
        ).prepared()
    if stored in (torch.float8_e5m2,):
        raise QuantizationError(
            f"tensor '{name}' is stored in {stored}: FP8 e5m2 weights are not supported; {SUPPORTED}"
        )
    w = reader.read(name, dtype, shape=shape)
    if scheme is not None and scheme.online_quantizes(module):
        block = scheme.block_of(*shape)
        codes, scale = quantize(w.to(device=device, dtype=torch.float32), block)
        return QuantLinear(codes, scale, block, act_quant=activations_quantized(scheme, dtype)).prepared()
    return w.to(device)
