"""The front end's metrics under vLLM's names (``vllm:...``, labelled ``model_name``), beside
moeserve's own, so that dashboards, alerts and autoscalers built for vLLM read moeserve
unchanged (docs/metrics.md, "vLLM's names").

Per request (recorded by ``moeserve.ops.metrics.RequestRecord`` as events arrive):
time to first token, every inter-token gap, the request's mean time per output token,
end-to-end latency, prompt and generated token counts and histograms, finished requests by
reason. The scheduler's state (running, waiting, KV cache usage, preemptions) is the leader's:
the front end's readiness probe hands over the status it reads once a second
(:meth:`VllmMetrics.update`), and a scrape of the HTTP port's /metrics asks for a fresh one first
(:meth:`VllmMetrics.refresh`); the collector shows the last.
"""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vLLM's buckets, so that a dashboard's quantiles read the same resolution
TTFT_BUCKETS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0)
TTFT_BUCKETS += (2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS: tuple[float, ...] = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
ITL_BUCKETS += (7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS: tuple[float, ...] = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0)
E2E_BUCKETS += (60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
# moeserve's finish reasons -> vLLM's finished_reason label
FINISHED = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}
STATUS_TIMEOUT_S = 2.0


class VllmMetrics:
    """vLLM's serving metrics in ``registry``, every series labelled ``model_name``."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.model_name = model_name
        labels = ("model_name",)

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry).labels(model_name)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token (vLLM's name).", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Every gap between two tokens (vLLM's name).", ITL_BUCKETS)
        self.tpot = hist(
            "vllm:time_per_output_token_seconds", "Every gap between two tokens (vLLM's older name).", ITL_BUCKETS
        )
        self.request_tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "A request's mean time per output token after the first (vLLM's name).",
            ITL_BUCKETS,
        )
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to last token (vLLM's name).", E2E_BUCKETS)
        self.queue = hist(
            "vllm:request_queue_time_seconds",
            "Time waiting for admission, the leader's clock (vLLM's name).",
            TTFT_BUCKETS,
        )
        self.prefill = hist(
            "vllm:request_prefill_time_seconds",
            "First admission to the first token, the leader's clock (vLLM's name).",
            TTFT_BUCKETS,
        )
        self.decode = hist("vllm:request_decode_time_seconds", "First token to last token (vLLM's name).", E2E_BUCKETS)
        self.inference = hist(
            "vllm:request_inference_time_seconds", "Prefill and decode time (vLLM's name).", E2E_BUCKETS
        )
        self.request_prompt = hist(
            "vllm:request_prompt_tokens", "Prompt tokens per finished request (vLLM's name).", TOKEN_BUCKETS
        )
        self.request_generation = hist(
            "vllm:request_generation_tokens", "Generated tokens per finished request (vLLM's name).", TOKEN_BUCKETS
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of admitted requests (vLLM's name).")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens (vLLM's name).")
        success = Counter(
            "vllm:request_success",
            "Finished requests by reason (vLLM's name).",
            ("model_name", "finished_reason"),
            registry=registry,
        )
        self.success = {r: success.labels(model_name, v) for r, v in FINISHED.items()}
        self._status: Any = None
        registry.register(_SchedulerState(self))  # type: ignore[arg-type]  # a collector by duck typing

    def update(self, status) -> None:
        """The leader's status (an EngineStatus) as the readiness probe read it, once a second."""
        self._status = status

    async def refresh(self, engine) -> None:
        """Ask the leader for its status (``engine.call("status")``; at most 2 s); a leader that
        does not answer leaves the last status shown."""
        call: Any = getattr(engine, "call", None)
        if call is None:
            return
        try:
            self._status = await asyncio.wait_for(call("status"), STATUS_TIMEOUT_S)
        except Exception:
            pass

    # what RequestRecord reports

    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def token(self, gap_s: float | None, first_s: float | None, n: int) -> None:
        if first_s is not None:
            self.ttft.observe(first_s)
        if gap_s is not None:
            self.itl.observe(gap_s)
            self.tpot.observe(gap_s)
        self.generation_tokens.inc(n)

    def engine_times(self, queued_s: float, prefill_s: float) -> None:
        self.queue.observe(queued_s)
        self.prefill.observe(prefill_s)

    def finished(
        self,
        reason: str,
        prompt_tokens: int,
        tokens: int,
        e2e_s: float | None,
        tpot_s: float | None,
        decode_s: float | None = None,
        prefill_s: float | None = None,
    ):
        self.success[reason if reason in FINISHED else "error"].inc()
        if decode_s is not None:
            self.decode.observe(decode_s)
            if prefill_s is not None:
                self.inference.observe(prefill_s + decode_s)
        self.request_prompt.observe(prompt_tokens)
        self.request_generation.observe(tokens)
        if e2e_s is not None:
            self.e2e.observe(e2e_s)
        if tpot_s is not None:
            self.request_tpot.observe(tpot_s)


class _SchedulerState:
    """The leader's scheduler state as vLLM names it, from the last status :meth:`refresh` got
    (zeros before the first)."""

    def __init__(self, m: VllmMetrics):
        self.m = m

    def describe(self):
        return self._families(None)

    def collect(self):
        return self._families(self.m._status)

    def _families(self, st):
        name = self.m.model_name
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Requests running (vLLM's name).", labels=["model_name"]
        )
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Requests waiting (vLLM's name).", labels=["model_name"]
        )
        kv = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV cache usage, 1 = full (vLLM's name).", labels=["model_name"]
        )
        pre = CounterMetricFamily("vllm:num_preemptions", "Preempted sequences (vLLM's name).", labels=["model_name"])
        total = getattr(st, "kv_blocks_total", 0) or 0
        running.add_metric([name], getattr(st, "running", 0) or 0)
        waiting.add_metric([name], getattr(st, "waiting", 0) or 0)
        kv.add_metric([name], (getattr(st, "kv_blocks_used", 0) or 0) / total if total else 0.0)
        pre.add_metric([name], getattr(st, "preemptions", 0) or 0)
        return [running, waiting, kv, pre]


__all__ = ["VllmMetrics"]
