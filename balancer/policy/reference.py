"""A drop-in for DeepSeek's published EPLB policy (``eplb.rebalance_experts``), in numpy.

Dimension letters: L MoE layers, E logical experts, P physical slots (``num_replicas``),
W workers (``num_gpus``), N nodes, G expert groups, X the most replicas any expert has,
B rows of a batch of independent sub-problems.

Written anew from the published description of the algorithm; it is the baseline that the
project's own policy (:mod:`moeserve.balancer.policy`) is measured against, and it lets users
of vLLM or SGLang call the same function with the same arguments and get the same answer:

1. *Hierarchical* (``num_groups % num_nodes == 0``): pack the expert groups onto the nodes
   (``G / N`` groups per node) with a greedy balanced packing, then, inside each node, give
   the node's ``P / N`` slots to its experts by replicating whichever expert has the largest
   load per replica, then pack the node's physical experts onto its ``W / N`` workers with the
   same greedy balanced packing.
2. *Global* (otherwise): the same with one group and one node.

The greedy balanced packing takes items in descending weight and puts each on the lightest
pack that still has room (every pack takes exactly ``n / packs`` items). Ties go to the lower
index everywhere: among equal weights the item with the lower index is taken first, among
equally loaded packs the lower pack wins, among experts with equal load per replica the lower
expert gets the next replica. Weights are float32 as in the original, so the example of DeepSeek
EPLB's own README reproduces exactly. Bad arguments raise ``ValueError`` (the original asserts).
"""

from __future__ import annotations

import sys

import numpy as np

__all__ = ["rebalance_experts", "place_reference"]


def _inverse(perm: np.ndarray) -> np.ndarray:
    """Inverse of each row of a permutation ``perm [B, n]``: ``inv[b, perm[b, i]] = i``."""
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy packing of ``n`` weighted items into ``num_packs`` packs of ``n / num_packs`` each.

    weight: float32 [B, n]. Returns ``pack_index [B, n]`` (the pack of each item) and
    ``rank_in_pack [B, n]`` (its position inside the pack, in the order items arrived).
    Vectorised across the B rows; items are taken one at a time, heaviest first.
    """
    rows, n = weight.shape
    per_pack = n // num_packs
    if per_pack == 1:
        return (np.broadcast_to(np.arange(n, dtype=np.int64), (rows, n)).copy(), np.zeros((rows, n), dtype=np.int64))
    order = np.argsort(-weight, axis=1, kind="stable")  # [B, n] heaviest first, ties by index
    pack_index = np.empty((rows, n), dtype=np.int64)
    rank_in_pack = np.empty((rows, n), dtype=np.int64)
    pack_weight = np.zeros((rows, num_packs), dtype=np.float32)  # float32 sums, as the original
    pack_items = np.zeros((rows, num_packs), dtype=np.int64)
    r = np.arange(rows)
    inf = np.float32(np.inf)
    for k in range(n):
        item = order[:, k]
        pack = np.where(pack_items < per_pack, pack_weight, inf).argmin(axis=1)
        pack_index[r, item] = pack
        rank_in_pack[r, item] = pack_items[r, pack]
        pack_weight[r, pack] += weight[r, item]
        pack_items[r, pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Give ``num_phy`` slots to ``n`` experts, one each and the rest to the heaviest per replica.

    weight: float32 [B, n]. Returns ``phy2log [B, num_phy]`` (slots ``0..n-1`` hold experts
    ``0..n-1``, the redundant ones follow in the order they were granted), ``rank [B, num_phy]``
    (which replica of its expert a slot is) and ``logcnt [B, n]``.
    """
    rows, n = weight.shape
    phy2log = np.empty((rows, num_phy), dtype=np.int64)
    phy2log[:, :n] = np.arange(n)
    rank = np.zeros((rows, num_phy), dtype=np.int64)
    logcnt = np.ones((rows, n), dtype=np.int64)
    per_replica = weight.copy()  # [B, n] float32
    r = np.arange(rows)
    for i in range(n, num_phy):
        e = per_replica.argmax(axis=1)  # first maximum on ties
        phy2log[:, i] = e
        rank[:, i] = logcnt[r, e]
        logcnt[r, e] += 1
        per_replica[r, e] = weight[r, e] / logcnt[r, e].astype(np.float32)
    return phy2log, rank, logcnt


def _check(weight_shape, num_replicas, num_groups, num_nodes, num_gpus) -> None:
    if len(weight_shape) != 2:
        raise ValueError(f"weight must be 2-D [layers, logical experts], got shape {tuple(weight_shape)}")
    num_logical = weight_shape[1]
    for name, v in (
        ("num_replicas", num_replicas),
        ("num_groups", num_groups),
        ("num_nodes", num_nodes),
        ("num_gpus", num_gpus),
    ):
        if int(v) != v or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if num_logical < 1:
        raise ValueError("weight has no logical experts (shape [L, 0])")
    if num_replicas < num_logical:
        raise ValueError(
            f"num_replicas ({num_replicas}) must be at least the number of logical experts ({num_logical})"
        )
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas ({num_replicas}) must be a multiple of num_gpus ({num_gpus})")


def _hierarchical(weight: np.ndarray, num_phy: int, num_groups: int, num_nodes: int, num_gpus: int):
    """The reference algorithm on float32 ``weight [L, E]``; returns phy2log, phyrank, logcnt."""
    layers, num_log = weight.shape
    if num_log % num_groups:
        raise ValueError(f"the {num_log} logical experts do not split into num_groups={num_groups} equal groups")
    if num_gpus % num_nodes:
        raise ValueError(f"num_gpus ({num_gpus}) must be a multiple of num_nodes ({num_nodes})")
    group_size = num_log // num_groups
    groups_per_node = num_groups // num_nodes
    per_gpu = num_phy // num_gpus

    # 1. groups to nodes. Sums in float64, then float32: exact for integer counts below 2**24.
    group_load = weight.astype(np.float64).reshape(layers, num_groups, group_size).sum(-1).astype(np.float32)
    group_node, group_rank = balanced_packing(group_load, num_nodes)  # [L, G]
    # "middle" ids: experts renumbered node by node, groups in packing order inside a node
    log2mlog = (((group_node * groups_per_node + group_rank) * group_size)[:, :, None] + np.arange(group_size)).reshape(
        layers, num_log
    )  # [L, E]
    mlog2log = _inverse(log2mlog)

    # 2. replicas inside each node: rows are (layer, node)
    mlog_load = np.take_along_axis(weight, mlog2log, 1).reshape(layers * num_nodes, num_log // num_nodes)
    phy2mlog, phyrank, mlogcnt = replicate_experts(mlog_load, num_phy // num_nodes)

    # 3. physical experts to the node's workers
    phy_load = np.take_along_axis(mlog_load / mlogcnt.astype(np.float32), phy2mlog, 1)
    gpu, rank_in_gpu = balanced_packing(phy_load, num_gpus // num_nodes)
    pphy2phy = _inverse(gpu * per_gpu + rank_in_gpu)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, 1).reshape(layers, num_nodes, -1)
    pphy2mlog = (pphy2mlog + (np.arange(num_nodes) * (num_log // num_nodes))[None, :, None]).reshape(layers, -1)
    phy2log = np.take_along_axis(mlog2log, pphy2mlog, 1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, 1).reshape(layers, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(layers, -1), log2mlog, 1)
    return phy2log, pphyrank, logcnt


def rebalance_experts(weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int):
    """DeepSeek EPLB's entry point: the same arguments, the same outputs.

    weight: [L, E] load of every logical expert (numpy array or torch tensor, any real dtype).
    num_replicas: P, physical slots per layer, a multiple of ``num_gpus``.
    num_groups: expert groups (group-limited routing); num_nodes: nodes; num_gpus: W workers.
    The hierarchical variant runs when ``num_groups % num_nodes == 0``, the global one otherwise.

    Returns ``(phy2log [L, P], log2phy [L, E, X], logcnt [L, E])``, int64, X = the largest
    replica count, ``log2phy`` padded with -1 and listing replicas by replica rank. A torch
    tensor in gives CPU torch tensors out, anything else numpy arrays.
    """
    is_torch = type(weight).__module__.startswith("torch")
    w = weight.detach().cpu().double().numpy() if is_torch else np.asarray(weight, dtype=np.float64)
    _check(w.shape, num_replicas, num_groups, num_nodes, num_gpus)
    if not np.isfinite(w).all():
        raise ValueError("weight must be finite (no NaN or inf)")
    w32 = w.astype(np.float32)
    layers, num_log = w.shape
    if num_groups % num_nodes == 0:
        phy2log, phyrank, logcnt = _hierarchical(w32, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, phyrank, logcnt = _hierarchical(w32, num_replicas, 1, 1, num_gpus)
    x = int(logcnt.max())
    log2phy = np.full((layers, num_log * x), -1, dtype=np.int64)
    np.put_along_axis(
        log2phy, phy2log * x + phyrank, np.broadcast_to(np.arange(num_replicas, dtype=np.int64), phy2log.shape), axis=1
    )
    log2phy = log2phy.reshape(layers, num_log, x)
    if is_torch:
        # the caller's tensor means torch is loaded: take it from sys.modules, so that the policy
        # package holds no import of torch at all (tests/test_architecture.py checks every one)
        torch = sys.modules["torch"]
        return torch.from_numpy(phy2log), torch.from_numpy(log2phy), torch.from_numpy(logcnt)
    return phy2log, log2phy, logcnt


def place_reference(load, num_slots, num_workers, num_groups, num_nodes, current=None) -> np.ndarray:
    """The reference as a placement policy with the yardstick's signature (``current`` is ignored).

    load [L, E] float -> phy2log [L, P] int64.
    """
    return rebalance_experts(np.asarray(load, dtype=np.float64), num_slots, num_groups, num_nodes, num_workers)[0]
