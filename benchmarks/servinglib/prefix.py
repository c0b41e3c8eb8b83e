"""The prefix-caching workloads (``--workloads prefix,multiturn``): their request plans, the
conversations' client, and their figures.

- prefix: ``--prefix-requests`` requests, each a system prompt of ``--prefix-system`` random ids
  that they all share and ``--prefix-unique`` ids of its own, ``--prefix-output`` tokens out,
  ignore_eos, Poisson arrivals at ``--prefix-rate`` requests/s: TTFT p50/p99, output tok/s and
  the share of prompt tokens read from the cache (each request's ``usage.cached_tokens``).
- multiturn (through gRPC): ``--multiturn-conversations`` conversations of ``--multiturn-turns``
  turns, starting at Poisson arrivals at ``--multiturn-rate``/s; a conversation sends a turn once
  the answer before it came back, and a turn's prompt is the conversation so far (every earlier
  prompt and answer) and ``--multiturn-new`` new ids, its answer ``--multiturn-output`` tokens:
  the share of prompt tokens read from the cache in the turns after the first, TTFT of first
  and later turns.

Every run has a ``cache_salt`` of its own (``servinglib.clients.drive``): the warm-up leaves
nothing a measured run could find.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

import numpy as np

from moeserve.ops.metrics import TTFT_PARTS as HOPS
from servinglib.common import pacing, pct, ratio
from servinglib.streams import record, start

TURN_STRIDE = 1000  # a record's index: conversation x TURN_STRIDE + turn


def poisson_offsets(rng: np.random.Generator, rate: float, count: int) -> np.ndarray:
    gaps = rng.exponential(1.0 / rate, count)
    return np.cumsum(gaps) - gaps[0]


def prefix_plan(a, vocab: int) -> list:
    """[(index, offset_s, prompt ids, max_tokens)]: one shared system prompt, a unique tail each."""
    rng = np.random.default_rng(a.seed + 3)
    system = rng.integers(3, vocab, a.prefix_system).tolist()
    offsets = poisson_offsets(rng, a.prefix_rate, a.prefix_requests)
    return [
        (3 * 10**6 + i, float(offsets[i]), system + rng.integers(3, vocab, a.prefix_unique).tolist(), a.prefix_output)
        for i in range(a.prefix_requests)
    ]


def conversation_plan(a, vocab: int) -> list:
    """[(conversation, start offset_s, first prompt, max_tokens per answer, [new ids of each later turn])]."""
    rng = np.random.default_rng(a.seed + 4)
    offsets = poisson_offsets(rng, a.multiturn_rate, a.multiturn_conversations)
    new = a.multiturn_new
    return [
        (
            c,
            float(offsets[c]),
            rng.integers(3, vocab, new).tolist(),
            a.multiturn_output,
            [rng.integers(3, vocab, new).tolist() for _ in range(a.multiturn_turns - 1)],
        )
        for c in range(a.multiturn_conversations)
    ]


async def client_turns(address, plan, t0_value, go, results, warm, deadline_s, salt="") -> None:
    """Conversations of ``conversation_plan`` through the SDK's streaming call, each starting at
    its offset from the common start; one record per turn (``conversation``, ``turn``, its
    prompt's length, ``cached``: the prompt tokens the server read from its prefix cache,
    ``ids``: the answer)."""
    from moeserve.client import AsyncClient

    client = AsyncClient(address, timeout=deadline_s)
    if warm:  # connect, and one token through every layer
        async for _ in client.generate_stream(prompt_token_ids=[5, 6, 7], max_tokens=1, ignore_eos=True):
            pass
    results.put(("ready", None))
    t0 = await start(go, t0_value)
    cpu0 = time.process_time()
    deadline = t0 + deadline_s

    async def turn(rec, prompt, n, answer):
        async for chunk in client.generate_stream(
            prompt_token_ids=prompt, max_tokens=n, ignore_eos=True, cache_salt=salt
        ):
            rec["tokens"].extend([time.monotonic() - t0] * len(chunk.token_ids))
            answer.extend(chunk.token_ids)
            if chunk.finish_reason:
                rec["finish"] = chunk.finish_reason
            if chunk.usage is not None:
                rec["cached"] = chunk.usage.cached_tokens

    async def conversation(c, offset, first, n, later):
        await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
        recs, history = [], list(first)
        for k in range(len(later) + 1):
            rec = record(c * TURN_STRIDE + k, offset, history, n, t0)
            answer: list[int] = []
            rec.update(conversation=c, turn=k, cached=0, ids=answer)
            recs.append(rec)
            try:
                await asyncio.wait_for(turn(rec, history, n, answer), timeout=max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                rec["finish"] = "timeout"
            except Exception as e:  # noqa: BLE001 - recorded per turn
                rec["error"] = f"{type(e).__name__}: {e}"
            if rec["error"] or rec["finish"] in (None, "timeout"):
                break
            if k < len(later):
                history = history + answer + list(later[k])
        return recs

    per = await asyncio.gather(*(conversation(*p) for p in plan))
    await client.close()
    results.put(("done", {"recs": [r for recs in per for r in recs], "cpu_s": time.process_time() - cpu0}))


def _done(recs: list[dict]) -> list[dict]:
    return [r for r in recs if r["error"] is None and r["finish"] not in (None, "timeout")]


def cache_figures(recs: list[dict]) -> dict:
    """TTFT, output tok/s and the prompt tokens read from the prefix cache, of ``recs``."""
    done = _done(recs)
    toks = sum(len(r["tokens"]) for r in recs)
    first_submit = min((r["submit"] for r in recs), default=0.0)
    last = max((r["tokens"][-1] for r in recs if r["tokens"]), default=first_submit)
    wall = last - first_submit
    ttft = [r["tokens"][0] - r["submit"] for r in recs if r["tokens"]]
    gaps = [b - a for r in recs for a, b in zip(r["tokens"], r["tokens"][1:])]  # inter-token: the step period
    prompt = sum(r["prompt_len"] for r in done)
    cached = sum(r.get("cached", 0) for r in done)
    digests = (  # each request's generated ids, to compare configurations (gRPC records carry them)
        {str(r["i"]): hashlib.sha1(repr(r["ids"]).encode()).hexdigest()[:16] for r in done}
        if done and all(r.get("ids") is not None for r in done)
        else None
    )
    return dict(
        requests=len(recs),
        completed=len(done),
        errors=sorted({r["error"] for r in recs if r["error"]})[:5],
        wall_s=wall,
        output_tokens=toks,
        output_tok_s=toks / wall if wall > 0 else None,
        ttft_p50_s=pct(ttft, 50),
        ttft_p99_s=pct(ttft, 99),
        ttft_mean_s=sum(ttft) / len(ttft) if ttft else None,
        itl_p50_s=pct(gaps, 50),
        itl_p99_s=pct(gaps, 99),
        prompt_tokens=prompt,
        cached_prompt_tokens=cached,
        computed_prompt_tokens=prompt - cached,
        hit_rate=ratio(cached, prompt),
        output_digests=digests,
    )


def settled_latency(up, tries: int = 20, wait_s: float = 0.05) -> dict:
    """The front end's latency histograms (``Cluster.frontend_latency``) once their request
    counts agree: a first token's queue and prefill times are observed just before its TTFT, by
    another thread than the scrape's, so a scrape between the two counts one request in the
    first and not the other, and the means of a window would cover different requests (the
    leader's parts of one more than the front end's TTFT). Scraped again, ``wait_s`` apart,
    until ``ttft``, ``queue`` and ``prefill`` count the same requests (at most ``tries``)."""
    got = up.frontend_latency()
    for _ in range(tries):
        counts = {got[k][1] for k in ("ttft", "queue", "prefill") if k in got}
        if len(counts) <= 1:
            break
        time.sleep(wait_s)
        got = up.frontend_latency()
    return got


def ttft_parts(client_mean_s: float | None, before: dict, after: dict) -> dict:
    """Mean TTFT by where it was spent, over the requests of one run: ``client`` (the client's
    clock, ``cache_figures``' ``ttft_mean_s``), ``front_end`` (the front end's, from its
    ``moeserve_time_to_first_token_seconds``, over ``front_end_requests`` requests: the clients'
    warm-ups too), the leader's ``queue`` (arrival to first admission) and ``prefill`` (admission
    to the first token known); the rest of the client's figure is the trip between client and
    front end. ``hops``: the front end's TTFT split at every hop (``HOPS`` in order, from
    ``moeserve_time_to_first_token_part_seconds``: the front end before the submit, the submit's
    way to the leader's channel, the leader's intake, queue and prefill, the first token's way
    to the leader's channel and back to the front end, the front end after; they add up to
    ``front_end``), with ``requests``: how many requests they cover. None where the front end
    serves no metrics (or, for ``hops``, no parts)."""

    def mean(key):
        s0, n0 = before.get(key, (0.0, 0.0))
        s1, n1 = after.get(key, (0.0, 0.0))
        return ((s1 - s0) / (n1 - n0) if key in after and n1 > n0 else None), n1 - n0

    out: dict = {"client": client_mean_s}
    for name, key in (("front_end", "ttft"), ("queue", "queue"), ("prefill", "prefill")):
        out[name] = mean(key)[0]
    out["front_end_requests"] = int(mean("ttft")[1])
    out["queue_requests"] = int(mean("queue")[1])
    hops = {name: mean(f"part:{name}") for name in HOPS}
    counts = {n for _, n in hops.values()}
    out["hops"] = (
        {**{name: m for name, (m, _) in hops.items()}, "requests": int(counts.pop())}
        if all(m is not None for m, _ in hops.values()) and len(counts) == 1
        else None
    )
    return out


def prefix_figures(recs: list[dict], a) -> dict:
    out = dict(
        rate_req_s=a.prefix_rate,
        system_tokens=a.prefix_system,
        unique_tokens=a.prefix_unique,
        output_tokens_per_request=a.prefix_output,
    )
    out.update(cache_figures(recs))
    return out


def multiturn_figures(recs: list[dict], a) -> dict:
    """The whole load's figures, and those of the first turns and of the later ones (whose
    ``hit_rate`` is the share of their prompt tokens read from the cache)."""
    out = dict(
        conversations=a.multiturn_conversations,
        turns=a.multiturn_turns,
        new_tokens_per_turn=a.multiturn_new,
        output_tokens_per_turn=a.multiturn_output,
        conversation_rate_s=a.multiturn_rate,
        conversations_completed=len({r["conversation"] for r in _done(recs) if r["turn"] == a.multiturn_turns - 1}),
    )
    out.update(cache_figures(recs))
    out["first_turns"] = cache_figures([r for r in recs if r["turn"] == 0])
    out["later_turns"] = cache_figures([r for r in recs if r["turn"] > 0])
    return out


def warm_up_plan(plans: dict, procs: int) -> list:
    """A few requests of the shape of the prefix workloads (their prompts' lengths), to compile
    what their first prefill would."""
    if "prefix" in plans:
        return plans["prefix"][: 2 * procs]
    return [(c, 0.0, first, n) for c, _, first, n, _ in plans["multiturn"][: 2 * procs]]


def run_prefix_workloads(m, plans: dict, drive) -> None:
    """The prefix workload through ``m``'s first API, the multi-turn one through gRPC
    (``drive``: ``servinglib.clients.drive``), on ``m.up`` (``servinglib.workloads.Measure``);
    each's figures and the engine's counters meanwhile."""
    a, up = m.a, m.up
    for key in ("prefix", "multiturn"):
        plan = plans.get(key)
        if plan is None:
            continue
        s0, l0 = up.status(), settled_latency(up)
        if key == "prefix":
            recs, _ = m.run(m.first, plan, plan[-1][1] + a.drain)
            f = prefix_figures(recs, a)
        else:
            span = plan[-1][1] + a.multiturn_turns * (a.drain / 2)
            recs = drive(up.serving, plan, a.client_procs, span + a.drain, api="turns")
            f = multiturn_figures(recs, a)
        s1, l1 = up.status(), settled_latency(up)
        f["ttft_parts_mean_s"] = ttft_parts(f["ttft_mean_s"], l0, l1)
        f["engine"] = {
            k: s1[k] - s0[k] for k in ("prefix_cache_queries", "prefix_cache_hits", "preemptions", "forward_steps")
        } | pacing(s0, s1)
        steps = f["engine"]["forward_steps"]
        f["wall_per_forward_step_s"] = f["wall_s"] / steps if steps else None
        m.res[key] = f
        parts = f["ttft_parts_mean_s"]
        if parts.get("queue") is not None:
            m.say(
                f"{key}: TTFT mean {1e3 * (parts['client'] or 0):.1f} ms at the client, "
                f"{1e3 * (parts['front_end'] or 0):.1f} at the front end; the leader's queue "
                f"{1e3 * parts['queue']:.1f} + prefill {1e3 * (parts['prefill'] or 0):.1f}"
            )
        if parts.get("hops") is not None:
            m.say(
                f"{key}: the front end's TTFT by hop, mean ms: "
                + ", ".join(f"{name} {1e3 * parts['hops'][name]:.2f}" for name in HOPS)
            )
        later = f.get("later_turns", f)
        m.say(
            f"{key}: {f['completed']}/{f['requests']} requests, TTFT p50 {1e3 * (f['ttft_p50_s'] or 0):.1f} ms "
            f"p99 {1e3 * (f['ttft_p99_s'] or 0):.1f} ms, ITL p50 {1e3 * (f['itl_p50_s'] or 0):.1f} ms "
            f"p99 {1e3 * (f['itl_p99_s'] or 0):.1f} ms, {f['output_tok_s'] or 0:.0f} tok/s, cached "
            f"{100 * (later['hit_rate'] or 0):.1f} % of the prompt tokens"
            + (" after the first turn" if key == "multiturn" else "")
        )


def side_by_side(configs: dict) -> dict:
    """Each configuration with prefix caching against its ``-no-prefix-cache`` twin measured in
    the same run: uncached / cached TTFT p50 (and p99), cached / uncached output tok/s, and the
    share of the requests both completed whose generated ids are the same (greedy, the same
    dummy weights: in bf16 a cache hit changes the attention's shape, so near-ties may break
    the other way)."""
    out = {}
    for name, c in configs.items():
        off = configs.get(f"{name}-no-prefix-cache")
        if off is None:
            continue
        for key in ("prefix", "multiturn"):
            on_f, off_f = c.get(key), off.get(key)
            if not on_f or not off_f:
                continue
            a, b = on_f.get("output_digests") or {}, off_f.get("output_digests") or {}
            both = set(a) & set(b)
            out.setdefault(name, {})[key] = dict(
                ttft_p50_uncached_over_cached=ratio(off_f["ttft_p50_s"], on_f["ttft_p50_s"]),
                ttft_p99_uncached_over_cached=ratio(off_f["ttft_p99_s"], on_f["ttft_p99_s"]),
                output_tok_s_cached_over_uncached=ratio(on_f["output_tok_s"], off_f["output_tok_s"]),
                identical_outputs_share=ratio(sum(a[i] == b[i] for i in both), len(both)),
                compared_requests=len(both),
            )
    return out


def prefix_table(result: dict) -> list[str]:
    """The prefix workloads' rows of the printed table, and the side-by-side ratios."""
    rows = [
        (name, key, c[key])
        for name, c in result["configs"].items()
        for key in ("prefix", "multiturn")
        if isinstance(c.get(key), dict)
    ]
    if not rows:
        return []
    lines = [
        "prefix caching: TTFT, output tok/s, share of prompt tokens read from the cache (multiturn: of "
        "the turns after the first)",
        f"  {'config':<32}{'workload':<10}{'done':>9}{'TTFT50 ms':>10}{'TTFT99 ms':>10}{'tok/s':>9}{'cached':>8}"
        f"{'computed':>10}",
    ]
    for name, key, f in rows:
        later = f.get("later_turns", f)
        rate = later.get("hit_rate")
        lines.append(
            f"  {name:<32}{key:<10}{f['completed']:>4}/{f['requests']:<4}"
            f"{1e3 * (f['ttft_p50_s'] or 0):>10.1f}{1e3 * (f['ttft_p99_s'] or 0):>10.1f}"
            f"{f['output_tok_s'] or 0:>9.0f}{'-' if rate is None else f'{100 * rate:.1f}%':>8}"
            f"{f['computed_prompt_tokens']:>10}"
        )
    for name, ws in (result.get("prefix_caching") or {}).items():
        for key, r in ws.items():
            lines.append(
                f"  {name} vs {name}-no-prefix-cache, {key}: TTFT p50 {r['ttft_p50_uncached_over_cached'] or 0:.2f}x "
                f"lower, p99 {r['ttft_p99_uncached_over_cached'] or 0:.2f}x; output tok/s "
                f"{r['output_tok_s_cached_over_uncached'] or 0:.2f}x; identical outputs "
                f"{100 * (r['identical_outputs_share'] or 0):.1f} % of {r['compared_requests']}"
            )
    return lines
