"""The workloads' request plans (a burst, Poisson arrivals of the online mix) and the figures of
the records the clients return: throughput, TTFT, inter-token latency, the steady decode step."""

from __future__ import annotations

import math

import numpy as np

from servinglib.common import pct

BURST_KEYS = (
    "requests",
    "prompt_tokens",
    "output_tokens_per_request",
    "completed",
    "errors",
    "wall_s",
    "output_tokens",
    "output_tok_s",
    "max_request_rate",
    "ttft_p50_s",
    "ttft_p99_s",
    "prefill_tok_s",
    "steady_step_s",
    "steady_step_mean_s",
    "steady_gap_p50_s",
    "steady_step_p10_s",
    "steady_step_p90_s",
    "steady_gaps",
    "steady_all_running",
    "steady_window_s",
    "steady_mean_context",
)
ONLINE_KEYS = (
    "requests",
    "load",
    "arrival_rate_req_s",
    "arrival_span_s",
    "prompt_tokens_range",
    "output_tokens_range",
    "completed",
    "cancelled",
    "errors",
    "wall_s",
    "output_tokens",
    "output_tok_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "itl_p50_s",
    "itl_p99_s",
    "itl_p99_over_p50",
    "e2e_p50_s",
    "e2e_p99_s",
)
ROUND_KEYS = (
    "api",
    "requests",
    "completed",
    "errors",
    "output_tok_s",
    "wall_s",
    "ttft_p50_s",
    "steady_step_s",
    "frontend_cpu_us_per_token",
    "client_cpu_s",
)


def burst_plan(rng: np.random.Generator, n: int, prompt: int, output: int, vocab: int) -> list:
    return [(i, 0.0, rng.integers(3, vocab, prompt).tolist(), output) for i in range(n)]


def online_plan(
    rng: np.random.Generator, rate: float, count: int, prompts: tuple, outputs: tuple, vocab: int, first: int = 0
) -> list:
    gaps = rng.exponential(1.0 / rate, count)
    offsets = np.cumsum(gaps) - gaps[0]
    plen = rng.integers(prompts[0], prompts[1] + 1, count)
    olen = rng.integers(outputs[0], outputs[1] + 1, count)
    return [
        (first + i, float(offsets[i]), rng.integers(3, vocab, int(plen[i])).tolist(), int(olen[i]))
        for i in range(count)
    ]


def mean_output(a) -> float:
    """The online mix's mean output length."""
    return (a.online_output[0] + a.online_output[1]) / 2


def capacity_plan(a, vocab: int) -> list:
    """The online mix's requests all at once (closed loop, as many as the burst): its maximum rate
    is their output tok/s / the mean output length."""
    probe = online_plan(
        np.random.default_rng(a.seed + 2),
        1e9,
        a.burst_requests,
        tuple(a.online_prompt),
        tuple(a.online_output),
        vocab,
        first=2 * 10**6,
    )
    return [(i, 0.0, p, n) for i, _, p, n in probe]


def arrival_plan(a, rate: float, vocab: int) -> list:
    """Poisson arrivals of the online mix at ``rate``: ``--duration`` seconds of them, at most
    ``--requests``."""
    count = max(1, min(a.requests, int(math.ceil(rate * a.duration))))
    return online_plan(
        np.random.default_rng(a.seed + 1),
        rate,
        count,
        tuple(a.online_prompt),
        tuple(a.online_output),
        vocab,
        first=10**6,
    )


def failed(recs: list[dict]) -> int:
    """Requests that ended in an error, were cancelled or never finished."""
    return sum(1 for r in recs if r["error"] or r["finish"] in (None, "timeout"))


def gaps(recs: list[dict], keep) -> list[float]:
    """The gaps between consecutive tokens of every stream, those that ``keep(a, b)``."""
    return [b - a for r in recs for a, b in zip(r["tokens"], r["tokens"][1:]) if keep(a, b)]


def steady_steps(recs: list[dict], trim: int) -> dict:
    """The step times of the window where every sequence is decoding: after the last first token
    (no prompt is being prefilled any more) and before the first last token (none finished)."""
    ok = [r for r in recs if r["tokens"]]
    out = dict(
        steady_step_s=None,
        steady_step_mean_s=None,
        steady_gap_p50_s=None,
        steady_step_p10_s=None,
        steady_step_p90_s=None,
        steady_gaps=0,
        steady_all_running=False,
        steady_window_s=None,
        steady_mean_context=None,
    )
    if not ok:
        return out
    lo = max(r["tokens"][0] for r in ok)
    hi = min(r["tokens"][-1] for r in ok)
    all_running = len(ok) == len(recs) and hi > lo
    gaps, ctxs, means = [], [], []
    for r in ok:
        ts = r["tokens"]
        idx = (
            [j for j in range(1, len(ts)) if ts[j - 1] >= lo and ts[j] <= hi]
            if all_running
            else list(range(1, len(ts)))
        )
        idx = idx[trim : len(idx) - trim] if len(idx) > 2 * trim else []
        if not idx:
            continue
        gaps.extend(ts[j] - ts[j - 1] for j in idx)
        ctxs.extend(r["prompt_len"] + j for j in idx)
        if len(idx) > 1:
            means.append((ts[idx[-1]] - ts[idx[0] - 1]) / len(idx))
    if not gaps:
        return out
    # the step time is wall time / steps (per stream over its window, the median stream): with
    # asynchronous steps a stream's tokens can reach the client in twos, which leaves the gaps'
    # median below the step time; the gaps' median is kept as steady_gap_p50_s
    mean = float(np.median(means)) if means else float(np.mean(gaps))
    out.update(
        steady_step_s=mean,
        steady_step_mean_s=mean,
        steady_gap_p50_s=pct(gaps, 50),
        steady_step_p10_s=pct(gaps, 10),
        steady_step_p90_s=pct(gaps, 90),
        steady_gaps=len(gaps),
        steady_all_running=all_running,
        steady_window_s=[lo, hi] if all_running else None,
        steady_mean_context=float(np.mean(ctxs)),
    )
    return out


def burst_figures(recs: list[dict], prompt: int, output: int, trim: int) -> dict:
    done = [r for r in recs if r["error"] is None and r["finish"] not in (None, "timeout")]
    toks = sum(len(r["tokens"]) for r in recs)
    last = max((r["tokens"][-1] for r in recs if r["tokens"]), default=0.0)
    first_submit = min(r["submit"] for r in recs)
    wall = last - first_submit
    ttft = [r["tokens"][0] - r["submit"] for r in recs if r["tokens"]]
    out = dict(
        requests=len(recs),
        prompt_tokens=prompt,
        output_tokens_per_request=output,
        completed=len(done),
        errors=sorted({r["error"] for r in recs if r["error"]})[:5],
        wall_s=wall,
        output_tokens=toks,
        output_tok_s=toks / wall if wall > 0 else None,
        max_request_rate=len(done) / wall if wall > 0 else None,
        ttft_p50_s=pct(ttft, 50),
        ttft_p99_s=pct(ttft, 99),
        # every prompt of the burst through prefill: its tokens over the time to the last first token
        prefill_tok_s=prompt * len(ttft) / max(ttft) if ttft and max(ttft) > 0 else None,
    )
    out.update(steady_steps(recs, trim))
    return out


def online_figures(recs: list[dict], load: float, rate: float, prompts: tuple, outputs: tuple) -> dict:
    done = [r for r in recs if r["error"] is None and r["finish"] not in (None, "timeout")]
    toks = sum(len(r["tokens"]) for r in recs)
    first_submit = min(r["submit"] for r in recs)
    last = max((r["tokens"][-1] for r in recs if r["tokens"]), default=first_submit)
    wall = last - first_submit
    ttft = [r["tokens"][0] - r["submit"] for r in recs if r["tokens"]]
    itl = [b - a for r in recs for a, b in zip(r["tokens"], r["tokens"][1:])]
    e2e = [r["tokens"][-1] - r["submit"] for r in done]
    p50, p99 = pct(itl, 50), pct(itl, 99)
    return dict(
        requests=len(recs),
        load=load,
        arrival_rate_req_s=rate,
        arrival_span_s=max(r["submit"] for r in recs) - first_submit,
        prompt_tokens_range=list(prompts),
        output_tokens_range=list(outputs),
        completed=len(done),
        cancelled=sum(r["finish"] == "timeout" for r in recs),
        errors=sorted({r["error"] for r in recs if r["error"]})[:5],
        wall_s=wall,
        output_tokens=toks,
        output_tok_s=toks / wall if wall > 0 else None,
        ttft_p50_s=pct(ttft, 50),
        ttft_p99_s=pct(ttft, 99),
        itl_p50_s=p50,
        itl_p99_s=p99,
        itl_p99_over_p50=(p99 / p50) if p50 else None,
        e2e_p50_s=pct(e2e, 50),
        e2e_p99_s=pct(e2e, 99),
    )


def api_figures(api: str, recs: list[dict], stats: dict, frontend_cpu_s: float | None, tokens: int) -> dict:
    """What one API's run cost outside the engine: the front end's CPU seconds (all its threads)
    and per output token, the clients' CPU seconds; for HTTP, tokens no chunk showed."""
    out = dict(
        api=api,
        frontend_cpu_s=frontend_cpu_s,
        frontend_cpu_us_per_token=(1e6 * frontend_cpu_s / tokens) if frontend_cpu_s is not None and tokens else None,
        client_cpu_s=stats.get("client_cpu_s"),
    )
    if api == "http":
        out.update(
            tokens_from_usage=sum(r.get("from_usage", 0) for r in recs), http_token_ids=stats.get("http_token_ids")
        )
    return out
