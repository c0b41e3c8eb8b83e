"""The data plane's shared vocabulary: who is who, which slot a (token, k) pair goes to, and
the interface every per-layer exchange implements.

Dimension letters: T tokens on a router, K experts per token, N = T*K (token, k) pairs, E
logical experts, X replicas at most per logical expert, P physical slots per MoE layer, W
workers, S = P / W slots per worker, R ranks of the world (routers and workers), H hidden.

Two exchanges implement :class:`Exchange`: the collective one (``moeserve.dataplane.collective``:
all-to-all on the data group, any backend) and the direct one (``moeserve.dataplane.nvlink``:
stores into peers' symmetric memory, one host, CUDA). The router's experts backend
(``moeserve.router.dispatcher``) and the step loop (``moeserve.dataplane.step``) drive either
through this interface and never ask which one they have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from moeserve.config import check_topology, rank_layout


@dataclass(frozen=True)
class Topology:
    """Who is who in the world.

    router_ranks[r] is the world rank of router r; worker_ranks[w] the world rank of worker w
    (co-located: both are ``0 .. N-1``). Slot p of a MoE layer lives on worker p // S.
    """

    world_size: int
    router_ranks: tuple[int, ...]
    worker_ranks: tuple[int, ...]
    slots_per_worker: int

    @classmethod
    def build(cls, routers: int, workers: int, colocated: bool, num_slots: int) -> Topology:
        check_topology(routers, workers, colocated, num_slots)
        router_ranks, worker_ranks = rank_layout(routers, workers, colocated)
        return cls(len(set(router_ranks + worker_ranks)), router_ranks, worker_ranks, num_slots // workers)

    @classmethod
    def of_members(cls, routers: int, workers: int, colocated: bool, num_slots: int, members) -> Topology:
        """The topology of a world of ``members`` (config ranks, ascending; a member's world
        rank is its index): every worker, and the routers present (docs/dataplane.md,
        "Generations and members")."""
        check_topology(routers, workers, colocated, num_slots)
        router_ranks, worker_ranks = rank_layout(routers, workers, colocated)
        index = {r: i for i, r in enumerate(members)}
        missing = [w for w in worker_ranks if w not in index]
        if missing:
            raise ValueError(f"a world without worker rank(s) {missing}: their slots would be nowhere")
        return cls(
            len(index),
            tuple(index[r] for r in router_ranks if r in index),
            tuple(index[w] for w in worker_ranks),
            num_slots // workers,
        )

    @property
    def num_routers(self) -> int:
        return len(self.router_ranks)

    @property
    def num_workers(self) -> int:
        return len(self.worker_ranks)

    @property
    def num_slots(self) -> int:
        return self.slots_per_worker * self.num_workers

    @property
    def colocated(self) -> bool:
        return self.router_ranks == self.worker_ranks

    def slot_positions(self) -> torch.Tensor:
        """LongTensor [P]: where each global slot sits in a flattened per-(rank, local slot)
        table [R*S] (the rank holding it, then its local index; ranks holding no slots have
        zero columns). The counts on the wire and a router's recorded load use this layout."""
        slot = torch.arange(self.num_slots)
        rank_of_slot = torch.tensor(self.worker_ranks)[slot // self.slots_per_worker]
        return rank_of_slot * self.slots_per_worker + slot % self.slots_per_worker

    def router_index(self, rank: int) -> int | None:
        return self.router_ranks.index(rank) if rank in self.router_ranks else None

    def worker_index(self, rank: int) -> int | None:
        return self.worker_ranks.index(rank) if rank in self.worker_ranks else None


def count(values: torch.Tensor, n: int) -> torch.Tensor:
    """LongTensor [n]: occurrences of each of 0 .. n-1 in ``values``. Unlike torch.bincount
    on CUDA, this never reads the maximum back to the host (no synchronisation)."""
    out = torch.zeros(n, dtype=torch.long, device=values.device)
    return out.index_add_(0, values, torch.ones_like(values))


def choose_slots(
    ids: torch.Tensor,
    log2phy: torch.Tensor,
    logcnt: torch.Tensor,
    offset: int,
    breakeven: torch.Tensor | None = None,
    router: int = 0,
    num_routers: int = 1,
) -> torch.Tensor:
    """Map each (token, k) pair to a physical slot, spreading tokens over replicas that pay.

    ids:       LongTensor [T, K] logical expert ids.
    log2phy:   LongTensor [E, X] replicas of each logical expert (-1 padded).
    logcnt:    LongTensor [E] replica counts (>= 1).
    offset:    router index + step number; rotates which replica gets the remainder.
    breakeven: LongTensor [E] or None, the break-even counts b (0 or None: every replica is
               always used, the rule without a threshold).
    router, num_routers: this router's index (so the step is ``offset - router``) and how many
               routers there are (the step's count of an expert is estimated as this router's
               count x num_routers: no extra exchange).
    returns    LongTensor [T*K] slots, in flat (token, k) order.

    Token t's pair for expert e takes replica (t + offset) mod u[e] of the first u[e] replicas.
    Without a threshold (b[e] = 0) u[e] = logcnt[e]. With one, the step's count of e is
    estimated as n[e] = (this router's pairs of e in the layer) x num_routers; at or below b[e]
    every router sends e's pairs to the one replica (step + e) mod logcnt[e], the same on every
    router, so one copy's weights are read (staggered by e: experts doubled on the same pair
    of workers take turns rather than all reading the same worker's copy); above it u[e] = min(logcnt[e], ceil(n[e] / b[e])).
    A token picks an expert at most once, so the tokens of a hot expert (close to all of them)
    split evenly over the replicas used, give or take one, and the rest split evenly in
    expectation: the even split the policy's cost model assumes (docs/dataplane.md explains
    why the token index and not the flat pair index). All on the device: no host read.
    """
    t, k = ids.shape
    flat = ids.reshape(-1)  # [N]
    token = torch.arange(t, device=ids.device).repeat_interleave(k) if k > 1 else torch.arange(t, device=ids.device)
    if breakeven is None:
        replica = (token + offset) % logcnt.index_select(0, flat)  # [N]
        return log2phy[flat, replica]
    used, alone = replicas_used(count(flat, logcnt.numel()) * num_routers, logcnt, breakeven, offset - router)
    replica = torch.where(
        alone.index_select(0, flat) >= 0, alone.index_select(0, flat), (token + offset) % used.index_select(0, flat)
    )  # [N]
    return log2phy[flat, replica]


def replicas_used(
    estimate: torch.Tensor, logcnt: torch.Tensor, breakeven: torch.Tensor, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The break-even rule per logical expert (the torch reference of the route kernel's).

    estimate: LongTensor [E], the step's estimated pairs of each expert; logcnt [E]; breakeven
    [E] (b, an integer count; <= 0: no threshold); step: the step number.
    returns   (used [E]: replicas the expert's pairs spread over, >= 1; alone [E]: the one
              replica every router takes, (step + e) mod logcnt, where estimate <= b with b > 0;
              -1 elsewhere).
    """
    b = breakeven.to(torch.long)
    on = b > 0
    wide = torch.minimum(logcnt, (estimate + b - 1) // b.clamp(min=1)).clamp(min=1)
    used = torch.where(on, wide, logcnt)
    expert = torch.arange(logcnt.numel(), device=logcnt.device)
    alone = torch.where(on & (estimate <= b), (step + expert) % logcnt.clamp(min=1), torch.full_like(logcnt, -1))
    return used, alone


@dataclass(frozen=True)
class RecvCounts:
    """Rows received per (source rank, local slot), [R, S]: a numpy array on the host (cheap
    to read from Python, which matters per layer) and a tensor on the device."""

    host: np.ndarray
    device: torch.Tensor


class Exchange(Protocol):
    """One MoE layer's exchange of rows between routers and workers, the same kind on every rank.

    A router calls ``dispatch`` (rows leave, the pairs sent are added to ``sent [R*S]``), computes
    its shared experts, then ``combine_rows`` (this rank's own slots run here when it is also a
    worker; the outputs come back in (token, k) order). A rank with no rows of its own in a MoE
    layer calls ``walk_layer`` instead, so that every rank takes part in every layer in lockstep.
    """

    topo: Topology
    device: torch.device
    slot_position: torch.Tensor  # LongTensor [P]: column of each slot in an [R*S] table

    def dispatch(self, moe_layer: int, hidden: torch.Tensor, routing, maps, offset: int, sent: torch.Tensor) -> object:
        """Send the rows of ``hidden [T, H]`` for ``routing`` (ids [T, K]); returns a handle."""
        ...

    def combine_rows(self, handle, store) -> torch.Tensor:
        """The expert outputs [N, H] of ``handle``'s rows, in flat (token, k) order."""
        ...

    def walk_layer(self, moe_layer: int, store, hidden_size: int, dtype: torch.dtype, maps=None) -> None:
        """Take part in ``moe_layer`` with no rows of one's own (an idle router, or a worker)."""
        ...


def idle_walk(exchange: Exchange, num_layers: int, hidden_size: int, dtype: torch.dtype, store=None, maps=None) -> None:
    """Take part in every MoE layer's exchange with no rows of one's own (an idle router, or a
    worker): all ranks walk the MoE layers in lockstep. ``maps``: an idle router's RouterMaps."""
    for layer in range(num_layers):
        exchange.walk_layer(layer, store, hidden_size, dtype, maps=maps)


def slot_major_index(received: RecvCounts) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Index that regroups received rows from (source rank, slot) blocks to slot-major order.

    received: rows per (source rank, local slot) [R, S]; the received layout is source-major
              with slots ascending inside each block.
    returns   (index [m] on the device such that rows[index] is grouped by slot, rows per
              slot [S] on the host, int32 cumulative rows per slot [S] on the device),
              computed on the device without a host synchronisation.
    """
    counts = received.device
    r, s = counts.shape
    total = int(received.host.sum())
    sizes = counts.reshape(-1)  # [R*S] received layout
    block_start = (torch.cumsum(sizes, 0) - sizes).view(r, s)  # [R, S]
    sizes_t = counts.t().reshape(-1)  # [S*R] slot-major blocks
    start_t = torch.cumsum(sizes_t, 0) - sizes_t  # where each block goes
    # index[j] = block_start[b] + (j - start_t[b]) for the slot-major block b that holds j.
    shift = torch.repeat_interleave(block_start.t().reshape(-1) - start_t, sizes_t, output_size=total)
    index = shift + torch.arange(total, device=counts.device)
    return index, received.host.sum(0).tolist(), torch.cumsum(counts.sum(0), 0).to(torch.int32)
