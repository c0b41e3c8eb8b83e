"""The printed tables: every configuration's burst, online and roofline figures, the figures by
API, and the EPLB measurement's phases."""

from __future__ import annotations


def by_round(per_round: list, failed: list) -> str:
    """The rounds' http/grpc ratios, "*" after those where a request failed."""
    return ", ".join(
        (f"{x:.3f}" if x is not None else "-") + ("*" if r in failed else "") for r, x in enumerate(per_round)
    )


def _ms(x) -> str:
    return f"{1e3 * x:>9.3g}" if isinstance(x, (int, float)) else f"{'-':>9}"


def _num(x, fmt="8.0f") -> str:
    width = int(fmt.split(".")[0])
    if not isinstance(x, (int, float)):
        return f"{'-':>{width}}"
    text = format(x, fmt).strip()
    return text.rjust(width) if len(text) < width else (" " + format(x, ".3g")).rjust(width)


def _f(x, fmt: str = ".3f") -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else "-"


def table(result: dict) -> str:
    lines = [
        f"serving benchmark: {result['shape']} on {result['gpu']} ({result['device']})",
        f"{'config':<20}{'burst tok/s':>12}{'pre tok/s':>10}{'step ms':>9}{'roof ms':>9}{'x roof':>8}{'roofc ms':>9}"
        f"{'x roofc':>8}"
        f"{'onl tok/s':>10}{'TTFT50 ms':>10}{'TTFT99 ms':>10}{'ITL50 ms':>9}{'ITL99 ms':>9}{'99/50':>7}",
    ]
    for name, c in result["configs"].items():
        if c.get("skipped"):
            lines.append(f"{name:<20} skipped: {c['skipped']}")
            continue
        if c.get("error") and not c.get("burst"):
            lines.append(f"{name:<20} failed: {c['error'][:100]}")
            continue
        if not (c.get("burst") or c.get("online")) and (c.get("prefix") or c.get("multiturn")):
            continue  # the prefix workloads only: their own table (servinglib.prefix)
        b, o, r = c.get("burst") or {}, c.get("online") or {}, c.get("roofline") or {}
        ds, mc = r.get("datasheet") or {}, r.get("measured_copy") or {}
        lines.append(
            f"{name:<20}{_num(b.get('output_tok_s'), '12.0f')}{_num(b.get('prefill_tok_s'), '10.0f')}"
            f"{_ms(b.get('steady_step_s'))}"
            f"{_ms(ds.get('step_s'))}{_num(ds.get('step_over_roofline'), '8.2f')}"
            f"{_ms(mc.get('step_s'))}{_num(mc.get('step_over_roofline'), '8.2f')}"
            f"{_num(o.get('output_tok_s'), '10.0f')} {_ms(o.get('ttft_p50_s'))} {_ms(o.get('ttft_p99_s'))}"
            f"{_ms(o.get('itl_p50_s'))}{_ms(o.get('itl_p99_s'))}{_num(o.get('itl_p99_over_p50'), '7.2f')}"
        )
    if len(result.get("apis") or ()) > 1 or (result.get("apis") or ["grpc"]) != ["grpc"]:
        lines.append(
            f"by API (same cluster, back to back; the rows above are {result['apis'][0]}'s): output tok/s, "
            f"front end CPU us per output token, clients' CPU s"
        )
        lines.append(
            f"{'config':<16}{'workload':<9}{'api':<6}{'tok/s':>9}{'TTFT50 ms':>10}{'ITL50 ms':>9}"
            f"{'ITL99 ms':>9}{'FE us/tok':>10}{'client s':>9}{'http/grpc':>10}"
        )
        for name, c in result["configs"].items():
            for w in ("burst", "online"):
                for api, r in (c.get("by_api") or {}).items():
                    f = r.get(w)
                    if not f:
                        continue
                    cmp = (c.get("http_over_grpc_output_tok_s") or {}).get(w) if api == "http" else None
                    lines.append(
                        f"{name:<16}{w:<9}{api:<6}{_num(f.get('output_tok_s'), '9.0f')}"
                        f" {_ms(f.get('ttft_p50_s'))}{_ms(f.get('itl_p50_s'))}{_ms(f.get('itl_p99_s'))}"
                        f"{_num(f.get('frontend_cpu_us_per_token'), '10.0f')}"
                        f"{_num(f.get('client_cpu_s'), '9.1f')}{_num(cmp, '10.3f')}"
                    )
                per_round = (c.get("http_over_grpc_output_tok_s_rounds") or {}).get(w)
                if per_round:
                    failed = (c.get("rounds_with_failed_requests") or {}).get(w) or []
                    lines.append(
                        f"{'':<16}{w:<9}http/grpc by round: "
                        + by_round(per_round, failed)
                        + " (median above"
                        + ("; * a request failed, left out" if 0 < len(failed) < len(per_round) else "")
                        + ")"
                    )
    lines += eplb_table(result)
    hb = result["hbm"]
    copy = hb["measured_copy_Bps"] / 1e12
    if hb.get("datasheet_Bps"):
        roof = f"datasheet {hb['datasheet_Bps'] / 1e12:g} TB/s"
    else:  # a device whose datasheet rate is not known (servinglib.roofline.datasheet_hbm_bps)
        roof = f"the measured copy rate {copy:.2f} TB/s (datasheet unknown for {hb.get('device') or result['gpu']})"
    lines.append(
        f"roofline: (weights a GPU reads + KV read per step) / HBM rate; roof = {roof}, "
        f"roofc = measured copy {copy:.2f} TB/s; x roof = measured step / roofline step"
    )
    for name, c in result["configs"].items():
        r = c.get("roofline")
        if r:
            lines.append(
                f"  {name:<14} weights {r['weight_bytes_per_gpu'] / 2**30:7.2f} GiB/GPU, KV read "
                f"{r['kv_bytes_per_step_per_gpu'] / 2**30:6.3f} GiB/step/GPU, {r['sequences_per_gpu']:.0f} "
                f"sequences/GPU at mean context {r['mean_context'] or 0:.0f}"
            )
            fa = r.get("flop_aware")
            if fa:
                m = fa["measured_copy"]
                parts = ", ".join(f"{k} {1e3 * v:.2f}" for k, v in m["per_class_s"].items())
                lines.append(
                    f"  {'':<14} FLOP-aware (matmul peak {fa['peak_flops'] / 1e12:.0f} TFLOP/s measured, copy rate): "
                    f"{1e3 * m['step_s']:.2f} ms ({parts} ms), step x{m['step_over_roofline'] or 0:.2f}"
                )
    return "\n".join(lines)


def eplb_table(result: dict) -> list[str]:
    lines = []
    for name, c in result["configs"].items():
        e = c.get("eplb")
        if not e:
            continue
        hot = e.get("hot_experts") or {}
        lines.append(
            f"EPLB end to end ({name}): {e['requests']} x {e['prompt']}-token prompts, {e['output']} out, "
            f"max-num-batched-tokens {e['max_num_batched_tokens']}, hot experts {hot.get('ids')} taking "
            f"~{hot.get('share')} of the tokens in every MoE layer"
        )
        lines.append(
            f"  {'phase':<26}{'balanced':>9}{'prefill tok/s':>14}{'pf ms/step':>11}{'out tok/s':>10}"
            f"{'ms/step':>9}{'TTFT99 ms':>10}{'failed':>7}"
        )
        for key, label in (
            ("before", "(a) EPLB off (initial)"),
            ("after", "(c) after rebalance"),
            ("decode_before", "(e) decode, initial"),
            ("decode_after", "(e) decode, rebalanced"),
        ):
            b = e.get(key)
            if not b:
                continue
            step = b.get("steady_step_s") if key.startswith("decode") else b.get("prefill_step_s")
            lines.append(
                f"  {label:<26}{_num(b['balancedness']['measured'], '9.3f')}"
                f"{_num(b.get('prefill_tok_s'), '14.0f')}{_ms(b.get('prefill_step_s'))[-11:]:>11}"
                f"{_num(b.get('output_tok_s'), '10.0f')}{_ms(step)}{_ms(b.get('ttft_p99_s'))[-10:]:>10}"
                f"{b.get('failed', 0):>7}"
            )
        r = e.get("rebalance") or {}
        if r:
            lines.append(
                f"  (b) rebalance: {'applied' if r.get('applied') else 'NOT applied'}, {r.get('slots_moved')} "
                f"slots ({r.get('slots_moved_across_workers')} across workers), "
                f"{(r.get('bytes_moved') or 0) / 2**20:.1f} MiB in {r.get('wall_s') or 0:.2f} s = "
                f"{(r.get('bytes_per_s') or 0) / 1e9:.2f} GB/s; predicted balancedness "
                f"{r.get('predicted_balancedness_before', 0):.3f} -> {r.get('predicted_balancedness_after', 0):.3f}"
            )
        i = e.get("ideal") or {}
        if i:
            lines.append(
                f"  (d) ideal MoE time = measured x balancedness: {_f(i.get('moe_time_ideal_over_measured_before'))}"
                f" x before, {_f(i.get('moe_time_ideal_over_measured_after'))} x after; MoE "
                f"speed-up predicted {_f(i.get('moe_speedup_predicted'))}, prefill step "
                f"speed-up measured {_f(i.get('prefill_step_speedup_measured'))}, prefill tok/s "
                f"{_f(i.get('prefill_tok_s_speedup_measured'))}"
            )
        d = e.get("decode_cost") or {}
        if d:
            lines.append(f"  (e) decode step rebalanced / initial: {_f(d.get('step_after_over_before'))}")
        lv = e.get("live") or {}
        if lv:
            t = lv.get("targets") or {}
            lines.append(
                f"  (f) live rebalance during the online load ({lv.get('requests')} requests at "
                f"{lv.get('arrival_rate_req_s') or 0:.2f}/s): {lv.get('slots_moved')} slots, "
                f"{(lv.get('bytes_moved') or 0) / 2**20:.1f} MiB in {lv.get('wall_s') or 0:.2f} s "
                f"({'ok' if t.get('rebalance_within_30s') else 'over'} 30 s); ITL p99 during "
                f"{_ms(lv.get('itl_p99_during_s')).strip()} ms vs steady {_ms(lv.get('itl_p99_steady_s')).strip()} ms = "
                f"{_f(lv.get('itl_p99_during_over_steady'), '.2f')}x "
                f"({'ok' if t.get('itl_p99_during_within_1_1x_steady') else 'over'} 1.1x); "
                f"{lv.get('failed')} failed"
            )
    return lines
