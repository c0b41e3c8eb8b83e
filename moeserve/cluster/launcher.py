"""``LocalCluster``: start a cluster of rank processes on this machine, use it, tear it down.

    with LocalCluster(model_dir, routers=1, workers=2, num_redundant_experts=4) as c:
        out = c.generate([[1, 2, 3]], max_tokens=24)      # generated ids per prompt
        c.apply_placement(new_phy2log, wait=True)         # migrate live

The launcher spawns one process per rank (``python -m moeserve.cluster.rank``, never a fork),
watches them every 0.2 s, and when one exits unexpectedly kills the others and fails every
pending call with a ``ClusterError`` naming the rank, its exit code and the end of its log.
Ranks also exit when the launcher's process goes away (no orphans).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from moeserve.cluster.nodes import NodeLayout
from moeserve.config import CacheConfig, ClusterConfig, EplbConfig, Limits, admin_hook, check_topology, log_level
from moeserve.ops import ports
from moeserve.ops.procs import child_env, describe_exit, module_command, set_death_signal
from moeserve.placement import MigrationProgress, MigrationState, Placement
from moeserve.router.engine.api import (
    EngineStatus,
    Failed,
    Finished,
    FirstToken,
    GenerateRequest,
    LoadReport,
    Token,
)
from moeserve.router.engine.channel import ClusterError, EngineClient
from moeserve.sampling import SamplingParams

RESTART_WINDOW_S = 60.0  # more replacements of one rank than max_restarts within this: a crash loop


def free_port() -> int:
    """A free port outside the kernel's ephemeral range (``moeserve.ops.ports.free_port``)."""
    return ports.free_port()


@dataclass(frozen=True)
class Generation:
    """One prompt's result: generated ids (prompt excluded), finish reason, the logits
    each token was sampled from (float32 [n, V]) when asked for, and the prompt tokens read from
    the prefix cache instead of computed."""

    token_ids: list[int]
    finish_reason: str
    logits: np.ndarray | None = None
    cached_tokens: int = 0


@dataclass(frozen=True)
class LaunchOptions:
    """How ``LocalCluster`` starts, serves and watches its ranks, beside the ``ClusterConfig``
    they all share.

    startup_timeout_s: how long the ranks may take to become ready. env: extra environment of
    every rank. log_dir: the ranks' logs (default: the run folder, removed at stop).
    admin_port: the leader serves the gRPC admin API there (-1: none, 0: a free port; see
    ``LocalCluster.admin_address``), on admin_host, guarded by admin_token (handed to the leader
    in its environment), over TLS with admin_tls_cert and admin_tls_key; max_message_bytes and
    grace_s are that server's. metrics_ports: one Prometheus port per rank (0: a free one), or
    None for no metrics. max_restarts: how many times a lost rank (an expert worker, or a router
    other than the leader) is replaced within a minute before the cluster gives up (0: never
    replaced). nodes: this launcher's node of a cluster over several hosts (it starts that
    node's ranks; ``moeserve.cluster.nodes``), None for one host; authkey: the cluster's secret,
    the same on every node (default: a fresh one, for one host).
    """

    startup_timeout_s: float = 300.0
    env: tuple[tuple[str, str], ...] = ()
    log_dir: str | None = None
    admin_port: int = -1
    admin_host: str = "127.0.0.1"
    admin_token: str | None = None
    admin_tls_cert: str = ""
    admin_tls_key: str = ""
    max_message_bytes: int = 64 << 20
    grace_s: float = 30.0
    metrics_ports: tuple[int, ...] | None = None
    max_restarts: int = 3
    nodes: NodeLayout | None = None
    authkey: bytes = field(default=b"", repr=False)

    def __post_init__(self):
        if not -1 <= self.admin_port <= 65535:
            raise ValueError(
                f"admin_port must be -1 (no admin API), 0 (any free port) or a port, got {self.admin_port}"
            )
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.nodes is not None and self.nodes.nnodes > 1 and not self.authkey:
            raise ValueError(
                "a cluster over several nodes needs the cluster's secret (authkey), the same on every node"
            )

    def leader_hook(self) -> dict:
        """The ClusterConfig fields that make the leader serve the admin API ({} without one)."""
        if self.admin_port < 0:
            return {}
        return admin_hook(
            self.admin_port,
            self.admin_host,
            self.admin_tls_cert,
            self.admin_tls_key,
            self.max_message_bytes,
            self.grace_s,
        )


_SECTIONS = {"eplb": EplbConfig, "limits": Limits, "cache": CacheConfig}
_SECTION_OF = {f.name: section for section, cls in _SECTIONS.items() for f in fields(cls)}
_LAUNCH_KEYS = {f.name for f in fields(LaunchOptions)}
# ClusterConfig fields that LocalCluster derives (from the model folder, a placement, LaunchOptions)
_DERIVED = {"model_dir", "phy2log", "breakeven", "leader_hook", "leader_hook_config", *_SECTIONS}
_CLUSTER_KEYS = {f.name for f in fields(ClusterConfig)} - _DERIVED


def configure(model_dir, placement=None, breakeven=None, **keywords) -> tuple[ClusterConfig, LaunchOptions]:
    """``LocalCluster``'s keywords as the ``ClusterConfig`` every rank shares and this launcher's
    ``LaunchOptions``: each keyword goes to the config section that has a field of its name
    (``ClusterConfig``, ``EplbConfig``, ``Limits``, ``CacheConfig``, ``LaunchOptions``; vLLM's
    names), so none is listed twice. ``placement`` (phy2log [L, P] or a Placement) and
    ``breakeven`` ([L, E]) are the start placement; LocalCluster checks both against the model."""
    top: dict[str, Any] = {}
    launch: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    unknown = []
    for key, value in keywords.items():
        if key in _SECTION_OF:
            sections[_SECTION_OF[key]][key] = value
        elif key in _LAUNCH_KEYS:
            launch[key] = value
        elif key in _CLUSTER_KEYS:
            top[key] = value
        else:
            unknown.append(key)
    if unknown:
        allowed = sorted(_CLUSTER_KEYS | _LAUNCH_KEYS | set(_SECTION_OF) | {"placement", "breakeven"})
        raise TypeError(f"LocalCluster got unknown keywords {sorted(unknown)}; it takes {', '.join(allowed)}")
    if "env" in launch:
        launch["env"] = tuple(sorted((str(k), str(v)) for k, v in dict(launch["env"] or {}).items()))
    if launch.get("metrics_ports") is not None:
        launch["metrics_ports"] = tuple(int(p) for p in launch["metrics_ports"])
    opts = LaunchOptions(**launch)
    top.setdefault("host", opts.admin_host)
    for key in ("state_dir", "tokenizer_dir"):
        if top.get(key):
            top[key] = os.path.abspath(top[key])
    if "metrics_peers" in top:
        top["metrics_peers"] = tuple(sorted((str(k), int(v)) for k, v in dict(top["metrics_peers"] or {}).items()))
    if breakeven is None and isinstance(placement, Placement):
        breakeven = placement.breakeven
    config = ClusterConfig(
        model_dir=os.path.abspath(os.fspath(model_dir)),
        eplb=EplbConfig(**sections["eplb"]),
        limits=Limits(**sections["limits"]),
        cache=CacheConfig(**sections["cache"]),
        phy2log=None
        if placement is None
        else tuple(tuple(int(x) for x in row) for row in np.asarray(getattr(placement, "phy2log", placement))),
        breakeven=None if breakeven is None else tuple(tuple(int(x) for x in row) for row in np.asarray(breakeven)),
        **top,
    )
    return config, opts


class LocalCluster:
    """A cluster of router and expert-worker processes on this machine, from a ``ClusterConfig``
    (what every rank shares) and ``LaunchOptions`` (how this launcher starts and watches them):
    ``LocalCluster(config=cfg, launch=opts)``. As a convenience, keywords build both
    (``configure``): ``LocalCluster(model_dir, routers=1, workers=2, num_redundant_experts=2,
    enable_eplb=True, max_model_len=256, admin_port=0)``.

    routers, workers: R and W; colocated=True makes N = R = W ranks that are each both.
    num_redundant_experts: redundant slots per MoE layer ((E + R) % W must be 0).
    placement: initial phy2log [L, P] (default: slot p holds expert p mod E), or a Placement
    (its maps and break-even counts).
    breakeven: the initial placement's break-even counts b, [L, E] (default: a Placement's own,
    else ``MOESERVE_EPLB_BREAKEVEN`` in ``env`` or 0: every replica always used).
    backend: "gloo" (CPU) or "nccl" (one GPU per rank).
    load_format: "auto" (the checkpoint's files) or "dummy" (seeded random weights made on each
    rank's device from config.json alone; moeserve.models.dummy).
    enable_prefix_caching (default True) and routing_policy ("cache_aware" or "round_robin"):
    prefix caching and which router a new request goes to (docs/engine.md, "Prefix caching").
    """

    def __init__(
        self,
        model_dir=None,
        routers: int = 1,
        workers: int = 1,
        colocated: bool = False,
        num_redundant_experts: int = 0,
        backend: str = "gloo",
        *,
        config: ClusterConfig | None = None,
        launch: LaunchOptions | None = None,
        **keywords,
    ):
        from moeserve.cluster.rank import DTYPES
        from moeserve.models import MoEInfo, load_config
        from moeserve.models.checkpoint import check_quantized_tensors
        from moeserve.models.config import with_quantization

        if config is None:
            if model_dir is None:
                raise TypeError("LocalCluster needs a model folder (or config=ClusterConfig(...))")
            config, built = configure(
                model_dir,
                routers=routers,
                workers=workers,
                colocated=colocated,
                num_redundant_experts=num_redundant_experts,
                enable_eplb=keywords.pop("enable_eplb", True),
                backend=backend,
                **keywords,
            )
            launch = launch or built
        elif model_dir is not None or keywords:
            raise TypeError("give LocalCluster a config or keywords, not both")
        launch = launch or LaunchOptions()
        # a bad checkpoint, or a quantization it does not declare, fails here (headers only)
        mcfg = with_quantization(load_config(config.model_dir), config.quantization or None)
        if config.load_format == "auto":
            check_quantized_tensors(config.model_dir, mcfg)
        info = MoEInfo.from_config(mcfg, DTYPES[config.dtype])
        num_slots = info.num_logical_experts + config.eplb.num_redundant_experts
        check_topology(config.routers, config.workers, config.colocated, num_slots)
        if config.breakeven is not None:
            from moeserve.placement import check_breakeven

            check_breakeven(np.asarray(config.breakeven), info.num_moe_layers, info.num_logical_experts)
        if config.phy2log is not None:
            p = Placement(
                phy2log=np.asarray(config.phy2log),
                num_logical=info.num_logical_experts,
                num_workers=config.workers,
                workers_per_node=config.workers_per_node or config.workers,
                version=1,
            )
            if p.phy2log.shape != (info.num_moe_layers, num_slots):
                raise ValueError(
                    f"placement has shape {p.phy2log.shape}, expected (L, P) = ({info.num_moe_layers}, {num_slots})"
                )
        if launch.nodes is not None:
            from moeserve.cluster.nodes import check_layout

            check_layout(config.routers, config.workers, config.colocated, launch.nodes.nnodes, config.workers_per_node)
        if launch.metrics_ports is not None and len(launch.metrics_ports) != config.world_size:
            raise ValueError(
                f"metrics_ports needs one port per rank ({config.world_size}), got {len(launch.metrics_ports)}"
            )
        self.config = replace(config, **launch.leader_hook())
        self.launch = launch
        self.metrics_ports = None if launch.metrics_ports is None else list(launch.metrics_ports)
        self.moe_info = info
        self.vocab_size = mcfg.vocab_size
        self.startup_timeout_s = launch.startup_timeout_s
        self.env = dict(launch.env)
        log_level({**os.environ, **self.env})  # the ranks' level: refused here, not in each rank's log
        if launch.admin_token:
            self.env["MOESERVE_ADMIN_TOKEN"] = launch.admin_token
        self.admin_address: tuple[str, int] | None = None
        self.authkey: bytes | None = None
        self._authkey = b""  # the cluster's secret (the ranks' store, the local channel), set at start
        self.log_dir = launch.log_dir
        self.procs: list[subprocess.Popen | None] = []  # by rank; None for a rank of another node
        self.node = launch.nodes
        self.remote = self.node is not None and self.node.node_rank > 0  # a node without the leader
        self.ended = False  # a remote node: the leader stopped the cluster and every rank here exited 0
        self.run_dir: str | None = None
        self.error: str | None = None
        self.max_restarts = launch.max_restarts
        self.replaced: list[tuple[int, int, float]] = []  # (rank, exit code, time) of each replacement
        self.gave_up: str | None = None  # why a lost rank was not replaced (the restart limit)
        self._store: Any = None  # a client of the ranks' store (the launcher marks lost ranks in it)
        self._stopping = False
        self._client: EngineClient | None = None
        self._monitor: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> LocalCluster:
        from moeserve import envs

        envs.warn_unknown({**os.environ, **self.env})  # the ranks' environment: a typo is said once, here
        authkey = self.launch.authkey or secrets.token_bytes(16)
        self._authkey = authkey
        node = self.node
        addr, port = (node.master_addr, node.master_port) if node is not None else ("127.0.0.1", free_port())
        if self.remote:  # node 0's config, read from its store
            from moeserve.cluster import nodes

            assert node is not None
            try:
                self.config = nodes.config_from_leader(
                    nodes.open_store(node, authkey, self.startup_timeout_s), self.config, self.startup_timeout_s
                )
            except Exception as e:
                raise ClusterError(f"node {node.node_rank} cannot join node 0 at {addr}:{port}: {e}") from None
        cfg = self.config
        here = node.ranks(cfg.world_size) if node is not None else range(cfg.world_size)
        self.run_dir = tempfile.mkdtemp(prefix="moeserve-cluster-")
        logs = self.log_dir or self.run_dir
        os.makedirs(logs, exist_ok=True)
        cfg_path = os.path.join(self.run_dir, "cluster.json")
        with open(cfg_path, "w") as f:
            f.write(cfg.to_json())
        base = child_env(**self.env)
        base.update(
            MASTER_ADDR=addr,
            MASTER_PORT=str(port),
            WORLD_SIZE=str(cfg.world_size),
            MOESERVE_CLUSTER_CONFIG=cfg_path,
            MOESERVE_RUN_DIR=self.run_dir,
            MOESERVE_AUTHKEY=authkey.hex(),
            MOESERVE_PARENT_PID=str(os.getpid()),
            MOESERVE_STARTUP_TIMEOUT_S=str(self.startup_timeout_s),
        )
        if cfg.backend == "gloo":
            base.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        self.log_paths = []
        self._envs = []
        for rank in range(cfg.world_size):
            env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank - here.start))
            if self.metrics_ports is not None:
                env["MOESERVE_METRICS_PORT"] = str(self.metrics_ports[rank])
            self._envs.append(env)
            path = os.path.join(logs, f"rank{rank}.log")
            self.log_paths.append(path)
            if rank not in here:  # another node starts it
                self.procs.append(None)
                continue
            out = open(path, "wb")
            self.procs.append(
                subprocess.Popen(
                    module_command("moeserve.cluster.rank"),
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    preexec_fn=set_death_signal,
                )
            )
            out.close()
        # The monitor also starts replacements: they die with the thread that started them (PDEATHSIG).
        self._monitor = threading.Thread(target=self._watch, name="cluster-monitor", daemon=True)
        self._monitor.start()
        if node is not None and node.nnodes > 1:
            from moeserve.cluster.nodes import NodeStart

            start = NodeStart(node, authkey, cfg, self.startup_timeout_s)
            started = start.wait(lambda: self.error, self.run_dir, remote=self.remote)
            if started is not True:
                self.stop(timeout_s=0.0)  # no leader to stop them in order: a rank here waits for peers
                raise ClusterError(f"{started} (logs: {logs})")
            if self.remote:
                return self
        ready_path = os.path.join(self.run_dir, "control.json")
        deadline = time.monotonic() + self.startup_timeout_s
        while not os.path.exists(ready_path):
            if self.error:
                self.stop()
                raise ClusterError(self.error)
            if time.monotonic() > deadline:
                self.stop()
                raise ClusterError(
                    f"the cluster did not become ready within {self.startup_timeout_s:.0f} s (logs: {logs})"
                )
            time.sleep(0.05)
        with open(ready_path) as f:
            addr = json.load(f)
        if cfg.leader_hook:
            with open(os.path.join(self.run_dir, "admin.json")) as f:
                a = json.load(f)
            self.admin_address = (a["host"], a["port"])
        self.authkey = authkey
        self._client = EngineClient((addr["host"], addr["port"]), authkey, on_failure=self._failure)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask the leader to stop every rank, wait for them, kill what is left."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        if self._client is not None and self.error is None:
            try:
                self._client.request_stop()
            except Exception:
                pass
        elif self.remote:  # no leader here to stop the ranks: they go now
            timeout_s = 0.0
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            if p is None:
                continue
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._kill_all()
        # The run folder holds the config and the addresses, and the logs unless log_dir has them:
        # it goes, except when a failed cluster's logs are in it.
        if self.run_dir and (self.log_dir or self.error is None):
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _kill_all(self) -> None:
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 5
        for p in self.procs:
            if p is None:
                continue
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _watch(self) -> None:
        from moeserve.cluster.nodes import LeaderWatch

        leader = LeaderWatch(self.node, self._authkey) if self.remote and self.node is not None else None
        while True:
            time.sleep(0.2)
            if self._stopping:
                return
            exited = self._exited()
            if leader is not None and self._leader_gone(leader, exited):
                return
            if exited:
                time.sleep(0.3)  # let peers that saw the failure exit too
                exited = self._exited()
                if leader is not None and leader.gone(force=True):  # they died of losing the leader
                    self._leader_gone(leader, exited, known=True)
                    return
                if self._replace(exited):
                    continue
                # A rank killed by a signal is the likely cause; the others died of losing it.
                exited.sort(key=lambda rc: (rc[1] >= 0, rc[0]))
                first, code = exited[0]
                what = "; ".join(
                    f"rank {r} ({self.config.role(r).name}) exited with {describe_exit(c)}" for r, c in exited
                )
                if self.gave_up:
                    what = f"{what}; {self.gave_up}"
                self.error = f"{what}\n--- end of rank {first}'s log ---\n{self._log_tail(first)}"
                self._kill_all()
                return

    def _leader_gone(self, leader, exited: list[tuple[int, int]], known: bool = False) -> bool:
        """A node without the leader: True when the cluster ended here, cleanly (the leader
        stopped it: every rank here exited 0) or because node 0 is gone (``error`` names it)."""
        local = sum(p is not None for p in self.procs)
        if len(exited) == local and all(code == 0 for _, code in exited):
            self.ended = True
            return True
        if not known and not leader.gone():
            return False
        deadline = time.monotonic() + 5.0  # a clean stop: the ranks here may exit just after the leader
        while time.monotonic() < deadline and len(self._exited()) < local:
            time.sleep(0.1)
        exited = self._exited()
        if len(exited) == local and all(code == 0 for _, code in exited):
            self.ended = True
            return True
        self.error = leader.describe()
        self._kill_all()
        return True

    def _replace(self, exited: list[tuple[int, int]]) -> bool:
        """Start a replacement for a lost rank (the others re-form their world without it and,
        for a worker, wait for it: docs/dataplane.md, "When a peer dies"). Expert workers and
        routers other than the leader are replaced (not the leader, which hosts the store and
        the engine, nor a co-located rank), unless the rank was replaced ``max_restarts`` times
        in the last ``RESTART_WINDOW_S`` (a crash loop: ``gave_up`` says so); a rank that
        exited 0 was not lost."""
        if len(exited) != 1:
            return False
        rank, code = exited[0]
        role = self.config.role(rank)
        if code == 0 or rank == 0 or self.config.colocated:
            return False
        now = time.time()
        recent = [t for r, _, t in self.replaced if r == rank and now - t < RESTART_WINDOW_S]
        if len(recent) >= self.max_restarts:
            self.gave_up = (
                f"rank {rank} ({role.name}) was lost {len(recent) + 1} times within {RESTART_WINDOW_S:.0f} s: "
                f"the restart limit (max_restarts = {self.max_restarts}) is reached, so it is not replaced again"
            )
            return False
        self._mark_lost(rank)
        self.replaced.append((rank, code, now))
        with open(self.log_paths[rank], "ab") as out:
            out.write(f"--- rank {rank} exited with {describe_exit(code)}: starting its replacement ---\n".encode())
            out.flush()
            self.procs[rank] = subprocess.Popen(
                module_command("moeserve.cluster.rank"),
                env=self._envs[rank],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=set_death_signal,
            )
        return True

    def _mark_lost(self, rank: int) -> None:
        """Tell the leader through the store that ``rank``'s process is gone, so that its
        recovery need not wait for the rank to report (a hint: without it the leader waits
        ``recovery_settle_s`` for a router)."""
        try:
            if self._store is None:
                import datetime

                from moeserve.cluster.store import AuthStore

                env = self._envs[0]
                self._store = AuthStore(
                    env["MASTER_ADDR"], int(env["MASTER_PORT"]), self._authkey, datetime.timedelta(seconds=5)
                )
            self._store.set(f"lost/{rank}", "1")
        except Exception:  # the leader is gone too: the monitor sees it next
            self._store = None

    def _failure(self, wait_s: float = 3.0) -> str | None:
        """The cluster's error; when a connection just broke, give the monitor a moment to see why."""
        deadline = time.monotonic() + wait_s
        while self.error is None and time.monotonic() < deadline and not self._stopping:
            time.sleep(0.05)
        return self.error

    def _log_tail(self, rank: int, lines: int = 20) -> str:
        try:
            with open(self.log_paths[rank], errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def _exited(self) -> list[tuple[int, int]]:
        """(rank, exit code) of every rank process that has exited."""
        return [(rank, code) for rank, p in enumerate(self.procs) if p is not None and (code := p.poll()) is not None]

    @property
    def control_address(self) -> tuple[str, int]:
        """(host, port) of the leader's local channel (its key is ``authkey``)."""
        return self._c().address

    @property
    def alive(self) -> bool:
        """Started, not stopped, and not failed. A lost expert worker being replaced is not a
        failure: the monitor decides (it sets ``error`` when the cluster cannot go on)."""
        return bool(self.procs) and self.error is None and not self._stopping and not self.ended

    # -- use --------------------------------------------------------------------------------

    def _c(self) -> EngineClient:
        if self._client is None:
            raise ClusterError("the cluster is not started")
        if self.error:
            raise ClusterError(self.error)
        return self._client

    def generate(
        self,
        prompts,
        max_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        ignore_eos: bool = False,
        stop_token_ids=(),
        return_logits: bool = False,
        details: bool = False,
        cache_salt: str = "",
        **adjust,
    ):
        """Generate for each prompt (a list of token ids); all prompts run concurrently.
        ``adjust``: the other ``SamplingParams`` fields (min_p, the penalties, min_tokens,
        logit_bias).

        Returns the generated ids per prompt (prompt excluded), or with ``details`` a list of
        :class:`Generation` (finish reason, the prompt tokens read from the prefix cache, and with
        ``return_logits`` the logits [n, V] each generated token was sampled from). Invalid input
        raises ValueError before anything runs. ``cache_salt``: the prompts share cached KV
        blocks only with requests of the same salt.
        """
        sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, **adjust)
        reqs = [
            GenerateRequest(
                prompt_ids=tuple(int(t) for t in p),
                max_tokens=max_tokens,
                sampling=sp,
                stop_token_ids=tuple(stop_token_ids),
                ignore_eos=ignore_eos,
                return_logits="last" if return_logits else "",
                cache_salt=cache_salt,
            )
            for p in prompts
        ]
        toks: list[list[int]] = [[] for _ in reqs]
        logits: list[list[np.ndarray]] = [[] for _ in reqs]
        reasons = [""] * len(reqs)
        cached = [0] * len(reqs)
        for i, ev in self._c().generate_stream(reqs):
            if isinstance(ev, Token):
                toks[i].append(ev.token_id)
                if isinstance(ev, FirstToken):
                    cached[i] = ev.cached_tokens
                if ev.logits is not None:
                    logits[i].append(ev.logits)
            elif isinstance(ev, Finished):
                reasons[i] = str(ev.reason)
            elif isinstance(ev, Failed):
                raise ClusterError(self._failure() or ev.message)  # the monitor names the rank that died first
        if not details:
            return toks
        return [
            Generation(t, r, np.concatenate(lg) if lg else None, n)
            for t, r, lg, n in zip(toks, reasons, logits, cached)
        ]

    def prompt_logits(self, prompt) -> np.ndarray:
        """float32 [T, V]: the logits at every position of ``prompt`` (one prefill)."""
        req = GenerateRequest(
            prompt_ids=tuple(int(t) for t in prompt), max_tokens=1, ignore_eos=True, return_logits="all"
        )
        for _, ev in self._c().generate_stream([req]):
            if isinstance(ev, Token) and ev.logits is not None:
                return ev.logits
            if isinstance(ev, Failed):
                raise ClusterError(self._failure() or ev.message)  # the monitor names the rank that died first
        raise ClusterError("no logits came back")

    def placement(self) -> Placement:
        """The placement in force (``.phy2log`` [L, P], ``.version``, ``.layer_versions``,
        ``.breakeven`` [L, E])."""
        return self._c().placement()

    def apply_placement(
        self, phy2log, wait: bool = True, expected_version: int | None = None, timeout_s: float = 600.0, breakeven=None
    ) -> str:
        """Migrate to ``phy2log`` [L, P] live; returns the migration id (at once with
        wait=False). ``breakeven`` [L, E]: the break-even counts b that come with it (None:
        those in force stay). Raises ValueError (InvalidRequest), changing nothing, when it is
        not a valid placement."""
        maps = np.asarray(phy2log)
        target: np.ndarray | Placement = maps
        if breakeven is not None:
            cur = self.placement()
            target = Placement(
                maps, cur.num_logical, cur.num_workers, cur.workers_per_node, cur.version, breakeven=breakeven
            )
        mig = self._c().apply_placement(target, expected_version)
        if wait:
            self.wait_migration(mig.migration_id, timeout_s)
        return mig.migration_id

    def wait_migration(self, migration_id: str, timeout_s: float = 600.0) -> MigrationProgress:
        """The migration once done; ClusterError when it was aborted or failed."""
        deadline = time.monotonic() + timeout_s
        while True:
            mig = self._c().wait_migration(migration_id, min(1.0, max(0.0, deadline - time.monotonic())))
            if mig.ended:
                if mig.state != MigrationState.DONE:
                    raise ClusterError(f"migration {migration_id} {mig.state}: {mig.error}")
                return mig
            if time.monotonic() > deadline:
                raise TimeoutError(f"migration {migration_id} not done after {timeout_s} s: {mig}")

    def migration(self, migration_id: str) -> MigrationProgress:
        return self._c().migration(migration_id)

    def abort_migration(self) -> bool:
        return self._c().abort_migration()

    def expert_load(self) -> LoadReport:
        """The load window: ``.load`` [L, E] and per-layer ``.balancedness_measured`` /
        ``.balancedness_predicted``."""
        return self._c().expert_load()

    def total_load(self) -> np.ndarray:
        """int64 [L, E]: pairs routed to each logical expert since the cluster started."""
        return self._c().total_load()

    def status(self) -> EngineStatus:
        return self._c().status()

    def slot_digests(self) -> list[np.ndarray]:
        """Per worker, float64 [L, S, 2]: (sum, sum of squares) of the weights each slot holds,
        read from the workers at a step boundary (tests use it to check what moved where)."""
        return self._c().slot_digests()

    def router_maps(self, timeout_s: float = 60.0) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per router, the maps it routes with, read at a step boundary: (phy2log int64 [L, P],
        breakeven int64 [L, E]) (tests use it to check that a placement reached every router)."""
        return self._c().router_maps(timeout_s)
