"""The expert slots a worker holds, their staging for migrations, and the grouped expert run.

Dimension letters: L MoE layers, S slots on this worker (P / W), M staging entries, R ranks,
m rows received in a layer, H hidden, n = ExpertSpec.numel elements of one expert (of
``ExpertSpec.storage_dtype``: the compute dtype, or bytes for FP8 experts, whose codes and
scales share one row).

Per MoE layer the weights of the S slots are one buffer [S, n] (an expert's canonical tensors
packed by ``ExpertSpec.flat``), so that moving a slot is moving one row of it. Staging is one
buffer [M, n], sized for the largest inflow into this worker of one MoE layer; a layer's
moves land there and a commit copies them into place, which keeps every slot serving its old
expert until the whole layer switches.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from moeserve.dataplane.exchange import RecvCounts, slot_major_index
from moeserve.models.moe import ExpertSpec, activate, grouped_expert_forward
from moeserve.ops.profiling import span


class ExpertStore:
    """The S slots of every MoE layer on one worker.

    spec:      how an expert computes and the size of its weights.
    logical:   int array [L, S], the logical expert each slot holds (the worker's share of
               the placement's phy2log).
    buffers:   one tensor [S, n] per MoE layer.
    """

    def __init__(
        self,
        spec: ExpertSpec,
        worker: int,
        buffers: list[torch.Tensor],
        logical: np.ndarray,
        max_staging_bytes: int = 0,
        num_workers: int = 1,
    ):
        self.spec = spec
        self.max_staging_bytes = max_staging_bytes  # 0: no limit but the device's memory
        self.worker = worker
        self.buffers = buffers
        self.logical = np.array(logical, dtype=np.int64)  # [L, S]
        self.slots_per_worker = self.logical.shape[1]
        self.staging: torch.Tensor | None = None  # [M, n]
        self._views = [spec.views(b) for b in buffers]
        self.num_workers = num_workers
        self.block_m = 0  # set per step by set_step_pairs (0: torch._grouped_mm)
        expert_kernel_mode()  # a bad MOESERVE_EXPERT_KERNEL fails the start, not the first step
        if spec.quant is not None and spec.quant.act_quant:
            fp8_prefill_block_m()  # and a bad MOESERVE_FP8_PREFILL_BLOCK_M

    @classmethod
    def from_checkpoint(
        cls,
        reader,
        spec: ExpertSpec,
        worker: int,
        phy2log: np.ndarray,
        num_workers: int,
        device: torch.device | str = "cpu",
        max_staging_bytes: int = 0,
    ) -> ExpertStore:
        """Load this worker's slots straight from the checkpoint, by logical id.

        phy2log: int array [L, P]; this worker holds slots w*S .. (w+1)*S-1 of each layer.
        Several slots may hold the same logical expert; only those experts' bytes are read.
        """
        phy2log = np.asarray(phy2log, dtype=np.int64)
        s = phy2log.shape[1] // num_workers
        logical = phy2log[:, worker * s : (worker + 1) * s]  # [L, S]
        buffers = []
        for layer in range(logical.shape[0]):
            ids = logical[layer].tolist()
            uniq = sorted(set(ids))
            stacked = reader.read_experts(layer, uniq, dtype=spec.dtype)  # name -> [u, ...]
            buf = torch.empty(s, spec.numel, dtype=spec.storage_dtype, device=device)
            for i, e in enumerate(ids):
                j = uniq.index(e)
                buf[i] = spec.flat({k: v[j] for k, v in stacked.items()}).to(device)
            buffers.append(buf)
        return cls(spec, worker, buffers, logical, max_staging_bytes, num_workers)

    def resync(self, reader, phy2log: np.ndarray) -> int:
        """Make every slot hold what ``phy2log [L, P]`` says, reading from the checkpoint the
        experts of the slots that differ (after a lost peer, a commit may have reached some
        ranks and not others; the leader's placement in force is what counts). Drops staging.
        Returns the number of slots reloaded."""
        s0 = self.worker * self.slots_per_worker
        want = np.asarray(phy2log, dtype=np.int64)[:, s0 : s0 + self.slots_per_worker]  # [L, S]
        reloaded = 0
        for layer, slot in zip(*np.nonzero(want != self.logical)):
            one = reader.read_experts(int(layer), [int(want[layer, slot])], dtype=self.spec.dtype)
            self.buffers[layer][slot] = self.spec.flat({k: v[0] for k, v in one.items()}).to(self.buffers[layer].device)
            reloaded += 1
        self.logical = want.copy()
        self.staging = None
        return reloaded

    def weights(self, layer: int) -> dict[str, torch.Tensor]:
        """Canonical tensors of a layer's slots, stacked: gate_up [S, H, 2I], down [S, I, H]..."""
        return self._views[layer]

    def compute(self, layer: int, rows: torch.Tensor, received: RecvCounts) -> torch.Tensor:
        """Run the received rows through their slots' experts.

        rows:     [m, H] in the received layout: one block per source rank, and inside each
                  block the rows of slot 0, then slot 1, ... (the sender sorted them by slot).
        received: rows per (source rank, local slot) [R, S].
        returns   [m, H] expert outputs in the same layout.

        Rows from several sources are first regrouped by slot, so that each slot's weights
        are read once per layer: with large experts and few rows per slot the grouped matmul
        is bound by reading weights, not by the rows.
        """
        if rows.shape[0] == 0:
            return rows
        with span("expert_matmul"):
            return self._compute(layer, rows, received)

    def _compute(self, layer: int, rows: torch.Tensor, received: RecvCounts) -> torch.Tensor:
        host = received.host
        busy = np.flatnonzero(host.sum(1))  # source ranks that sent rows
        if busy.size == 1:  # one block: already grouped by slot
            r = int(busy[0])
            offs = torch.cumsum(received.device[r], 0).to(torch.int32) if rows.is_cuda else None
            return grouped_forward(self.spec, rows, self.weights(layer), host[r].tolist(), offs)
        index, per_slot, offs = slot_major_index(received)
        y = grouped_forward(self.spec, rows.index_select(0, index), self.weights(layer), per_slot, offs)
        return torch.empty_like(y).index_copy_(0, index, y)

    @property
    def capturable(self) -> bool:
        """Whether ``compute_slot_major`` runs without reading anything back to the host (so it
        can be captured in a CUDA graph): CUDA, bf16, torch._grouped_mm (biases and the clamped
        activation included); or FP8 experts through the Triton kernels."""
        if not self.buffers:
            return False
        device = self.buffers[0].device
        return grouped_mm_applies(self.spec, device, self.spec.dtype) or fp8_kernel_applies(self.spec, device)

    def scales(self, layer: int):
        """``kernels.ExpertScales`` of a layer's FP8 slots (None for unquantized experts)."""
        q = self.spec.quant
        if q is None:
            return None
        from moeserve import kernels

        w = self.weights(layer)
        return kernels.ExpertScales(w["gate_up_scale"], q.gate_up_block, w["down_scale"], q.down_block, q.act_quant)

    def compute_slot_major(
        self, layer: int, rows: torch.Tensor, offs: torch.Tensor, total: torch.Tensor
    ) -> torch.Tensor:
        """Run rows that arrived already grouped by slot (the direct exchange, ``moeserve.dataplane.nvlink``).

        rows:  [C, H], the receive buffer: rows 0 .. total-1 are slot-major, the rest unused.
        offs:  int32 [S] cumulative rows per slot, on the device; total: offs[-1:] (device [1]).
        returns [C, H]; rows past ``total`` are undefined.

        On CUDA with bf16 nothing is read back to the host: with few rows per slot
        (``set_step_pairs``) the two Triton kernels of ``moeserve.kernels.expert_mlp`` (silu
        fused into the first), else ``torch._grouped_mm`` twice with the activation kernel
        between; both take the device-side offsets. Otherwise the per-slot counts are read back
        (one synchronisation) and the slot loop runs.
        """
        with span("expert_matmul"):
            return self._compute_slot_major(layer, rows, offs, total)

    def set_step_pairs(self, pairs: int) -> None:
        """The step's (token, k) pairs over every router (known to every rank from the step
        header): with few rows per slot (decode) the slot-major compute takes the Triton kernels
        that stream each used expert's weights once (``moeserve.kernels.expert_mlp``), with many
        (prefill) ``torch._grouped_mm``. A speed choice only: both paths compute the same rows."""
        if not self.capturable:
            self.block_m = 0
        elif self.spec.quant is not None:  # FP8: the Triton kernels at every size (no FP8 grouped GEMM here)
            from moeserve import kernels

            slots = self.slots_per_worker * self.num_workers
            a8 = self.spec.quant.act_quant
            self.block_m = expert_block_m_for(pairs, slots, "triton", quantized=True, a8=a8) or kernels.EXPERT_MAX_BM
        else:
            self.block_m = expert_block_m_for(pairs, self.slots_per_worker * self.num_workers)

    def warm_up_kernels(self) -> list[int]:
        """Compile the Triton expert kernels for every rows-per-pass a step can pick, before
        serving (``kernels.warm_up_expert_mlp`` on layer 0's views: the same strides as every
        layer's). Returns the block sizes compiled; [] where a step never picks them (not CUDA
        bf16, ``MOESERVE_EXPERT_KERNEL=grouped_mm``, no Triton). Also the activation kernel
        between the two ``torch._grouped_mm`` of a step with many rows per slot (a prefill), where
        that path takes it (bf16 SwiGLU without biases)."""
        from moeserve import kernels

        w = self.weights(0)
        dev, spec = w["gate_up"].device, self.spec
        if (
            kernels.available()
            and grouped_mm_applies(spec, dev, spec.dtype)
            and not spec.has_bias
            and spec.activation == "silu"
        ):
            gu = torch.zeros(1, 2 * spec.intermediate_size, dtype=spec.dtype, device=dev)
            kernels.silu_mul(gu, torch.zeros(1, dtype=torch.int32, device=dev))  # total: offs[-1:], int32
        if not self.capturable or expert_block_m_for(1, 1) == 0:
            return []
        q = self.spec.quant
        prefill = q is not None and q.act_quant and fp8_prefill_block_m() > kernels.EXPERT_MAX_BM
        return kernels.warm_up_expert_mlp(
            w["gate_up"],
            w["down"],
            self.scales(0),
            self.spec.dtype,
            expert_act(self.spec, w),
            kernels.expert_block_ms(prefill=prefill),
        )

    @property
    def kernel_key(self) -> int:
        """What ``compute_slot_major`` bakes into a captured graph: 0 (``torch._grouped_mm``) or
        the Triton kernels' rows per pass."""
        return self.block_m

    def _compute_slot_major(
        self, layer: int, rows: torch.Tensor, offs: torch.Tensor, total: torch.Tensor
    ) -> torch.Tensor:
        spec = self.spec
        weights = self.weights(layer)
        if self.block_m and rows.is_cuda:
            from moeserve import kernels

            act = expert_act(spec, weights)
            return kernels.expert_mlp(
                rows, weights["gate_up"], weights["down"], offs, self.block_m, self.scales(layer), act
            )
        if grouped_mm_applies(spec, rows.device, rows.dtype):
            return grouped_mm_forward(spec, rows, weights, offs, total)
        ends = offs.cpu().numpy().astype(np.int64)
        per_slot = np.diff(ends, prepend=0).tolist()
        m = int(ends[-1]) if len(ends) else 0
        out = torch.empty_like(rows)
        if m:
            out[:m] = grouped_forward(spec, rows[:m], weights, per_slot)
        return out

    # -- migration -------------------------------------------------------------------------

    def begin_staging(self, entries: int) -> str | None:
        """Allocate staging for ``entries`` experts; returns an error message instead of raising
        (a failure must not break the step on this rank alone: the leader rolls back)."""
        self.staging = None
        if entries <= 0:
            return None
        need = entries * self.spec.nbytes
        if self.max_staging_bytes and need > self.max_staging_bytes:
            return (
                f"worker {self.worker}: staging for {entries} experts needs {need} bytes, over the "
                f"limit of {self.max_staging_bytes} bytes (max_staging_bytes)"
            )
        try:
            self.staging = torch.empty(
                entries, self.spec.numel, dtype=self.spec.storage_dtype, device=self.buffers[0].device
            )
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            return (
                f"worker {self.worker}: cannot allocate staging for {entries} experts "
                f"({entries * self.spec.nbytes} bytes): {e}"
            )
        return None

    def slot_row(self, layer: int, slot: int) -> torch.Tensor:
        """The flat weights [n] held in global ``slot`` (which must be on this worker)."""
        return self.buffers[layer][slot - self.worker * self.slots_per_worker]

    def commit(self, layer: int, staged: list[tuple[int, int]], phy2log_row) -> None:
        """Copy staged entries into their slots and record the layer's new logical ids."""
        s0 = self.worker * self.slots_per_worker
        for slot, entry in staged:
            local = slot - s0
            if 0 <= local < self.slots_per_worker:
                assert self.staging is not None  # entries staged here are in what begin_staging allocated
                self.buffers[layer][local].copy_(self.staging[entry])
        self.logical[layer] = np.asarray(phy2log_row, dtype=np.int64)[s0 : s0 + self.slots_per_worker]

    def end_staging(self) -> None:
        self.staging = None

    def digest(self) -> np.ndarray:
        """float64 [L, S, 2]: (sum, sum of squares) of each slot's weights, to check which
        expert a slot really holds."""
        out = np.zeros((len(self.buffers), self.slots_per_worker, 2))
        for layer, buf in enumerate(self.buffers):
            b = buf.double()
            out[layer, :, 0] = b.sum(1).cpu().numpy()
            out[layer, :, 1] = (b * b).sum(1).cpu().numpy()
        return out


EXPERT_KERNEL_MODES = ("auto", "triton", "grouped_mm")


def expert_kernel_mode() -> str:
    """``MOESERVE_EXPERT_KERNEL``: auto (default: the Triton kernels when a step has at most
    ``kernels.EXPERT_MAX_BM`` rows per slot on average, ``torch._grouped_mm`` above), triton
    (always, where they apply), grouped_mm (never)."""
    mode = os.environ.get("MOESERVE_EXPERT_KERNEL", "auto") or "auto"
    if mode not in EXPERT_KERNEL_MODES:
        raise ValueError(f"MOESERVE_EXPERT_KERNEL={mode!r}: choose one of {', '.join(EXPERT_KERNEL_MODES)}")
    return mode


@functools.cache
def expert_block_m_setting() -> int:
    """``MOESERVE_EXPERT_BLOCK_M``: auto (the default, 0 here: ``expert_block_m_for`` picks twice
    a slot's mean rows, as a power of two 16-64) or one of ``kernels.expert_block_ms()`` (a
    measurement switch: every step that takes the Triton kernels passes that many rows at a
    time, a slot with more taking more passes). Read once, at a worker's warm-up; anything else
    is refused by name."""
    from moeserve import kernels

    v = os.environ.get("MOESERVE_EXPERT_BLOCK_M", "auto") or "auto"
    allowed = kernels.expert_block_ms()
    if v == "auto":
        return 0
    if not v.isdigit() or int(v) not in allowed:
        raise ValueError(f"MOESERVE_EXPERT_BLOCK_M={v!r}: allowed auto or one of {', '.join(map(str, allowed))}")
    return int(v)


# FP8 experts at 17-32 rows per slot on average take 32-row passes, not 64: their codes are half
# the bytes, so a slot's second pass (its weights again, mostly from L2) costs less than the
# 64-row tiles lose. On an H100 at ERNIE's layer, 256 tokens (32 per slot): W8A8 0.403 against
# 0.476 ms uniform, 0.417 against 0.462 skewed, 0.218 against 0.210 with every token on the same
# 8 experts (results/expert-kernel-rows-per-pass-ernie-h100.json); ERNIE-28L's decode step 14.00
# against 14.51 ms (results/serving-ernie28-fp8-bm32-h100.json). At Scout's 16 rows per slot
# 16-row passes gained nothing end to end and lost 6-14 % per layer, so the rule stops at 32.
FP8_BLOCK_M_CAP = 32


@functools.cache
def fp8_prefill_block_m() -> int:
    """``MOESERVE_FP8_PREFILL_BLOCK_M``: the rows per pass of W8A8 expert steps with more than
    ``kernels.EXPERT_MAX_BM`` rows a slot on average (a prefill): 64 (the default: the decode
    tiles' largest pass) or ``kernels.FP8_PREFILL_BM`` (128-row passes on their own tiles, a
    measurement switch until a GPU shows them faster with every row bitwise the same as
    64-row passes'). Read once, at a worker's warm-up; anything else is refused by name."""
    from moeserve import kernels

    v = os.environ.get("MOESERVE_FP8_PREFILL_BLOCK_M", "") or str(kernels.EXPERT_MAX_BM)
    allowed = (kernels.EXPERT_MAX_BM, kernels.FP8_PREFILL_BM)
    if not v.isdigit() or int(v) not in allowed:
        raise ValueError(f"MOESERVE_FP8_PREFILL_BLOCK_M={v!r}: allowed {' or '.join(map(str, allowed))}")
    return int(v)


def w8a8_prefill_pass(rows_per_slot: int, a8: bool) -> int:
    """The rows per pass of W8A8 experts (``a8``) whose slots hold more than
    ``kernels.EXPERT_MAX_BM`` rows (a prefill: by the mean in the slot-major compute, the fullest
    slot in ``grouped_forward``): ``fp8_prefill_block_m()``; 0 where the decode rules apply."""
    from moeserve import kernels

    return fp8_prefill_block_m() if a8 and rows_per_slot > kernels.EXPERT_MAX_BM else 0


def expert_block_m_for(
    pairs: int, num_slots: int, mode: str | None = None, quantized: bool = False, a8: bool = False
) -> int:
    """The slot-major compute's kernel for a step of ``pairs`` (token, k) pairs over
    ``num_slots`` slots (every worker's), on CUDA in bf16 (``quantized``: FP8 codes; ``a8``:
    their rows quantized too, W8A8): the Triton kernels' rows per pass, or 0 for
    ``torch._grouped_mm``. ``mode``: ``expert_kernel_mode()`` when None. The balancer's
    step-time table is measured through the same choice (benchmarks/calibrate.py)."""
    from moeserve import kernels

    mode = expert_kernel_mode() if mode is None else mode
    if mode == "grouped_mm" or not kernels.available():
        return 0
    per_slot = -(-max(0, pairs) // max(1, num_slots))
    if mode != "triton" and per_slot > kernels.EXPERT_MAX_BM:
        return 0
    if setting := expert_block_m_setting():
        return setting
    if prefill := w8a8_prefill_pass(per_slot, quantized and a8):
        return prefill
    bm = kernels.expert_block_m(2 * per_slot)
    return min(bm, FP8_BLOCK_M_CAP) if quantized and per_slot <= FP8_BLOCK_M_CAP else bm


def fp8_kernel_applies(spec: ExpertSpec, device: torch.device) -> bool:
    """Whether FP8 experts of ``spec`` run through the Triton kernels (``kernels.expert_mlp``
    with scales): CUDA, Triton, a 16-bit compute dtype and scale blocks the kernel takes."""
    from moeserve import kernels

    q = spec.quant
    return (
        q is not None
        and device.type == "cuda"
        and spec.dtype in (torch.bfloat16, torch.float16)
        and kernels.available()
        and kernels.fp8_blocks_supported(spec.hidden_size, q.gate_up_block)
        and kernels.fp8_blocks_supported(spec.intermediate_size, q.down_block)
    )


def grouped_mm_applies(spec: ExpertSpec, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether rows of ``dtype`` on ``device`` run through ``torch._grouped_mm`` (one kernel per
    projection over all slots, with device-side offsets, so nothing is read back to the host).

    ``torch._grouped_mm`` is CUDA-only and, in the torch versions this runs on, only bf16 (biases
    are added around it: ``grouped_mm_forward``); anything else takes the slot loop.
    """
    return device.type == "cuda" and dtype == torch.bfloat16 and spec.quant is None and hasattr(torch, "_grouped_mm")


def grouped_forward(
    spec: ExpertSpec,
    x: torch.Tensor,
    weights: dict[str, torch.Tensor],
    per_slot: list[int],
    offs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows grouped by slot through their experts: x [m, H] slot-major, per_slot [S] -> [m, H].
    offs: int32 [S] cumulative rows per slot on x's device (computed from per_slot if None).

    On CUDA with bf16 this is two ``torch._grouped_mm`` calls (one kernel each over all slots);
    elsewhere a loop over slots (never over tokens).
    """
    if fp8_kernel_applies(spec, x.device) and x.dtype == spec.dtype:
        from moeserve import kernels

        if offs is None:
            offs = torch.tensor(np.cumsum(per_slot), dtype=torch.int32, device=x.device)
        q = spec.quant
        assert q is not None
        sc = kernels.ExpertScales(
            weights["gate_up_scale"], q.gate_up_block, weights["down_scale"], q.down_block, q.act_quant
        )
        most = max(per_slot, default=1)
        bm = w8a8_prefill_pass(most, q.act_quant) or kernels.expert_block_m(most)
        return kernels.expert_mlp(x, weights["gate_up"], weights["down"], offs, bm, sc)
    if grouped_mm_applies(spec, x.device, x.dtype):
        if offs is None:
            offs = torch.tensor(np.cumsum(per_slot), dtype=torch.int32, device=x.device)
        return grouped_mm_forward(spec, x, weights, offs)
    return grouped_expert_forward(spec, x, None, weights, counts=per_slot)


def grouped_mm_forward(
    spec: ExpertSpec,
    x: torch.Tensor,
    weights: dict[str, torch.Tensor],
    offs: torch.Tensor,
    total: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows grouped by slot through two ``torch._grouped_mm`` (device-side offsets, nothing read
    back): x [C, H] -> [C, H]. SwiGLU without biases takes the fused ``kernels.silu_mul`` (rows
    up to ``total`` [1]); biases (added per row, by its slot) and the clamped activation take
    the torch ops of ``moe.activate``, which round as the Triton kernels do."""
    gu = torch._grouped_mm(x, weights["gate_up"], offs=offs)  # [C, 2I]
    if not spec.has_bias and spec.activation == "silu":
        if total is None:
            i = spec.intermediate_size
            h = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]  # [C, I]
        else:
            from moeserve import kernels

            h = kernels.silu_mul(gu, total)  # [C, I]
        return torch._grouped_mm(h, weights["down"], offs=offs)  # [C, H]
    slot = None
    if spec.has_bias:  # each row's slot: the first whose inclusive cumulative count exceeds it
        rows = torch.arange(x.shape[0], device=x.device, dtype=offs.dtype)
        slot = torch.searchsorted(offs, rows, right=True).clamp_(max=offs.numel() - 1)  # [C]
        gu = gu + weights["gate_up_bias"].index_select(0, slot)
    y = torch._grouped_mm(activate(spec, gu), weights["down"], offs=offs)  # [C, H]
    if slot is not None:
        y = y + weights["down_bias"].index_select(0, slot)
    return y


def expert_act(spec: ExpertSpec, weights: dict[str, torch.Tensor]):
    """The ``kernels.ExpertAct`` of ``spec`` over a layer's slot views (their bias rows)."""
    from moeserve import kernels

    return kernels.ExpertAct(
        spec.activation,
        spec.swiglu_alpha,
        spec.swiglu_limit,
        weights.get("gate_up_bias") if spec.has_bias else None,
        weights.get("down_bias") if spec.has_bias else None,
    )
