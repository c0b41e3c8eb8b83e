"""A moeserve configuration's workloads on one running cluster: the burst (``--rounds`` rounds
through each API, every other round in the reverse order) and the online load (Poisson arrivals
at ``--load`` of the online mix's maximum rate), through each API of ``--apis`` in turn, with
the roofline beside every measured step, then the prefix-caching workloads
(``servinglib.prefix``); ``--workloads eplb`` hands the cluster to ``servinglib.eplb`` instead."""

from __future__ import annotations

import os

import numpy as np

from servinglib.clients import drive, warm_up
from servinglib.cluster import Cluster, configuration_flags
from servinglib.common import pacing, ratio
from servinglib.figures import (
    ROUND_KEYS,
    api_figures,
    arrival_plan,
    burst_figures,
    capacity_plan,
    mean_output,
    online_figures,
)
from servinglib.profiles import profile_table, read_profiles
from servinglib.report import by_round
from servinglib.roofline import kv_bytes_read, roofline, step_classes
from servinglib.shapes import expert_bytes_per_gpu, weights_read_per_gpu
from servinglib.steps import StepPoller, decode_step_s


def clean(b: dict) -> bool:
    """Every request of the round completed."""
    return b["completed"] == b["requests"] and not b["errors"]


class Measure:
    """The figures of one configuration (``res``, its entry in the JSON) as its workloads run on
    ``up`` through each API of ``a.apis``; the first API's are the configuration's own."""

    def __init__(self, name: str, ranks: int, redundant: int, a):
        self.name, self.ranks, self.redundant, self.a = name, ranks, redundant, a
        self.apis = apis = list(getattr(a, "apis", None) or ["grpc"])
        self.first = apis[0]
        self.res: dict = dict(
            kind="moeserve",
            ranks=ranks,
            gpus=ranks if a.backend == "nccl" else 0,
            redundant_experts=redundant,
            backend=a.backend,
            exchange=a.exchange,
            error=None,
            burst=None,
            online=None,
            roofline=None,
            engine=None,
            apis=apis,
            by_api={api: dict(burst=None, online=None, roofline=None, engine=None) for api in apis},
        )
        if "grpc" in apis and "http" in apis:
            self.res["http_over_grpc_output_tok_s"] = {}
        self.up: Cluster | None = None

    def say(self, text: str) -> None:
        print(f"[{self.name}] {text}", flush=True)

    def record(self, api: str, key: str, value) -> None:
        self.res["by_api"][api][key] = value
        if api == self.first:  # the configuration's own figures: the first API's
            self.res[key] = value

    def compare(self, workload: str) -> None:
        res = self.res
        if "http_over_grpc_output_tok_s" in res:
            g, h = (res["by_api"][api][workload] or {} for api in ("grpc", "http"))
            res["http_over_grpc_output_tok_s"][workload] = ratio(h.get("output_tok_s"), g.get("output_tok_s"))

    def run(self, api: str, plan: list, deadline_s: float):
        """(records, the API's cost figures less the token count) of one workload through ``api``."""
        up = self.up
        stats: dict = {}
        cpu0 = up.frontend_cpu_s()
        recs = drive(up.api_address(api), plan, self.a.client_procs, deadline_s, api=api, stats=stats)
        cpu1 = up.frontend_cpu_s()
        fe = (cpu1 - cpu0) if cpu0 is not None and cpu1 is not None else None
        return recs, lambda tokens: api_figures(api, recs, stats, fe, tokens)

    def burst(self, plan: list, sizes: dict, rates: dict) -> None:
        """``--rounds`` bursts through each API; each API's figures are its median round's."""
        a, apis, up, ranks = self.a, self.apis, self.up, self.ranks
        weights = weights_read_per_gpu(sizes, self.redundant, ranks)  # the roofline's bytes
        rounds: dict = {api: [] for api in apis}
        for r in range(a.rounds):  # odd rounds in the reverse order of the APIs
            for api in apis if r % 2 == 0 else apis[::-1]:
                poller = StepPoller(up.admin, period=0.05)  # the leader's steps over time
                try:
                    s0 = up.status()
                    recs, cost = self.run(api, plan, a.burst_timeout)
                    s1 = up.status()
                finally:
                    poller.close()
                b = burst_figures(recs, a.burst_prompt, a.burst_output, a.trim)
                b.update(cost(b["output_tokens"]))
                steps = s1["forward_steps"] - s0["forward_steps"]
                preempted = s1["preemptions"] - s0["preemptions"]
                # the engine's own decode step: the clients' can be longer when the front end
                # is behind (docs/engine.md, "The front end's share")
                own = (
                    decode_step_s(poller, s1["forward_steps"], a.burst_output, a.trim)
                    if a.burst_requests <= a.max_num_seqs and not preempted
                    else None
                )
                engine = dict(
                    burst_forward_steps=steps,
                    burst_wall_per_step_s=(b["wall_s"] / steps) if steps else None,
                    engine_decode_step_s=own,
                    client_step_over_engine=ratio(b["steady_step_s"], own),
                    preemptions=preempted,
                    kv_blocks_total=s1["kv_blocks_total"],
                    **pacing(s0, s1),
                )
                rounds[api].append((b, engine))
                fe = b.get("frontend_cpu_us_per_token")
                self.say(
                    f"burst via {api}{f' (round {r + 1})' if a.rounds > 1 else ''}: "
                    f"{b['output_tok_s'] or 0:.0f} tok/s, step {1e3 * (b['steady_step_s'] or 0):.2f} ms"
                    + (f" (the engine's {1e3 * own:.2f} ms)" if own else "")
                    + (f", front end {fe:.0f} us CPU/token" if fe is not None else "")
                )
        for api in apis:
            runs = rounds[api]
            pool = [j for j in range(len(runs)) if clean(runs[j][0])] or list(range(len(runs)))
            k = sorted(pool, key=lambda j: runs[j][0]["output_tok_s"] or 0)[len(pool) // 2]
            b, engine = runs[k]
            if len(runs) > 1:  # the round with the median output tok/s, and every round
                b = dict(b, round=k, rounds=[{key: x[0].get(key) for key in ROUND_KEYS} for x in runs])
            self.record(api, "engine", engine)
            self.record(api, "burst", b)
            per_gpu = a.burst_requests / ranks
            ctx = b["steady_mean_context"] or (a.burst_prompt + a.burst_output / 2)
            kv = kv_bytes_read(sizes, [int(round(ctx))]) * per_gpu
            classes = step_classes(sizes, weights, kv, per_gpu, [int(round(ctx))] * int(per_gpu))
            line = roofline(
                weights, kv, b["steady_step_s"], rates, max(1, ranks), per_gpu, ctx, classes, self.a.peak_flops
            )
            self.record(api, "roofline", line)
        if "http_over_grpc_output_tok_s" in self.res:
            self.burst_ratio(rounds)

    def burst_ratio(self, rounds: dict) -> None:
        """http / grpc output tok/s of the burst: the median of the rounds' ratios, leaving out
        the rounds where a request failed through either API (unless every round has one)."""
        res, a = self.res, self.a
        pairs = list(zip(rounds["grpc"], rounds["http"]))
        per_round = [ratio(h[0]["output_tok_s"], g[0]["output_tok_s"]) for g, h in pairs]
        failed = [r for r, (g, h) in enumerate(pairs) if not (clean(g[0]) and clean(h[0]))]
        known = [x for r, x in enumerate(per_round) if x is not None and r not in failed] or [
            x for x in per_round if x is not None
        ]
        res["http_over_grpc_output_tok_s"]["burst"] = float(np.median(known)) if known else None
        if a.rounds > 1:
            res.setdefault("http_over_grpc_output_tok_s_rounds", {})["burst"] = per_round
            res.setdefault("rounds_with_failed_requests", {})["burst"] = failed
        self.say(
            "burst http/grpc output tok/s: "
            + by_round(per_round, failed)
            + (
                f" (median {res['http_over_grpc_output_tok_s']['burst'] or 0:.3f}"
                + ("; * a request failed, left out" if failed and len(failed) < len(per_round) else "")
                + ")"
                if a.rounds > 1
                else ""
            )
        )

    def online(self, sizes: dict) -> None:
        """Poisson arrivals at ``--load`` of the maximum rate, the same plan through each API."""
        a, res = self.a, self.res
        base = (res["by_api"][self.first]["burst"] or {}).get("output_tok_s")
        if not base:
            raise RuntimeError("the online workload needs the burst's throughput")
        mean_out = mean_output(a)
        if a.online_capacity == "probe":
            # The maximum rate of the online mix itself: its requests all at once (closed
            # loop, as many as the burst), output tok/s over the run / mean output length.
            recs, _ = self.run(self.first, capacity_plan(a, sizes["vocab_size"]), a.burst_timeout)
            cap = burst_figures(recs, 0, 0, a.trim)
            res["online_capacity"] = {
                k: cap[k]
                for k in (
                    "requests",
                    "completed",
                    "wall_s",
                    "output_tokens",
                    "output_tok_s",
                    "ttft_p50_s",
                    "ttft_p99_s",
                )
            }
            base = cap["output_tok_s"] or base
            self.say(f"online mix all at once: {base:.0f} tok/s, max rate {base / mean_out:.1f} req/s")
        rate = a.load * base / mean_out
        plan = arrival_plan(a, rate, sizes["vocab_size"])
        for api in self.apis:
            s0 = self.up.status()
            recs, cost = self.run(api, plan, plan[-1][1] + a.drain)
            o = online_figures(recs, a.load, rate, tuple(a.online_prompt), tuple(a.online_output))
            o.update(cost(o["output_tokens"]))
            o.update(pacing(s0, self.up.status()))
            self.record(api, "online", o)
            self.say(
                f"online via {api}: {o['requests']} requests at {rate:.1f}/s, "
                f"{o['output_tok_s'] or 0:.0f} tok/s, ITL p50 {1e3 * (o['itl_p50_s'] or 0):.1f} ms "
                f"p99 {1e3 * (o['itl_p99_s'] or 0):.1f} ms"
            )
        self.compare("online")

    def finish(self, sizes: dict) -> None:
        """The warnings in the cluster's logs and, with ``--profile``, the ranks' step profiles."""
        res, up = self.res, self.up
        res["log_warnings"] = up.warnings()
        for line in res["log_warnings"][:5]:
            self.say(f"log: {line}")
        if up.profile_dir:
            res["profile"] = read_profiles(up.profile_dir)
            ebytes = expert_bytes_per_gpu(sizes, self.redundant, self.ranks)
            res["profile_expert_bytes_per_step"] = ebytes
            for line in profile_table(res["profile"], ebytes):
                self.say(line)
        if not up.alive():
            raise RuntimeError(f"moeserve up exited during the run:\n{up.tail()}")


def run_moeserve(
    name: str, ranks: int, redundant: int, model_dir: str, sizes: dict, a, rates: dict, plans: dict, log_root: str
) -> dict:
    """One moeserve configuration end to end, its cluster stopped at the end; a failure is
    recorded in the result's ``error``, with the tail of the cluster's logs printed."""
    m = Measure(name, ranks, redundant, a)
    try:
        eplb = "eplb" in plans
        extra, env = configuration_flags(name, a, eplb)
        m.up = up = Cluster(
            model_dir,
            ranks,
            redundant,
            a,
            os.path.join(log_root, name),
            http="http" in m.apis,
            extra=extra,
            env=env,
        )
        m.res["startup_s"] = up.startup_s
        m.say(f"ready in {up.startup_s:.0f} s")
        if eplb:
            from servinglib.eplb import run_eplb

            m.res["eplb"] = run_eplb(name, up, a, sizes, plans)
            plans = {}
        # warm-up, through each API: the burst's batch through prefill and a few decode steps
        for api in m.apis if "burst" in plans else ():
            warm_up(up.api_address(api), plans["burst"], a.client_procs, api=api)
        if "burst" in plans:
            m.burst(plans["burst"], sizes, rates)
        if "online" in plans:
            m.online(sizes)
        if "prefix" in plans or "multiturn" in plans:
            from servinglib.prefix import run_prefix_workloads, warm_up_plan

            if "burst" not in plans:
                warm_up(up.api_address(m.first), warm_up_plan(plans, a.client_procs), a.client_procs, api=m.first)
            run_prefix_workloads(m, plans, drive)
        m.finish(sizes)
    except Exception as e:  # noqa: BLE001 - one configuration's failure
        m.res["error"] = f"{type(e).__name__}: {e}"
        m.say(f"failed: {m.res['error']}")
        if m.up is not None:
            print(m.up.tail(), flush=True)
    finally:
        if m.up is not None:
            m.up.stop()
    return m.res
