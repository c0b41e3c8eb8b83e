"""The admin API (``moeserve.v1.Admin``), hosted in the router leader's process.

Dimension letters: L MoE layers, E logical experts, P physical slots, W workers.

Handlers call the leader's :class:`~moeserve.router.leader.Engine` directly: its admin methods
only validate, record and enqueue work for the next step header, under short locks, so no
handler ever waits for a step (waiting for a migration polls on the event loop). The server
runs on its own uvloop event loop in a thread of its own (:class:`ThreadedServer`), beside the
step driver.

Errors: an invalid placement or argument -> INVALID_ARGUMENT, a stale expected version or a
cluster without EPLB -> FAILED_PRECONDITION, an unknown migration -> NOT_FOUND, a cluster that
failed or is stopping -> UNAVAILABLE; every message says what was wrong.
"""
from __future__ import annotations

import asyncio
import os
import tempfile
import time

import grpc
import numpy as np

from moeserve.placement import Placement
from moeserve.router.leader import EplbDisabled
from moeserve.router.migration import StaleVersion
from moeserve.rpc import admin_pb2, admin_pb2_grpc
from moeserve.services.convert import (balancedness_msg, from_int64_matrix, int64_matrix, migration_msg,
                                       placement_balancedness)
from moeserve.services.server import ADMIN, ServerOptions, ServiceServer, ThreadedServer

FILE_SUFFIX = {admin_pb2.PlacementFile.SGLANG_JSON: ".json", admin_pb2.PlacementFile.SGLANG_PT: ".pt"}


async def _abort_for(context, e: Exception):
    if isinstance(e, StaleVersion):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"stale placement version: {e}")
    if isinstance(e, EplbDisabled):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
    if isinstance(e, ValueError):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))


class AdminService(admin_pb2_grpc.AdminServicer):
    """``engine``: the leader's Engine (its ``cfg`` is the ClusterConfig)."""

    def __init__(self, engine):
        self.engine = engine
        self.cfg = engine.cfg
        self._balancer_settings = admin_pb2.BalancerSettings()

    # -- placement ------------------------------------------------------------------------

    def _placement_msg(self, p: Placement) -> admin_pb2.Placement:
        return admin_pb2.Placement(phy2log=int64_matrix(p.phy2log), version=int(p.version),
                                   layer_versions=[int(v) for v in p.layer_versions],
                                   num_logical_experts=p.num_logical, num_workers=p.num_workers,
                                   workers_per_node=p.workers_per_node)

    async def GetPlacement(self, request, context):
        return self._placement_msg(self.engine.placement())

    def _phy2log_of(self, request) -> np.ndarray:
        which = request.WhichOneof("source")
        if which == "phy2log":
            return from_int64_matrix(request.phy2log, "phy2log")
        if which != "file":
            raise ValueError("give the placement: phy2log [L, P] or a placement file")
        f = request.file
        cur = self.engine.placement()
        if f.format == admin_pb2.PlacementFile.MOESERVE_JSON:
            return Placement.from_json(f.content.decode("utf-8", errors="replace")).phy2log
        if f.format not in FILE_SUFFIX:
            raise ValueError(f"placement file format {f.format} is unknown (allowed: MOESERVE_JSON, SGLANG_JSON, SGLANG_PT)")
        shape = self.engine.shape
        with tempfile.NamedTemporaryFile(suffix=FILE_SUFFIX[f.format]) as tmp:
            tmp.write(f.content)
            tmp.flush()
            p = Placement.from_sglang(tmp.name, shape.moe_layer_ids, cur.num_logical, cur.num_workers,
                                      cur.workers_per_node, shape.num_decoder_layers or None)
        return p.phy2log

    async def ApplyPlacement(self, request, context):
        e = self.engine
        try:
            phy2log = self._phy2log_of(request)
            version = request.expected_version if request.HasField("expected_version") else None
            before = e.placement()
            mig = (e.plan_placement if request.dry_run else e.apply_placement)(phy2log, version)
        except (ValueError, StaleVersion, EplbDisabled, RuntimeError) as ex:
            await _abort_for(context, ex)
        s = mig.summary()
        load = e.expert_load().load
        return admin_pb2.ApplyPlacementResponse(
            migration_id="" if request.dry_run else s["migration_id"], dry_run=request.dry_run,
            migration=None if request.dry_run else migration_msg(s), moves=s["moves_total"], bytes=s["bytes_total"],
            balancedness_before=placement_balancedness(load, before.phy2log, before.num_workers),
            balancedness_after=placement_balancedness(load, mig.target, before.num_workers),
            phy2log=int64_matrix(mig.target))

    async def GetMigration(self, request, context):
        mig = self.engine.migration(request.migration_id)
        if mig is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no migration with id {request.migration_id!r}")
        if request.wait_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"wait_s must be >= 0, got {request.wait_s}")
        wait = request.wait_s
        left = context.time_remaining()
        if left is not None:
            wait = min(wait, max(0.0, left - 0.05))
        deadline = time.monotonic() + wait
        while not mig.done.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return migration_msg(mig.summary())

    async def AbortMigration(self, request, context):
        return admin_pb2.AbortMigrationResponse(aborted=self.engine.abort_migration())

    # -- load -----------------------------------------------------------------------------

    async def GetExpertLoad(self, request, context):
        size = self.cfg.eplb.window_size
        if not 0 <= request.window_steps <= size:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"window_steps must be in 0..{size} (the leader's window_size; 0 = all), "
                                f"got {request.window_steps}")
        r = self.engine.expert_load(request.window_steps or None)
        return admin_pb2.ExpertLoad(
            load=int64_matrix(r.load), worker_load=int64_matrix(r.worker_load), steps=r.steps,
            total_steps=r.total_steps, measured=balancedness_msg(r.balancedness_measured, r.worker_load),
            predicted=placement_balancedness(r.load, self.engine.placement().phy2log, self.cfg.workers),
            placement_version=r.placement_version, steps_since_placement_change=r.steps_since_placement_change,
            window_size=size)

    async def DumpLoad(self, request, context):
        r = self.engine.expert_load()
        shape = self.engine.shape
        return admin_pb2.LoadDump(total_load=int64_matrix(self.engine.total_load()), window_load=int64_matrix(r.load),
                                  total_steps=r.total_steps, window_steps=r.steps,
                                  moe_layer_ids=list(shape.moe_layer_ids), num_decoder_layers=shape.num_decoder_layers)

    # -- status ---------------------------------------------------------------------------

    def _ranks(self) -> list[admin_pb2.RankInfo]:
        c = self.cfg
        out = []
        for rank in range(c.world_size):
            router = rank if rank < c.routers else -1
            worker = rank if c.colocated else (rank - c.routers if rank >= c.routers else -1)
            role = "router+worker" if c.colocated else ("router" if router >= 0 else "worker")
            out.append(admin_pb2.RankInfo(rank=rank, role=role, router_index=router, worker_index=worker))
        return out

    async def GetStatus(self, request, context):
        e, c = self.engine, self.cfg
        s = e.status()
        p = e.placement()
        msg = admin_pb2.ClusterStatus(
            step=s["step"], forward_steps=s["forward_steps"], uptime_s=s["uptime_s"],
            placement_version=s["placement_version"], layer_versions=s["layer_versions"],
            waiting=s["waiting"], running=s["running"], ranks=self._ranks(), error=s["error"] or "",
            model=admin_pb2.ModelInfo(num_moe_layers=e.shape.num_moe_layers, num_logical_experts=e.shape.num_logical_experts,
                                      num_slots=p.num_slots, num_workers=p.num_workers,
                                      workers_per_node=p.workers_per_node, top_k=e.shape.top_k,
                                      vocab_size=e.shape.vocab_size, expert_bytes=e.shape.expert_bytes),
            eplb=admin_pb2.EplbInfo(enable_eplb=c.eplb.enable_eplb, num_redundant_experts=c.eplb.num_redundant_experts,
                                    window_size=c.eplb.window_size, step_interval=c.eplb.step_interval,
                                    log_balancedness=c.eplb.log_balancedness))
        if s["migration"]:
            msg.migration.CopyFrom(migration_msg(s["migration"]))
        msg.metrics_ports.update(s["metrics_ports"])
        return msg

    async def GetBalancerSettings(self, request, context):
        return self._balancer_settings

    async def PutBalancerSettings(self, request, context):
        self._balancer_settings = admin_pb2.BalancerSettings()
        self._balancer_settings.CopyFrom(request)
        return self._balancer_settings


def start_admin(engine, token: str | None, interceptors: tuple = ()) -> ThreadedServer:
    """Start the admin API for ``engine`` on its own thread and event loop (rank 0).
    ``interceptors``: more grpc.aio server interceptors (the hook for metrics)."""
    c = engine.cfg
    opts = ServerOptions(host=c.admin_host, port=c.admin_port, max_message_bytes=c.max_message_bytes,
                         tls_cert=c.admin_tls_cert or None, tls_key=c.admin_tls_key or None, token=token,
                         grace_s=c.grace_s, interceptors=tuple(interceptors))
    service = AdminService(engine)
    server = ThreadedServer(ServiceServer(ADMIN, lambda s: admin_pb2_grpc.add_AdminServicer_to_server(service, s), opts))
    server.start()
    return server


__all__ = ["AdminService", "start_admin"]
