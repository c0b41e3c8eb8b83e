"""The admin API (``moeserve.v1.Admin``), hosted in the router leader's process.

Dimension letters: L MoE layers, E logical experts, P physical slots, W workers.

Handlers call the leader's engine through its typed API
(:class:`~moeserve.router.engine.api.EngineAPI`): its methods only validate, record and enqueue
work for the next step header, under short locks, so no handler ever waits for a step
(waiting for a migration polls on the event loop). The server runs on its own uvloop event loop
in a thread of its own (:class:`ThreadedServer`), beside the step driver. The leader starts it
through its hook (:func:`serve_admin`, named in ``ClusterConfig.leader_hook``): the rank itself
never imports gRPC.

With a state folder (``ClusterConfig.state_dir``, ``--state-dir``) the balancer's settings
are saved there (``balancer.json``, replaced atomically) before PutBalancerSettings answers, and
read back at start; the leader's engine saves the placement in force there (``moeserve.state``).
Settings are validated like every other input: a negative interval, a NaN or a balancedness
outside [0, 1] answers INVALID_ARGUMENT saying what is allowed, and nothing is stored.

The server's health follows the cluster's readiness (``moeserve.services.readiness``): it reads
``engine.status()`` once a second and says NOT_SERVING while the step loop is stalled or the
cluster failed.

Errors go through the one table of ``moeserve.services.errors``: an invalid placement or
argument (a placement file that does not parse included, named by its format and size) ->
INVALID_ARGUMENT, a stale expected version or a cluster without EPLB ->
FAILED_PRECONDITION, an unknown migration -> NOT_FOUND, a cluster that failed or is stopping ->
UNAVAILABLE; every message says what was wrong.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import grpc
import numpy as np

from moeserve import state
from moeserve.placement import Placement
from moeserve.router.engine.api import EngineAPI, InvalidRequest
from moeserve.rpc import admin_pb2, admin_pb2_grpc
from moeserve.services.errors import abort_for
from moeserve.services.server import ADMIN, ServerOptions, ServiceServer, ThreadedServer
from moeserve.wire import (
    breakeven_from_msg,
    from_int64_matrix,
    int64_matrix,
    migration_msg,
    placement_balancedness,
    placement_msg,
    worker_balancedness_msg,
)

if TYPE_CHECKING:
    from moeserve.config import ClusterConfig

log = logging.getLogger("moeserve.admin")

FILE_SUFFIX = {admin_pb2.PlacementFile.SGLANG_JSON: ".json", admin_pb2.PlacementFile.SGLANG_PT: ".pt"}
SETTINGS_FIELDS = ("window_steps", "step_interval", "min_balancedness", "paused")


def settings_dict(msg: admin_pb2.BalancerSettings) -> dict:
    """The set fields of a BalancerSettings message (None for unset ones)."""
    return {k: (getattr(msg, k) if msg.HasField(k) else None) for k in SETTINGS_FIELDS}


def settings_msg(d: dict) -> admin_pb2.BalancerSettings:
    msg = admin_pb2.BalancerSettings()
    for k in SETTINGS_FIELDS:
        if d.get(k) is not None:
            setattr(msg, k, d[k])
    return msg


class LeaderEngine(EngineAPI, Protocol):
    """The engine the admin API serves: the leader's, in its process, with its ClusterConfig."""

    cfg: ClusterConfig


class AdminService(admin_pb2_grpc.AdminServicer):
    """``engine``: the leader's engine (its ``cfg`` is the ClusterConfig)."""

    def __init__(self, engine: LeaderEngine):
        self.engine = engine
        self.cfg = engine.cfg
        self.state_dir = getattr(self.cfg, "state_dir", "") or ""
        saved = {}
        if self.state_dir:
            try:
                saved = state.read_balancer_settings(self.state_dir, self.cfg.eplb.window_size)
            except state.StateError as e:  # the CLI checked it at start; never fail the leader for it
                log.error("the balancer's saved settings are ignored: %s", e)
        self._balancer_settings = settings_msg(saved)

    # -- placement ------------------------------------------------------------------------

    async def GetPlacement(self, request, context):
        return placement_msg(self.engine.placement())

    def _target_of(self, request) -> np.ndarray | Placement:
        """The placement asked for: a phy2log [L, P] (the engine validates it; the break-even
        counts in force stay) or a Placement for this cluster's topology (validated as it is
        built): a phy2log with the request's ``breakeven`` [L, E], or a file parsed (with the
        request's b, else a moeserve JSON file's own, else the b in force)."""
        which = request.WhichOneof("source")
        b = breakeven_from_msg(request)
        if which == "phy2log":
            phy2log = from_int64_matrix(request.phy2log, "phy2log")
            if b is None:
                return phy2log
            cur = self.engine.placement()
            if phy2log.shape != cur.phy2log.shape:
                raise InvalidRequest(
                    f"phy2log has shape {phy2log.shape}, expected (MoE layers, slots) = {cur.phy2log.shape}"
                )
            return self._with_breakeven(
                Placement(phy2log, cur.num_logical, cur.num_workers, cur.workers_per_node, cur.version), b
            )
        if which != "file":
            raise InvalidRequest("give the placement: phy2log [L, P] or a placement file")
        f = request.file
        if f.format not in FILE_SUFFIX and f.format != admin_pb2.PlacementFile.MOESERVE_JSON:
            raise InvalidRequest(
                f"placement file format {f.format} is unknown (allowed: MOESERVE_JSON, SGLANG_JSON, SGLANG_PT)"
            )
        name = admin_pb2.PlacementFile.Format.Name(f.format)
        what = f"the placement file ({name}, {len(f.content)} bytes)"
        try:
            p, has_b = self._parse_file(f)
        except InvalidRequest as e:
            raise InvalidRequest(f"{what}: {e}") from None
        except Exception as e:  # whatever a parser raises on bytes that are not a placement
            msg = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
            raise InvalidRequest(f"{what} is not a valid {name} placement: {msg}") from None
        return self._with_breakeven(p, b if b is not None or has_b else self.engine.placement().breakeven)

    def _with_breakeven(self, p: Placement, b) -> Placement:
        """``p`` with the break-even counts ``b`` [L, E] (None: its own); InvalidRequest naming
        the shape expected when b has another shape or a negative count."""
        if b is None:
            return p
        try:
            return Placement(
                p.phy2log, p.num_logical, p.num_workers, p.workers_per_node, p.version, p.layer_versions, breakeven=b
            )
        except ValueError as e:
            raise InvalidRequest(str(e)) from None

    def _parse_file(self, f) -> tuple[Placement, bool]:
        """The file's placement, and whether it brought its own break-even counts."""
        cur = self.engine.placement()
        if f.format == admin_pb2.PlacementFile.MOESERVE_JSON:
            try:
                text = f.content.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InvalidRequest(f"not UTF-8 text ({e.reason} at byte {e.start})") from None
            p = Placement.from_json(text)
            has_b = '"breakeven"' in text
            if (p.num_logical, p.num_workers, p.workers_per_node) != (
                cur.num_logical,
                cur.num_workers,
                cur.workers_per_node,
            ):
                raise InvalidRequest(
                    f"it is for {p.num_logical} logical experts on {p.num_workers} "
                    f"workers ({p.workers_per_node} per node); this cluster has {cur.num_logical} "
                    f"on {cur.num_workers} ({cur.workers_per_node} per node)"
                )
            return p.evolve(version=cur.version), has_b
        shape = self.engine.shape
        with tempfile.TemporaryDirectory(prefix="moeserve-placement-") as d:
            path = os.path.join(d, "placement" + FILE_SUFFIX[f.format])
            with open(path, "wb") as tmp:
                tmp.write(f.content)
            try:
                return Placement.from_sglang(
                    path,
                    shape.moe_layer_ids,
                    cur.num_logical,
                    cur.num_workers,
                    cur.workers_per_node,
                    shape.num_decoder_layers or None,
                ), False
            except Exception as e:  # the message names the temporary file: not the client's
                raise InvalidRequest(str(e).replace(path + ": ", "").replace(path, "the file")) from None

    async def ApplyPlacement(self, request, context):
        e = self.engine
        try:
            target = self._target_of(request)
            version = request.expected_version if request.HasField("expected_version") else None
            before = e.placement()
            mig = (e.plan_placement if request.dry_run else e.apply_placement)(target, version)
        except Exception as ex:
            await abort_for(context, ex)
        phy2log = target.phy2log if isinstance(target, Placement) else target
        breakeven = target.breakeven if isinstance(target, Placement) else before.breakeven
        load = e.expert_load().load
        return admin_pb2.ApplyPlacementResponse(
            migration_id="" if request.dry_run else mig.migration_id,
            dry_run=request.dry_run,
            migration=None if request.dry_run else migration_msg(mig),
            moves=mig.moves_total,
            bytes=mig.bytes_total,
            balancedness_before=placement_balancedness(load, before.phy2log, before.num_workers),
            balancedness_after=placement_balancedness(load, phy2log, before.num_workers),
            phy2log=int64_matrix(phy2log),
            breakeven=int64_matrix(breakeven),
        )

    async def GetMigration(self, request, context):
        if not request.wait_s >= 0:  # NaN too
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"wait_s must be >= 0, got {request.wait_s}")
        try:
            mig = self.engine.migration(request.migration_id)
        except Exception as ex:
            await abort_for(context, ex)
        wait = request.wait_s
        left = context.time_remaining()
        if left is not None:
            wait = min(wait, max(0.0, left - 0.05))
        deadline = time.monotonic() + wait
        while not mig.ended and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            mig = self.engine.migration(request.migration_id)
        return migration_msg(mig)

    async def AbortMigration(self, request, context):
        return admin_pb2.AbortMigrationResponse(aborted=self.engine.abort_migration())

    # -- load -----------------------------------------------------------------------------

    async def GetExpertLoad(self, request, context):
        size = self.cfg.eplb.window_size
        if not 0 <= request.window_steps <= size:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"window_steps must be in 0..{size} (the leader's window_size; 0 = all), got {request.window_steps}",
            )
        r = self.engine.expert_load(request.window_steps or None)
        return admin_pb2.ExpertLoad(
            load=int64_matrix(r.load),
            worker_load=int64_matrix(r.worker_load),
            steps=r.steps,
            total_steps=r.total_steps,
            measured=worker_balancedness_msg(r.worker_load),
            predicted=placement_balancedness(r.load, self.engine.placement().phy2log, self.cfg.workers),
            placement_version=r.placement_version,
            steps_since_placement_change=r.steps_since_placement_change,
            window_size=size,
            histogram=int64_matrix(
                r.histogram.reshape(r.histogram.shape[0], -1)
                if r.histogram is not None
                else np.zeros((0, 0), dtype=np.int64)
            ),
            histogram_bins=r.histogram.shape[2] if r.histogram is not None else 0,
            slot_busy_steps=int64_matrix(
                r.slot_busy_steps if r.slot_busy_steps is not None else np.zeros((0, 0), dtype=np.int64)
            ),
        )

    async def DumpLoad(self, request, context):
        r = self.engine.expert_load()
        shape = self.engine.shape
        return admin_pb2.LoadDump(
            total_load=int64_matrix(self.engine.total_load()),
            window_load=int64_matrix(r.load),
            total_steps=r.total_steps,
            window_steps=r.steps,
            moe_layer_ids=list(shape.moe_layer_ids),
            num_decoder_layers=shape.num_decoder_layers,
        )

    # -- status ---------------------------------------------------------------------------

    def _ranks(self) -> list[admin_pb2.RankInfo]:
        roles = [self.cfg.role(rank) for rank in range(self.cfg.world_size)]
        return [
            admin_pb2.RankInfo(rank=r.rank, role=r.name, router_index=r.router_index, worker_index=r.worker_index)
            for r in roles
        ]

    async def GetStatus(self, request, context):
        e, c = self.engine, self.cfg
        s = e.status()
        p = e.placement()
        msg = admin_pb2.ClusterStatus(
            step=s.step,
            forward_steps=s.forward_steps,
            uptime_s=s.uptime_s,
            placement_version=s.placement_version,
            layer_versions=list(s.layer_versions),
            waiting=s.waiting,
            running=s.running,
            ranks=self._ranks(),
            error=s.error or "",
            kv_blocks_total=s.kv_blocks_total,
            kv_blocks_used=s.kv_blocks_used,
            preemptions=s.preemptions,
            kv_blocks_cached=s.kv_blocks_cached,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            model=admin_pb2.ModelInfo(
                num_moe_layers=e.shape.num_moe_layers,
                num_logical_experts=e.shape.num_logical_experts,
                num_slots=p.num_slots,
                num_workers=p.num_workers,
                workers_per_node=p.workers_per_node,
                top_k=e.shape.top_k,
                vocab_size=e.shape.vocab_size,
                expert_bytes=e.shape.expert_bytes,
            ),
            eplb=admin_pb2.EplbInfo(
                enable_eplb=c.eplb.enable_eplb,
                num_redundant_experts=c.eplb.num_redundant_experts,
                window_size=c.eplb.window_size,
                step_interval=c.eplb.step_interval,
                log_balancedness=c.eplb.log_balancedness,
            ),
        )
        if s.migration is not None:
            msg.migration.CopyFrom(migration_msg(s.migration))
        msg.metrics_ports.update(s.metrics_ports)
        return msg

    async def GetBalancerSettings(self, request, context):
        return self._balancer_settings

    async def PutBalancerSettings(self, request, context):
        new = settings_dict(request)
        try:
            state.check_balancer_settings(new, self.cfg.eplb.window_size)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"balancer settings: {e}")
        if self.state_dir:  # saved before it answers: an answered change survives a restart
            try:
                await asyncio.to_thread(state.write_balancer_settings, self.state_dir, new)
            except OSError as e:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"cannot save the balancer's settings in the state folder {self.state_dir}: "
                    f"{e.strerror or e}; nothing changed",
                )
        self._balancer_settings = settings_msg(new)
        return self._balancer_settings


@dataclass(frozen=True)
class AdminHandle:
    """What the leader's hook returns: the running admin server."""

    name: str
    address: tuple[str, int]
    server: ThreadedServer

    def stop(self) -> None:
        self.server.stop()


def start_admin(engine: LeaderEngine, options: ServerOptions, process_metrics=None) -> ThreadedServer:
    """Start the admin API for ``engine`` on its own thread and event loop; its health follows
    the cluster's readiness (recorded in ``process_metrics`` when given)."""
    from moeserve.services.readiness import Readiness, engine_probe

    service = AdminService(engine)
    srv = ServiceServer(ADMIN, lambda s: admin_pb2_grpc.add_AdminServicer_to_server(service, s), options)
    metrics = None
    if process_metrics is not None:
        from moeserve.ops.metrics import ReadinessMetrics

        metrics = ReadinessMetrics(process_metrics.registry)
    srv.readiness = Readiness(engine_probe(engine, getattr(engine.cfg, "heartbeat_s", None)), metrics)
    server = ThreadedServer(srv)
    server.start()
    return server


def serve_admin(engine: LeaderEngine, config_json: str, process_metrics=None) -> AdminHandle:
    """The leader hook (``moeserve.config.admin_hook``): the admin API on the configured host
    and port, guarded by the token in MOESERVE_ADMIN_TOKEN, counted in ``process_metrics``."""
    c = json.loads(config_json)
    interceptors: tuple = ()
    if process_metrics is not None:
        from moeserve.services.metrics import grpc_interceptor

        interceptors = (grpc_interceptor(process_metrics, ADMIN),)
    opts = ServerOptions(
        host=c["host"],
        port=c["port"],
        max_message_bytes=c["max_message_bytes"],
        tls_cert=c["tls_cert"],
        tls_key=c["tls_key"],
        grace_s=c["grace_s"],
        token=os.environ.get("MOESERVE_ADMIN_TOKEN") or None,
        interceptors=interceptors,
    )
    server = start_admin(engine, opts, process_metrics)
    assert server.server.port is not None  # started
    return AdminHandle("admin", (c["host"], server.server.port), server)


__all__ = ["AdminService", "start_admin", "serve_admin"]
