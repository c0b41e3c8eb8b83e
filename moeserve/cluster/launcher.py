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

import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass

import numpy as np

from moeserve.config import CacheConfig, ClusterConfig, EplbConfig, Limits, admin_hook, check_topology
from moeserve.ops import ports
from moeserve.ops.procs import child_env, module_command
from moeserve.placement import MigrationProgress, MigrationState, Placement
from moeserve.router.engine.api import EngineStatus, Failed, Finished, GenerateRequest, LoadReport, Token
from moeserve.router.engine.channel import ClusterError, EngineClient
from moeserve.sampling import SamplingParams

RESTART_WINDOW_S = 60.0  # more replacements of one rank than max_worker_restarts within this: a crash loop


def free_port() -> int:
    """A free port outside the kernel's ephemeral range (``moeserve.ops.ports.free_port``)."""
    return ports.free_port()


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def _die_with_parent() -> None:
    """Run in the child before exec: SIGKILL it when the launcher's thread dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass(frozen=True)
class Generation:
    """One prompt's result: generated ids (prompt excluded), finish reason, and the logits
    each token was sampled from (float32 [n, V]) when asked for."""

    token_ids: list[int]
    finish_reason: str
    logits: np.ndarray | None = None


class LocalCluster:
    """A cluster of router and expert-worker processes on this machine.

    routers, workers: R and W; colocated=True makes N = R = W ranks that are each both.
    num_redundant_experts: redundant slots per MoE layer ((E + R) % W must be 0).
    placement: initial phy2log [L, P] (default: slot p holds expert p mod E), or a Placement
    (its maps and break-even counts).
    breakeven: the initial placement's break-even counts b, [L, E] (default: a Placement's own,
    else ``MOESERVE_EPLB_BREAKEVEN`` in ``env`` or 0: every replica always used).
    backend: "gloo" (CPU) or "nccl" (one GPU per rank). Other keywords: see ClusterConfig,
    EplbConfig, Limits and CacheConfig (vLLM's names: block_size, gpu_memory_utilization,
    num_gpu_blocks_override).
    admin_port: the leader serves the gRPC admin API there (-1: none, 0: a free port; see
    ``admin_address``), guarded by ``admin_token`` (passed to the leader in its environment).
    metrics_ports: one Prometheus port per rank (0: a free one), or None for no metrics;
    per_expert_metrics and metrics_peers: see ClusterConfig.
    load_format: "auto" (the checkpoint's files) or "dummy" (seeded random weights made on each
    rank's device from config.json alone; moeserve.models.dummy).
    """

    def __init__(
        self,
        model_dir,
        routers: int = 1,
        workers: int = 1,
        colocated: bool = False,
        num_redundant_experts: int = 0,
        backend: str = "gloo",
        *,
        enable_eplb: bool = True,
        placement=None,
        dtype: str = "float32",
        window_size: int = 1000,
        step_interval: int = 3000,
        log_balancedness: bool = False,
        max_model_len: int = 4096,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 4096,
        max_waiting: int = 1024,
        workers_per_node: int = 0,
        migration_bytes_per_step: int = 512 << 20,
        max_staging_bytes: int = 0,
        heartbeat_s: float = 0.1,
        pg_timeout_s: float = 30.0,
        startup_timeout_s: float = 300.0,
        env: dict | None = None,
        log_dir: str | None = None,
        admin_port: int = -1,
        admin_host: str = "127.0.0.1",
        admin_token: str | None = None,
        admin_tls_cert: str = "",
        admin_tls_key: str = "",
        max_message_bytes: int = 64 << 20,
        grace_s: float = 30.0,
        metrics_ports=None,
        per_expert_metrics: str = "auto",
        metrics_peers: dict | None = None,
        exchange: str = "auto",
        block_size: int = 16,
        gpu_memory_utilization: float = 0.9,
        num_gpu_blocks_override: int = 0,
        cpu_kv_cache_gib: float = 1.0,
        max_worker_restarts: int = 3,
        load_format: str = "auto",
        state_dir: str = "",
        enforce_eager: bool = False,
        breakeven=None,
        async_scheduling: bool = True,
        capture_graphs_at_start: bool = False,
    ):
        from moeserve.cluster.rank import DTYPES
        from moeserve.models import MoEInfo, load_config

        model_dir = os.fspath(model_dir)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        mcfg = load_config(model_dir)  # fails early on a bad checkpoint
        info = MoEInfo.from_config(mcfg, DTYPES[dtype])
        num_slots = info.num_logical_experts + num_redundant_experts
        check_topology(routers, workers, colocated, num_slots)
        if not -1 <= admin_port <= 65535:
            raise ValueError(f"admin_port must be -1 (no admin API), 0 (any free port) or a port, got {admin_port}")
        hook = (
            {}
            if admin_port < 0
            else admin_hook(admin_port, admin_host, admin_tls_cert, admin_tls_key, max_message_bytes, grace_s)
        )
        phy2log = b_start = None
        if breakeven is None and isinstance(placement, Placement):
            breakeven = placement.breakeven
        if breakeven is not None:
            from moeserve.placement import check_breakeven

            b_start = tuple(
                tuple(int(x) for x in row)
                for row in check_breakeven(breakeven, info.num_moe_layers, info.num_logical_experts)
            )
        if placement is not None:
            p = Placement(
                phy2log=np.asarray(getattr(placement, "phy2log", placement)),
                num_logical=info.num_logical_experts,
                num_workers=workers,
                workers_per_node=workers_per_node or workers,
                version=1,
            )
            if p.phy2log.shape != (info.num_moe_layers, num_slots):
                raise ValueError(
                    f"placement has shape {p.phy2log.shape}, expected (L, P) = ({info.num_moe_layers}, {num_slots})"
                )
            phy2log = tuple(tuple(int(x) for x in row) for row in p.phy2log)
        self.config = ClusterConfig(
            model_dir=os.path.abspath(model_dir),
            routers=routers,
            workers=workers,
            colocated=colocated,
            backend=backend,
            dtype=dtype,
            eplb=EplbConfig(
                enable_eplb=enable_eplb,
                num_redundant_experts=num_redundant_experts,
                window_size=window_size,
                step_interval=step_interval,
                log_balancedness=log_balancedness,
            ),
            limits=Limits(
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_waiting=max_waiting,
            ),
            cache=CacheConfig(
                block_size=block_size,
                gpu_memory_utilization=gpu_memory_utilization,
                num_gpu_blocks_override=num_gpu_blocks_override,
                cpu_kv_cache_gib=cpu_kv_cache_gib,
            ),
            workers_per_node=workers_per_node,
            phy2log=phy2log,
            breakeven=b_start,
            migration_bytes_per_step=migration_bytes_per_step,
            max_staging_bytes=max_staging_bytes,
            heartbeat_s=heartbeat_s,
            pg_timeout_s=pg_timeout_s,
            host=admin_host,
            **hook,
            per_expert_metrics=per_expert_metrics,
            exchange=exchange,
            load_format=load_format,
            state_dir=os.path.abspath(state_dir) if state_dir else "",
            enforce_eager=enforce_eager,
            async_scheduling=async_scheduling,
            capture_graphs_at_start=capture_graphs_at_start,
            metrics_peers=tuple(sorted((str(k), int(v)) for k, v in (metrics_peers or {}).items())),
        )
        if metrics_ports is not None and len(metrics_ports) != self.config.world_size:
            raise ValueError(
                f"metrics_ports needs one port per rank ({self.config.world_size}), got {len(metrics_ports)}"
            )
        self.metrics_ports = None if metrics_ports is None else [int(p) for p in metrics_ports]
        self.moe_info = info
        self.vocab_size = mcfg.vocab_size
        self.startup_timeout_s = startup_timeout_s
        self.env = dict(env or {})
        if admin_token:
            self.env["MOESERVE_ADMIN_TOKEN"] = admin_token
        self.admin_address: tuple[str, int] | None = None
        self.authkey: bytes | None = None
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []
        self.run_dir: str | None = None
        self.error: str | None = None
        self.max_worker_restarts = max_worker_restarts
        self.replaced: list[tuple[int, int, float]] = []  # (rank, exit code, time) of each replacement
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
        cfg = self.config
        self.run_dir = tempfile.mkdtemp(prefix="moeserve-cluster-")
        logs = self.log_dir or self.run_dir
        os.makedirs(logs, exist_ok=True)
        cfg_path = os.path.join(self.run_dir, "cluster.json")
        with open(cfg_path, "w") as f:
            f.write(cfg.to_json())
        authkey = secrets.token_bytes(16)
        port = free_port()
        base = child_env(self.env)
        base.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE=str(cfg.world_size),
            MOESERVE_CLUSTER_CONFIG=cfg_path,
            MOESERVE_RUN_DIR=self.run_dir,
            MOESERVE_AUTHKEY=authkey.hex(),
            MOESERVE_PARENT_PID=str(os.getpid()),
        )
        if cfg.backend == "gloo":
            base.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        self.log_paths = []
        self._envs = []
        for rank in range(cfg.world_size):
            env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
            if self.metrics_ports is not None:
                env["MOESERVE_METRICS_PORT"] = str(self.metrics_ports[rank])
            self._envs.append(env)
            path = os.path.join(logs, f"rank{rank}.log")
            self.log_paths.append(path)
            out = open(path, "wb")
            self.procs.append(
                subprocess.Popen(
                    module_command("moeserve.cluster.rank"),
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    preexec_fn=_die_with_parent,
                )
            )
            out.close()
        # The monitor also starts replacements: they die with the thread that started them (PDEATHSIG).
        self._monitor = threading.Thread(target=self._watch, name="cluster-monitor", daemon=True)
        self._monitor.start()
        ready = os.path.join(self.run_dir, "control.json")
        deadline = time.monotonic() + self.startup_timeout_s
        while not os.path.exists(ready):
            if self.error:
                self.stop()
                raise ClusterError(self.error)
            if time.monotonic() > deadline:
                self.stop()
                raise ClusterError(
                    f"the cluster did not become ready within {self.startup_timeout_s:.0f} s (logs: {logs})"
                )
            time.sleep(0.05)
        with open(ready) as f:
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
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
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
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 5
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _watch(self) -> None:
        while True:
            time.sleep(0.2)
            if self._stopping:
                return
            exited = [(rank, p.poll()) for rank, p in enumerate(self.procs) if p.poll() is not None]
            if exited:
                time.sleep(0.3)  # let peers that saw the failure exit too
                exited = [(rank, p.poll()) for rank, p in enumerate(self.procs) if p.poll() is not None]
                if self._replace(exited):
                    continue
                # A rank killed by a signal is the likely cause; the others died of losing it.
                exited.sort(key=lambda rc: (rc[1] >= 0, rc[0]))
                first, code = exited[0]
                what = "; ".join(
                    f"rank {r} ({self.config.role(r).name}) exited with {describe_exit(c)}" for r, c in exited
                )
                self.error = f"{what}\n--- end of rank {first}'s log ---\n{self._log_tail(first)}"
                self._kill_all()
                return

    def _replace(self, exited: list[tuple[int, int]]) -> bool:
        """Start a replacement for a lost expert worker (the other ranks wait for it, re-form
        their groups and run the failed step again: docs/dataplane.md, "When a peer dies").
        Only expert-worker ranks (not routers, whose KV caches die with them) are replaced, and
        not a rank already replaced ``max_worker_restarts`` times in the last
        ``RESTART_WINDOW_S`` (a crash loop); a rank that exited 0 was not lost."""
        if len(exited) != 1 or not self.max_worker_restarts:
            return False
        rank, code = exited[0]
        now = time.time()
        recent = [t for r, _, t in self.replaced if r == rank and now - t < RESTART_WINDOW_S]
        if code == 0 or self.config.role(rank).router_index >= 0 or len(recent) >= self.max_worker_restarts:
            return False
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
                preexec_fn=_die_with_parent,
            )
        return True

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

    @property
    def control_address(self) -> tuple[str, int]:
        """(host, port) of the leader's local channel (its key is ``authkey``)."""
        return self._c().address

    @property
    def alive(self) -> bool:
        """Started, not stopped, and not failed. A lost expert worker being replaced is not a
        failure: the monitor decides (it sets ``error`` when the cluster cannot go on)."""
        return bool(self.procs) and self.error is None and not self._stopping

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
    ):
        """Generate for each prompt (a list of token ids); all prompts run concurrently.

        Returns the generated ids per prompt (prompt excluded), or with ``details`` a list of
        :class:`Generation` (finish reason, and with ``return_logits`` the logits [n, V] each
        generated token was sampled from). Invalid input raises ValueError before anything runs.
        """
        sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        reqs = [
            GenerateRequest(
                tuple(int(t) for t in p),
                max_tokens,
                sp,
                tuple(stop_token_ids),
                ignore_eos,
                "last" if return_logits else "",
            )
            for p in prompts
        ]
        toks = [[] for _ in reqs]
        logits = [[] for _ in reqs]
        reasons = [""] * len(reqs)
        for i, ev in self._c().generate_stream(reqs):
            if isinstance(ev, Token):
                toks[i].append(ev.token_id)
                if ev.logits is not None:
                    logits[i].append(ev.logits)
            elif isinstance(ev, Finished):
                reasons[i] = str(ev.reason)
            elif isinstance(ev, Failed):
                raise ClusterError(self._failure() or ev.message)  # the monitor names the rank that died first
        if not details:
            return toks
        return [Generation(t, r, np.concatenate(lg) if lg else None) for t, r, lg in zip(toks, reasons, logits)]

    def prompt_logits(self, prompt) -> np.ndarray:
        """float32 [T, V]: the logits at every position of ``prompt`` (one prefill)."""
        req = GenerateRequest(tuple(int(t) for t in prompt), 1, SamplingParams(), (), True, "all")
        for _, ev in self._c().generate_stream([req]):
            if isinstance(ev, Token):
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
        target = np.asarray(phy2log)
        if breakeven is not None:
            cur = self.placement()
            target = Placement(
                target, cur.num_logical, cur.num_workers, cur.workers_per_node, cur.version, breakeven=breakeven
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
