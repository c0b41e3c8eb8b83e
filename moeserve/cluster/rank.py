"""One rank of a cluster: ``python -m moeserve.cluster.rank`` (the launcher starts it).

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torch.distributed),
MOESERVE_CLUSTER_CONFIG (path of the ClusterConfig JSON), MOESERVE_RUN_DIR (where the leader
writes control.json), MOESERVE_AUTHKEY (hex key of the local channel), MOESERVE_PARENT_PID
(exit when that process is gone: no orphans).

The main thread becomes the step driver (docs/dataplane.md): it owns every torch.distributed
call. The leader additionally serves the local channel on other threads.
"""
from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from moeserve.cluster.config import ClusterConfig
from moeserve.cluster.protocol import RankResult, StepHeader
from moeserve.dispatch import Exchange, Topology
from moeserve.placement import Placement

log = logging.getLogger("moeserve.rank")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def initial_placement(cfg: ClusterConfig, num_layers: int, num_logical: int) -> Placement:
    """The placement a cluster starts with: cfg.phy2log, or slot p holding expert p mod E."""
    p = num_logical + cfg.eplb.num_redundant_experts
    if cfg.phy2log is not None:
        phy2log = np.asarray(cfg.phy2log, dtype=np.int64)
    else:
        phy2log = np.tile(np.arange(p, dtype=np.int64) % num_logical, (num_layers, 1))
    return Placement(phy2log=phy2log, num_logical=num_logical, num_workers=cfg.workers,
                     workers_per_node=cfg.workers_per_node or cfg.workers, version=1)


@dataclass
class RankState:
    """What one rank holds: its roles' objects (None for a role it does not have)."""

    rank: int
    topo: Topology
    exchange: object               # Exchange (collective) or nvlink.NvlinkExchange
    control_group: object
    num_layers: int
    hidden_size: int
    dtype: torch.dtype
    runner: object = None          # RouterRunner (routers)
    maps: object = None            # RouterMaps (routers)
    store: object = None           # ExpertStore (workers)
    engine: object = None          # Engine (the leader)


def build(cfg: ClusterConfig, rank: int) -> RankState:
    """Load this rank's share of the model and join the process groups."""
    from moeserve.models import CheckpointReader, load_config, load_model

    world = cfg.world_size
    if cfg.backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=cfg.pg_timeout_s)
    dist.init_process_group(cfg.backend, rank=rank, world_size=world, timeout=timeout,
                            device_id=device if cfg.backend == "nccl" else None)
    control = dist.new_group(backend="gloo", timeout=timeout)

    dtype = DTYPES[cfg.dtype]
    mcfg = load_config(cfg.model_dir)
    info_model = None
    placement = None
    topo = None
    is_router = rank < cfg.routers
    is_worker = cfg.colocated or rank >= cfg.routers
    if is_router:
        info_model = load_model(cfg.model_dir, dtype=dtype, device=device, load_experts=False)
        info = info_model.moe_info
    else:
        info = _moe_info(cfg.model_dir, dtype)
    e = info.num_logical_experts
    topo = Topology.build(cfg.routers, cfg.workers, cfg.colocated, e + cfg.eplb.num_redundant_experts)
    placement = initial_placement(cfg, info.num_moe_layers, e)
    exchange = make_exchange(cfg, topo, rank, device, control, mcfg.hidden_size, dtype, info.top_k)
    st = RankState(rank, topo, exchange, control, info.num_moe_layers, mcfg.hidden_size, dtype)

    if is_worker:
        from moeserve.expert_worker.store import ExpertStore
        reader = CheckpointReader(cfg.model_dir)
        st.store = ExpertStore.from_checkpoint(reader, info.expert_spec, topo.worker_index(rank), placement.phy2log,
                                               topo.num_workers, device, cfg.max_staging_bytes)
    if is_router:
        from moeserve.router.dispatcher import DistributedExperts, RouterMaps
        from moeserve.router.runner import RouterRunner
        st.maps = RouterMaps(placement.phy2log, e, cfg.eplb.num_redundant_experts + 1, device)
        experts = DistributedExperts(exchange, st.maps, topo.router_index(rank), info.num_moe_layers, st.store)
        st.runner = RouterRunner(info_model, experts)
    if rank == 0:
        from moeserve.router.leader import Engine, ModelShape
        shape = ModelShape(info.num_moe_layers, e, info.top_k, mcfg.vocab_size, tuple(mcfg.eos_token_ids),
                           info.expert_bytes, tuple(int(x) for x in info.moe_layer_ids), mcfg.num_layers)
        st.engine = Engine(cfg, shape, placement)

    from moeserve.expert_worker.migration import warm_up_pairs
    warm_up_pairs(rank, world, device)
    return st


def make_exchange(cfg: ClusterConfig, topo: Topology, rank: int, device: torch.device, control,
                  hidden_size: int, dtype: torch.dtype, top_k: int):
    """The data plane's per-layer exchange, the same kind on every rank (``cfg.exchange``).

    "auto" takes the direct NVLink exchange when every rank can run it (one collective on the
    control group decides), else the collective one; "nvlink" insists and fails otherwise.
    """
    if cfg.exchange == "collective" or cfg.backend != "nccl":
        return Exchange(topo, rank, group=None, device=device)
    from moeserve import nvlink
    ok, why = nvlink.usable(device)
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=control)
    if not int(flag.item()):
        if cfg.exchange == "nvlink":
            raise RuntimeError(f"exchange='nvlink' cannot run on every rank (rank {rank}: {why or 'usable'}); "
                               f"use exchange='auto' or 'collective'")
        return Exchange(topo, rank, group=None, device=device)
    return nvlink.NvlinkExchange(topo, rank, device, hidden_size, dtype,
                                 pair_capacity=cfg.limits.max_num_batched_tokens * top_k, top_k=top_k,
                                 timeout_ms=int(cfg.pg_timeout_s * 1000))


def _moe_info(model_dir: str, dtype: torch.dtype):
    """MoE shapes without building a model (a worker holds no attention)."""
    from moeserve.models import MoEInfo, load_config
    return MoEInfo.from_config(load_config(model_dir), dtype)


def run_step(st: RankState, header: StepHeader) -> RankResult:
    """This rank's part of one step, after the header (docs/dataplane.md, steps 2-4)."""
    res = RankResult(st.rank)
    mig = header.migration
    if mig is not None:
        if st.store is not None and mig.begin_staging_slots:
            res.staging_error = st.store.begin_staging(mig.begin_staging_slots)
        for c in mig.commits:
            if st.maps is not None:
                st.maps.set_layer(c.moe_layer, c.phy2log)
            if st.store is not None:
                st.store.commit(c.moe_layer, list(c.staged), c.phy2log)
        if st.store is not None:
            if mig.rollback:
                st.store.end_staging()
            if mig.moves:
                from moeserve.expert_worker.migration import run_moves
                run_moves(mig.moves, st.store, st.topo)
            if mig.end:
                st.store.end_staging()
    if header.report and st.store is not None:
        res.slot_digest = st.store.digest()
    router = st.topo.router_index(st.rank)
    if header.forward:
        if st.runner is not None:
            res.tokens, res.logits = st.runner.run(header.work[router], header.step)
            res.logical_load, res.worker_load = st.runner.experts.take_load()
        else:
            from moeserve.router.dispatcher import idle_walk
            idle_walk(st.exchange, st.num_layers, st.hidden_size, st.dtype, st.store)
    elif header.work and st.runner is not None:
        st.runner.release(header.work[router].release)
    return res


def step_loop(st: RankState) -> None:
    """The step driver: header, this rank's work, gather; until a stop header."""
    leader = st.rank == 0
    world = st.topo.world_size
    while True:
        box = [st.engine.next_header() if leader else None]
        dist.broadcast_object_list(box, src=0, group=st.control_group)
        header: StepHeader = box[0]
        if header.stop:
            return
        res = run_step(st, header)
        out = [None] * world if leader else None
        dist.gather_object(res, out, dst=0, group=st.control_group)
        if leader:
            st.engine.on_results(header, out)


def _watch_parent(pid: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != pid:
            os._exit(3)


def serve(cfg: ClusterConfig, rank: int, authkey: bytes, run_dir: str | None = None,
          control_host: str = "127.0.0.1", control_port: int = 0, metrics_port: int | None = None) -> int:
    """Build this rank and run its step loop until a stop header. The leader also serves the
    local channel on (control_host, control_port) and, when ``cfg.admin_port`` >= 0, the gRPC
    admin API (token from MOESERVE_ADMIN_TOKEN); with ``run_dir`` it writes ``admin.json`` and
    then ``control.json`` there once it is ready. With ``metrics_port`` (0: a free port) the
    rank serves Prometheus metrics on ``cfg.admin_host``; every rank's port reaches the leader
    in one gather at start (-1 for a rank without metrics), which reports them in its status."""
    st = None
    admin = None
    metrics = None
    try:
        if metrics_port is not None:                   # before the model loads: a slow start shows
            from moeserve.metrics import ProcessMetrics
            role = "router+worker" if cfg.colocated else "router" if rank < cfg.routers else "worker"
            metrics = ProcessMetrics(role, rank)
            metrics.serve(metrics_port, cfg.admin_host)
            log.info("metrics on http://%s:%d/metrics", cfg.admin_host, metrics.port)
        st = build(cfg, rank)
        ports = [None] * cfg.world_size if rank == 0 else None
        dist.gather_object(metrics.port if metrics else -1, ports, dst=0, group=st.control_group)
        if metrics is not None:
            _record_metrics(metrics, st, cfg)
        if st.engine is not None:
            st.engine.metrics_ports = {**{f"rank{r}": int(p) for r, p in enumerate(ports) if p >= 0},
                                       **dict(cfg.metrics_peers)}
            from moeserve.cluster.control import ControlServer
            server = ControlServer(st.engine, authkey, control_host, control_port)
            server.start()
            signal.signal(signal.SIGTERM, lambda *_: st.engine.request_stop())
            if cfg.admin_port >= 0:
                from moeserve.services.admin import start_admin     # the gRPC layer: only when asked for
                from moeserve.services.server import ADMIN
                admin = start_admin(st.engine, os.environ.get("MOESERVE_ADMIN_TOKEN") or None,
                                    (metrics.grpc_interceptor(ADMIN),) if metrics else ())
                if run_dir:
                    _write_json(os.path.join(run_dir, "admin.json"), {"host": cfg.admin_host, "port": admin.server.port})
                log.info("admin API on %s:%d", cfg.admin_host, admin.server.port)
            if run_dir:
                server.write_address(os.path.join(run_dir, "control.json"))
            log.info("leader ready: %d routers, %d workers, world %d, local channel on %s:%d",
                     cfg.routers, cfg.workers, cfg.world_size, *server.address)
        step_loop(st)
    except Exception as e:
        traceback.print_exc()
        if st is not None and st.engine is not None:
            st.engine.fail(f"rank {rank} failed: {type(e).__name__}: {e}")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if admin is not None:
        admin.stop()
    dist.destroy_process_group()
    return 0


def _record_metrics(metrics, st: RankState, cfg: ClusterConfig) -> None:
    """Hand this rank's roles what they record: the leader's step hook and state, the router's
    dispatch/combine timings."""
    from moeserve.metrics import LeaderMetrics, RouterMetrics
    if st.engine is not None:
        st.engine.metrics = LeaderMetrics(metrics.registry, st.engine, cfg.per_expert_metrics)
    if st.runner is not None:
        RouterMetrics(metrics.registry).instrument(st.runner.experts)


def _write_json(path: str, value) -> None:
    import json
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def main() -> int:
    rank = int(os.environ["RANK"])
    logging.basicConfig(level=os.environ.get("MOESERVE_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s")
    parent = os.environ.get("MOESERVE_PARENT_PID")
    if parent:
        threading.Thread(target=_watch_parent, args=(int(parent),), daemon=True).start()
    with open(os.environ["MOESERVE_CLUSTER_CONFIG"]) as f:
        cfg = ClusterConfig.from_json(f.read())
    port = os.environ.get("MOESERVE_METRICS_PORT")
    return serve(cfg, rank, bytes.fromhex(os.environ["MOESERVE_AUTHKEY"]), os.environ["MOESERVE_RUN_DIR"],
                 metrics_port=int(port) if port else None)


if __name__ == "__main__":
    sys.exit(main())
