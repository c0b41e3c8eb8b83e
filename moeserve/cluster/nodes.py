"""A cluster over several hosts: one launcher per node, each starting its block of ranks
(docs/operations.md, "Several hosts"; docs/dataplane.md, "Ranks and groups").

``NodeLayout(nnodes=N, node_rank=K, master_addr=A, master_port=P)`` is torchrun's and SGLang's
description of a node. The world's ranks split into N contiguous blocks of ``world / N``;
node K starts ranks ``K * B .. K * B + B - 1``. Node 0 starts rank 0, the leader, which serves
the cluster's store on A:P; every other node's launcher and ranks meet there, proving the
cluster's secret (``moeserve.cluster.store``), which the operator gives every node.

What goes through the store at start, in this order:

    node 0's launcher   config          the ClusterConfig JSON every rank runs with
    node K's launcher   (reads config)  its ranks run node 0's config (its own model folder)
    every rank          up/<rank>       it reached the store; it waits until every rank has
    the leader          running         every rank joined, loaded and warmed up

A node that never shows up leaves its ``up/<rank>`` keys unset: every launcher names those
ranks when its start-up timeout passes.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from moeserve.config import ClusterConfig, rank_layout

CONFIG_KEY = "config"
STARTUP_ENV = "MOESERVE_STARTUP_TIMEOUT_S"  # how long a rank waits for the store and its peers at start
POLL_S = 0.2
# ClusterConfig fields that may differ between nodes: node 0's are the ones in force
NODE_LOCAL = {
    *("model_dir", "host", "leader_hook", "leader_hook_config", "metrics_peers"),
    *("state_dir", "phy2log", "breakeven"),
}


@dataclass(frozen=True)
class NodeLayout:
    """This node's place among ``nnodes`` nodes, and where node 0's store is."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int

    def __post_init__(self):
        if self.nnodes < 1:
            raise ValueError(f"nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"node_rank must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes}), got {self.node_rank}"
            )
        if not 1 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be a port in 1..65535, got {self.master_port}")
        if not self.master_addr:
            raise ValueError("master_addr must be node 0's address, the one every node reaches it at")

    def ranks(self, world_size: int) -> range:
        """The ranks this node starts."""
        b = world_size // self.nnodes
        return range(self.node_rank * b, (self.node_rank + 1) * b)

    def node_of(self, rank: int, world_size: int) -> int:
        return rank // (world_size // self.nnodes)


def host_workers(routers: int, workers: int, colocated: bool, nnodes: int) -> list[int]:
    """How many workers each of ``nnodes`` contiguous blocks of the world holds."""
    world = routers if colocated else routers + workers
    b = world // nnodes
    worker_ranks = set(rank_layout(routers, workers, colocated)[1])
    return [sum(1 for r in range(k * b, (k + 1) * b) if r in worker_ranks) for k in range(nnodes)]


def check_layout(routers: int, workers: int, colocated: bool, nnodes: int, workers_per_node: int = 0) -> int:
    """The workers_per_node of a cluster split into ``nnodes`` nodes (ValueError saying what is
    allowed when it cannot be split). A placement's node is ``workers_per_node`` consecutive
    workers; it must never straddle two hosts, so it divides every host's worker count. The
    default (0) is the largest that does: the hosts' worker counts' greatest common divisor
    (8 for 2 nodes of 8 co-located ranks; 1 when the leader's node holds fewer workers)."""
    world = routers if colocated else routers + workers
    plural = lambda n, word: f"{n} {word}{'s' if n != 1 else ''}"  # noqa: E731
    what = (
        plural(routers, "co-located rank")
        if colocated
        else f"{plural(routers, 'router')} + {plural(workers, 'worker')}"
    )
    if world % nnodes:
        raise ValueError(
            f"--nnodes {nnodes}: the {world} ranks ({what}) do not split into {nnodes} nodes of equal size; "
            f"the ranks must be a multiple of the nodes"
        )
    counts = host_workers(routers, workers, colocated, nnodes)
    fits = math.gcd(*counts)
    if workers_per_node and fits % workers_per_node:
        raise ValueError(
            f"--workers-per-node {workers_per_node} does not fit {nnodes} nodes holding {counts} workers: a "
            f"placement's node must lie on one host, so it must divide {fits} (leave it out for {fits})"
        )
    return workers_per_node or fits


# -- the launchers ---------------------------------------------------------------------------------


def open_store(layout: NodeLayout, secret: bytes, timeout_s: float):
    """A client of node 0's store (``moeserve.cluster.store.AuthStore``), connecting for up to
    timeout_s (node 0 may start after this node)."""
    from moeserve.cluster.store import AuthStore

    return AuthStore(layout.master_addr, layout.master_port, secret, datetime.timedelta(seconds=timeout_s))


def publish_config(store, cfg: ClusterConfig) -> None:
    """Node 0's launcher: the config every rank of every node runs with."""
    store.set(CONFIG_KEY, cfg.to_json())


def config_from_leader(store, mine: ClusterConfig, timeout_s: float) -> ClusterConfig:
    """Node K's launcher: node 0's config, with this node's model folder and host (where its
    ranks serve metrics). ValueError naming the fields where this node's flags disagree with
    node 0's (every node takes the same flags; node 0's state folder and start placement are
    the ones in force)."""
    store.wait([CONFIG_KEY], datetime.timedelta(seconds=timeout_s))
    theirs = ClusterConfig.from_json(store.get_now(CONFIG_KEY).decode())
    a, b = asdict(mine), asdict(theirs)
    differ = sorted(k for k in a if k not in NODE_LOCAL and a[k] != b[k])
    if differ:
        raise ValueError(
            "this node's flags disagree with node 0's: "
            + "; ".join(f"{k} {_short(a[k])} here, {_short(b[k])} on node 0" for k in differ)
            + "; give every node the same model and cluster flags"
        )
    # the leader's own (its state folder, its services) stay on node 0
    return replace(
        theirs, model_dir=mine.model_dir, host=mine.host, state_dir="", leader_hook="", leader_hook_config=""
    )


def _short(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def missing_ranks(store, world_size: int) -> list[int]:
    """The ranks that have not reached the store yet (no ``up/<rank>``)."""
    return [r for r in range(world_size) if not store.check([f"up/{r}"])]


def describe_missing(missing: list[int], layout: NodeLayout, world_size: int) -> str:
    """``ranks 2, 3 (node 1)``: the missing ranks by node."""
    by_node: dict[int, list[int]] = {}
    for r in missing:
        by_node.setdefault(layout.node_of(r, world_size), []).append(r)
    return "; ".join(
        f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} (node {k})" for k, rs in sorted(by_node.items())
    )


class NodeStart:
    """A launcher of a cluster over several nodes, once it spawned its ranks: node 0 publishes
    its config; every node then waits until the cluster is ready (node 0: the leader's
    ``control.json``; node K: ``running`` in the store), naming, when the start-up timeout
    passes, the ranks that never reached the store and their nodes."""

    def __init__(self, layout: NodeLayout, secret: bytes, cfg: ClusterConfig, timeout_s: float):
        self.layout, self.secret, self.cfg, self.timeout_s = layout, secret, cfg, timeout_s

    def wait(self, error, run_dir: str, remote: bool) -> bool | str:
        """True once ready, else why not (``error()``: the launcher's own, when a rank here failed)."""
        where = f"node 0's store at {self.layout.master_addr}:{self.layout.master_port}"
        deadline = time.monotonic() + self.timeout_s
        try:
            store = open_store(self.layout, self.secret, self.timeout_s)
            if not remote:
                publish_config(store, self.cfg)
        except Exception as e:
            return error() or f"{where}: {e}"
        control = os.path.join(run_dir, "control.json")
        while True:
            if error():
                return error()
            try:
                if store.check(["running"]) if remote else os.path.exists(control):
                    return True
                missing = missing_ranks(store, self.cfg.world_size) if time.monotonic() > deadline else []
            except Exception as e:
                return error() or f"{where} went away while the cluster started (node 0 is gone): {e}"
            if time.monotonic() > deadline:
                why = (
                    f"{describe_missing(missing, self.layout, self.cfg.world_size)} never reached {where}: start "
                    f"every node (moeserve up --nnodes {self.layout.nnodes} --node-rank K --master-addr "
                    f"{self.layout.master_addr} --master-port {self.layout.master_port} ...)"
                    if missing
                    else "every rank reached the store"
                )
                return f"the cluster did not become ready within {self.timeout_s:.0f} s: {why}"
            time.sleep(POLL_S)


class LeaderWatch:
    """A node without the leader watches node 0's store: when it stops answering, node 0 is gone
    and this node's ranks cannot go on (fatal, as losing the leader is on one host)."""

    def __init__(self, layout: NodeLayout, secret: bytes, every_s: float = 1.0):
        self.layout, self.secret, self.every_s = layout, secret, every_s
        self._store: Any = None
        self._next = 0.0

    def gone(self, force: bool = False) -> bool:
        """Whether node 0's store stopped answering (looked at every ``every_s``, or now with ``force``)."""
        now = time.monotonic()
        if now < self._next and not force:
            return False
        self._next = now + self.every_s
        try:
            if self._store is None:
                self._store = open_store(self.layout, self.secret, 5.0)
            self._store.check(["running"])
            return False
        except Exception:
            self._store = None
            return True

    def describe(self) -> str:
        return (
            f"node 0 (rank 0, the leader) is gone: its store at {self.layout.master_addr}:{self.layout.master_port} "
            f"does not answer; this node's ranks cannot go on"
        )


# -- the ranks -------------------------------------------------------------------------------------


def startup_timeout_s(default: float = 60.0) -> float:
    """How long a rank waits at start for the store and for every peer (the launcher's start-up
    timeout, handed over in the environment; ``default`` without one)."""
    raw = os.environ.get(STARTUP_ENV)
    return max(default, float(raw)) if raw else default


def await_world(store, rank: int, world_size: int, timeout_s: float) -> None:
    """A rank at start: say it reached the store (``up/<rank>``), then wait until every rank
    did, so that the first process group forms within its own timeout even when nodes start
    minutes apart. RuntimeError naming the missing ranks after timeout_s."""
    store.set(f"up/{rank}", "1")
    deadline = time.monotonic() + timeout_s
    while True:
        missing = missing_ranks(store, world_size)
        if not missing:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"ranks {', '.join(map(str, missing))} did not reach the store within {timeout_s:.0f} s: "
                f"start every node (moeserve up --nnodes N --node-rank K ...)"
            )
        time.sleep(POLL_S)


__all__ = [
    "NodeLayout",
    "check_layout",
    "host_workers",
    "open_store",
    "publish_config",
    "config_from_leader",
    "missing_ranks",
    "describe_missing",
    "NodeStart",
    "LeaderWatch",
    "await_world",
    "startup_timeout_s",
]
