"""Weight moves between workers at the fixed point of a step (docs/dataplane.md, step 3).

Each move copies one logical expert's flat weights [n] from a slot of its source worker into
a staging entry of its destination worker. A worker posts all its sends and receives of the
step as one ``batch_isend_irecv`` and waits for them; moves within one worker are local
copies. Both ends walk the header's move list in the same order, so the point-to-point
messages between a pair of workers match in order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeserve.dataplane.exchange import Topology
from moeserve.dataplane.protocol import MoveOp

# Experts smaller than this travel packed, one message per pair of workers and step (small
# messages do not reach the link's rate); larger ones travel one message each (packing them
# would cost a copy of many MB for nothing). 23.6 MB ERNIE-21B experts: 52% of the send/recv
# rate one by one, 86% packed; 252 MB Scout experts: 83% one by one, 61% packed (2 x H200).
PACK_BELOW_BYTES = 64 << 20


def run_moves(moves: tuple[MoveOp, ...], store, topo: Topology, group=None) -> int:
    """Execute this worker's part of ``moves``; returns the bytes it received.

    store: this rank's ExpertStore with staging allocated (``begin_staging``). Small experts
    between one pair of workers travel as one message (their staging entries are consecutive:
    the leader numbers them so, and the sender gathers its slots into one buffer).
    """
    me = store.worker
    pack = store.spec.nbytes < PACK_BELOW_BYTES
    ops = []
    received = 0
    for (src, dst), group_moves in _by_pair(moves):
        if src == me and dst == me:
            for m in group_moves:
                store.staging[m.stage].copy_(store.slot_row(m.moe_layer, m.src_slot))
        elif src == me:
            bufs = (
                [_gather_rows(store, group_moves)]
                if pack
                else [store.slot_row(m.moe_layer, m.src_slot) for m in group_moves]
            )
            ops += [dist.P2POp(dist.isend, b, topo.worker_ranks[dst], group) for b in bufs]
        elif dst == me:
            targets = [_staging_view(store, group_moves)] if pack else [store.staging[m.stage] for m in group_moves]
            ops += [dist.P2POp(dist.irecv, t, topo.worker_ranks[src], group) for t in targets]
            received += sum(t.numel() * t.element_size() for t in targets)
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return received


def _by_pair(moves):
    """Moves grouped by (source worker, destination worker), in first-seen order."""
    groups: dict[tuple[int, int], list[MoveOp]] = {}
    for m in moves:
        groups.setdefault((m.src_worker, m.dst_worker), []).append(m)
    return groups.items()


def _first_stage(group_moves) -> int:
    """The first staging entry of moves that fill consecutive entries (the leader numbers the
    moves between a pair of workers so; anything else is a bug, not an input error)."""
    stages = [m.stage for m in group_moves]
    assert stages == list(range(stages[0], stages[0] + len(stages))), f"staging entries not consecutive: {stages}"
    return stages[0]


def _gather_rows(store, group_moves) -> torch.Tensor:
    """The flat weights of the moves' source slots as one contiguous buffer [n * numel]."""
    _first_stage(group_moves)
    layer = group_moves[0].moe_layer
    if len(group_moves) == 1:
        return store.slot_row(layer, group_moves[0].src_slot)
    s0 = store.worker * store.slots_per_worker
    idx = torch.tensor([m.src_slot - s0 for m in group_moves], device=store.buffers[layer].device)
    return store.buffers[layer].index_select(0, idx).reshape(-1)


def _staging_view(store, group_moves) -> torch.Tensor:
    """Where the moves from one source land: their staging entries, one contiguous view."""
    first = _first_stage(group_moves)
    return store.staging[first : first + len(group_moves)].reshape(-1)


def warm_up_pairs(rank: int, world_size: int, device: torch.device, group=None) -> None:
    """Exchange one element with every other rank in one batch, on every rank.

    NCCL creates point-to-point communicators lazily and requires every rank in the first
    ``batch_isend_irecv`` of a group; doing it at start keeps the first migration fast and
    lets later batches involve only the workers that move something.
    """
    if world_size == 1:
        return
    send = torch.full((world_size,), float(rank), device=device)
    recv = torch.empty(world_size, device=device)
    ops = []
    for peer in range(world_size):
        if peer != rank:
            ops.append(dist.P2POp(dist.isend, send[peer : peer + 1], peer, group))
            ops.append(dist.P2POp(dist.irecv, recv[peer : peer + 1], peer, group))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    got = recv.cpu()
    for peer in range(world_size):
        if peer != rank and got[peer].item() != float(peer):
            raise RuntimeError(f"warm-up with rank {peer} returned {got[peer].item()}")
