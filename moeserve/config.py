"""Configuration of a cluster: shapes, EPLB knobs (vLLM's names), serving limits, timeouts.

One ``ClusterConfig`` is written as JSON by the launcher and read by every rank, so all ranks
agree on it. Validation happens here, before any process starts.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields


def env_switch(name: str, default: str, on: str, off: str) -> bool:
    """A 0/1 environment variable (unset or empty: ``default``, "0" or "1"): whether it is 1.
    Anything else raises ValueError naming the variable and both values (``on`` / ``off``:
    what each does)."""
    mode = os.environ.get(name, default) or default
    if mode not in ("0", "1"):
        what = {"1": on, "0": off}
        other = "0" if default == "1" else "1"
        raise ValueError(
            f"{name}={mode!r}: allowed {default} (the default: {what[default]}) or {other} ({what[other]})"
        )
    return mode == "1"


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(env=None) -> str:
    """``MOESERVE_LOG_LEVEL`` of ``env`` (default: this process's environment): the logging
    level of every moeserve process (ranks, front ends, balancer), INFO unless set, any case.
    Anything else raises ValueError naming the variable and the levels, so that a cluster
    refuses it before starting a process, not in each rank's log."""
    raw = (os.environ if env is None else env).get("MOESERVE_LOG_LEVEL", "") or "INFO"
    if raw.upper() not in LOG_LEVELS:
        raise ValueError(f"MOESERVE_LOG_LEVEL={raw!r}: allowed {', '.join(LOG_LEVELS)} (any case; the default INFO)")
    return raw.upper()


@dataclass(frozen=True)
class Limits:
    """Serving limits, as vLLM names them. ``max_num_seqs`` and ``max_num_batched_tokens``
    apply per router rank; ``max_waiting`` bounds the admission queue (a full queue rejects
    new requests)."""

    max_model_len: int = 4096
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_waiting: int = 1024

    def __post_init__(self):
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class EplbConfig:
    """EPLB knobs with vLLM's names (``--eplb-config`` keys without the ``eplb_`` prefix).

    enable_eplb:           accept placements with redundant slots and record load for EPLB.
    num_redundant_experts: R, redundant slots per MoE layer (P = E + R); needs enable_eplb.
    window_size:           steps of load the balancer plans on.
    step_interval:         steps between periodic rebalances (the balancer's loop).
    log_balancedness:      log per-layer balancedness every step_interval steps.
    """

    enable_eplb: bool = False
    num_redundant_experts: int = 0
    window_size: int = 1000
    step_interval: int = 3000
    log_balancedness: bool = False

    def __post_init__(self):
        if self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be >= 0, got {self.num_redundant_experts}")
        if self.num_redundant_experts and not self.enable_eplb:
            raise ValueError("num_redundant_experts > 0 needs enable_eplb")
        if self.window_size < 1:
            raise ValueError(f"eplb window_size must be >= 1, got {self.window_size}")
        if self.step_interval < 1:
            raise ValueError(f"eplb step_interval must be >= 1, got {self.step_interval}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache of every router rank, with vLLM's names.

    block_size:              tokens per KV block.
    gpu_memory_utilization:  the share of the GPU's memory this rank may use in all; the KV
                             pool gets what is left of it after the weights, the exchange's
                             buffers and room for a step's activations.
    num_gpu_blocks_override: use exactly this many blocks per router (0: size from memory).
    cpu_kv_cache_gib:        on CPU ranks (gloo), the pool's size in GiB (vLLM's
                             VLLM_CPU_KVCACHE_SPACE), at most what max_num_seqs sequences of
                             max_model_len tokens need.
    enable_prefix_caching:   full blocks are shared between requests by the hash of their
                             tokens, and kept cached when freed (docs/engine.md, "Prefix
                             caching").
    """

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int = 0
    cpu_kv_cache_gib: float = 1.0
    enable_prefix_caching: bool = True

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override < 0:
            raise ValueError(
                f"num_gpu_blocks_override must be >= 0 (0 = size from memory), got {self.num_gpu_blocks_override}"
            )
        if self.cpu_kv_cache_gib <= 0:
            raise ValueError(f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")


EXCHANGES = ("auto", "collective", "nvlink")
ROUTING_POLICIES = ("cache_aware", "round_robin")  # which router a new sequence goes to (scheduler.py)
QUANTIZATIONS = ("", "fp8")  # --quantization (moeserve.models.quant; config imports no torch)
LOAD_FORMATS = ("auto", "dummy")  # as moeserve.models.dummy.LOAD_FORMATS (config imports no torch)


def check_topology(routers: int, workers: int, colocated: bool, num_slots: int | None = None) -> None:
    """ValueError unless R routers and W workers (co-located or not) can hold ``num_slots`` slots
    per MoE layer (P = E + R must split evenly over W). The one place these rules are checked."""
    if routers < 1 or workers < 1:
        raise ValueError(f"need at least one router and one worker, got routers={routers}, workers={workers}")
    if colocated and routers != workers:
        raise ValueError(
            f"co-located ranks are each router and worker: routers ({routers}) must equal workers ({workers})"
        )
    if num_slots is not None and num_slots % workers:
        raise ValueError(
            f"(E + R) % W != 0: {num_slots} slots per MoE layer cannot be split evenly over "
            f"W={workers} workers; choose num_redundant_experts so that E + R is a multiple of W"
        )


def rank_layout(routers: int, workers: int, colocated: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(router ranks, worker ranks) of the world: routers first, then workers; co-located ranks
    ``0 .. N-1`` are each both. The one place this rule is written."""
    if colocated:
        ranks = tuple(range(routers))
        return ranks, ranks
    return tuple(range(routers)), tuple(range(routers, routers + workers))


@dataclass(frozen=True)
class RankRole:
    """What one rank of the world is: router index and worker index (-1 when it is not one)."""

    rank: int
    router_index: int
    worker_index: int

    @property
    def name(self) -> str:
        """ "router", "worker" or "router+worker" (as status and metrics label it)."""
        if self.router_index >= 0 and self.worker_index >= 0:
            return "router+worker"
        return "router" if self.router_index >= 0 else "worker"


BREAKEVEN_ENV = "MOESERVE_EPLB_BREAKEVEN"


def default_breakeven() -> int:
    """The break-even count b (one integer for every MoE layer and expert) of a cluster's start
    placement when that placement carries none (``ClusterConfig.breakeven`` None: no b in the
    --state-dir or --init-expert-location placement, none given to LocalCluster):
    ``MOESERVE_EPLB_BREAKEVEN`` when set in the ranks' environment, else 0 (every replica
    always used). Every later placement (ApplyPlacement, the balancer) carries its own b."""
    raw = os.environ.get(BREAKEVEN_ENV, "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{BREAKEVEN_ENV} must be an integer count of tokens (0 = off), got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{BREAKEVEN_ENV} must be >= 0 (0 = off), got {value}")
    return value


MAX_LATE_SCHEDULING_MARGIN_MS = 100.0


@dataclass(frozen=True)
class ClusterConfig:
    """Everything every rank must agree on.

    phy2log: the initial placement [L][P] (None: slot p holds logical expert p mod E).
    breakeven: the initial placement's break-even counts [L][E] (None: ``default_breakeven()``).
    migration_bytes_per_step: byte budget of weight moves per destination worker per step.
    max_staging_bytes: a worker refuses a migration whose staging would exceed this (the
    migration fails and rolls back, serving goes on).
    heartbeat_s: the longest gap between two steps; pg_timeout_s: process-group timeout.
    recovery_settle_s: after a failed step, how long the leader waits for a router that
    neither reported the failure nor was marked lost by the launcher before the world
    re-forms without it (docs/dataplane.md, "When a step fails").
    host: where ranks serve their endpoints (metrics).
    leader_hook: ``module:function`` the leader calls with its engine once it is ready, e.g.
    ``moeserve.services.admin:serve_admin`` (the gRPC admin API, which the launcher asks for
    with ``admin_port``); leader_hook_config: the JSON text handed to it. Ranks themselves never
    import gRPC; secrets (the admin token) come from the environment, never from this file.
    per_expert_metrics: the leader's per-expert series (auto: while L x E <= 4096, on, off);
    metrics_peers: (name, port) of the metrics endpoints of other services (the balancer, the
    front end) that the leader reports in its status, beside every rank's.
    exchange: how rows travel per MoE layer: "collective" (all-to-all on the data group, any
    backend), "nvlink" (direct stores into peers' symmetric memory: one host, CUDA, Triton;
    moeserve.dataplane.nvlink), "auto" (nvlink where every rank can run it, else collective).
    load_format: "auto" reads the checkpoint's safetensors files; "dummy" (vLLM's name) makes
    seeded random weights on each rank's device from config.json alone, the same bytes for a
    tensor or expert on every rank (moeserve.models.dummy).
    state_dir: the leader keeps the placement in force (and the admin service the balancer's
    settings) there, replaced atomically on every change (moeserve.state; "" = nowhere).
    enforce_eager: never replay decode steps as CUDA graphs (vLLM's name; graphs need CUDA and
    the direct exchange: moeserve.router.graphs).
    async_scheduling: the leader learns a step's sampled tokens one step late, so that it
    schedules step N+1 while the GPUs run step N (vLLM's name; docs/dataplane.md, "Asynchronous
    steps"); False: every step's tokens come back in its own gather.
    late_scheduling: with async_scheduling, the leader schedules step N+1 just before the GPUs
    are expected to finish step N rather than when they start it, so that a request arriving
    meanwhile joins step N+1, one step earlier (moeserve.router.engine.pacing; docs/dataplane.md,
    "Late scheduling"); late_scheduling_margin_ms: how long before that end the next step should
    be enqueued.
    capture_graphs_at_start: before serving, the leader runs warm-up steps that make every router
    compile and capture its decode graph of every (bucket, attention split) key (the default, as
    vLLM does); False: on a key's first two uses while serving, which costs those steps' latency.
    load_read_steps: routers keep the expert load on the device and send it every this many
    forward steps (and when the load is asked for, before a commit, and when the cluster goes
    idle), not every step.
    quantization: "fp8" serves a bf16 checkpoint with FP8 experts and MLPs, quantized at load
    (vLLM's ``--quantization fp8``); "" serves the checkpoint as its quantization_config says.
    seed: the seed of the leader's stream of seeds for requests that give none (vLLM's
    ``--seed``: the same requests in the same order sample the same tokens on every run); None:
    each such request gets a random seed.
    routing_policy: which router a new sequence goes to: "cache_aware" (the one holding its
    longest cached prefix, balanced against the routers' running sequences) or "round_robin"
    (``moeserve.router.engine.scheduler``).
    tokenizer_dir: the folder whose ``tokenizer.json`` the routers compile structured output's
    grammars with (the front end's ``--tokenizer``; "" = ``model_dir``).
    """

    model_dir: str
    routers: int = 1
    workers: int = 1
    colocated: bool = False
    backend: str = "gloo"
    dtype: str = "float32"
    eplb: EplbConfig = field(default_factory=EplbConfig)
    limits: Limits = field(default_factory=Limits)
    cache: CacheConfig = field(default_factory=CacheConfig)
    workers_per_node: int = 0  # 0: all workers on one node
    phy2log: tuple | None = None
    breakeven: tuple | None = None
    migration_bytes_per_step: int = 512 << 20
    max_staging_bytes: int = 0  # 0: staging limited only by the device's memory
    heartbeat_s: float = 0.1
    pg_timeout_s: float = 30.0
    recovery_settle_s: float = 3.0
    host: str = "127.0.0.1"
    leader_hook: str = ""
    leader_hook_config: str = ""
    per_expert_metrics: str = "auto"
    metrics_peers: tuple = ()
    exchange: str = "auto"
    load_format: str = "auto"
    state_dir: str = ""
    enforce_eager: bool = False
    async_scheduling: bool = True
    late_scheduling: bool = True
    late_scheduling_margin_ms: float = 1.0
    capture_graphs_at_start: bool = True
    load_read_steps: int = 16
    quantization: str = ""  # "" (the checkpoint's own) or "fp8" (vLLM's --quantization)
    seed: int | None = None
    routing_policy: str = "cache_aware"
    tokenizer_dir: str = ""  # the folder of the tokenizer.json grammars compile with ("": model_dir)

    def __post_init__(self):
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' (CPU) or 'nccl' (GPU), got {self.backend!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        check_topology(self.routers, self.workers, self.colocated)
        if not 0 <= self.late_scheduling_margin_ms <= MAX_LATE_SCHEDULING_MARGIN_MS:
            raise ValueError(
                f"late_scheduling_margin_ms must be in [0, {MAX_LATE_SCHEDULING_MARGIN_MS:g}] (milliseconds), "
                f"got {self.late_scheduling_margin_ms}"
            )
        if self.load_read_steps < 1:
            raise ValueError(f"load_read_steps must be >= 1, got {self.load_read_steps}")
        wpn = self.workers_per_node or self.workers
        if self.workers % wpn:
            raise ValueError(f"workers ({self.workers}) must be a multiple of workers_per_node ({wpn})")
        if self.heartbeat_s <= 0 or self.pg_timeout_s <= 0 or self.recovery_settle_s <= 0:
            raise ValueError("heartbeat_s, pg_timeout_s and recovery_settle_s must be > 0")
        if self.leader_hook and ":" not in self.leader_hook:
            raise ValueError(f"leader_hook must be 'module:function', got {self.leader_hook!r}")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {self.exchange!r}")
        if self.exchange == "nvlink" and self.backend != "nccl":
            raise ValueError("exchange='nvlink' needs backend='nccl' (CUDA devices); use 'auto' or 'collective'")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS[1:]} (or unset), got {self.quantization!r}")
        if self.routing_policy not in ROUTING_POLICIES:
            raise ValueError(f"routing_policy must be one of {ROUTING_POLICIES}, got {self.routing_policy!r}")
        if self.per_expert_metrics not in ("auto", "on", "off"):
            raise ValueError(f"per_expert_metrics must be auto, on or off, got {self.per_expert_metrics!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be None or an integer >= 0, got {self.seed!r}")

    @property
    def world_size(self) -> int:
        return self.routers if self.colocated else self.routers + self.workers

    @property
    def worker_ranks(self) -> tuple[int, ...]:
        return rank_layout(self.routers, self.workers, self.colocated)[1]

    def role(self, rank: int) -> RankRole:
        routers, workers = rank_layout(self.routers, self.workers, self.colocated)
        return RankRole(
            rank, routers.index(rank) if rank in routers else -1, workers.index(rank) if rank in workers else -1
        )

    def to_json(self) -> str:
        d = asdict(self)
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> ClusterConfig:
        d = json.loads(text)
        d["eplb"] = EplbConfig(**d["eplb"])
        d["limits"] = Limits(**d["limits"])
        d["cache"] = CacheConfig(**d.get("cache", {}))
        if d.get("phy2log") is not None:
            d["phy2log"] = tuple(tuple(r) for r in d["phy2log"])
        if d.get("breakeven") is not None:
            d["breakeven"] = tuple(tuple(r) for r in d["breakeven"])
        d["metrics_peers"] = tuple((str(n), int(p)) for n, p in d.get("metrics_peers", ()))
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


ADMIN_HOOK = "moeserve.services.admin:serve_admin"


def admin_hook(
    port: int,
    host: str = "127.0.0.1",
    tls_cert: str = "",
    tls_key: str = "",
    max_message_bytes: int = 64 << 20,
    grace_s: float = 30.0,
) -> dict:
    """The ClusterConfig fields that make the leader serve the gRPC admin API on (host, port)
    (0: a free port, written to ``admin.json`` in the run folder): ``leader_hook`` and
    ``leader_hook_config``. Checked here, before any process starts; the token comes from the
    leader's environment (MOESERVE_ADMIN_TOKEN)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"admin_port must be -1 (no admin API), 0 (any free port) or a port, got {port}")
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("admin TLS needs both a certificate and a key")
    if max_message_bytes < 1024:
        raise ValueError(f"max_message_bytes must be >= 1024, got {max_message_bytes}")
    if grace_s < 0:
        raise ValueError(f"grace_s must be >= 0, got {grace_s}")
    return dict(
        leader_hook=ADMIN_HOOK,
        leader_hook_config=json.dumps(
            dict(
                host=host,
                port=port,
                tls_cert=tls_cert or None,
                tls_key=tls_key or None,
                max_message_bytes=max_message_bytes,
                grace_s=grace_s,
            )
        ),
    )
