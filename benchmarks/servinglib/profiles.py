"""The ranks' step profiles (``--profile START:COUNT``, ``moeserve.ops.profiling``): a step's
device time broken down by part and by kernel class, and the lines that print them."""

from __future__ import annotations

import json
import os


def read_profiles(folder: str) -> dict:
    """The ranks' step profiles (``moeserve.ops.profiling``) with the breakdown of a step's device
    time: attention, expert matmuls (and their weight-read rate when known), exchange (dispatch
    and combine less the matmuls inside them), LM head + sampling, the rest; and host times."""
    out: dict = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if not name.endswith(".json"):
            continue
        with open(os.path.join(folder, name)) as f:
            p = json.load(f)
        sp = {k: v for k, v in p["spans"].items()}

        def dev(k):
            return sp.get(k, {}).get("device_s", 0.0)

        def host(k):
            return sp.get(k, {}).get("host_s", 0.0)

        busy = p["device_busy_per_step_s"]
        parts = {
            "attention": dev("attention"),
            "expert_matmul": dev("expert_matmul"),
            "exchange": max(0.0, dev("moe_dispatch") + dev("moe_combine") - dev("expert_matmul")),
            "gate_shared_dense": dev("gate") + dev("shared_expert") + dev("dense_mlp"),
            "lm_head_sampling": dev("lm_head") + dev("sampling"),
        }
        parts["rest"] = max(0.0, busy - sum(parts.values()))
        p["breakdown_device_s"] = parts
        p["breakdown_by_kernel_s"] = kernel_breakdown(p["kernels"])
        p["host_s"] = {
            k: host(k)
            for k in ("schedule", "header_broadcast", "batch_build", "result_gather", "load_read", "sampling")
        }
        out[name[:-5]] = p
    return out


KERNEL_CLASSES = (  # (class, substrings of kernel names), first match wins
    (
        "exchange",
        (
            "barrier_kernel",
            "route_kernel",
            "expert_count_kernel",
            "publish_kernel",
            "prep_kernel",
            "scatter_pairs_kernel",
            "return_rows_kernel",
            "nccl",
            "all_to_all",
            "AllToAll",
        ),
    ),
    (
        "expert_matmul",
        ("GroupProblem", "grouped", "expert_matmul_kernel", "silu_mul_kernel", "weighted_sum_kernel"),
    ),
    ("fp8_quant", ("quant_rows",)),
    ("attention", ("paged_attention",)),
    ("sampling", ("sample", "philox", "race", "argmax", "ArgMax")),
)


def kernel_breakdown(kernels: list[dict]) -> dict:
    """Device seconds per step by kernel class (``KERNEL_CLASSES``; the rest: dense matmuls of
    attention projections, shared experts, LM head, norms, elementwise)."""
    out = {name: 0.0 for name, _ in KERNEL_CLASSES}
    out["rest"] = 0.0
    for k in kernels:
        cls = next((name for name, keys in KERNEL_CLASSES if any(s in k["name"] for s in keys)), "rest")
        out[cls] += k["device_s"]
    return out


def profile_table(profiles: dict, expert_bytes_per_step: float | None = None) -> list[str]:
    lines = []
    for rank, p in profiles.items():
        kb = p.get("breakdown_by_kernel_s") or {}
        if kb:
            rate = ""
            if expert_bytes_per_step and kb.get("expert_matmul"):
                rate = f" ({expert_bytes_per_step / kb['expert_matmul'] / 1e9:.0f} GB/s of expert weights)"
            lines.append(
                f"profile {rank}: kernels ms/step: " + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in kb.items()) + rate
            )
        b = p["breakdown_device_s"]
        lines.append(
            f"profile {rank}: wall {1e3 * p['wall_per_step_s']:.2f} ms/step, device busy "
            f"{1e3 * p['device_busy_per_step_s']:.2f} ms: " + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in b.items())
        )
        lines.append(
            f"profile {rank}: host ms/step: " + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in p["host_s"].items())
        )
        for k in p["kernels"][:14]:
            lines.append(f"    {1e3 * k['device_s']:7.3f} ms x{k['calls_per_step']:.0f}  {k['name'][:90]}")
    return lines
