"""The collective exchange: one MoE layer's rows over all-to-all collectives on the data group.

Dimension letters: T tokens on a router, K experts per token, N = T*K (token, k) pairs, E
logical experts, X replicas at most per logical expert, P physical slots per MoE layer, W
workers, S = P / W slots per worker, R ranks of the world (routers and workers), H hidden.

One MoE layer moves rows in three collectives on the data group, identical on every rank
(docs/dataplane.md, step 4): counts (int64 ``[R, S]``: rows for each slot of each
destination rank, zeros for ranks that hold no slots), dispatch (the rows, sorted by
destination slot), combine (the expert outputs, back along the reversed splits). Routers
need no expert ids on the wire: rows arrive sorted by slot and the counts say where each
slot's rows start. :class:`CollectiveExchange` runs that sequence for any rank, router, worker or
both; the router backend (``moeserve.router.dispatcher``) and the worker loop
(``moeserve.expert_worker.worker``) both drive it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from moeserve.dataplane.exchange import RecvCounts, Topology, choose_slots, count  # noqa: F401


@dataclass
class Pending:
    """An exchange in flight: :meth:`CollectiveExchange.start` -> :meth:`CollectiveExchange.send` -> :meth:`CollectiveExchange.finish`."""

    counts_work: dist.Work  # the counts collective's Work handle (async)
    counts: torch.Tensor  # LongTensor [2, R, S]: rows sent to / received from each rank, per slot
    work: dist.Work | None = None  # the dispatch collective's Work handle (async)
    recv_rows: torch.Tensor | None = None  # [sum(recv_splits), H] rows for this rank's slots
    received: RecvCounts | None = None
    send_splits: list[int] | None = None  # [R] rows this rank sent to each rank
    recv_splits: list[int] | None = None  # [R] rows this rank received from each rank


class CollectiveExchange:
    """The per-MoE-layer collective sequence on the data group (counts, dispatch, combine).

    Every rank of the world calls ``start``, ``send`` and ``finish`` once per MoE layer per
    forward step, in layer order, whatever its role: a rank with nothing to send passes zero
    rows. ``start`` only needs the rows per slot, so the counts travel while the caller
    gathers the rows themselves.
    """

    def __init__(self, topo: Topology, rank: int, group=None, device: torch.device | str = "cpu"):
        self.topo = topo
        self.rank = rank
        self.group = group
        self.device = torch.device(device)
        self.slot_position = topo.slot_positions().to(self.device)  # [P] into the flattened [R, S] counts
        self._side: torch.cuda.Stream | None = None  # CUDA: stream and pinned buffer for the counts' host read
        self._host: torch.Tensor | None = None

    def new_counts(self) -> torch.Tensor:
        """A zeroed LongTensor [2, R, S] for one layer: [0] what this rank sends to each slot
        of each rank (fill it, e.g. with ``count``), [1] what it will receive."""
        return torch.zeros(2, self.topo.world_size, self.topo.slots_per_worker, dtype=torch.long, device=self.device)

    def start(self, counts: torch.Tensor) -> Pending:
        """Start the counts exchange. counts: from ``new_counts`` with counts[0] filled: the rows
        this rank will send to each slot of each rank (its rows go out sorted by slot, so by
        destination); counts[1] receives the rows each rank sends to this rank's slots."""
        work = dist.all_to_all_single(counts[1], counts[0], group=self.group, async_op=True)
        return Pending(work, counts)

    def _counts_to_host(self, pending: Pending) -> np.ndarray:
        """The one host read of the layer: all_to_all needs its split sizes on the host. On
        CUDA the copy runs on a side stream that waits only for the counts collective, so the
        host does not also wait for the row gather queued on the compute stream."""
        if self.device.type != "cuda":
            pending.counts_work.wait()
            return pending.counts.numpy().copy()
        if self._side is None or self._host is None:  # (set together)
            self._side = torch.cuda.Stream(self.device)
            self._host = torch.empty(pending.counts.shape, dtype=torch.long, pin_memory=True)
        with torch.cuda.stream(self._side):
            pending.counts_work.wait()  # the side stream waits for the collective
            self._host.copy_(pending.counts, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._side)
        done.synchronize()
        return self._host.numpy().copy()

    def send(self, pending: Pending, send_rows: torch.Tensor) -> None:
        """Start the dispatch of ``send_rows`` [n, H] (sorted by slot, as given to start)."""
        both = self._counts_to_host(pending)  # [2, R, S] numpy
        pending.send_splits = both[0].sum(1).tolist()
        pending.recv_splits = both[1].sum(1).tolist()
        pending.received = RecvCounts(both[1], pending.counts[1])
        pending.recv_rows = send_rows.new_empty(sum(pending.recv_splits), send_rows.shape[1])
        pending.work = dist.all_to_all_single(
            pending.recv_rows, send_rows, pending.recv_splits, pending.send_splits, group=self.group, async_op=True
        )

    def finish(
        self, pending: Pending, compute: Callable[[torch.Tensor, RecvCounts], torch.Tensor] | None
    ) -> torch.Tensor:
        """Wait for the rows, run this rank's slots on them, and combine back.

        compute(rows [m, H], received: RecvCounts) -> [m, H], the expert outputs in the
        received layout; None on a rank that holds no slots (it must receive nothing).
        returns the outputs of the rows this rank sent, in its send order: [n, H].
        """
        work, rows, received, send_splits = pending.work, pending.recv_rows, pending.received, pending.send_splits
        assert work is not None and rows is not None and received is not None and send_splits is not None  # send()'s
        work.wait()
        if compute is not None:
            out = compute(rows, received)
        else:
            if rows.shape[0]:
                raise RuntimeError(f"rank {self.rank} holds no expert slots but received {rows.shape[0]} rows")
            out = rows
        back = out.new_empty(sum(send_splits), out.shape[1])
        dist.all_to_all_single(back, out, pending.send_splits, pending.recv_splits, group=self.group)
        return back

    # -- the row-level interface shared with moeserve.dataplane.nvlink.NvlinkExchange ----------------

    kind = "collective"

    def dispatch(
        self, moe_layer: int, hidden: torch.Tensor, routing, maps, offset: int, sent_row: torch.Tensor
    ) -> RowsHandle:
        """Send a router's rows: hidden [T, H], routing [T, K]; each pair's slot by the replica
        rule of ``maps`` (``RouterMaps``: its break-even counts included) with ``offset`` (router +
        step); this rank's router index and the number of routers make the rule's estimate of the
        step's count (docs/dataplane.md, "Replica choice"). Rows are sorted by slot
        (so by destination), scaled first when the weights scale the input, and start
        travelling; the counts go ahead of them. Adds the pairs sent per (rank, local slot) to
        ``sent_row`` [R*S]. The same call as ``NvlinkExchange.dispatch``."""
        slots = maps.slots_of(
            moe_layer, routing.ids, offset, self.topo.router_index(self.rank) or 0, self.topo.num_routers
        )  # [N]
        handle = _dispatch_rows(self, moe_layer, hidden, routing, slots)
        sent_row += handle.counts
        return handle

    def combine_rows(self, handle: RowsHandle, store) -> torch.Tensor:
        """Finish the layer (running this rank's slots when ``store`` is given) and return the
        outputs of the router's pairs, [N, H] in (token, k) order."""
        compute = None
        if store is not None:
            layer = handle.moe_layer
            compute = lambda rows, received: store.compute(layer, rows, received)  # noqa: E731
        back = self.finish(handle.pending, compute)  # [N, H] in sent order
        # Back to (token, k) order with a gather through the inverse permutation: a gather is
        # 2.6x faster than the equivalent scatter (index_copy_) on H200s (0.19 vs 0.50 ms for
        # 336 MB of bf16 rows).
        inverse = torch.empty_like(handle.order).scatter_(
            0, handle.order, torch.arange(handle.order.numel(), device=handle.order.device)
        )
        return back.index_select(0, inverse)

    def walk_layer(self, moe_layer: int, store, hidden_size: int, dtype: torch.dtype, maps=None) -> None:
        """Take part in one MoE layer with no rows of one's own (idle router, or worker); ``maps``
        is not needed here (the direct exchange's idle routers use it)."""
        pending = self.start(self.new_counts())
        self.send(pending, torch.empty(0, hidden_size, dtype=dtype, device=self.device))
        compute = None
        if store is not None:
            compute = lambda rows, received: store.compute(moe_layer, rows, received)  # noqa: E731
        self.finish(pending, compute)


@dataclass
class RowsHandle:
    """A router's rows in flight through the collective exchange (``CollectiveExchange.dispatch``)."""

    moe_layer: int
    pending: Pending
    order: torch.Tensor  # [N] pair index of each sent row (rows sorted by slot)
    counts: torch.Tensor  # int64 [R*S] pairs sent per (rank, local slot)


def _dispatch_rows(
    ex: CollectiveExchange, moe_layer: int, hidden: torch.Tensor, routing, slots: torch.Tensor
) -> RowsHandle:
    t, k = routing.ids.shape
    counts = ex.new_counts()  # [2, R, S]
    counts.view(2, -1)[0].index_add_(0, ex.slot_position.index_select(0, slots), torch.ones_like(slots))
    pending = ex.start(counts)  # counts travel meanwhile
    order = torch.argsort(slots, stable=True)  # [N] rows by slot
    if routing.weights_on_input and k == 1:  # scale, then gather
        hidden = hidden * routing.weights.to(hidden.dtype)
    rows = hidden.index_select(0, order // k if k > 1 else order)  # [N, H]
    if routing.weights_on_input and k > 1:
        rows = rows * routing.weights.reshape(-1, 1).index_select(0, order).to(rows.dtype)
    ex.send(pending, rows)
    return RowsHandle(moe_layer, pending, order, counts[0].view(-1))
