"""The direct exchange: rows written straight into peers' memory over NVLink, no host sync.

Dimension letters: T tokens of a router, K top-k, N = T*K pairs, P physical slots per MoE layer,
W workers, S = P / W slots per worker, R ranks of the world, H hidden, C receive capacity
(rows), B send capacity (pairs per router and step).

The collective exchange (``moeserve.dispatch.Exchange``) needs the split sizes on the host:
one synchronisation per MoE layer, then a row gather, the all-to-all, and an un-permute pass.
This exchange needs none of that. Every rank allocates the same buffers in torch's symmetric
memory (each rank can address every other rank's copy):

- ``counts`` int64 [R, P]: row r = pairs router r sends to each slot this layer;
- ``rows`` [C, H] and ``meta`` int64 [C]: rows received by this worker, slot-major (slot 0
  of this worker from router 0, router 1, ..., then slot 1 ...), and for each row its return
  address ``router * B + pair``;
- ``out`` [B, H]: the expert outputs of this router's pairs, in (token, k) order.

One MoE layer, identical on every rank (docs/dataplane.md, "Direct exchange"):

1. each router writes its slot counts into row [rank] of every rank's ``counts``; barrier;
2. every rank derives, on the device, where each of its rows lands: destination slot s of
   worker w starts at the rows of w's slots before s, plus the rows earlier routers send to s;
   a worker derives its per-slot offsets for the grouped matmul the same way;
3. a router's ``scatter_rows`` kernel reads each token's row (scaled when the weights scale
   the input) and stores it, with its return address, into the destination's ``rows``; barrier;
4. a worker runs its slots on its ``rows`` (grouped matmul with device-side offsets) and
   ``return_rows`` stores each output row at its return address in the router's ``out``;
   barrier; the router combines ``out`` over k.

The barriers (torch symmetric memory's, release/acquire at system scope) also order buffer
reuse: a peer writes a buffer of layer l+1 only after the barrier that follows every read of
layer l. A dead peer stalls a barrier until its timeout, which traps the kernel: the rank dies
and the launcher tears the cluster down, as with a collective timeout.

Capacity: B = max_num_batched_tokens x K per router; C = routers x B (all routers may pick one
worker). Buffers are allocated once at start.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeserve import kernels
from moeserve.dispatch import Topology, count
from moeserve.models.moe import RoutingResult


def usable(device: torch.device) -> tuple[bool, str]:
    """Whether this process can run the direct exchange: (ok, reason when not)."""
    if device.type != "cuda":
        return False, "needs CUDA devices"
    if not kernels.available():
        return False, "needs Triton"
    try:
        import torch.distributed._symmetric_memory as symm_mem  # noqa: F401
    except Exception as e:                                              # pragma: no cover - build without it
        return False, f"torch has no symmetric memory: {e}"
    return True, ""


def positions(counts: torch.Tensor, rank: int, slots_sorted: torch.Tensor, topo: Topology
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Destination rank and row of each of this rank's sent rows.

    counts:       int64 [R, P], pairs each rank sends to each slot (all ranks' rows).
    slots_sorted: int64 [N], the slot of each sent row, non-decreasing.
    returns       (dest [N] world ranks, row [N] in the destination's receive buffer), where a
                  worker's buffer is slot-major and, inside a slot, ordered by sending rank.
    """
    w, s = topo.num_workers, topo.slots_per_worker
    total = counts.sum(0)                                                 # [P] rows per slot
    slot_base = (torch.cumsum(total.view(w, s), 1) - total.view(w, s)).reshape(-1)
    before = (torch.cumsum(counts, 0) - counts)[rank]                     # [P] from earlier ranks
    mine = counts[rank]
    my_start = torch.cumsum(mine, 0) - mine                               # [P] in my sorted order
    shift = slot_base + before - my_start                                 # [P]
    n = slots_sorted.numel()
    row = shift.index_select(0, slots_sorted) + torch.arange(n, device=slots_sorted.device)
    rank_of_slot = torch.as_tensor(topo.worker_ranks, device=counts.device).repeat_interleave(s)
    return rank_of_slot.index_select(0, slots_sorted), row


def worker_offsets(counts: torch.Tensor, worker: int, topo: Topology) -> torch.Tensor:
    """int32 [S]: cumulative rows per local slot of ``worker`` (its receive buffer's layout)."""
    s = topo.slots_per_worker
    return torch.cumsum(counts[:, worker * s:(worker + 1) * s].sum(0), 0).to(torch.int32)


@dataclass
class NvlinkHandle:
    moe_layer: int
    routing: RoutingResult | None
    pairs: int                      # N
    sent: torch.Tensor              # int64 [R*S] pairs sent per (rank, local slot), Exchange.slot_position order
    offs: torch.Tensor | None       # int32 [S] this worker's offsets (None: not a worker)


class NvlinkExchange:
    """The direct exchange of one world (see the module docstring). Same role as
    ``moeserve.dispatch.Exchange``; ``dispatch_rows`` / ``combine_rows`` / ``walk_layer`` are
    what the router backend and idle ranks call.

    pair_capacity: B, the most (token, k) pairs one router sends in a layer.
    """

    kind = "nvlink"

    def __init__(self, topo: Topology, rank: int, device: torch.device, hidden_size: int, dtype: torch.dtype,
                 pair_capacity: int, group=None, timeout_ms: int = 30_000):
        import torch.distributed._symmetric_memory as symm_mem
        self.topo = topo
        self.rank = rank
        self.device = torch.device(device)
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.pair_capacity = pair_capacity
        self.recv_capacity = topo.num_routers * pair_capacity
        self.timeout_ms = int(timeout_ms)
        self.router = topo.router_index(rank)
        self.worker = topo.worker_index(rank)
        group = group if group is not None else dist.group.WORLD
        r, p = topo.world_size, topo.num_slots

        def alloc(shape, dt):
            t = symm_mem.empty(shape, dtype=dt, device=self.device)
            return t, symm_mem.rendezvous(t, group)

        self.counts, self._h_counts = alloc((r, p), torch.long)
        self.rows, self._h_rows = alloc((self.recv_capacity, hidden_size), dtype)
        self.meta, self._h_meta = alloc((self.recv_capacity,), torch.long)
        self.out, self._h_out = alloc((pair_capacity, hidden_size), dtype)
        self.counts.zero_()
        self._peer_counts = [self._h_counts.get_buffer(d, (r, p), torch.long, 0) for d in range(r)]

        def table(h, shape, dt):
            return torch.tensor([h.get_buffer(d, shape, dt, 0).data_ptr() for d in range(r)],
                                dtype=torch.long, device=self.device)

        self.rows_table = table(self._h_rows, (self.recv_capacity, hidden_size), dtype)
        self.meta_table = table(self._h_meta, (self.recv_capacity,), torch.long)
        self.out_table = table(self._h_out, (pair_capacity, hidden_size), dtype)
        slot = torch.arange(p)
        rank_of_slot = torch.tensor(topo.worker_ranks)[slot // topo.slots_per_worker]
        self.slot_position = (rank_of_slot * topo.slots_per_worker + slot % topo.slots_per_worker).to(self.device)
        self._zeros = torch.zeros(p, dtype=torch.long, device=self.device)
        self._barrier()                                       # every rank's counts are zero

    def _barrier(self) -> None:
        self._h_counts.barrier(channel=0, timeout_ms=self.timeout_ms)

    def _publish(self, c: torch.Tensor) -> None:
        """Step 1: this router's counts [P] into row [rank] of every rank's counts, then barrier."""
        if self.router is not None:
            for peer in self._peer_counts:
                peer[self.rank].copy_(c)
        self._barrier()

    def _worker_offsets(self) -> torch.Tensor | None:
        return worker_offsets(self.counts, self.worker, self.topo) if self.worker is not None else None

    def dispatch_rows(self, moe_layer: int, hidden: torch.Tensor, routing: RoutingResult,
                      slots: torch.Tensor) -> NvlinkHandle:
        """Send the rows of a router's pairs (slots [N] in flat (token, k) order) to their slots."""
        t, k = routing.ids.shape
        n = slots.numel()
        if n > self.pair_capacity:
            raise ValueError(f"{n} (token, k) pairs in one MoE layer exceed the exchange's capacity of "
                             f"{self.pair_capacity} (max_num_batched_tokens x top-k)")
        c = count(slots, self.topo.num_slots)                                        # [P]
        self._publish(c)
        offs = self._worker_offsets()
        slots_sorted, order = torch.sort(slots, stable=True)
        dest, row = positions(self.counts, self.rank, slots_sorted, self.topo)
        scale = routing.weights.reshape(-1).to(hidden.dtype).contiguous() if routing.weights_on_input else None
        kernels.scatter_rows(hidden.contiguous(), order, k, scale, dest, row, self.rows_table, self.meta_table,
                             self.rank * self.pair_capacity)
        self._barrier()
        sent = torch.zeros(self.topo.world_size * self.topo.slots_per_worker, dtype=torch.long,
                           device=self.device).index_copy_(0, self.slot_position, c)
        return NvlinkHandle(moe_layer, routing, n, sent, offs)

    def _serve(self, moe_layer: int, offs: torch.Tensor | None, store) -> None:
        """Step 4 on a worker: run its slots and return the outputs; then barrier."""
        if offs is not None:
            if store is None:
                raise RuntimeError(f"rank {self.rank} is a worker but has no expert store")
            total = offs[-1:]
            y = store.compute_slot_major(moe_layer, self.rows, offs, total)           # [C, H]
            kernels.return_rows(y, self.meta, total, self.out_table, self.pair_capacity)
        self._barrier()

    def combine_rows(self, handle: NvlinkHandle, store) -> torch.Tensor:
        """The outputs of the router's pairs, [N, H] in (token, k) order: a view of this rank's
        output buffer, valid until the next layer's combine (use it before dispatching again)."""
        self._serve(handle.moe_layer, handle.offs, store)
        return self.out[:handle.pairs]

    def walk_layer(self, moe_layer: int, store, hidden_size: int = 0, dtype: torch.dtype | None = None) -> None:
        """Take part in one MoE layer with no rows of one's own (idle router, or worker)."""
        self._publish(self._zeros)
        offs = self._worker_offsets()
        self._barrier()
        self._serve(moe_layer, offs, store)
