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

from moeserve.cluster.protocol import MoveOp
from moeserve.dispatch import Topology


def run_moves(moves: tuple[MoveOp, ...], store, topo: Topology, group=None) -> int:
    """Execute this worker's part of ``moves``; returns the bytes it received.

    store: this rank's ExpertStore with staging allocated (``begin_staging``).
    """
    me = store.worker
    ops = []
    received = 0
    for m in moves:
        if m.dst_worker == me and m.src_worker == me:
            store.staging[m.stage].copy_(store.slot_row(m.moe_layer, m.src_slot))
        elif m.src_worker == me:
            ops.append(dist.P2POp(dist.isend, store.slot_row(m.moe_layer, m.src_slot), topo.worker_ranks[m.dst_worker], group))
        elif m.dst_worker == me:
            ops.append(dist.P2POp(dist.irecv, store.staging[m.stage], topo.worker_ranks[m.src_worker], group))
            received += store.staging[m.stage].numel() * store.staging.element_size()
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return received


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
            ops.append(dist.P2POp(dist.isend, send[peer:peer + 1], peer, group))
            ops.append(dist.P2POp(dist.irecv, recv[peer:peer + 1], peer, group))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    got = recv.cpu()
    for peer in range(world_size):
        if peer != rank and got[peer].item() != float(peer):
            raise RuntimeError(f"warm-up with rank {peer} returned {got[peer].item()}")
