"""``moeserve demo``: the whole system at work in one command, on a CPU, nothing downloaded.

1. A small Llama 4-style checkpoint whose gate sends most tokens to 2 experts per MoE layer
   (``init_model(..., hot_experts=2)``), written once into a cache folder and reused.
2. ``moeserve up``: router ranks, expert workers, the serving front end and the balancer,
   every process with its Prometheus endpoint. The balancer's own loop is held back (a very
   long ``step_interval``) so that the demo decides when it rebalances.
3. The EPLB-off run: the same prompts on one process with every expert local (no placement,
   no redundant slot, no balancer), greedy; computed while the cluster starts.
4. A workload through the SDK (``moeserve.client``) with a progress bar; the leader's load
   window gives each MoE layer's measured balancedness and each worker's load.
5. One rebalance through the balancer's API: it plans on the load window, applies the
   placement through the leader and follows the live migration to its end.
6. The same workload again, measured over the steps since the placement changed.
7. Checks: every generated token equals the EPLB-off run; balancedness after the rebalance
   is higher than before; the migration completed. Any failed check: exit code 1.

Dimension letters: L MoE layers, E logical experts, W workers.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moeserve.ops.procs import UpProcess

FAMILY = "llama4"
HOT_EXPERTS = 2
CHECKPOINT_VERSION = 1  # bump when init_model's output for the demo changes


class DemoUsageError(ValueError):
    """Options the demo cannot run with (said before anything starts)."""


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moeserve" / "demo"


@dataclass(frozen=True)
class DemoOptions:
    """What the demo runs. ``requests`` per phase (before and after the rebalance), each
    ``max_tokens`` greedy tokens from a random prompt of ``prompt_len`` tokens, ``concurrency``
    at a time; ``metrics_port``: ``moeserve up --metrics-port`` (0: free ports)."""

    cache_dir: Path = field(default_factory=default_cache_dir)
    routers: int = 1
    workers: int = 2
    num_redundant_experts: int = 2
    requests: int = 24
    prompt_len: tuple[int, int] = (8, 24)
    max_tokens: int = 24
    concurrency: int = 8
    move_budget: float = 0.2
    seed: int = 0
    metrics_port: int = 0
    plot: Path | None = None
    keep_running: bool = False
    startup_timeout_s: float = 240.0
    progress: bool = True

    def __post_init__(self):
        if self.workers < 2:
            raise DemoUsageError(
                f"the demo needs at least 2 workers (EPLB balances load between workers), got {self.workers}"
            )
        for name in ("routers", "requests", "max_tokens", "concurrency"):
            if getattr(self, name) < 1:
                raise DemoUsageError(f"{name} must be >= 1, got {getattr(self, name)}")
        lo, hi = self.prompt_len
        if not 1 <= lo <= hi:
            raise DemoUsageError(f"prompt_len must be (min, max) with 1 <= min <= max, got {self.prompt_len}")


@dataclass(frozen=True)
class PhaseLoad:
    """What one phase measured: ``load`` [L, E] and ``worker_load`` [L, W] pairs (token, k),
    ``balancedness`` [L] measured (mean / max worker load), over ``steps`` forward steps,
    under placement ``phy2log`` [L, P] (version ``version``)."""

    steps: int
    load: np.ndarray
    worker_load: np.ndarray
    balancedness: np.ndarray
    phy2log: np.ndarray
    version: int
    seconds: float
    tokens: int

    def dump(self, path: Path, title: str) -> None:
        """A ``moeserve load --dump`` file of this phase (for ``moeserve load --plot``)."""
        num_workers = self.worker_load.shape[1]
        path.write_text(
            json.dumps(
                {
                    "format": "moeserve.load/1",
                    "title": title,
                    "total_load": self.load.tolist(),
                    "window_load": self.load.tolist(),
                    "total_steps": self.steps,
                    "window_steps": self.steps,
                    "placement": {
                        "phy2log": self.phy2log.tolist(),
                        "version": self.version,
                        "num_workers": num_workers,
                    },
                }
            )
        )


@dataclass
class DemoResult:
    before: PhaseLoad
    after: PhaseLoad
    slots_moved: int
    bytes_moved: int
    migration_state: str
    mismatches: list[int]  # request indices whose tokens differ from the EPLB-off run
    requests: int
    tokens: int
    metrics: list[str]
    wall_s: float = 0.0

    def checks(self) -> list[tuple[bool, str]]:
        b, a = self.before.balancedness.mean(), self.after.balancedness.mean()
        same = not self.mismatches
        return [
            (
                same,
                f"every generated token equals the EPLB-off run ({self.requests} requests, {self.tokens} tokens; "
                "one process, every expert local, greedy)"
                if same
                else f"{len(self.mismatches)} of {self.requests} requests differ from the EPLB-off run "
                f"(first: request {self.mismatches[0]})",
            ),
            (a > b, f"balancedness after the rebalance ({a:.3f}) is higher than before ({b:.3f})"),
            (
                self.migration_state == "done" and self.slots_moved > 0,
                f"the rebalance moved {self.slots_moved} slots live and its migration is {self.migration_state}",
            ),
        ]

    @property
    def ok(self) -> bool:
        return all(ok for ok, _ in self.checks())


# -- the checkpoint -----------------------------------------------------------------------------


def ensure_checkpoint(cache_dir: Path, seed: int = 0, out=None) -> tuple[Path, bool]:
    """The demo's checkpoint in ``cache_dir`` (written once, then reused); returns (folder,
    reused). Written into a temporary folder and renamed, so an interrupted run leaves
    nothing half-written behind."""
    from moeserve.models import init_model
    from moeserve.models.init import WRITTEN_FILES

    folder = Path(cache_dir) / f"{FAMILY}-hot{HOT_EXPERTS}-seed{seed}-v{CHECKPOINT_VERSION}"
    if all((folder / f).is_file() for f in WRITTEN_FILES):
        return folder, True
    folder.parent.mkdir(parents=True, exist_ok=True)
    if out is not None:
        print(
            f"checkpoint   writing a small {FAMILY} checkpoint with {HOT_EXPERTS} hot experts per MoE layer "
            f"to {folder} (once; ~10 s)",
            file=out,
            flush=True,
        )
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    init_model(tmp, FAMILY, seed=seed, hot_experts=HOT_EXPERTS)
    if folder.exists():  # another run finished first, or an old copy
        import shutil

        shutil.rmtree(folder)
    tmp.rename(folder)
    return folder, False


def prompts_for(opts: DemoOptions, vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(opts.seed)
    lo, hi = opts.prompt_len
    return [rng.integers(3, vocab_size, int(rng.integers(lo, hi + 1))).tolist() for _ in range(opts.requests)]


def eplb_off_tokens(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of the single-process model (every expert local: no EPLB)."""
    import torch

    from moeserve.models import load_model
    from moeserve.sampling import SamplingParams

    torch.set_num_threads(1)
    model = load_model(model_dir, dtype=torch.float32)
    return model.generate_ids(prompts, [SamplingParams()] * len(prompts), max_tokens, ignore_eos=True)


# -- the cluster --------------------------------------------------------------------------------


def start_cluster(model_dir: Path, opts: DemoOptions, log_dir: Path) -> UpProcess:
    """``moeserve up`` for the demo, started (not yet ready: :meth:`UpProcess.wait_ready`), in a
    session of its own (Ctrl-C reaches the demo, which stops it in order) and killed with us."""
    return UpProcess(
        model_dir,
        "--routers",
        str(opts.routers),
        "--workers",
        str(opts.workers),
        "--enable-eplb",
        "--num-redundant-experts",
        str(opts.num_redundant_experts),
        # The whole demo fits in the window; the balancer's loop waits for the demo's call.
        "--eplb-window-size",
        "100000",
        "--eplb-step-interval",
        "100000000",
        "--eplb-move-budget",
        str(opts.move_budget),
        "--metrics-port",
        str(opts.metrics_port),
        log_dir=log_dir,
        env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
        new_session=True,
    )


class Progress:
    """A one-line progress bar on a terminal; a line per quarter elsewhere."""

    def __init__(self, label: str, total: int, out, enabled: bool):
        self.label, self.total, self.out, self.enabled = label, total, out, enabled
        self.tty = enabled and hasattr(out, "isatty") and out.isatty()
        self.done = self.tokens = 0
        self.start = time.monotonic()
        self._quarter = 0
        self.update(0, 0)

    def update(self, requests: int, tokens: int) -> None:
        self.done += requests
        self.tokens += tokens
        if not self.enabled:
            return
        dt = max(time.monotonic() - self.start, 1e-9)
        width = 30
        fill = int(width * self.done / self.total)
        line = (
            f"{self.label:<8} [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} requests, "
            f"{self.tokens} tokens, {self.tokens / dt:.0f} tokens/s"
        )
        if self.tty:
            print("\r" + line, end="", file=self.out, flush=True)
        elif self.done == self.total or self.done * 4 >= (self._quarter + 1) * self.total:
            self._quarter = self.done * 4 // self.total
            print(line, file=self.out, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=self.out, flush=True)


def run_phase(serving, prompts: list[list[int]], opts: DemoOptions, label: str, out) -> tuple[list[list[int]], float]:
    """Send every prompt through the SDK, ``concurrency`` at a time; (tokens per prompt, seconds)."""
    outputs: list[list[int]] = [[] for _ in prompts]
    bar = Progress(label, len(prompts), out, opts.progress)
    t0 = time.monotonic()
    with ThreadPoolExecutor(opts.concurrency) as pool:
        futures = {
            pool.submit(
                serving.generate,
                prompt_token_ids=p,
                max_tokens=opts.max_tokens,
                temperature=0.0,
                ignore_eos=True,
                timeout=300.0,
            ): i
            for i, p in enumerate(prompts)
        }
        for f in as_completed(futures):
            ids = outputs[futures[f]] = f.result().token_ids
            bar.update(1, len(ids))
    bar.close()
    return outputs, time.monotonic() - t0


def measure(admin, window_steps: int, seconds: float, tokens: int) -> PhaseLoad:
    rep = admin.expert_load(window_steps)
    p = admin.placement()
    return PhaseLoad(
        steps=rep.steps,
        load=np.asarray(rep.load),
        worker_load=np.asarray(rep.worker_load),
        balancedness=np.asarray(rep.measured.per_layer, dtype=np.float64),
        phy2log=np.asarray(p.phy2log),
        version=int(p.version),
        seconds=seconds,
        tokens=tokens,
    )


# -- the whole run --------------------------------------------------------------------------------


def run_demo(opts: DemoOptions, out=sys.stdout) -> DemoResult:
    import torch

    from moeserve.client import Client
    from moeserve.models import MoEInfo, load_config

    t_start = time.monotonic()
    print("moeserve demo: expert-parallel MoE serving with online EPLB, on this machine's CPU", file=out)
    model_dir, reused = ensure_checkpoint(Path(opts.cache_dir), opts.seed, out)
    cfg = load_config(model_dir)
    info = MoEInfo.from_config(cfg, torch.float32)
    layers, experts = info.num_moe_layers, info.num_logical_experts
    slots = experts + opts.num_redundant_experts
    if slots % opts.workers:
        raise DemoUsageError(
            f"{experts} experts + {opts.num_redundant_experts} redundant = {slots} slots per MoE layer "
            f"cannot be split over {opts.workers} workers ((E + R) % W must be 0)"
        )
    print(
        f"checkpoint   {model_dir}{' (reused)' if reused else ''}: Llama 4-style, {layers} MoE layers x {experts} "
        f"experts, top-{info.top_k}, {HOT_EXPERTS} hot experts per layer",
        file=out,
    )
    log_dir = Path(tempfile.mkdtemp(prefix="moeserve-demo-"))
    up = start_cluster(model_dir, opts, log_dir)
    try:
        prompts = prompts_for(opts, cfg.vocab_size)
        reference = eplb_off_tokens(model_dir, prompts, opts.max_tokens)  # while the cluster starts
        up.wait_ready(opts.startup_timeout_s)
        print(
            f"cluster      {opts.routers} router{'s' * (opts.routers > 1)} + {opts.workers} expert workers, "
            f"{slots} slots per MoE layer ({opts.num_redundant_experts} redundant), front end, balancer "
            f"(up in {time.monotonic() - t_start:.0f} s; logs in {log_dir})",
            file=out,
        )
        metrics = up.metrics_lines()
        for i, line in enumerate(metrics):
            print(f"{'metrics' if i == 0 else '':<12} {line}", file=out)
        print(
            f"workload     {opts.requests} requests before and {opts.requests} after the rebalance, "
            f"{opts.max_tokens} greedy tokens each, {opts.concurrency} at a time, through the SDK",
            file=out,
            flush=True,
        )
        serving = Client(up.address("serving"))
        admin = Client(up.address("admin"), token=up.token)
        balancer = Client(up.address("balancer"), token=up.token)

        first, secs = run_phase(serving, prompts, opts, "before", out)
        before = measure(admin, 0, secs, sum(map(len, first)))

        t0 = time.monotonic()
        rb = balancer.rebalance(wait=True)
        mig = rb.migration
        state = mig.state if (rb.applied and mig is not None) else "not applied"
        print(
            f"rebalance    the balancer planned on {before.steps} steps of load and moved {rb.slots_moved} slots "
            f"({rb.bytes_moved / 1e3:.1f} kB of expert weights) live in {time.monotonic() - t0:.2f} s: "
            f"migration {state}" + (f"; {rb.note}" if rb.note else ""),
            file=out,
            flush=True,
        )

        second, secs = run_phase(serving, prompts, opts, "after", out)
        since = admin.expert_load().steps_since_placement_change
        after = measure(admin, max(1, since), secs, sum(map(len, second)))

        mismatches = [i for i in range(len(prompts)) if first[i] != reference[i] or second[i] != reference[i]]
        result = DemoResult(
            before,
            after,
            rb.slots_moved,
            rb.bytes_moved,
            state,
            mismatches,
            2 * len(prompts),
            before.tokens + after.tokens,
            metrics,
        )
        report(result, out)
        dumps = [log_dir / "load-before.json", log_dir / "load-after.json"]
        before.dump(dumps[0], f"before the rebalance (placement v{before.version})")
        after.dump(dumps[1], f"after the rebalance (placement v{after.version})")
        print(
            f"load dumps   {dumps[0]} {dumps[1]}\n             (moeserve load --plot FILE.png {dumps[0]} {dumps[1]} "
            "draws them side by side)",
            file=out,
        )
        if opts.plot is not None:
            write_plot(result, Path(opts.plot), out)
        if opts.keep_running:
            print(
                "serving      until Ctrl-C: "
                + " ".join(f"{n} {up.address(n)}" for n in ("serving", "admin", "balancer"))
                + f" (admin token {up.token})",
                file=out,
                flush=True,
            )
            try:
                up.proc.wait()
            except KeyboardInterrupt:
                pass
    finally:
        up.stop()
    result.wall_s = time.monotonic() - t_start
    print(
        f"done in {result.wall_s:.1f} s: {'all checks passed' if result.ok else 'A CHECK FAILED'}", file=out, flush=True
    )
    return result


def report(r: DemoResult, out) -> None:
    b, a = r.before, r.after
    w = b.worker_load.shape[1]
    print("\nbalancedness per MoE layer (mean worker load / max worker load, measured by the leader)", file=out)
    print(f"  {'layer':<7}{'before':>8}{'after':>8}", file=out)
    for layer in range(len(b.balancedness)):
        print(f"  {layer:<7}{b.balancedness[layer]:>8.3f}{a.balancedness[layer]:>8.3f}", file=out)
    print(f"  {'mean':<7}{b.balancedness.mean():>8.3f}{a.balancedness.mean():>8.3f}", file=out)
    print("\nload per worker (share of each MoE layer's pairs (token, k), before -> after)", file=out)
    print("  " + f"{'layer':<7}" + "".join(f"{'worker ' + str(k):>16}" for k in range(w)), file=out)
    bs, as_ = _shares(b.worker_load), _shares(a.worker_load)
    for layer in range(b.worker_load.shape[0]):
        cells = "".join(f"{f'{bs[layer, k]:.0%} -> {as_[layer, k]:.0%}':>16}" for k in range(w))
        print(f"  {layer:<7}{cells}", file=out)
    moved = f"{r.slots_moved} slots, {r.bytes_moved} bytes of expert weights"
    print(f"\nmoved        {moved}; placement version {b.version} -> {a.version}", file=out)
    print("\nchecks", file=out)
    for ok, text in r.checks():
        print(f"  {'ok  ' if ok else 'FAIL'}  {text}", file=out)
    deploy = Path(__file__).resolve().parent.parent / "deploy" / "docker-compose.yml"
    where = str(deploy) if deploy.is_file() else "deploy/docker-compose.yml (in the repository)"
    print(
        "\ncompose      the same system in containers, with Prometheus and Grafana dashboards:\n"
        "             export MOESERVE_ADMIN_TOKEN=$(openssl rand -hex 16) MOESERVE_CONTROL_KEY=$(openssl rand -hex 16)\n"
        f"             docker compose -f {where} up --build\n"
        "             then Grafana on http://127.0.0.1:3000, Prometheus on http://127.0.0.1:9090",
        file=out,
        flush=True,
    )


def _shares(worker_load: np.ndarray) -> np.ndarray:
    w = np.asarray(worker_load, dtype=np.float64)
    tot = w.sum(axis=1, keepdims=True)
    return np.divide(w, tot, out=np.zeros_like(w), where=tot > 0)


def write_plot(r: DemoResult, path: Path, out) -> None:
    from moeserve.ops.plot import LoadPicture, PlotUnavailable, plot_load

    pics = [
        LoadPicture(
            f"before the rebalance (placement v{r.before.version})",
            r.before.load,
            r.before.phy2log,
            r.before.worker_load.shape[1],
            r.before.steps,
        ),
        LoadPicture(
            f"after the rebalance (placement v{r.after.version})",
            r.after.load,
            r.after.phy2log,
            r.after.worker_load.shape[1],
            r.after.steps,
        ),
    ]
    try:
        plot_load(pics, path, "moeserve demo: expert load before and after the balancer's rebalance")
    except PlotUnavailable as e:
        print(f"heatmap      not written: {e}", file=out)
        return
    print(f"heatmap      {path}", file=out)
