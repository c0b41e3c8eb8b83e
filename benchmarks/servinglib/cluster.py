"""One configuration's cluster: ``moeserve up`` with dummy weights and co-located ranks, through
the repository's one launcher (``moeserve.ops.procs.UpProcess``), and what the benchmark reads
off it: the engine's status, the front end's CPU time, the warnings in its logs."""

from __future__ import annotations

import os

from moeserve.ops.procs import UpProcess
from servinglib.common import ROOT
from servinglib.httpclient import SERVER_FLAGS

TOKEN = "serving-bench"

# Lines of the cluster's logs that say a step ran eagerly or a graph failed, a step or a schedule
# was slow (> 0.5 s), a request waited over 1 s for admission, or a kernel compiled while serving.
WARNING_WORDS = (
    "CUDA graph",
    "run eagerly",
    "Traceback",
    "slow step",
    "slow schedule",
    "for admission",
    "slow garbage collection",
)


def colocated_rank(folder: str, smoke: bool, dtype: str, **keywords):
    """One co-located rank (a router and an expert worker) in-process through ``LocalCluster``,
    on ``--load-format dummy`` weights of ``folder``'s config: NCCL on the GPU, gloo on the CPU
    (``smoke``); ``keywords`` are LocalCluster's (limits, env). Started; the caller stops it."""
    from moeserve.cluster.launcher import LocalCluster

    return LocalCluster(
        folder,
        routers=1,
        workers=1,
        colocated=True,
        backend="gloo" if smoke else "nccl",
        load_format="dummy",
        dtype=dtype,
        startup_timeout_s=900,
        **keywords,
    ).start()


def is_fp8(name: str) -> bool:
    """Whether a configuration serves FP8 experts and MLPs (``-fp8``, ``-fp8-weight-only``)."""
    return name.endswith(("-fp8", "-fp8-weight-only"))


def configuration_flags(name: str, a, eplb: bool) -> tuple[list[str], dict[str, str]]:
    """The ``moeserve up`` flags a configuration adds to the common ones, and the environment
    its ranks get: ``-sync`` runs without asynchronous steps, ``-grouped-mm`` with
    torch._grouped_mm (``MOESERVE_EXPERT_KERNEL``), ``-fp8`` with ``--quantization fp8`` (W8A8,
    the default), ``-fp8-weight-only`` the same with ``MOESERVE_FP8_ACTIVATIONS=weight-only``,
    ``-no-prefix-cache`` without prefix caching, ``-no-late-schedule`` (after the rank count)
    without late scheduling; the EPLB workload lets one rebalance move
    every layer; ``--api-server-count`` N front-end processes for every configuration."""
    extra = []
    env: dict[str, str] = {}
    if eplb:
        extra += ["--eplb-move-budget", "1.0"]  # one rebalance may move every layer
        if getattr(a, "eplb_step_model", None):
            extra += ["--eplb-step-model", os.path.abspath(a.eplb_step_model)]
        if getattr(a, "eplb_step_model_shape", None):
            extra += ["--eplb-step-model-shape", a.eplb_step_model_shape]
    if "-no-late-schedule" in name:
        extra.append("--no-late-scheduling")
    elif getattr(a, "late_scheduling_margin_ms", None) is not None:
        extra += ["--late-scheduling-margin-ms", str(a.late_scheduling_margin_ms)]
    if name.endswith("-sync"):
        extra.append("--no-async-scheduling")
    if is_fp8(name):
        extra += ["--quantization", "fp8"]
    if name.endswith("-fp8-weight-only"):
        env["MOESERVE_FP8_ACTIVATIONS"] = "weight-only"
    if name.endswith("-no-prefix-cache"):
        extra.append("--no-enable-prefix-caching")
    if not a.capture_graphs_at_start:
        extra.append("--no-capture-graphs-at-start")
    if name.endswith("-grouped-mm"):
        env["MOESERVE_EXPERT_KERNEL"] = "grouped_mm"
    if getattr(a, "api_server_count", 1) > 1:
        extra += ["--api-server-count", str(a.api_server_count)]
    return extra, env


class Cluster(UpProcess):
    """``moeserve up`` of ``ranks`` co-located ranks on ``model_dir`` (dummy weights), ready when
    constructed; ``redundant`` slots per MoE layer with EPLB on (the balancer never rebalances on
    its own here), the HTTP API too when ``http``."""

    def __init__(
        self,
        model_dir: str,
        ranks: int,
        redundant: int,
        a,
        log_dir: str,
        http: bool = False,
        extra: list | None = None,
        env: dict[str, str] | None = None,
    ):
        flags = [
            "--load-format",
            "dummy",
            "--routers",
            str(ranks),
            "--workers",
            str(ranks),
            "--colocated",
            "--backend",
            a.backend,
            "--dtype",
            a.dtype,
            "--exchange",
            a.exchange,
            "--max-model-len",
            str(a.max_model_len),
            "--max-num-seqs",
            str(a.max_num_seqs),
            "--max-num-batched-tokens",
            str(a.max_num_batched_tokens),
            "--max-waiting",
            "100000",
            "--grace-period",
            "5",
            "--startup-timeout",
            str(a.startup_timeout),
            "--eplb-step-interval",
            "1000000000",  # the balancer never rebalances here
            "--metrics-port",
            "0",  # the front end's latencies by part (frontend_latency)
        ]
        if redundant:
            flags += ["--enable-eplb", "--num-redundant-experts", str(redundant)]
        if http:  # the clients' warm-up connections outlive the wait for the common start
            flags += SERVER_FLAGS
        env = dict(env or {})
        self.profile_dir = None
        if getattr(a, "profile", None):  # ranks profile forward steps START .. START+COUNT-1
            self.profile_dir = os.path.join(log_dir, "profile")
            env["MOESERVE_PROFILE"] = f"{self.profile_dir}:{a.profile}"
        super().__init__(
            model_dir,
            *flags,
            *(extra or ()),
            log_dir=log_dir,
            token=TOKEN,
            http_port=0 if http else None,
            env=env,
            cwd=ROOT,
        )
        self.wait_ready(a.startup_timeout + 30, poll_s=0.2)
        self.has_http = http
        self._frontend_pids: list[int] | None = None

    def frontend_latency(self) -> dict[str, tuple[float, float]]:
        """The front end's latency histograms so far, (sum s, count) each: ``ttft`` (its own
        clock, arrival to first token), ``queue`` and ``prefill`` (the leader's clock,
        ``moeserve_request_{queue,prefill}_time_seconds``) and ``part:NAME`` for each part of the
        TTFT (``moeserve_time_to_first_token_part_seconds{part=NAME}``: the hops between front end
        and leader, ``moeserve.ops.metrics.TTFT_PARTS``); {} where it serves no metrics."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        url = next((line.split()[-1] for line in self.metrics_lines() if line.startswith("front end")), None)
        if url is None:
            return {}
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        names = {
            "moeserve_time_to_first_token_seconds": "ttft",
            "moeserve_request_queue_time_seconds": "queue",
            "moeserve_request_prefill_time_seconds": "prefill",
            "moeserve_time_to_first_token_part_seconds": "part",
        }
        out: dict[str, list[float]] = {}
        for fam in text_string_to_metric_families(text):
            key = names.get(fam.name)
            if key is None:
                continue
            for smp in fam.samples:
                if smp.name not in (fam.name + "_sum", fam.name + "_count"):
                    continue
                got = out.setdefault(f"part:{smp.labels['part']}" if key == "part" else key, [0.0, 0.0])
                got[smp.name.endswith("_count")] += smp.value
        return {k: (v[0], v[1]) for k, v in out.items()}

    def api_address(self, api: str) -> str:
        return self.http if api == "http" else self.serving

    def frontend_cpu_s(self) -> float | None:
        """CPU seconds (user + system, every thread) the front-end processes have used so far, from
        /proc (None where there is none); they are ``moeserve up``'s children (several with
        ``--api-server-count``)."""
        try:
            if self._frontend_pids is None:
                self._frontend_pids = self.children_named("frontend")
            if not self._frontend_pids:
                return None
            total = 0.0
            for pid in self._frontend_pids:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            return total
        except (OSError, ValueError, IndexError):
            return None

    def leader_counters(self) -> dict[str, float]:
        """The leader's late-scheduling counters (``moeserve_late_schedule*_total``, summed over
        every process's metrics; only the leader's rank has them); {} without metrics."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        names = {
            "moeserve_late_schedules": "late_schedules",
            "moeserve_late_schedule_delay_seconds": "late_schedule_delay_s",
            "moeserve_late_schedule_bubbles": "late_schedule_bubbles",
            "moeserve_late_schedule_ahead_seconds": "late_schedule_ahead_s",
            "moeserve_late_schedule_slack_seconds": "late_schedule_slack_s",
        }
        out: dict[str, float] = {}
        for line in self.metrics_lines():
            try:
                with urllib.request.urlopen(line.split()[-1], timeout=10) as r:
                    text = r.read().decode()
            except OSError:
                continue
            for fam in text_string_to_metric_families(text):
                key = names.get(fam.name)
                for smp in fam.samples if key else ():
                    if smp.name == fam.name + "_total":
                        out[key] = out.get(key, 0.0) + smp.value
        return out

    def status(self) -> dict:
        from moeserve.client import Client

        with Client(self.admin, TOKEN, timeout=10) as c:
            s = c.status()
        return self.leader_counters() | dict(
            forward_steps=s.forward_steps,
            step=s.step,
            running=s.running,
            waiting=s.waiting,
            kv_blocks_total=getattr(s, "kv_blocks_total", 0),
            kv_blocks_used=getattr(s, "kv_blocks_used", 0),
            preemptions=getattr(s, "preemptions", 0),
            prefix_cache_queries=getattr(s, "prefix_cache_queries", 0),
            prefix_cache_hits=getattr(s, "prefix_cache_hits", 0),
        )

    def warnings(self) -> list[str]:
        """Lines of the cluster's logs that say something went slow or wrong (``WARNING_WORDS``,
        and a kernel "compiled" "while serving")."""
        found = []
        for root, _, files in os.walk(self.log_dir):
            for f in files:
                try:
                    with open(os.path.join(root, f), errors="replace") as fh:
                        found += [
                            f"{f}: {ln.strip()}"[: 4000 if "compiled" in ln else 300]  # a compile: its whole key
                            for ln in fh
                            if any(w in ln for w in WARNING_WORDS) or "compiled" in ln and "while serving" in ln
                        ]
                except OSError:
                    continue
        return found
