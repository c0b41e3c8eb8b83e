"""The seam between a router (attention side) and the expert workers (routed experts).

Dimension letters: T tokens in a step, H hidden size, I one routed expert's intermediate size,
K experts per token (top-k), E logical experts of a MoE layer, S expert slots held by one party.

Every family routes through the same three pieces, so that the dispatcher never needs to know
which model it serves:

- the model's routing function ``MoEBlock.route(hidden [T, H]) -> RoutingResult``, computed on
  the router rank (gate, top-k, weights; logical expert ids);
- an :class:`ExpertSpec` saying how one routed expert computes (activation, weight layout,
  biases, dtype) and how many bytes its weights take (migration and the balancer count them);
- an :class:`ExpertsBackend` that runs the routed experts for a routing result, in two phases
  (``dispatch`` then ``combine``) so that the router can compute the shared experts while rows
  are in flight. :class:`LocalExperts` is the single-process backend; the data plane provides
  one that sends rows to expert workers.

Expert weights are held in one canonical layout on every party, whatever the checkpoint says:
``gate_up [H, 2I]`` (x @ W style; the gate is the first I columns, the up projection the last
I) and ``down [I, H]``, plus ``gate_up_bias [2I]`` / ``down_bias [H]`` when the family has
biases. ``flat`` packs one expert's tensors into a single 1-D buffer (in ``ExpertSpec.tensor
names`` order), which is what a weight migration sends.

FP8 experts (``ExpertSpec.quant``, ``moeserve.models.quant``) hold ``gate_up`` and ``down`` as
FP8 codes with their float32 scales ``gate_up_scale [ceil(H/bk), 2 ceil(I/bn)]`` (the gate's
blocks, then the up projection's) and ``down_scale [ceil(I/bk), ceil(H/bn)]``; the flat buffer
is then the bytes of all four (each at a 16-byte aligned offset), so a slot is its weights and
its scales as one unit: a migration, a redundant copy or a reload moves both or neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from moeserve.models import quant as Q


@dataclass(frozen=True)
class RoutingResult:
    """The routing decision for a batch of tokens.

    ids:     LongTensor [T, K], logical expert ids, 0 .. E-1.
    weights: Tensor [T, K], the model dtype; the factor for each (token, k) pair.
    weights_on_input: True when the weight scales the expert's *input* (Llama 4:
        E(w * x)); False when it scales the expert's *output* (ERNIE, Mixtral, Qwen:
        w * E(x)). Either way the routed output of a token is the unweighted sum over its K
        pairs of the (possibly pre-scaled) expert outputs.
    """

    ids: torch.Tensor
    weights: torch.Tensor
    weights_on_input: bool


ACTIVATIONS = ("silu", "clamped_swiglu")
ALIGN = 16  # bytes: every tensor of a quantized expert starts at such an offset of its flat buffer


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class ExpertQuant:
    """FP8 routed experts: codes in the canonical layout, one float32 scale per block of
    ``bk`` inputs x ``bn`` outputs (``gate_up_block`` over gate_up's [H, I] halves apart,
    ``down_block`` over down [I, H]). Per output channel: (K, 1); per tensor: (K, N)."""

    gate_up_block: tuple[int, int]
    down_block: tuple[int, int]
    act_quant: bool = False  # W8A8 in the GPU kernels (``quant.activations_quantized``)

    @classmethod
    def from_scheme(
        cls, scheme: Q.QuantScheme, hidden: int, inter: int, dtype: torch.dtype | None = None
    ) -> ExpertQuant:
        bo, bi = scheme.block_of(inter, hidden)  # gate_proj / up_proj: [I, H] as a checkpoint holds them
        do, di = scheme.block_of(hidden, inter)  # down_proj: [H, I]
        return cls(gate_up_block=(bi, bo), down_block=(di, do), act_quant=Q.activations_quantized(scheme, dtype))


# FP8 codes of a slot, stored [N, K] (the checkpoint's own nn.Linear layout, each output
# channel's inputs contiguous) and viewed as the canonical [K, N]: the layout that lets the
# grouped kernel feed FP8 tensor cores (both operands K-major; benchmarks/fp8_kernels.py)
FP8_CODES = ("gate_up", "down")


@dataclass(frozen=True)
class ExpertSpec:
    """How one routed expert computes, and the shape and size of its weights.

    E(x) = act(x @ G, x @ U) @ D, with [G | U] = gate_up [H, 2I] and D = down [I, H]; with
    biases, x @ gate_up + gate_up_bias and ... @ down + down_bias. ``activation`` (``activate``):
    "silu", silu(g) * u (SwiGLU); "clamped_swiglu" (GPT-OSS), with g' = min(g, limit) and
    u' = clamp(u, -limit, limit), (u' + 1) * g' * sigmoid(alpha g'). ``dtype`` is the compute
    dtype (of rows, outputs and unquantized weights); with ``quant`` the weights are FP8 codes
    and scales (``ExpertQuant``), dequantized to ``dtype`` by the torch path.
    """

    hidden_size: int
    intermediate_size: int
    activation: str = "silu"
    has_bias: bool = False
    dtype: torch.dtype = torch.float32
    quant: ExpertQuant | None = None
    swiglu_alpha: float = 1.702  # clamped_swiglu only
    swiglu_limit: float = 7.0  # clamped_swiglu only

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown expert activation {self.activation!r}; allowed: {ACTIVATIONS}")
        if self.quant is not None and self.has_bias:
            raise ValueError("FP8 experts with biases are not supported")

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(self.shapes)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Canonical shape of each tensor of one expert, in ``tensor_names`` order."""
        h, i = self.hidden_size, self.intermediate_size
        if self.quant is not None:
            (gk, gn), (dk, dn) = self.quant.gate_up_block, self.quant.down_block
            return {
                "gate_up": (h, 2 * i),
                "gate_up_scale": (-(-h // gk), 2 * -(-i // gn)),
                "down": (i, h),
                "down_scale": (-(-i // dk), -(-h // dn)),
            }
        s: dict[str, tuple[int, ...]] = {"gate_up": (h, 2 * i), "down": (i, h)}
        if self.has_bias:
            s.update(gate_up_bias=(2 * i,), down_bias=(h,))
        return s

    @property
    def tensor_dtypes(self) -> dict[str, torch.dtype]:
        """Each tensor's dtype: FP8 codes and float32 scales when quantized, else ``dtype``."""
        if self.quant is not None:
            return {"gate_up": Q.FP8, "gate_up_scale": torch.float32, "down": Q.FP8, "down_scale": torch.float32}
        return dict.fromkeys(self.shapes, self.dtype)

    @property
    def storage_dtype(self) -> torch.dtype:
        """The element type of a slot's flat buffer: bytes when quantized, else ``dtype``."""
        return torch.uint8 if self.quant is not None else self.dtype

    def _layout(self) -> dict[str, tuple[int, int]]:
        """(offset, length) of each tensor in the flat buffer, in elements of ``storage_dtype``."""
        out, off = {}, 0
        for name, shape in self.shapes.items():
            n = _numel(shape)
            if self.quant is not None:
                n *= torch.empty((), dtype=self.tensor_dtypes[name]).element_size()
                off = -(-off // ALIGN) * ALIGN
            out[name] = (off, n)
            off += n
        return out

    @property
    def numel(self) -> int:
        """Elements of ``storage_dtype`` in one expert's flat buffer (all tensors; bytes, padded
        to 16, when quantized)."""
        off, n = list(self._layout().values())[-1]
        total = off + n
        return -(-total // ALIGN) * ALIGN if self.quant is not None else total

    @property
    def nbytes(self) -> int:
        """Bytes of one expert's weights (and scales): what moving one slot costs."""
        return self.numel * torch.empty((), dtype=self.storage_dtype).element_size()

    def canonical(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One expert's tensors as this spec holds them: FP8 experts read from a checkpoint pass
        as they are; unquantized ones are quantized per this spec's blocks (``--quantization
        fp8``) or cast to ``dtype``."""
        if self.quant is None:
            return {k: tensors[k].to(self.dtype) for k in self.shapes}
        if "gate_up_scale" in tensors:
            return {k: tensors[k] for k in self.shapes}
        i = self.intermediate_size
        gate, up = tensors["gate_up"][:, :i], tensors["gate_up"][:, i:]
        (gc, gs), (uc, us) = Q.quantize(gate, self.quant.gate_up_block), Q.quantize(up, self.quant.gate_up_block)
        dc, ds = Q.quantize(tensors["down"], self.quant.down_block)
        return {
            "gate_up": torch.cat([gc, uc], 1),
            "gate_up_scale": torch.cat([gs, us], 1),
            "down": dc,
            "down_scale": ds,
        }

    def canonical_stack(self, stacked: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``canonical`` of experts stacked on dim 0 ([N, ...] each)."""
        if self.quant is None or "gate_up_scale" in stacked:
            return self.canonical(stacked) if self.quant is None else {k: stacked[k] for k in self.shapes}
        per = [self.canonical({k: v[n] for k, v in stacked.items()}) for n in range(stacked["gate_up"].shape[0])]
        return {k: torch.stack([e[k] for e in per]) for k in self.shapes}

    def flat(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Pack one expert's canonical tensors into a 1-D buffer [numel] of ``storage_dtype``."""
        tensors = self.canonical(tensors)
        if self.quant is None:
            parts = []
            for name, shape in self.shapes.items():
                t = tensors[name]
                if tuple(t.shape) != shape:
                    raise ValueError(f"expert tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
                parts.append(t.reshape(-1).to(self.dtype))
            return torch.cat(parts)
        device = tensors["gate_up"].device
        out = torch.zeros(self.numel, dtype=torch.uint8, device=device)
        for name, (off, n) in self._layout().items():
            t = tensors[name]
            if tuple(t.shape) != self.shapes[name] or t.dtype != self.tensor_dtypes[name]:
                raise ValueError(
                    f"expert tensor {name!r} is {t.dtype} {tuple(t.shape)}, expected "
                    f"{self.tensor_dtypes[name]} {self.shapes[name]}"
                )
            if name in FP8_CODES:  # stored [N, K]: each output channel's inputs contiguous
                t = t.t()
            out[off : off + n] = t.contiguous().reshape(-1).view(torch.uint8)
        return out

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views into a buffer [..., numel] (one expert, or S experts stacked) by tensor name."""
        lead = flat.shape[:-1]
        out = {}
        for name, (off, n) in self._layout().items():
            part = flat[..., off : off + n]
            if self.quant is not None:
                part = part.view(self.tensor_dtypes[name])
            if self.quant is not None and name in FP8_CODES:  # [.., K, N] views of [.., N, K] bytes
                k, n_out = self.shapes[name]
                out[name] = part.view(*lead, n_out, k).transpose(-1, -2)
            else:
                out[name] = part.view(*lead, *self.shapes[name])
        return out

    def dense(self, w: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """One expert's (or a stack's) weights as dense tensors in ``dtype``: FP8 codes times
        their scales (``quant.dequantize``), unquantized ones as they are."""
        if self.quant is None:
            return w
        i = self.intermediate_size
        gb, db = self.quant.gate_up_block, self.quant.down_block
        if w["gate_up"].dim() == 3:  # [S, ...]: one expert at a time
            per = [self.dense({k: v[s] for k, v in w.items()}, dtype) for s in range(w["gate_up"].shape[0])]
            return {k: torch.stack([p[k] for p in per]) for k in ("gate_up", "down")}
        half = w["gate_up_scale"].shape[1] // 2
        gate = Q.dequantize(w["gate_up"][:, :i], w["gate_up_scale"][:, :half], gb, dtype)
        up = Q.dequantize(w["gate_up"][:, i:], w["gate_up_scale"][:, half:], gb, dtype)
        return {"gate_up": torch.cat([gate, up], 1), "down": Q.dequantize(w["down"], w["down_scale"], db, dtype)}


def activate(spec: ExpertSpec, gu: torch.Tensor) -> torch.Tensor:
    """The expert's activation of gate_up's output [n, 2I] (gate columns, then up) -> [n, I], op
    by op in gu's dtype (the rounding the Triton expert kernels reproduce)."""
    i = spec.intermediate_size
    gate, up = gu[:, :i], gu[:, i:]
    if spec.activation == "silu":
        return F.silu(gate) * up
    limit = spec.swiglu_limit
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * spec.swiglu_alpha))


def expert_forward(spec: ExpertSpec, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """Run one routed expert: x [n, H] -> [n, H], with w the expert's canonical tensors
    (FP8 ones dequantized to x's dtype first: weight-only)."""
    w = spec.dense(w, x.dtype)
    gu = x @ w["gate_up"]  # [n, 2I]
    if spec.has_bias:
        gu = gu + w["gate_up_bias"]
    h = activate(spec, gu)  # [n, I]
    y = h @ w["down"]  # [n, H]
    if spec.has_bias:
        y = y + w["down_bias"]
    return y


def grouped_expert_forward(
    spec: ExpertSpec,
    x: torch.Tensor,
    slot_of_row: torch.Tensor | None,
    weights: dict[str, torch.Tensor],
    counts: list[int] | None = None,
) -> torch.Tensor:
    """Run many experts over rows grouped by slot: a loop over slots, never over tokens.

    x:           [N, H] rows, sorted so that rows of the same slot are contiguous.
    slot_of_row: LongTensor [N], which slot (0 .. S-1, index into ``weights``) each row goes to,
                 non-decreasing; None when ``counts`` are given.
    weights:     canonical tensors stacked over slots, e.g. gate_up [S, H, 2I].
    counts:      rows per slot (length S) if the caller already has them on the host.
    returns      [N, H].
    """
    n_slots = weights["gate_up"].shape[0]
    if counts is None:
        assert slot_of_row is not None, "grouped_expert_forward needs slot_of_row or counts"
        counts = torch.bincount(slot_of_row, minlength=n_slots).tolist()
    out = torch.empty_like(x)
    start = 0
    for s, c in enumerate(counts):
        if c:
            out[start : start + c] = expert_forward(spec, x[start : start + c], {k: v[s] for k, v in weights.items()})
        start += c
    return out


class MoEBlock(Protocol):
    """The router side of one MoE layer (``moeserve.models.routing.MoEBlock``, for every family)."""

    def route(self, hidden: torch.Tensor) -> RoutingResult:
        """hidden [T, H] (the post-attention-norm MoE input) -> logical ids and weights [T, K]."""
        ...

    def shared(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The shared experts' output [T, H], or None when the family has none."""
        ...

    @property
    def shared_mlp(self):
        """The shared experts' SwiGLU, or None."""
        ...


class ExpertsBackend(Protocol):
    """Runs the routed experts of one MoE layer, in two phases.

    ``dispatch`` starts the work for ``hidden`` [T, H] (the post-norm MoE input) and returns an
    opaque handle; ``combine(handle)`` returns the routed output [T, H] (the sum over each
    token's K pairs, weights applied as ``routing.weights_on_input`` says). Between the two
    the caller computes the shared experts, which overlaps them with the exchange.
    """

    def dispatch(self, moe_layer: int, hidden: torch.Tensor, routing: RoutingResult): ...

    def combine(self, handle) -> torch.Tensor: ...


def apply_routed(spec: ExpertSpec, hidden: torch.Tensor, routing: RoutingResult, run_rows) -> torch.Tensor:
    """Reference semantics of one MoE layer's routed part, for any way of running the rows.

    hidden [T, H]; ``run_rows(rows [N, H], expert_ids [N]) -> [N, H]`` runs each row through
    its logical expert. Returns sum_k (w_k * E_k(x)) or sum_k E_k(w_k * x): [T, H].
    """
    t, k = routing.ids.shape
    rows = hidden.repeat_interleave(k, dim=0)  # [T*K, H], (token, k) flat order
    w = routing.weights.reshape(-1, 1).to(hidden.dtype)  # [T*K, 1]
    if routing.weights_on_input:
        rows = rows * w
    out = run_rows(rows, routing.ids.reshape(-1))  # [T*K, H]
    return combine_pairs(out, routing)


def combine_pairs(out: torch.Tensor, routing: RoutingResult) -> torch.Tensor:
    """Sum each token's K expert outputs: out [T*K, H] in (token, k) order -> [T, H].

    With weights on the output (``not routing.weights_on_input``) the sum is weighted: one
    batched [1, K] x [K, H] product per token, or on CUDA with Triton one kernel that
    accumulates in fp32 in k order (cuBLAS's batched product of such thin matrices reads at a
    quarter of the memory bandwidth). Every backend (single process or distributed)
    combines through this function, so they round the same way in every dtype.
    """
    t, k = routing.ids.shape
    h = out.shape[-1]  # explicit H: -1 is ambiguous when T = 0
    if routing.weights_on_input:
        return out if k == 1 else out.view(t, k, h).sum(dim=1)
    w = routing.weights.to(out.dtype)
    if k == 1:
        return out * w
    if out.is_cuda and _triton():
        from moeserve import kernels  # fp32 accumulation in k order, one kernel

        return kernels.weighted_sum(out.contiguous(), w)
    return torch.bmm(w.view(t, 1, k), out.view(t, k, h)).view(t, h)


def _triton() -> bool:
    from moeserve import kernels

    return kernels.available()


class LocalExperts:
    """Single-process backend: every logical expert of every MoE layer held in this process.

    weights[moe_layer] maps a canonical tensor name to a tensor stacked over the E logical
    experts (gate_up [E, H, 2I], down [E, I, H], ...).
    """

    def __init__(self, spec: ExpertSpec, weights: list[dict[str, torch.Tensor]]):
        self.spec = spec
        self.weights = weights

    def run_rows(self, moe_layer: int, rows: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        order = torch.argsort(expert_ids, stable=True)  # [N] rows grouped by expert
        out_sorted = grouped_expert_forward(self.spec, rows[order], expert_ids[order], self.weights[moe_layer])
        out = torch.empty_like(out_sorted)
        out[order] = out_sorted
        return out

    def dispatch(self, moe_layer: int, hidden: torch.Tensor, routing: RoutingResult):
        return apply_routed(self.spec, hidden, routing, lambda r, e: self.run_rows(moe_layer, r, e))

    def combine(self, handle) -> torch.Tensor:
        return handle
