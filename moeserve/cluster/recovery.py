"""Who is in the world, and re-forming it when a rank dies or joins (docs/dataplane.md, "When a
peer dies"): the members of each generation, agreed through the cluster's authenticated store
(``moeserve.cluster.store``), and the sequence every member runs once the world of a new
generation formed.

A generation is a number and its members (config ranks, ascending); a member's rank in the
torch.distributed world is its index among them. The leader decides every generation and
writes it (``gen``); the others read it. Keys of the store: ``running``, ``gen``,
``failed/<g>/<rank>``, ``join/<rank>``, ``admit/<rank>``, ``lost/<rank>`` (the table in
docs/dataplane.md says who writes each).
"""

from __future__ import annotations

import datetime
import gc
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moeserve.config import ClusterConfig
from moeserve.dataplane.collective import CollectiveExchange
from moeserve.dataplane.exchange import Topology

log = logging.getLogger("moeserve.rank")

POLL_S = 0.05  # between looks at the store while a recovery waits
JOIN_POLL_S = 0.5  # between the leader's looks for ranks that join a running cluster


class Dropped(RuntimeError):
    """This rank is not a member of the generation that formed (it answered too late)."""


@dataclass(frozen=True)
class Generation:
    number: int
    members: tuple[int, ...]

    def to_json(self) -> str:
        return json.dumps({"g": self.number, "members": list(self.members)})

    @classmethod
    def from_json(cls, raw: bytes | str) -> Generation:
        d = json.loads(raw)
        return cls(int(d["g"]), tuple(int(r) for r in d["members"]))


class Membership:
    """This rank's view of the world: its generation and members, and the store they are
    agreed through. ``incarnation``: this process's id (a replacement is admitted by it)."""

    def __init__(self, cfg: ClusterConfig, rank: int, store):
        self.cfg, self.rank, self.store = cfg, rank, store
        self.gen = Generation(0, tuple(range(cfg.world_size)))
        self.incarnation = secrets.token_hex(8)
        self._next_poll = 0.0

    @property
    def dist_rank(self) -> int:
        return self.gen.members.index(self.rank)

    @property
    def world_size(self) -> int:
        return len(self.gen.members)

    def topology(self, num_slots: int) -> Topology:
        return Topology.of_members(self.cfg.routers, self.cfg.workers, self.cfg.colocated, num_slots, self.gen.members)

    def replacing(self) -> bool:
        """Whether this process joins a running cluster (in place of a lost rank)."""
        return self.rank != 0 and self.store.check(["running"])

    def _read_gen(self) -> Generation | None:
        raw = self.store.get_now("gen")
        return Generation.from_json(raw) if raw else None

    # -- the leader -----------------------------------------------------------------------------

    def publish(self, gen: Generation) -> None:
        self.store.set("gen", gen.to_json())

    def _joins(self, ranks) -> dict[int, str]:
        out = {}
        for r in ranks:
            raw = self.store.get_now(f"join/{r}")
            if raw:
                out[r] = raw.decode()
        return out

    def _admit(self, joins: dict[int, str], number: int) -> None:
        for r, incarnation in joins.items():
            self.store.set(f"admit/{r}", f"{incarnation}:{number}")
            self.store.delete_key(f"join/{r}")

    def poll_joins(self) -> bool:
        """The leader, between steps: whether a rank outside the world waits to join it (a
        replacement of a lost rank, loaded); looked at every JOIN_POLL_S."""
        now = time.monotonic()
        if now < self._next_poll:
            return False
        self._next_poll = now + JOIN_POLL_S
        return any(self.store.check([f"join/{r}"]) for r in range(1, self.cfg.world_size) if r not in self.gen.members)

    def with_joins(self) -> Generation:
        """The leader, after a regroup header: the next generation, the ranks that wait to join
        admitted into it, written to the store."""
        joins = self._joins(r for r in range(1, self.cfg.world_size) if r not in self.gen.members)
        new = Generation(self.gen.number + 1, tuple(sorted({*self.gen.members, *joins})))
        self._admit(joins, new.number)
        self.publish(new)
        return new

    def decide(self, settle_s: float, worker_wait_s: float) -> tuple[Generation, set[int]] | None:
        """The leader, after a failed step of this generation: the next generation and the
        members of this one that are in it (those that reported the failure), or None when a
        lost worker has no replacement within ``worker_wait_s`` (fatal)."""
        g, members = self.gen.number, self.gen.members
        t0 = time.monotonic()
        while True:
            failed = {0} | {r for r in members if r and self.store.check([f"failed/{g}/{r}"])}
            joins = self._joins(r for r in range(1, self.cfg.world_size) if r not in failed)
            missing = set(members) - failed - set(joins)
            workers = {r for r in missing if self.cfg.role(r).worker_index >= 0}
            routers = missing - workers
            lost = {r for r in routers if self.store.check([f"lost/{r}"])}
            waited = time.monotonic() - t0
            if not workers and (routers <= lost or waited >= settle_s):
                break
            if waited >= worker_wait_s:
                log.error(
                    "recovery of generation %d: worker rank(s) %s neither answered nor were replaced within %.0f s",
                    g,
                    sorted(workers),
                    worker_wait_s,
                )
                return None
            time.sleep(POLL_S)
        new = Generation(g + 1, tuple(sorted(failed | set(joins))))
        for r in set(members) - failed:
            self.store.delete_key(f"lost/{r}")
        self._admit(joins, new.number)
        self.publish(new)
        return new, failed

    # -- every other rank -------------------------------------------------------------------------

    def await_next(self, timeout_s: float) -> Generation | None:
        """The generation after this one, once the leader wrote it (None within timeout_s: the
        leader is gone). Dropped when this rank is not in it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                gen = self._read_gen()
            except Exception:  # the store (the leader) is gone: fatal
                return None
            if gen is not None and gen.number > self.gen.number:
                if self.rank not in gen.members:
                    raise Dropped(
                        f"rank {self.rank} is not in generation {gen.number} (members {list(gen.members)}): "
                        f"it reported the failed step too late"
                    )
                return gen
            time.sleep(POLL_S)
        return None

    def join_running(self, timeout_s: float) -> Generation:
        """A replacement: announce itself (``join/<rank>``) and wait until the leader admits it
        into a generation."""
        self.store.set(f"join/{self.rank}", self.incarnation)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            raw = self.store.get_now(f"admit/{self.rank}")
            if raw is not None and raw.decode().startswith(self.incarnation + ":"):
                number = int(raw.decode().rsplit(":", 1)[1])
                gen = self._read_gen()
                if gen is not None and gen.number == number:
                    return gen
                if gen is not None and gen.number > number:
                    raise Dropped(f"rank {self.rank} was admitted to generation {number}, which is over")
            time.sleep(POLL_S)
        raise TimeoutError(f"rank {self.rank} was not admitted into the running cluster within {timeout_s:.0f} s")


# -- re-forming the world ---------------------------------------------------------------------


def destroy_groups(st=None) -> None:
    """Leave the world now. The groups close their connections only once nothing refers to
    them, so this rank's references go first: a peer still blocked on this rank then fails at
    once instead of at its timeout, and the failure spreads to every member within a step."""
    if st is not None:
        st.control_group = None
        st.header_wire = None
    try:
        dist.destroy_process_group()
    except Exception:  # a group whose peer died may not close cleanly
        pass
    gc.collect()


def recover(st, cfg: ClusterConfig, device, membership: Membership, error: BaseException) -> bool:
    """A step's collective failed. Destroy the groups at once (every member blocked on this
    one fails too), report the failure, and re-form with the generation the leader decides
    (docs/dataplane.md, "When a step fails"); the leader runs the failed step again. False when
    the failure is fatal (not a lost peer, the leader gone, a lost worker not replaced)."""
    if not peer_lost(error):
        return False
    t0 = time.monotonic()
    m = membership
    log.warning(
        "step failed in generation %d (%s: %s): re-forming", m.gen.number, type(error).__name__, str(error)[:200]
    )
    destroy_groups(st)
    try:
        m.store.set(f"failed/{m.gen.number}/{m.rank}", "1")
    except Exception:  # the store (the leader) is gone
        return False
    if st.leader is not None:
        decided = m.decide(cfg.recovery_settle_s, cfg.pg_timeout_s + 30.0)
        if decided is None:
            return False
        gen, survivors = decided
    else:
        try:
            got = m.await_next(cfg.pg_timeout_s + cfg.recovery_settle_s + 60.0)
        except Dropped as e:
            log.error("%s; exiting (the launcher starts it again)", e)
            os._exit(4)
        if got is None:
            return False
        gen, survivors = got, set()
    reform(st, cfg, device, m, gen, survivors, failed=True, t0=t0)
    return True


def regroup(st, cfg: ClusterConfig, device, membership: Membership) -> None:
    """After a regroup header: every member re-forms with the generation the leader wrote,
    which has a rank that joins (nothing failed, nothing runs again)."""
    t0 = time.monotonic()
    m = membership
    destroy_groups(st)
    gen = m.with_joins() if st.leader is not None else m.await_next(cfg.pg_timeout_s + 30.0)
    if gen is None:
        raise RuntimeError(
            f"no generation after {m.gen.number} in the store after a regroup header: the leader is gone"
        )
    reform(st, cfg, device, m, gen, set(m.gen.members), failed=False, t0=t0)


def reform(st, cfg: ClusterConfig, device, m: Membership, gen: Generation, survivors: set[int], failed: bool, t0=0.0):
    """Join ``gen`` and run, on every member, what a new world needs before its first step:
    the leader's placement in force (and, on the leader, the lost routers' sequences
    re-admitted), installed; the exchange rebuilt on the members' topology and every pair
    warmed up; one gather of each member's metrics port and KV blocks (a replacement router
    opens with them). ``survivors``: the leader's set of the old members that are in ``gen``."""
    from moeserve.expert_worker.migration import warm_up_pairs

    old = m.gen
    m.gen = gen
    st.topo = m.topology(st.topo.num_slots)
    st.control_group = join(cfg, m, device)
    placement = None
    if st.leader is not None:
        placement = st.leader.on_regroup(set(old.members) - survivors, failed)
    box: list[Any] = [(placement.phy2log, placement.breakeven) if placement is not None else None]
    dist.broadcast_object_list(box, src=0, group=st.control_group)
    phy2log, breakeven = box[0]
    if st.maps is not None:
        for layer in range(phy2log.shape[0]):
            st.maps.set_layer(layer, phy2log[layer], breakeven[layer])
    if st.store is not None:
        from moeserve.models import open_reader

        with open_reader(cfg.model_dir, cfg.load_format, device, quantization=cfg.quantization or None) as reader:
            st.store.resync(reader, phy2log)
    st.exchange = make_exchange(cfg, st.topo, m.dist_rank, device, st.control_group, st.hidden_size, st.dtype, st.top_k)
    if st.runner is not None:
        st.runner.experts.set_exchange(st.exchange)
    if st.store is not None:  # weight moves address workers by their rank in this world
        from functools import partial

        from moeserve.expert_worker.migration import run_moves

        st.run_moves = partial(run_moves, store=st.store, topo=st.topo)
    warm_up_pairs(m.dist_rank, m.world_size, device)
    report_members(st, m, joined_after=survivors if st.leader is not None else None)
    log.warning(
        "re-formed the groups as generation %d (members %s%s) in %.2f s",
        gen.number,
        list(gen.members),
        f"; without {sorted(set(old.members) - set(gen.members))}" if set(old.members) - set(gen.members) else "",
        time.monotonic() - t0,
    )


def report_members(st, m: Membership, joined_after: set[int] | None = None) -> list | None:
    """The gather every new world ends with: each member's (rank, metrics port, KV blocks) to
    the leader, which opens a joining router with its blocks. ``joined_after`` (the leader):
    the members that were in the world before (the rest joined). Returns the leader's list."""
    blocks = st.runner.num_blocks if st.runner is not None else 0
    out: list[Any] | None = [None] * m.world_size if st.leader is not None else None
    dist.gather_object((m.rank, st.metrics_port, blocks), out, dst=0, group=st.control_group)
    if st.leader is not None and joined_after is not None and out is not None:
        joined = {r: (port, b) for r, port, b in out if r not in joined_after}
        st.leader.on_members(m.gen.number, m.gen.members, joined)
    return out


def peer_lost(error: BaseException) -> bool:
    """Whether a step failed because a peer of a collective went away (gloo: its connections
    closed or timed out; NCCL: a backend error), not because of this rank's own fault."""
    if isinstance(error, (dist.DistBackendError, dist.DistNetworkError)):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        m in text for m in ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out")
    )


def join(cfg: ClusterConfig, membership, device: torch.device):
    """Join the world of the membership's generation (0 at start; one more each time the world
    re-forms): the data group and the gloo control group, this rank at its index among the
    members. Returns the control group. Gloo (and NCCL's bootstrap) use the interface that
    holds this rank's address towards the leader, unless GLOO_SOCKET_IFNAME /
    NCCL_SOCKET_IFNAME say otherwise."""
    from moeserve.cluster.netif import data_interface

    iface = data_interface(os.environ["MASTER_ADDR"])
    if iface:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", iface)
    timeout = datetime.timedelta(seconds=cfg.pg_timeout_s)
    dist.init_process_group(
        cfg.backend,
        store=dist.PrefixStore(f"generation{membership.gen.number}", membership.store),
        rank=membership.dist_rank,
        world_size=membership.world_size,
        timeout=timeout,
        device_id=device if cfg.backend == "nccl" else None,
    )
    return dist.new_group(backend="gloo", timeout=timeout)


def make_exchange(
    cfg: ClusterConfig,
    topo: Topology,
    rank: int,
    device: torch.device,
    control,
    hidden_size: int,
    dtype: torch.dtype,
    top_k: int,
):
    """The data plane's per-layer exchange, the same kind on every rank (``cfg.exchange``).

    "auto" takes the direct NVLink exchange when every rank can run it (one collective on the
    control group decides), else the collective one; "nvlink" insists and fails otherwise.
    """
    if cfg.exchange == "collective" or cfg.backend != "nccl":
        return CollectiveExchange(topo, rank, group=None, device=device)
    from moeserve.dataplane import nvlink

    ok, why = nvlink.usable(device)
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=control)
    if not int(flag.item()):
        if cfg.exchange == "nvlink":
            raise RuntimeError(
                f"exchange='nvlink' cannot run on every rank (rank {rank}: {why or 'usable'}); "
                f"use exchange='auto' or 'collective'"
            )
        return CollectiveExchange(topo, rank, group=None, device=device)
    return nvlink.NvlinkExchange(
        topo,
        rank,
        device,
        hidden_size,
        dtype,
        pair_capacity=cfg.limits.max_num_batched_tokens * top_k,
        top_k=top_k,
        timeout_ms=int(cfg.pg_timeout_s * 1000),
    )


__all__ = [
    "Membership",
    "Generation",
    "Dropped",
    "recover",
    "regroup",
    "reform",
    "report_members",
    "peer_lost",
    "join",
    "make_exchange",
]
