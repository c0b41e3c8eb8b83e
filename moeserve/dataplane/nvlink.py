"""The direct exchange: rows written straight into peers' memory over NVLink, no host sync.

Dimension letters: T tokens of a router, K top-k, N = T*K pairs, P physical slots per MoE layer,
W workers, S = P / W slots per worker, R ranks of the world, H hidden, C receive capacity
(rows), B send capacity (pairs per router and step).

The collective exchange (``moeserve.dataplane.collective.CollectiveExchange``) needs the split sizes on the host:
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
layer l. A dead peer stalls a barrier until its timeout, where torch's barrier kernel fails a
device-side assertion: the rank dies and the launcher tears the cluster down, as with a
collective timeout (not yet exercised on GPUs: the kill test runs on gloo).

Each half of a layer (steps 1-3; step 4) launches only kernels and reads nothing back, so it
is captured into a CUDA graph at its second use and replayed afterwards (``graphs``).

Capacity: B = max_num_batched_tokens x K per router; C = routers x B (all routers may pick one
worker). Buffers are allocated once at start.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeserve import kernels
from moeserve.dataplane.exchange import Topology
from moeserve.kernels import cudagraph
from moeserve.models.moe import RoutingResult


def usable(device: torch.device) -> tuple[bool, str]:
    """Whether this process can run the direct exchange: (ok, reason when not)."""
    if device.type != "cuda":
        return False, "needs CUDA devices"
    if not kernels.available():
        return False, "needs Triton"
    try:
        import torch.distributed._symmetric_memory as symm_mem  # noqa: F401
    except Exception as e:  # pragma: no cover - build without it
        return False, f"torch has no symmetric memory: {e}"
    return True, ""


def positions(
    counts: torch.Tensor, rank: int, slots_sorted: torch.Tensor, topo: Topology
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference (torch) of where this rank's sent rows land; the kernels compute the same.

    counts:       int64 [R, P], pairs each rank sends to each slot (all ranks' rows).
    slots_sorted: int64 [N], the slot of each sent row, non-decreasing.
    returns       (dest [N] world ranks, row [N] in the destination's receive buffer), where a
                  worker's buffer is slot-major and, inside a slot, ordered by sending rank.
    """
    w, s = topo.num_workers, topo.slots_per_worker
    total = counts.sum(0)  # [P] rows per slot
    slot_base = (torch.cumsum(total.view(w, s), 1) - total.view(w, s)).reshape(-1)
    before = (torch.cumsum(counts, 0) - counts)[rank]  # [P] from earlier ranks
    mine = counts[rank]
    my_start = torch.cumsum(mine, 0) - mine  # [P] in my sorted order
    shift = slot_base + before - my_start  # [P]
    n = slots_sorted.numel()
    row = shift.index_select(0, slots_sorted) + torch.arange(n, device=slots_sorted.device)
    rank_of_slot = torch.as_tensor(topo.worker_ranks, device=counts.device).repeat_interleave(s)
    return rank_of_slot.index_select(0, slots_sorted), row


def worker_offsets(counts: torch.Tensor, worker: int, topo: Topology) -> torch.Tensor:
    """Reference: int32 [S], cumulative rows per local slot of ``worker`` (its buffer's layout)."""
    s = topo.slots_per_worker
    return torch.cumsum(counts[:, worker * s : (worker + 1) * s].sum(0), 0).to(torch.int32)


def _route(ex, args: torch.Tensor, maps, layer: int, single: bool, breakeven) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.route`` of a router of exchange ``ex`` for MoE layer ``layer`` of ``maps``."""
    topo = ex.topo
    return kernels.route(
        args,
        maps.log2phy[layer],
        maps.logcnt[layer],
        topo.num_slots,
        single,
        ex.top_k,
        ex.pair_capacity,
        breakeven,
        ex.router,
        topo.num_routers,
    )


def _scatter(ex, args, scaled: bool, slots, prefix, shift, rows_table, meta_table) -> None:
    """``kernels.scatter_pairs`` of a router of exchange ``ex`` into the receive buffers of
    ``rows_table`` / ``meta_table`` (its return addresses start at rank x B)."""
    kernels.scatter_pairs(
        args,
        ex.dtype,
        ex.hidden_size,
        ex.top_k,
        scaled,
        slots,
        prefix,
        shift,
        ex.topo.slots_per_worker,
        ex.worker_base,
        rows_table,
        meta_table,
        ex.rank * ex.pair_capacity,
    )


@dataclass
class NvlinkHandle:
    moe_layer: int
    routing: RoutingResult | None
    pairs: int  # N
    keep: tuple  # the tensors the kernels read (kept alive until combine)


class NvlinkExchange:
    """The direct exchange of one world (see the module docstring). Same role as
    ``moeserve.dataplane.collective.CollectiveExchange``; ``dispatch`` / ``combine_rows`` / ``walk_layer`` are
    what the router backend and idle ranks call.

    pair_capacity: B, the most (token, k) pairs one router sends in a layer; top_k: K.
    graphs: on CUDA, each layer's two halves (route ... rows sent; experts ... outputs back) are
    captured into CUDA graphs at their second use and replayed afterwards: every shape in them
    is fixed by the capacities, and what changes per step (the tensors' addresses, N, the
    replica offset) is read from a small device table. A MoE layer then costs the host two
    graph replays and one 40-byte copy instead of ~10 kernel launches. A store whose compute
    reads counts back to the host (fp32, biases: ``capturable`` false) runs eagerly.
    """

    kind = "nvlink"

    def __init__(
        self,
        topo: Topology,
        rank: int,
        device: torch.device,
        hidden_size: int,
        dtype: torch.dtype,
        pair_capacity: int,
        top_k: int,
        group=None,
        timeout_ms: int = 30_000,
        graphs: bool = True,
    ):
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

        def table(h, shape, dt):
            return torch.tensor(
                [h.get_buffer(d, shape, dt, 0).data_ptr() for d in range(r)], dtype=torch.long, device=self.device
            )

        self.counts_table = table(self._h_counts, (r, p), torch.long)
        self.rows_table = table(self._h_rows, (self.recv_capacity, hidden_size), dtype)
        self.meta_table = table(self._h_meta, (self.recv_capacity,), torch.long)
        self.out_table = table(self._h_out, (pair_capacity, hidden_size), dtype)
        if list(topo.worker_ranks) != list(range(topo.worker_ranks[0], topo.worker_ranks[0] + topo.num_workers)):
            raise ValueError(f"worker ranks must be consecutive, got {topo.worker_ranks}")
        self.worker_base = topo.worker_ranks[0]
        self.slot_position = topo.slot_positions().to(self.device)  # as Exchange's (take_load reads it)
        # Sort keys: the narrowest integer type that holds every slot (fewer radix-sort passes).
        self.shift = torch.zeros(p, dtype=torch.long, device=self.device)  # [P]
        self.offs = torch.zeros(max(topo.slots_per_worker, 1), dtype=torch.int32, device=self.device)  # [S]
        self.top_k = top_k
        self.args = torch.zeros(5, dtype=torch.long, device=self.device)  # pair_args, on the device
        self._scratch_sent = torch.zeros(p, dtype=torch.long, device=self.device)
        self._scaled = False
        self.graphs = graphs and self.device.type == "cuda"
        self._graphs: dict = {}  # key -> (CUDAGraph, tensors kept alive)
        self._seen: dict = {}  # key -> tensors kept alive (first, eager use)
        self._pool: torch.cuda._POOL_HANDLE | None = None
        self._in_flight = False
        # Whole-step graphs (moeserve.router.graphs): per MoE layer a device row like ``args``
        # whose addresses are written inside the capture and whose N and offset are set before
        # each replay (``set_step_args``); ``valid_pairs`` caps N when a padded batch runs eagerly.
        self.step_args: torch.Tensor | None = None
        self.valid_pairs: int | None = None
        self.out.zero_()  # rows of padded pairs are read, never used
        self._barrier()  # every rank's counts are zero

    def warm_up_kernels(self, maps, num_moe_layers: int) -> int:
        """Compile, before the rank is ready, every kernel a MoE layer of this exchange launches
        (route and its expert count, publish, prep, scatter, return), at each launch
        configuration a layer can reach: the replica rule with and without replicas and
        break-even counts when steps run eagerly (graphs always take the general rule), inputs
        scaled by the weights or not. On this rank's own scratch copies of the shared buffers,
        with arguments of N = 0 pairs: nothing is read past them, nothing reaches a peer, no
        barrier is passed. The kernels leave the per-step and per-layer inputs unspecialized on
        alignment (``moeserve.kernels.triton_exchange``), so these keys are the serving keys
        (tests/test_triton_specialization.py). ``maps``: this router's RouterMaps (None on a
        worker alone). Returns the launches."""
        dev, r, p = self.device, self.topo.world_size, self.topo.num_slots
        args = kernels.pair_args(None, None, None, 0, 0).to(dev)
        counts = torch.zeros(r, p, dtype=torch.long, device=dev)
        rows = torch.zeros(1, self.hidden_size, dtype=self.dtype, device=dev)
        meta = torch.zeros(1, dtype=torch.long, device=dev)

        def table(t):  # every "peer" is this scratch
            return torch.full((r,), t.data_ptr(), dtype=torch.long, device=dev)

        counts_table, rows_table, meta_table = table(counts), table(rows), table(meta)
        shift, offs = torch.zeros_like(self.shift), torch.zeros_like(self.offs)
        sent = torch.zeros(p, dtype=torch.long, device=dev)
        launches = 0
        if self.router is not None and maps is not None:
            for layer in range(num_moe_layers):
                if self.graphs:
                    rules = [(False, maps.route_breakeven(layer, always=True))]
                else:
                    rules = [(single, b) for single in (True, False) for b in (None, maps.breakeven[layer])]
                for single, b in rules:
                    slots, hist = _route(self, args, maps, layer, single, b)
                    prefix = torch.empty_like(hist)
                    kernels.publish(args, hist, prefix, counts_table, self.rank, sent, p)
                    launches += 2
                    for scaled in (False, True):
                        _scatter(self, args, scaled, slots, prefix, shift, rows_table, meta_table)
                        launches += 1
        kernels.prep(counts, self.rank, -1 if self.worker is None else self.worker, self.topo.num_workers, shift, offs)
        launches += 1
        if self.worker is not None:
            kernels.return_rows(rows, meta, offs[-1:], table(rows), self.pair_capacity)
            launches += 1
        return launches

    def _barrier(self) -> None:
        # One rank (router and worker in one process): its own stream orders its kernels, and a
        # barrier would be a launch of a kernel that waits for no one (3 per MoE layer).
        if self.topo.world_size > 1:
            self._h_counts.barrier(channel=0, timeout_ms=self.timeout_ms)

    def _run(self, key, body, capturable: bool = True, keep: tuple = ()) -> None:
        """Run ``body`` (kernel launches only, no host reads): eagerly the first time (which also
        compiles its kernels), captured into a CUDA graph and replayed the second time, replayed
        afterwards. ``key`` names everything the body bakes in (layer, flags, the addresses of
        tensors it reads that this exchange does not own); ``keep`` holds those tensors, so that
        no address in a key can be freed and reused while its graph exists."""
        if not (self.graphs and capturable) or torch.cuda.is_current_stream_capturing():
            body()  # (inside a whole-step capture: recorded into that graph)
            return
        entry = self._graphs.get(key)
        if entry is None:
            if key not in self._seen:
                self._seen[key] = keep
                body()
                return
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            g = torch.cuda.CUDAGraph()
            # Graphs share one pool (nothing escapes them); thread_local: the NCCL watchdog thread's
            # event queries must not invalidate the capture.
            with cudagraph.capture(g, pool=self._pool, capture_error_mode="thread_local"):
                body()
            entry = self._graphs[key] = (g, keep)
        entry[0].replay()

    def reset_graphs(self) -> None:
        """Drop every captured graph (and the tensors they kept alive); the next uses capture anew."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._graphs.clear()
        self._seen.clear()

    def prepare_step_graphs(self, num_moe_layers: int) -> None:
        """Allocate the per-layer argument rows a whole-step CUDA graph reads (before capturing)."""
        if self.step_args is None or self.step_args.shape[0] < num_moe_layers:
            self.step_args = torch.zeros(num_moe_layers, 5, dtype=torch.long, device=self.device)

    def _set_args(self, host: torch.Tensor) -> None:
        """Copy a layer's pair_args [5] into the device table without a host sync: a pageable
        copy would wait for every kernel enqueued before it, once per MoE layer of an eager step."""
        if self.args.is_cuda:
            host = host.pin_memory()
        self.args.copy_(host, non_blocking=self.args.is_cuda)

    def set_step_args(self, pairs: int, offset: int) -> None:
        """N (the valid pairs) and the replica offset of the next whole-step graph replay."""
        # from pinned memory, without a sync: the host must not wait here for the steps enqueued
        # before (asynchronous steps); the caching host allocator keeps the buffer until the copy ran
        step_args = self.step_args
        assert step_args is not None  # prepare_step_graphs ran before the capture
        args = torch.tensor([[pairs, offset]], dtype=torch.long)
        if step_args.is_cuda:
            args = args.pin_memory().to(step_args.device, non_blocking=True)
        step_args[:, 3:].copy_(args.expand(step_args.shape[0], 2))

    def _send_half(
        self, moe_layer: int, maps, single: bool, scaled: bool, sent: torch.Tensor, args: torch.Tensor | None = None
    ) -> None:
        """Steps 1-3: publish this router's counts, barrier, layout, rows, barrier (any rank)."""
        args = self.args if args is None else args

        def body():
            if self.router is not None:
                slots, hist = _route(
                    self, args, maps, moe_layer, single, maps.route_breakeven(moe_layer, always=self.graphs)
                )
                prefix = torch.empty_like(hist)
                kernels.publish(args, hist, prefix, self.counts_table, self.rank, sent, self.topo.num_slots)
            self._barrier()
            kernels.prep(
                self.counts,
                self.rank,
                -1 if self.worker is None else self.worker,
                self.topo.num_workers,
                self.shift,
                self.offs,
            )
            if self.router is not None:
                _scatter(self, args, scaled, slots, prefix, self.shift, self.rows_table, self.meta_table)
            self._barrier()

        tables = (maps.log2phy, maps.logcnt) if maps is not None else ()
        self._run(
            ("send", moe_layer, single, scaled, sent.data_ptr(), *(t.data_ptr() for t in tables)),
            body,
            keep=(sent, *tables),
        )

    def sent_slice(self, sent_row: torch.Tensor) -> torch.Tensor:
        """The part [P] of a router's per-(rank, local slot) counts [R*S] that holds the slots
        (workers are consecutive ranks, so it is one contiguous range)."""
        s0 = self.worker_base * self.topo.slots_per_worker
        return sent_row[s0 : s0 + self.topo.num_slots]

    def dispatch(
        self, moe_layer: int, hidden: torch.Tensor, routing: RoutingResult, maps, offset: int, sent_row: torch.Tensor
    ) -> NvlinkHandle:
        """Route and send a router's pairs: slot choice by the replica rule of ``maps``
        (``RouterMaps``) for ``routing.ids`` [T, K] with ``offset`` (router + step), the counts,
        the layout and the rows. Adds the pairs sent per slot to ``sent_row`` [R*S] (on the device)."""
        if self._in_flight:
            raise RuntimeError("dispatch called twice without combine: one MoE layer at a time")
        t, k = routing.ids.shape
        n = t * k
        if n > self.pair_capacity:
            raise ValueError(
                f"{n} (token, k) pairs in one MoE layer exceed the exchange's capacity of "
                f"{self.pair_capacity} (max_num_batched_tokens x top-k)"
            )
        if k != self.top_k or hidden.dtype != self.dtype or hidden.shape[1] != self.hidden_size:
            raise ValueError(
                f"dispatch of [T, {hidden.shape[1]}] {hidden.dtype} rows with top-{k}: this exchange "
                f"was built for [T, {self.hidden_size}] {self.dtype} with top-{self.top_k}"
            )
        x = hidden.contiguous()
        if x.data_ptr() % 16:  # the kernels assume 16-byte aligned rows' base
            x = x.clone()
        ids = routing.ids.contiguous()
        scaled = bool(routing.weights_on_input)
        w = routing.weights.reshape(-1).to(self.dtype).contiguous() if scaled else None
        args = None
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # A whole-step capture: this layer's row of step_args gets the addresses (fills
            # recorded in the graph); N and the offset are set before each replay.
            assert self.step_args is not None  # prepare_step_graphs ran before the capture
            args = self.step_args[moe_layer]
            for i, a in enumerate((x, ids, w)):
                args[i].fill_(0 if a is None else a.data_ptr())
        else:
            valid = n if self.valid_pairs is None else min(n, self.valid_pairs)
            self._set_args(kernels.pair_args(x, ids, w, valid, offset))  # read by the kernels, graphs too
        self._scaled = scaled
        # In graphs the general replica rule always runs (logcnt 1 gives replica 0): a commit that
        # changes whether a layer has replicas must not force a new capture mid-migration.
        single = bool(maps.single[moe_layer]) and not self.graphs
        self._send_half(moe_layer, maps, single, scaled, self.sent_slice(sent_row), args)
        self._in_flight = True
        # The tensors the kernels read stay referenced until the layer is combined.
        return NvlinkHandle(moe_layer, routing, n, (x, ids, w))

    def _serve(self, moe_layer: int, store) -> None:
        """Step 4 on a worker: run its slots and return the outputs; then barrier (any rank)."""
        if self.worker is not None and store is None:
            raise RuntimeError(f"rank {self.rank} is a worker but has no expert store")

        def body():
            if self.worker is not None:
                total = self.offs[-1:]
                y = store.compute_slot_major(moe_layer, self.rows, self.offs, total)  # [C, H]
                kernels.return_rows(y, self.meta, total, self.out_table, self.pair_capacity)
            self._barrier()

        self._run(
            ("serve", moe_layer, id(store), getattr(store, "kernel_key", 0)),
            body,
            capturable=self.worker is None or getattr(store, "capturable", False),
            keep=(store,),
        )

    def combine_rows(self, handle: NvlinkHandle, store) -> torch.Tensor:
        """The outputs of the router's pairs, [N, H] in (token, k) order: a view of this rank's
        output buffer, valid until the next layer's combine (use it before dispatching again)."""
        self._serve(handle.moe_layer, store)
        self._in_flight = False
        return self.out[: handle.pairs]

    def walk_layer(
        self, moe_layer: int, store, hidden_size: int = 0, dtype: torch.dtype | None = None, maps=None
    ) -> None:
        """Take part in one MoE layer with no rows of one's own (idle router, or worker). An
        idle router publishes zero counts (``maps``: its RouterMaps; the tables are not read)."""
        self._set_args(kernels.pair_args(None, None, None, 0, 0))
        if self.router is not None and maps is None:
            raise ValueError("an idle router's walk needs its RouterMaps")
        single = bool(maps.single[moe_layer]) and not self.graphs if maps is not None else True
        self._send_half(moe_layer, maps, single, self._scaled, self._scratch_sent)
        self._serve(moe_layer, store)
