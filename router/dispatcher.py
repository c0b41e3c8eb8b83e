"""The router's experts backend: routed experts run on expert workers over torch.distributed.

Dimension letters: T tokens of this router in the step, K top-k, N = T*K pairs, L MoE layers,
E logical experts, X max replicas, P physical slots, W workers, H hidden.

``DistributedExperts`` plugs into the model's MoE seam (``moeserve.models.moe.ExpertsBackend``):
``dispatch`` maps each (token, k) pair to a slot of the placement in force, sorts the rows by
slot (which sorts them by worker) and starts the exchange; the model computes its shared
experts while rows are in flight; ``combine`` finishes the exchange (running this rank's own
slots when it is also a worker), puts the outputs back in (token, k) order, applies the
routing weights when they scale the output, and sums over k in a fixed order, so the result
does not depend on where the experts sit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# The environment knob lives in moeserve.config (the default b of a start placement that carries none).
from moeserve.config import BREAKEVEN_ENV, default_breakeven  # noqa: E402,F401  (re-exported)
from moeserve.dataplane.exchange import choose_slots
from moeserve.models.moe import RoutingResult, combine_pairs
from moeserve.placement import log2phy


class RouterMaps:
    """The placement in force as the router uses it, per MoE layer, on the router's device.

    log2phy: LongTensor [L, E, X] (-1 padded); logcnt: LongTensor [L, E]; breakeven: LongTensor
    [L, E], the break-even counts b of the replica rule (``moeserve.dataplane.exchange.
    choose_slots``; 0: every replica always used). X is fixed at start (R + 1) so the tables
    never change shape; a commit rewrites one layer's rows. ``logcnt`` and ``breakeven`` are
    two rows of one allocation, so whatever keeps ``logcnt`` alive (a captured graph) keeps
    ``breakeven`` alive at a fixed address too.

    breakeven: b for every layer: None (the default: 0, every replica always used), an integer,
    or an array [L, E] (floats are floored: the rule compares integer counts). A cluster passes
    its placement's ``Placement.breakeven`` at start and on recovery, and each layer's commit
    carries its row.
    """

    def __init__(
        self,
        phy2log: np.ndarray,
        num_logical: int,
        max_replicas: int,
        device: torch.device | str = "cpu",
        breakeven=None,
    ):
        phy2log = np.asarray(phy2log, dtype=np.int64)
        layers = phy2log.shape[0]
        self.num_logical = num_logical
        self.max_replicas = max_replicas
        self.phy2log = phy2log.copy()  # [L, P] host copy
        self.single = [False] * layers  # no logical expert has 2 replicas
        self.thresholded = [False] * layers  # some expert of the layer has b > 0
        self.default_breakeven = 0
        self.log2phy = torch.full((layers, num_logical, max_replicas), -1, dtype=torch.long, device=device)
        self.phy2log_dev = torch.zeros(phy2log.shape, dtype=torch.long, device=device)  # [L, P] device copy
        self._tables = torch.zeros(2, layers, num_logical, dtype=torch.long, device=device)
        self.logcnt = self._tables[0]  # [L, E]
        self.breakeven = self._tables[1]  # [L, E]
        rows = self._breakeven_rows(breakeven, layers)
        for layer in range(layers):
            self.set_layer(layer, phy2log[layer], rows[layer])

    def _breakeven_rows(self, breakeven, layers: int) -> np.ndarray:
        """int64 [layers, E] from None, a number, a row [E] or a matrix [layers, E]."""
        value = self.default_breakeven if breakeven is None else breakeven
        b = np.floor(np.asarray(value, dtype=np.float64))
        try:
            b = np.broadcast_to(b, (layers, self.num_logical))
        except ValueError:
            raise ValueError(
                f"breakeven must be a number, [E] or [L, E] with E = {self.num_logical}, got shape {np.shape(value)}"
            ) from None
        if not np.isfinite(b).all() or (b < 0).any():
            raise ValueError("breakeven counts must be finite and >= 0 (0 = every replica always used)")
        return b.astype(np.int64)

    def set_layer(self, layer: int, phy2log_row, breakeven=None) -> None:
        """Install the map of one MoE layer from its phy2log row [P] (a row of a placement the
        leader validated: not checked again) and its break-even counts (a number or [E];
        None: the maps' default, 0)."""
        row = np.array(phy2log_row, dtype=np.int64)  # a copy: the row may be a read-only view of a message
        table = log2phy(row[None, :], self.num_logical, self.max_replicas)[0]  # [E, X]
        counts = (table >= 0).sum(1)  # [E]
        self.log2phy[layer].copy_(torch.from_numpy(table))
        self.logcnt[layer].copy_(torch.from_numpy(counts))
        self.phy2log[layer] = row
        self.phy2log_dev[layer].copy_(torch.from_numpy(row))
        self.single[layer] = bool(counts.max() == 1)
        self.set_breakeven(breakeven, layer)

    def set_breakeven(self, breakeven, layer: int | None = None) -> None:
        """Set the break-even counts b of one layer (a number or [E]) or, with ``layer`` None, of
        every layer (a number, [E] or [L, E]); None: the maps' default. Takes effect at the next
        dispatch of the layer (call it between steps, as commits are applied)."""
        layers = range(self.logcnt.shape[0]) if layer is None else [layer]
        rows = self._breakeven_rows(breakeven, len(layers))
        for i, l in enumerate(layers):
            self.breakeven[l].copy_(torch.from_numpy(rows[i]))
            self.thresholded[l] = bool(rows[i].max() > 0) if rows[i].size else False

    def route_breakeven(self, layer: int, always: bool = False) -> torch.Tensor | None:
        """The break-even row [E] a route kernel applies to ``layer``, or None when the layer
        has no threshold (the rule without one; ``always``: the row anyway, as a CUDA graph
        needs, which must stay valid when a later commit sets b)."""
        return self.breakeven[layer] if always or self.thresholded[layer] else None

    def slots_of(
        self, layer: int, ids: torch.Tensor, offset: int, router: int = 0, num_routers: int = 1
    ) -> torch.Tensor:
        """Slots [T*K] for the logical ids [T, K] of a layer (the replica rule of choose_slots
        with this layer's break-even counts; a plain look-up when every expert of the layer has
        one replica). ``router``: this router's index (offset - router is the step)."""
        if self.single[layer]:
            return self.log2phy[layer, :, 0].index_select(0, ids.reshape(-1))
        return choose_slots(
            ids, self.log2phy[layer], self.logcnt[layer], offset, self.route_breakeven(layer), router, num_routers
        )


@dataclass(frozen=True)
class _Handle:
    moe_layer: int
    rows: object  # the exchange's handle of the rows in flight
    routing: RoutingResult


LOAD_BINS = 16  # power-of-two bins of per-step counts: 0, 1, 2-3, ..., 2**14 and more


class DistributedExperts:
    """ExpertsBackend of a router rank.

    exchange: the data plane's per-layer exchange (``moeserve.dataplane.collective.CollectiveExchange``, collective,
    or ``moeserve.dataplane.nvlink.NvlinkExchange``, direct); maps: the placement in force; router: this
    router's index (0 .. R-1); store: this rank's ``ExpertStore`` when it is also a worker.
    ``step`` must be set before each forward (it rotates the replica choice); the pairs sent
    to each (rank, local slot) in a step are counted in ``sent`` [L, R*S] (a CUDA graph writes
    to it: never reallocated), which ``end_step`` adds to ``total`` on the device; the load is
    read to the host only when asked (``snapshot_load`` then ``finish_load``, or ``take_load``).

    Per-step statistics, kept on the device beside the total (``end_step``; docs/eplb.md,
    "Per-step statistics"):
    ``histogram`` int64 [L, E, K]: per step and logical expert, the step's count as the replica
    rule estimates it (this router's pairs x routers), counted in power-of-two bins (bin 0: no
    pair, bin j: 2**(j-1) .. 2**j - 1, the last bin open); ``busy`` int64 [L, P]: the steps in
    which this router sent at least one pair to each slot.
    """

    def __init__(self, exchange, maps: RouterMaps, router: int, num_layers: int, store=None):
        self.exchange = exchange
        self.maps = maps
        self.router = router
        self.store = store
        self.step = 0
        self.num_slots = exchange.topo.num_slots
        self.sent = torch.zeros(
            num_layers,
            exchange.topo.world_size * exchange.topo.slots_per_worker,
            dtype=torch.long,
            device=exchange.device,
        )
        self.total = torch.zeros_like(self.sent)
        self.steps = 0  # forward steps in ``total``
        self.num_routers = exchange.topo.num_routers
        p = exchange.topo.num_slots
        self.histogram = torch.zeros(num_layers, maps.num_logical, LOAD_BINS, dtype=torch.long, device=exchange.device)
        self.busy = torch.zeros(num_layers, p, dtype=torch.long, device=exchange.device)

    def set_exchange(self, exchange) -> None:
        """The exchange of a re-formed world (a rank lost or joined): this router's index among
        the routers present and their number follow it; the unread load is dropped (its counts
        are per world rank; docs/dataplane.md, "When a peer dies")."""
        self.exchange = exchange
        self.router = exchange.topo.router_index(exchange.rank) or 0
        self.num_routers = exchange.topo.num_routers
        width = exchange.topo.world_size * exchange.topo.slots_per_worker
        if self.sent.shape[1] != width:
            self.sent = torch.zeros(self.sent.shape[0], width, dtype=torch.long, device=exchange.device)
            self.total = torch.zeros_like(self.sent)
        self.discard_load()

    def dispatch(self, moe_layer: int, hidden: torch.Tensor, routing: RoutingResult) -> _Handle:
        # The exchange picks each pair's slot (the collective one with torch ops, the direct one in
        # its kernels) and adds the pairs it sends to this layer's row of ``sent``.
        rows = self.exchange.dispatch(
            moe_layer, hidden, routing, self.maps, self.router + self.step, self.sent[moe_layer]
        )
        return _Handle(moe_layer, rows, routing)

    def combine(self, handle: _Handle) -> torch.Tensor:
        out = self.exchange.combine_rows(handle.rows, self.store)  # [N, H] (token, k) order
        return combine_pairs(out, handle.routing)  # [T, H]

    def end_step(self) -> None:
        """A forward step ended: its counts join the unread total and the per-step statistics
        (on the device, no host read; a few small kernels outside any graph)."""
        slot = self.sent.index_select(1, self.exchange.slot_position)  # [L, P] this step
        self.busy.add_(slot > 0)
        est = torch.zeros(self.histogram.shape[:2], dtype=torch.long, device=slot.device)
        est.scatter_add_(1, self.maps.phy2log_dev, slot)  # [L, E] this router's
        est.mul_(self.num_routers)  # the rule's estimate
        bins = torch.where(est > 0, est.clamp(min=1).double().log2().floor().long() + 1, 0).clamp_(max=LOAD_BINS - 1)
        self.histogram.scatter_add_(2, bins.unsqueeze(2), torch.ones_like(bins).unsqueeze(2))
        self.total.add_(self.sent)
        self.sent.zero_()
        self.steps += 1

    def discard_load(self) -> None:
        """Forget the unread load (a step failed after a lost peer; the maps are re-installed)."""
        for t in (self.sent, self.total, self.histogram, self.busy):
            t.zero_()
        self.steps = 0

    def snapshot_load(self) -> tuple:
        """Start copying the unread total to the host and reset it; the copy waits only for the
        steps already enqueued. Returns the snapshot for ``finish_load`` (which takes the maps
        in force now: commits come after a snapshot, never between it and the counted steps)."""
        pin = self.total.is_cuda
        hosts = []
        for t in (self.total, self.histogram, self.busy):
            h = torch.empty(t.shape, dtype=torch.long, pin_memory=pin)
            h.copy_(t, non_blocking=pin)
            hosts.append(h)
        event = None
        if pin:
            event = torch.cuda.Event()
            event.record()
        for t in (self.total, self.histogram, self.busy):
            t.zero_()  # stream-ordered after the copies
        snap = (hosts, event, self.maps.phy2log.copy(), self.steps)
        self.steps = 0
        return snap

    def finish_load(self, snap: tuple) -> tuple[np.ndarray, np.ndarray, int, np.ndarray, np.ndarray]:
        """(logical [L, E], worker [L, W], steps, histogram [L, E, K], busy [L, P]) int64 of a
        ``snapshot_load``.

        Only per-slot counts are recorded on the device; since every pair sent to a slot was
        routed to the expert that slot holds, the logical counts follow exactly from the maps
        in force during the counted steps."""
        (host, hist, busy), event, phy2log, steps = snap
        if event is not None:
            event.synchronize()
        sent = host.numpy()  # [L, R*S]
        # the topology's slot layout, computed on the host: reading the exchange's device copy
        # (.cpu()) waited for every step enqueued since, so each load read drained the pipeline
        slot = sent[:, self.exchange.topo.slot_positions().numpy()]  # [L, P]
        layers, p = slot.shape
        logical = np.zeros((layers, self.maps.num_logical), dtype=np.int64)
        rows = np.repeat(np.arange(layers), p)
        np.add.at(logical, (rows, phy2log.reshape(-1)), slot.reshape(-1))
        workers = self.exchange.topo.num_workers
        return logical, slot.reshape(layers, workers, p // workers).sum(axis=2), steps, hist.numpy(), busy.numpy()

    def take_load(self) -> tuple[np.ndarray, np.ndarray]:
        """Read and reset the unread load now: (logical [L, E], worker [L, W]) int64."""
        if self.sent.any():  # counted by a forward that did not call end_step (tests)
            self.end_step()
        return self.finish_load(self.snapshot_load())[:2]
