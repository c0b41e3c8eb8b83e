"""``--workloads eplb``: the EPLB measurement end to end on one running cluster (docs/eplb.md,
"The end-to-end measurement"), the hot experts all on worker 0 in the start placement.

Phases: a decode burst and the prefill-heavy burst on the start placement ("EPLB off"), with
the routers' measured balancedness over each burst's steps; a rebalance now through the
balancer; the same two bursts on the new placement; the ideal MoE time (measured x
balancedness); then, back on the start placement, a live rebalance during a Poisson online load:
its wall time, the inter-token p99 of the gaps that overlap it against the steady ones, and the
failed requests."""

from __future__ import annotations

import threading
import time

import numpy as np

from servinglib.clients import drive, warm_up
from servinglib.cluster import TOKEN
from servinglib.common import pct, ratio
from servinglib.figures import (
    arrival_plan,
    burst_figures,
    burst_plan,
    capacity_plan,
    failed,
    gaps,
    mean_output,
    online_figures,
)
from servinglib.steps import StepPoller


def _balancedness(load) -> dict:
    return dict(
        measured=float(load.measured.mean),
        measured_per_layer=[float(x) for x in load.measured.per_layer],
        predicted=float(load.predicted.mean),
        steps=int(load.steps),
        placement_version=int(load.placement_version),
    )


def eplb_burst(up, admin, poller: StepPoller, a, plan: list, prompt: int, output: int, window: int) -> dict:
    """One burst (all at once) with its prefill and decode figures, the engine's step count and
    the balancedness the routers measured over the burst's steps."""
    started: dict = {}
    s0 = admin.status().forward_steps
    recs = drive(up.serving, plan, a.client_procs, a.burst_timeout, on_start=lambda t: started.update(t0=t))
    s1 = admin.status().forward_steps
    time.sleep(2 * poller._period)
    b = burst_figures(recs, prompt, output, a.trim)
    steps = s1 - s0
    firsts = [r["tokens"][0] for r in recs if r["tokens"]]
    prompt_tokens = sum(r["prompt_len"] for r in recs)
    prefill_s = max(firsts) if firsts else None  # from the common start to the last first token
    prefill_steps = poller.steps_between(started["t0"], started["t0"] + prefill_s) if prefill_s else None
    b.update(
        forward_steps=steps,
        wall_per_step_s=(b["wall_s"] / steps) if steps else None,
        prompt_tokens_total=prompt_tokens,
        prefill_s=prefill_s,
        prefill_tok_s=(prompt_tokens / prefill_s) if prefill_s else None,
        prefill_steps=prefill_steps,
        prefill_step_s=(prefill_s / prefill_steps) if prefill_s and prefill_steps else None,
        failed=failed(recs),
    )
    b["balancedness"] = _balancedness(admin.expert_load(window_steps=max(1, min(steps, window))))
    return b


def wait_for_decoding(admin, until: float, steps: int = 2, period: float = 0.005) -> float:
    """Wait (at most until monotonic time ``until``) for the engine to run ``steps`` forward steps
    while a sequence is running, so that streams are between tokens; return the seconds waited."""
    t = time.monotonic()
    base = None
    while time.monotonic() < until:
        s = admin.status()
        if s.running <= 0:
            base = None
        elif base is None:
            base = s.forward_steps
        elif s.forward_steps >= base + steps:
            break
        time.sleep(period)
    return time.monotonic() - t


def rebalance_now(balancer, label: str) -> dict:
    """The balancer plans on its load window and applies the plan; the call returns when the
    migration ended."""
    t = time.monotonic()
    rb = balancer.rebalance(wait=True, timeout=600)
    wall = time.monotonic() - t
    mig = rb.migration
    out = dict(
        applied=bool(rb.applied),
        note=rb.note,
        wall_s=wall,
        slots_moved=int(rb.slots_moved),
        slots_moved_across_workers=int(rb.slots_moved_across_workers),
        bytes_moved=int(rb.bytes_moved),
        bytes_per_s=rb.bytes_moved / wall if wall > 0 else None,
        predicted_balancedness_before=float(rb.balancedness_before.mean),
        predicted_balancedness_after=float(rb.balancedness_after.mean),
        predicted_step_s_before=float(rb.predicted_step_s_before) or None,
        predicted_step_s_after=float(rb.predicted_step_s_after) or None,
        breakeven_sent=rb.breakeven is not None and bool(np.asarray(rb.breakeven).size),
        migration_state=str(mig.state) if mig is not None else None,
        migration_layers_committed=int(mig.layers_committed) if mig is not None else None,
        migration_layers_total=int(mig.layers_total) if mig is not None else None,
    )
    print(
        f"[eplb] {label}: {'applied' if rb.applied else 'NOT applied'}, {rb.slots_moved} slots "
        f"({rb.bytes_moved / 2**20:.1f} MiB) in {wall:.2f} s"
        + (f" = {out['bytes_per_s'] / 1e9:.2f} GB/s" if out["bytes_per_s"] else "")
        + f", predicted balancedness {out['predicted_balancedness_before']:.3f} -> "
        f"{out['predicted_balancedness_after']:.3f}" + (f" ({rb.note})" if rb.note else ""),
        flush=True,
    )
    return out


def run_eplb(name: str, up, a, sizes: dict, plans: dict) -> dict:
    """The phases of ``--workloads eplb`` on one running cluster; see the module docstring."""
    from moeserve.client import Client

    admin = Client(up.admin, TOKEN, timeout=60)
    balancer = Client(up.balancer, TOKEN, timeout=60)
    poller = StepPoller(up.admin)
    out: dict = dict(
        hot_experts=a.hot_experts_cfg,
        prompt=a.eplb_prompt,
        output=a.eplb_output,
        requests=a.eplb_requests,
        max_num_batched_tokens=a.max_num_batched_tokens,
        decode=dict(requests=a.burst_requests, prompt=a.burst_prompt, output=a.burst_output),
    )
    try:
        st = admin.status()
        window = int(st.eplb.window_size) or 1000
        initial = admin.placement()
        out["initial_phy2log"] = initial.phy2log.tolist()
        vocab = sizes["vocab_size"]
        rng = np.random.default_rng(a.seed + 7)
        prefill_plan = burst_plan(rng, a.eplb_requests, a.eplb_prompt, a.eplb_output, vocab)
        decode_plan = plans["burst"]
        # warm-up: a few long prompts, then the decode burst's batch through a few steps
        drive(
            up.serving, [(i, 0.0, p, 2) for i, _, p, _ in prefill_plan[: max(2, a.client_procs)]], a.client_procs, 300
        )
        warm_up(up.serving, decode_plan, a.client_procs)

        def decode(label: str) -> dict:
            d = eplb_burst(up, admin, poller, a, decode_plan, a.burst_prompt, a.burst_output, window)
            print(
                f"[eplb] decode burst {label}: {d['output_tok_s'] or 0:.0f} tok/s, steady step "
                f"{1e3 * (d['steady_step_s'] or 0):.2f} ms, balancedness {d['balancedness']['measured']:.3f}",
                flush=True,
            )
            return d

        def prefill(label: str) -> dict:
            b = eplb_burst(up, admin, poller, a, prefill_plan, a.eplb_prompt, a.eplb_output, window)
            print(
                f"[eplb] prefill burst {label}: prefill {b['prefill_tok_s'] or 0:.0f} tok/s "
                f"({1e3 * (b['prefill_step_s'] or 0):.1f} ms/step), output {b['output_tok_s'] or 0:.0f} tok/s, "
                f"balancedness {b['balancedness']['measured']:.3f}",
                flush=True,
            )
            return b

        # (e) decode at the initial placement; (a) the skewed prefill-heavy burst, EPLB off
        out["decode_before"] = decode("before")
        out["before"] = prefill("before (initial placement)")
        # (b) rebalance now, every layer (--eplb-move-budget 1.0), idle cluster
        out["rebalance"] = rebalance_now(balancer, "rebalance")
        out["rebalance"]["phy2log"] = admin.placement().phy2log.tolist()
        # (c) the same burst on the new placement; (e) decode on it
        out["after"] = prefill("after")
        out["decode_after"] = decode("after")
        # (d) the ideal: MoE time scales with the slowest worker's load, so a perfectly balanced
        # placement would take (measured MoE time) x balancedness
        bb, ba = out["before"]["balancedness"]["measured"], out["after"]["balancedness"]["measured"]
        sb, sa = out["before"].get("prefill_step_s"), out["after"].get("prefill_step_s")
        out["ideal"] = dict(
            moe_time_ideal_over_measured_before=bb,
            moe_time_ideal_over_measured_after=ba,
            moe_speedup_predicted=ratio(ba, bb) if bb else None,
            prefill_step_speedup_measured=ratio(sb, sa),
            prefill_tok_s_speedup_measured=ratio(out["after"].get("prefill_tok_s"), out["before"].get("prefill_tok_s")),
            output_tok_s_speedup_measured=ratio(out["after"].get("output_tok_s"), out["before"].get("output_tok_s")),
            prefill_step_if_all_moe_balanced_s=(sb * bb) if sb else None,
            note="balancedness = mean / max worker load; the MoE part of a step scales with the max, so "
            "ideal MoE time = measured MoE time x balancedness; the step also holds attention, the "
            "shared expert and the LM head, which balance does not change (their share: --profile)",
        )
        out["decode_cost"] = dict(
            step_before_s=out["decode_before"].get("steady_step_s"),
            step_after_s=out["decode_after"].get("steady_step_s"),
            step_after_over_before=ratio(
                out["decode_after"].get("steady_step_s"), out["decode_before"].get("steady_step_s")
            ),
        )
        # (f) back to the initial placement, then a live rebalance during the online load
        t = time.monotonic()
        restore = admin.apply_placement(np.asarray(initial.phy2log), wait=True, timeout=600)
        out["restore"] = dict(wall_s=time.monotonic() - t, moves=int(restore.moves), bytes=int(restore.bytes))
        cap = burst_figures(drive(up.serving, capacity_plan(a, vocab), a.client_procs, a.burst_timeout), 0, 0, a.trim)
        rate = a.load * (cap["output_tok_s"] or 1.0) / mean_output(a)
        plan = arrival_plan(a, rate, vocab)
        count = len(plan)
        span = plan[-1][1]
        at = a.eplb_rebalance_at if a.eplb_rebalance_at is not None else 0.4 * span
        go, live = threading.Event(), {}

        def live_rebalance():
            go.wait()
            time.sleep(max(0.0, live["t0"] + at - time.monotonic()))
            # the rebalance must overlap decoding streams: on a slow machine the first tokens
            # can come after `at`, and a migration of a few tens of ms then overlaps no gap
            live["waited"] = wait_for_decoding(admin, live["t0"] + span + 10.0)
            live["start"] = time.monotonic() - live["t0"]
            try:
                live["result"] = rebalance_now(balancer, "live rebalance during the online load")
            except Exception as e:  # noqa: BLE001 - reported
                live["error"] = f"{type(e).__name__}: {e}"
            live["end"] = time.monotonic() - live["t0"]

        th = threading.Thread(target=live_rebalance, daemon=True)
        th.start()
        recs = drive(
            up.serving, plan, a.client_procs, span + a.drain, on_start=lambda t0: (live.update(t0=t0), go.set())
        )
        th.join(600)
        o = online_figures(recs, a.load, rate, tuple(a.online_prompt), tuple(a.online_output))
        ts, te = live.get("start"), live.get("end")
        lv = dict(
            live.get("result") or {},
            error=live.get("error"),
            start_s=ts,
            end_s=te,
            rebalance_at_s=at,
            waited_for_decoding_s=live.get("waited"),
            arrival_span_s=span,
            requests=len(recs),
            completed=o["completed"],
            cancelled=o["cancelled"],
            errors=o["errors"],
            failed=failed(recs),
            output_tok_s=o["output_tok_s"],
            capacity_output_tok_s=cap["output_tok_s"],
            arrival_rate_req_s=rate,
            itl_p50_s=o["itl_p50_s"],
            itl_p99_s=o["itl_p99_s"],
        )
        if ts is not None and te is not None:
            during = gaps(recs, lambda x, y: x < te and y > ts)  # gaps that overlap the migration
            steady = gaps(recs, lambda x, y: (0.25 * ts <= y < ts) or (te < x and y <= span))
            lv.update(
                itl_during_n=len(during),
                itl_steady_n=len(steady),
                itl_p50_during_s=pct(during, 50),
                itl_p99_during_s=pct(during, 99),
                itl_p50_steady_s=pct(steady, 50),
                itl_p99_steady_s=pct(steady, 99),
                itl_p99_during_over_steady=ratio(pct(during, 99), pct(steady, 99)),
            )
        lv["targets"] = dict(
            rebalance_within_30s=bool(lv.get("wall_s") is not None and lv["wall_s"] <= 30.0),
            itl_p99_during_within_1_1x_steady=bool(
                lv.get("itl_p99_during_over_steady") is not None and lv["itl_p99_during_over_steady"] <= 1.1
            ),
            no_request_failed=lv["failed"] == 0 and not lv["errors"],
        )
        out["live"] = lv
        print(
            f"[eplb] live: {lv.get('slots_moved')} slots in {lv.get('wall_s') or 0:.2f} s during the online load "
            f"({count} requests at {rate:.2f}/s), ITL p99 during {1e3 * (lv.get('itl_p99_during_s') or 0):.1f} ms vs "
            f"steady {1e3 * (lv.get('itl_p99_steady_s') or 0):.1f} ms, {lv['failed']} failed",
            flush=True,
        )
        out["failed_requests"] = (
            sum(out[k]["failed"] for k in ("decode_before", "before", "after", "decode_after")) + lv["failed"]
        )
    finally:
        poller.close()
        admin.close()
        balancer.close()
    return out
