"""One rank of a cluster: ``python -m moeserve.cluster.rank`` (the launcher starts it).

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torch.distributed),
MOESERVE_CLUSTER_CONFIG (path of the ClusterConfig JSON), MOESERVE_RUN_DIR (where the leader
writes control.json), MOESERVE_AUTHKEY (hex key of the local channel), MOESERVE_PARENT_PID
(exit when that process is gone: no orphans).

This module composes a rank from its roles (router runner and maps, worker store, the
leader's engine) and hands it to the data plane's step loop (``moeserve.dataplane.step``);
the main thread becomes the step driver (docs/dataplane.md). The leader also serves the local
channel, and runs ``cfg.leader_hook`` (``module:function``, e.g. the gRPC admin server the CLI
asks for): no module imported here at start imports gRPC or protobuf.
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
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from moeserve.cluster.recovery import join, make_exchange
from moeserve.config import ClusterConfig, default_breakeven, log_level
from moeserve.dataplane.step import RankState, step_loop
from moeserve.placement import Placement

if TYPE_CHECKING:  # the roles' modules are imported where a rank takes the role (build)
    from moeserve.expert_worker.store import ExpertStore
    from moeserve.router.dispatcher import RouterMaps
    from moeserve.router.engine.leader import Engine
    from moeserve.router.runner import RouterRunner

log = logging.getLogger("moeserve.rank")


@dataclass
class ComposedRank(RankState):
    """A rank as this module composes it: its roles' own classes (the step loop sees them
    through ``moeserve.dataplane.roles``; recovery, metrics and the leader's services here use
    more of them)."""

    runner: RouterRunner | None = None
    maps: RouterMaps | None = None
    store: ExpertStore | None = None
    leader: Engine | None = None
    metrics_port: int = -1  # this rank's Prometheus port (-1: none), in every new world's gather


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def initial_placement(cfg: ClusterConfig, num_layers: int, num_logical: int, num_groups: int = 1) -> Placement:
    """The placement a cluster starts with: cfg.phy2log, or slot p holding expert p mod E, or,
    with expert groups that divide over several nodes (``num_groups``, workers_per_node), each
    node holding its G / N consecutive groups, slot j of node k expert k E/N + j mod E/N (every
    group's replicas on one node, as the hierarchical policy keeps them); its break-even counts
    cfg.breakeven, or ``config.default_breakeven()`` (0 unless MOESERVE_EPLB_BREAKEVEN is set)
    for every layer and expert."""
    p = num_logical + cfg.eplb.num_redundant_experts
    nodes = cfg.workers // (cfg.workers_per_node or cfg.workers)
    if cfg.phy2log is not None:
        phy2log = np.asarray(cfg.phy2log, dtype=np.int64)
    elif nodes > 1 and num_groups > 1 and num_groups % nodes == 0 and num_logical % num_groups == 0:
        local, per_node = num_logical // nodes, p // nodes
        row = (np.arange(p) // per_node) * local + np.arange(p) % per_node % local  # [P]
        phy2log = np.tile(row.astype(np.int64), (num_layers, 1))
    else:
        phy2log = np.tile(np.arange(p, dtype=np.int64) % num_logical, (num_layers, 1))
    if cfg.breakeven is not None:
        b = np.asarray(cfg.breakeven, dtype=np.int64)
    else:
        b = np.full((num_layers, num_logical), default_breakeven(), dtype=np.int64)
    return Placement(
        phy2log=phy2log,
        num_logical=num_logical,
        num_workers=cfg.workers,
        workers_per_node=cfg.workers_per_node or cfg.workers,
        version=1,
        breakeven=b,
    )


_SERVER: list = []  # the leader's store server, kept for the process's life


def open_store(cfg: ClusterConfig, rank: int, secret: bytes):
    """The cluster's store (``moeserve.cluster.store``): only holders of ``secret`` reach it.
    The leader (rank 0, never replaced) serves it on MASTER_ADDR:MASTER_PORT, bound to that
    address only, not on every interface; every rank (the leader too) is its client."""
    from moeserve.cluster.nodes import startup_timeout_s
    from moeserve.cluster.store import AuthStore, serve

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    # another node's ranks may start minutes before node 0's store is up
    timeout = datetime.timedelta(seconds=startup_timeout_s(max(60.0, cfg.pg_timeout_s)))
    if rank == 0:
        _SERVER.append(serve(host, port, secret))
    return AuthStore(host, port, secret, timeout)


def build(cfg: ClusterConfig, rank: int, membership, metrics_port: int = -1) -> ComposedRank:
    """Load this rank's share of the model and join the process groups. A replacement (of a
    lost worker or router, joining a running cluster) loads what it can first (a router its
    model), then waits to be admitted into a generation, and loads the experts of the
    placement the leader sends it (docs/dataplane.md, "When a rank joins a running cluster")."""
    from moeserve.models import load_config, load_model, open_reader
    from moeserve.models.config import with_quantization

    if cfg.backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dtype = DTYPES[cfg.dtype]
    role = cfg.role(rank)
    replacing = membership.replacing()
    if replacing and role.router_index >= 0 and cfg.colocated:
        raise RuntimeError(
            f"rank {rank} (co-located) cannot rejoin a running cluster: its slots and sequences were lost with "
            f"it; restart the whole cluster"
        )

    def router_model():
        return load_model(
            cfg.model_dir,
            dtype=dtype,
            device=device,
            load_experts=False,
            load_format=cfg.load_format,
            quantization=cfg.quantization or None,
        )

    info_model = router_model() if replacing and role.router_index >= 0 else None
    if replacing:
        gen = membership.join_running(cfg.pg_timeout_s + 300.0)
        membership.gen = gen
        log.warning("rank %d (%s) joins the running cluster: generation %d", rank, role.name, gen.number)
    control = join(cfg, membership, device)

    mcfg = with_quantization(load_config(cfg.model_dir), cfg.quantization or None)
    if role.router_index >= 0:
        info_model = info_model or router_model()
        info = info_model.moe_info
    else:
        info = _moe_info(cfg.model_dir, dtype, cfg.quantization or None)
    e = info.num_logical_experts
    topo = membership.topology(e + cfg.eplb.num_redundant_experts)
    placement = initial_placement(cfg, info.num_moe_layers, e, info.num_expert_groups)
    if replacing:  # the placement in force
        placement = _placement_from_leader(control, placement)
    exchange = make_exchange(cfg, topo, membership.dist_rank, device, control, mcfg.hidden_size, dtype, info.top_k)
    st = ComposedRank(
        rank=rank,
        topo=topo,
        exchange=exchange,
        control_group=control,
        num_layers=info.num_moe_layers,
        hidden_size=mcfg.hidden_size,
        dtype=dtype,
        top_k=info.top_k,
        router=role.router_index if role.router_index >= 0 else None,
        metrics_port=metrics_port,
    )

    if role.worker_index >= 0:
        from moeserve.expert_worker.migration import run_moves
        from moeserve.expert_worker.store import ExpertStore

        # "dummy": every worker makes an expert from (seed, its name), so replicas are identical
        with open_reader(cfg.model_dir, cfg.load_format, device, quantization=cfg.quantization or None) as reader:
            st.store = ExpertStore.from_checkpoint(
                reader,
                info.expert_spec,
                role.worker_index,
                placement.phy2log,
                topo.num_workers,
                device,
                cfg.max_staging_bytes,
            )
        st.run_moves = partial(run_moves, store=st.store, topo=topo)
    if role.router_index >= 0:
        from moeserve.router.dispatcher import DistributedExperts, RouterMaps
        from moeserve.router.runner import RouterRunner

        st.maps = RouterMaps(
            placement.phy2log, e, cfg.eplb.num_redundant_experts + 1, device, breakeven=placement.breakeven
        )
        experts = DistributedExperts(
            exchange, st.maps, topo.router_index(membership.dist_rank) or 0, info.num_moe_layers, st.store
        )
        from moeserve.router.graphs import applies

        use_graphs, why = applies(info_model, exchange, st.store, cfg.enforce_eager)
        if not use_graphs and device.type == "cuda":
            log.info("decode steps run eagerly: %s", why)
        from moeserve.models.attention import PREFILL, PREFILL_BACKENDS, PREFILL_ENV

        if PREFILL["backend"] != "triton":  # a measurement switch: said where the run's logs show it
            log.info("%s=%s: %s", PREFILL_ENV, PREFILL["backend"], PREFILL_BACKENDS[PREFILL["backend"]])
        from moeserve.grammar import Compiler
        from moeserve.router.grammars import GrammarBook, default_threads

        # structured output: grammars compile with the model's vocabulary (xgrammar imported on
        # the first grammar, in the book's thread)
        tokenizer = Path(cfg.tokenizer_dir or cfg.model_dir) / "tokenizer.json"
        compiler = Compiler(tokenizer, mcfg.vocab_size, mcfg.eos_token_ids, threads=default_threads())
        st.runner = RouterRunner(
            info_model,
            experts,
            kv_blocks(cfg, mcfg, dtype, device),
            cfg.cache.block_size,
            graphs=(cfg.limits.max_num_seqs, cfg.limits.max_model_len, cfg.limits.max_num_batched_tokens)
            if use_graphs
            else None,
            async_outputs=cfg.async_scheduling,
            grammars=GrammarBook(compiler, mcfg.vocab_size, device),
        )
    if rank == 0:
        from moeserve.router.engine.api import ModelShape
        from moeserve.router.engine.leader import Engine

        shape = ModelShape(
            info.num_moe_layers,
            e,
            info.top_k,
            mcfg.vocab_size,
            tuple(mcfg.eos_token_ids),
            info.expert_bytes,
            tuple(int(x) for x in info.moe_layer_ids),
            mcfg.num_layers,
            num_expert_groups=info.num_expert_groups,
        )
        st.leader = Engine(cfg, shape, placement)
        if cfg.capture_graphs_at_start and st.runner is not None and st.runner.graphs is not None:
            st.leader.warm_up(st.runner.graphs.warmup_keys())  # every router has the same keys

    _warm_up_kernels(st, mcfg.vocab_size, device, min(cfg.limits.max_num_batched_tokens, cfg.limits.max_model_len))
    from moeserve.expert_worker.migration import warm_up_pairs

    warm_up_pairs(membership.dist_rank, membership.world_size, device)
    from moeserve.cluster import recovery

    st.recover = partial(recovery.recover, st, cfg, device, membership)
    st.regroup = partial(recovery.regroup, st, cfg, device, membership)
    if rank == 0:
        st.poll = membership.poll_joins
    return st


def _warm_up_kernels(st: ComposedRank, vocab_size: int, device: torch.device, max_fresh: int) -> None:
    """Compile, before the rank is ready, the Triton kernels whose launch configurations a
    step picks from its shape: the expert kernels' rows per pass (a worker), the race sampler
    with and without a threshold, the paged attention's decode and prefill tiles at every split
    for each kind of attention layer the model has (chunk, window, sinks; or the MLA kernel),
    the combine over k, the FP8 linears, the fused norms and RoPE and the fused routing of
    each MoE layer (a router), the direct exchange's kernels for every MoE layer (any rank);
    the table of tests/test_triton_specialization.py says which kernel is compiled where. Each is ~1 s of
    host time on an H200 host that a step would otherwise wait for, mid-serving."""
    if device.type != "cuda":
        return
    t0 = time.perf_counter()
    blocks = st.store.warm_up_kernels() if st.store is not None else []
    races = linears = attention = exchange = norms = routing = 0
    from moeserve import kernels
    from moeserve.dataplane.nvlink import NvlinkExchange

    if isinstance(st.exchange, NvlinkExchange):
        exchange = st.exchange.warm_up_kernels(st.maps, st.num_layers)
    if st.runner is not None and st.top_k > 1 and kernels.available():
        # the combine over k of a family that weighs the outputs (every one but Llama 4)
        kernels.weighted_sum(
            torch.zeros(st.top_k, st.hidden_size, dtype=st.dtype, device=device),
            torch.zeros(1, st.top_k, dtype=st.dtype, device=device),
        )
        exchange += 1
    if st.runner is not None:
        from moeserve import sampling
        from moeserve.models.attention import warm_up_attention
        from moeserve.models.quant import QuantLinear

        races = sampling.warm_up(vocab_size, device)
        model, cache = st.runner.model, st.runner.cache
        if kernels.available() and model.config.mla is not None:
            from moeserve.models.mla import warm_up_mla

            attn = model.layers[0].attn
            attention = warm_up_mla(
                cache.k[0], model.config.num_heads, model.config.mla, cache.block_size, attn.scale, max_fresh
            )
        elif kernels.available():
            attention = warm_up_attention(
                cache.k[0],
                cache.v[0],
                model.config.num_heads,
                cache.block_size,
                [(layer.attn.chunk, layer.attn.window, layer.attn.sinks) for layer in model.layers],
                model.layers[0].attn.scale,
                max_fresh,
            )
        norms = model.warm_up_norms()  # the fused norm and RoPE kernels
        routing = sum(block.warm_up(st.dtype) for block in model.moe_blocks)  # the fused routing
        fp8 = [q for q in st.runner.model.linears() if isinstance(q, QuantLinear)]
        if fp8 and kernels.available():
            linears = kernels.warm_up_fp8_linears(fp8, st.dtype)
    torch.cuda.synchronize(device)
    if blocks or races or linears or attention or exchange or norms or routing:
        log.info(
            "compiled the expert kernels for rows per pass %s, %d race sampler, %d paged attention, %d FP8 "
            "linear, %d norm and RoPE, %d routing, and %d exchange and combine launches in %.1f s",
            blocks,
            races,
            attention,
            linears,
            norms,
            routing,
            exchange,
            time.perf_counter() - t0,
        )


def _placement_from_leader(control, placement: Placement) -> Placement:
    """The leader's placement in force (maps and break-even counts), broadcast on the control
    group after a re-join."""
    box: list[Any] = [(placement.phy2log, placement.breakeven) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=control)
    return placement.evolve(phy2log=box[0][0], breakeven=box[0][1])


def kv_blocks(cfg: ClusterConfig, mcfg, dtype: torch.dtype, device: torch.device) -> int:
    """Blocks of this router's KV pool: ``num_gpu_blocks_override``, else what the memory left
    after the weights and the exchange's buffers allows (GPU: gpu_memory_utilization of the
    device, less room for one step's activations; CPU: cpu_kv_cache_gib), at most what
    max_num_seqs sequences of max_model_len tokens need."""
    from moeserve.models.mla import cache_class

    c, lim = cfg.cache, cfg.limits
    per_block = cache_class(mcfg).bytes_per_block(
        mcfg.num_layers, mcfg.cache_heads, mcfg.cache_dim, c.block_size, dtype
    )
    enough = lim.max_num_seqs * -(-lim.max_model_len // c.block_size) + 1
    if c.num_gpu_blocks_override:
        return c.num_gpu_blocks_override
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        # A step's activations: hidden states and MLP of max_num_batched_tokens tokens, and the
        # logits of max_num_seqs rows (fp32) with the sampler's temporaries.
        width = max(mcfg.intermediate_size, mcfg.hidden_size * 4)
        activations = (
            lim.max_num_batched_tokens * (mcfg.hidden_size * 8 + width * 3) * dtype.itemsize
            + lim.max_num_seqs * mcfg.vocab_size * 4 * 6
            + (1 << 30)
        )
        budget = int(total * c.gpu_memory_utilization) - used - activations
    else:
        budget = int(c.cpu_kv_cache_gib * (1 << 30))
    blocks = min(enough, budget // per_block)
    if blocks < 1:
        raise RuntimeError(
            f"no memory is left for the KV cache ({budget / 2**30:.2f} GiB after the weights and "
            f"activations; one block of {c.block_size} tokens needs {per_block} bytes): raise "
            f"gpu_memory_utilization, lower max_num_batched_tokens, or use more GPUs"
        )
    return int(blocks)


def _moe_info(model_dir: str, dtype: torch.dtype, quantization: str | None = None):
    """MoE shapes without building a model (a worker holds no attention)."""
    from moeserve.models import MoEInfo, load_config
    from moeserve.models.config import with_quantization

    return MoEInfo.from_config(with_quantization(load_config(model_dir), quantization), dtype)


def _watch_parent(pid: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != pid:
            os._exit(3)


def serve(
    cfg: ClusterConfig,
    rank: int,
    authkey: bytes,
    run_dir: str | None = None,
    control_host: str = "127.0.0.1",
    control_port: int = 0,
    metrics_port: int | None = None,
) -> int:
    """Build this rank and run its step loop until a stop header. The leader also serves the
    local channel on (control_host, control_port) and runs ``cfg.leader_hook`` with its engine;
    with ``run_dir`` it writes what the hook returns as ``<name>.json`` and then
    ``control.json`` there once it is ready. With ``metrics_port`` (0: a free port) the rank
    serves Prometheus metrics on ``cfg.host``; every rank's port (-1 for a rank without
    metrics) and KV blocks (0 for a worker) reach the leader in one gather at start: it reports
    the ports in its status and admits requests by the blocks."""
    st = None
    hooked = None
    metrics = None
    try:
        if metrics_port is not None:  # before the model loads: a slow start shows
            from moeserve.ops.metrics import ProcessMetrics

            metrics = ProcessMetrics(cfg.role(rank).name, rank)
            metrics.serve(metrics_port, cfg.host)
            log.info("metrics on http://%s:%d/metrics", cfg.host, metrics.port)
        from moeserve.cluster.recovery import Membership, report_members

        membership = Membership(cfg, rank, open_store(cfg, rank, authkey))
        if not membership.replacing():  # every rank of every node reached the store
            from moeserve.cluster.nodes import await_world, startup_timeout_s

            await_world(membership.store, rank, cfg.world_size, startup_timeout_s(max(60.0, cfg.pg_timeout_s)) + 10)
        st = build(cfg, rank, membership, metrics.port if metrics is not None and metrics.port is not None else -1)
        # every rank's (rank, metrics port, KV blocks), at start as in every new world; a
        # replacement's reaches the leader in the gather of the survivors' re-forming
        ports = report_members(st, membership)
        if metrics is not None:
            _record_metrics(metrics, st, cfg)
        if st.leader is not None:
            engine = st.leader
            assert ports is not None  # the leader took the gather
            engine.metrics_ports = {
                **{f"rank{r}": int(p) for r, p, _ in ports if p >= 0},
                **dict(cfg.metrics_peers),
            }
            engine.set_kv_capacity([b for r, _, b in sorted(ports) if cfg.role(r).router_index >= 0])
            membership.publish(membership.gen)
            from moeserve.router.engine.channel import ChannelServer

            server = ChannelServer(engine, authkey, control_host, control_port)
            server.start()
            signal.signal(signal.SIGTERM, lambda *_: engine.request_stop())
            if cfg.leader_hook:
                hooked = _load_hook(cfg.leader_hook)(engine, cfg.leader_hook_config, metrics)
                if run_dir:
                    _write_json(
                        os.path.join(run_dir, f"{hooked.name}.json"),
                        {"host": hooked.address[0], "port": hooked.address[1]},
                    )
                log.info("%s on %s:%d", hooked.name, *hooked.address)
            membership.store.set("running", "1")  # from now on a rank that starts is a replacement
            if run_dir:
                server.write_address(os.path.join(run_dir, "control.json"))
            log.info(
                "leader ready: %d routers, %d workers, world %d, local channel on %s:%d",
                cfg.routers,
                cfg.workers,
                cfg.world_size,
                *server.address,
            )
        from moeserve.kernels import compilelog
        from moeserve.ops import gcpause

        gcpause.freeze_startup_heap()  # full collections skip the start-up heap
        if cfg.backend == "nccl":
            compilelog.watch()  # every Triton compile from here on is logged
        step_loop(st)
    except Exception as e:
        traceback.print_exc()
        if st is not None and st.leader is not None:
            st.leader.fail(f"rank {rank} ({cfg.role(rank).name}) failed: {type(e).__name__}: {e}")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if hooked is not None:
        hooked.stop()
    dist.destroy_process_group()
    return 0


def _load_hook(spec: str):
    """``module:function`` -> the function (called on the leader as ``fn(engine, config_json,
    process_metrics)``; it returns an object with ``name``, ``address`` and ``stop()``)."""
    import importlib

    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _record_metrics(metrics, st: ComposedRank, cfg: ClusterConfig) -> None:
    """Hand this rank's roles what they record: the leader's step hook and state, the router's
    dispatch/combine timings."""
    from moeserve.ops.metrics import LeaderMetrics, RouterMetrics

    if st.leader is not None:
        st.leader.metrics = LeaderMetrics(metrics.registry, st.leader, cfg.per_expert_metrics)
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
    logging.basicConfig(
        level=log_level(),
        format=f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s",
    )
    parent = os.environ.get("MOESERVE_PARENT_PID")
    if parent:
        threading.Thread(target=_watch_parent, args=(int(parent),), daemon=True).start()
    with open(os.environ["MOESERVE_CLUSTER_CONFIG"]) as f:
        cfg = ClusterConfig.from_json(f.read())
    port = os.environ.get("MOESERVE_METRICS_PORT")
    return serve(
        cfg,
        rank,
        bytes.fromhex(os.environ["MOESERVE_AUTHKEY"]),
        os.environ["MOESERVE_RUN_DIR"],
        metrics_port=int(port) if port else None,
    )


if __name__ == "__main__":
    sys.exit(main())
