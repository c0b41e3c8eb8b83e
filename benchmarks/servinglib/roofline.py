"""The roofline: the bytes a GPU reads per decode step (its weights and the KV the step reads)
over the HBM rate, the device's datasheet rate (``datasheet_hbm_bps``; where the device is not in
the table, the measured copy rate in its place, said so) and that of a large device-to-device
copy measured here; and
beside it the FLOP-aware roofline: per kernel class (dense products, routed experts, attention)
max(bytes / HBM rate, FLOPs / matmul peak), summed, with the peak measured in the same run (the
best of 10 of a bf16 GEMM of 8192 x 5120 x 16384)."""

from __future__ import annotations

import time

from servinglib.common import run_in_process

# The datasheet's HBM rate (B/s) by a part of torch.cuda.get_device_name(), matched in this
# order (case aside), so the more specific names come first: "H200" before "H20", "H100 NVL"
# and "H100 PCIe" before "H100". None: a device whose rate is not known here.
DATASHEET_HBM = (
    ("GH200", None),  # 4.0 or 4.9 TB/s by its memory: not told apart by the name
    ("H200", 4.8e12),  # SXM and NVL
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM: "NVIDIA H100 80GB HBM3"
    ("H20", 4.0e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100-SXM4-40GB", 1.555e12),
    ("A100-PCIE-40GB", 1.555e12),
    ("B200", 8.0e12),
)


def datasheet_hbm_bps(device_name: str) -> float | None:
    """The datasheet's HBM rate (B/s) of the device named ``device_name`` (as
    ``torch.cuda.get_device_name()`` names it), or None where ``DATASHEET_HBM`` does not know it."""
    name = (device_name or "").lower()
    for part, rate in DATASHEET_HBM:
        if part.lower() in name:
            return rate
    return None


def hbm_rates(names: list[str], measured: float) -> tuple[dict, dict]:
    """The roofline's rates ({"datasheet": .., "measured_copy": ..}) and the record of them for a
    result's JSON, for the devices named ``names`` (one rate: the lowest) and the ``measured``
    copy rate. Where a device's datasheet rate is unknown, the measured rate stands in for it
    (``roof_rate`` "measured_copy", ``datasheet_Bps`` None): never another GPU's figure."""
    known = [datasheet_hbm_bps(n) for n in names]
    datasheet = min(known) if known and None not in known else None
    rates = {"datasheet": datasheet if datasheet else measured, "measured_copy": measured}
    record = dict(
        device=names[0] if names else None,
        datasheet_Bps=datasheet,
        measured_copy_Bps=measured,
        roof_rate="datasheet" if datasheet else "measured_copy",
    )
    return rates, record


def rate_line(record: dict) -> str:
    """The printed line of a run's HBM rates (``hbm_rates``' record)."""
    name, ds = record["device"], record["datasheet_Bps"]
    told = f"datasheet {ds / 1e12:g}" if ds else f"datasheet: unknown for {name}, the measured copy rate used"
    return f"{name}: device-to-device copy {record['measured_copy_Bps'] / 1e12:.2f} TB/s ({told})"


PEAK_GEMM = (8192, 5120, 16384)  # M, K, N of the bf16 product whose best of 10 is the matmul peak

ROOFLINE_KEYS = (
    "gpus",
    "weight_bytes_per_gpu",
    "kv_bytes_per_step_per_gpu",
    "bytes_per_step_per_gpu",
    "sequences_per_gpu",
    "mean_context",
    "datasheet",
    "measured_copy",
)


def keys_read(sizes: dict, contexts) -> float:
    """(layer, key) pairs one decode step reads for sequences at these context lengths (a
    chunked-attention layer reads only the current chunk, a sliding-window layer only its
    window)."""
    total = 0.0
    windows = sizes.get("windows") or [None] * len(sizes["chunked"])
    for ctx in contexts:
        for chunked, window in zip(sizes["chunked"], windows):
            n = (ctx - 1) % sizes["chunk"] + 1 if chunked and sizes["chunk"] else ctx
            total += min(n, window) if window else n
    return total


def kv_bytes_read(sizes: dict, contexts) -> float:
    """KV bytes one decode step reads for sequences at these context lengths (``keys_read``)."""
    return keys_read(sizes, contexts) * sizes["kv_layer_token"]


def step_classes(sizes: dict, weight_bytes: float, kv_bytes: float, tokens: float, contexts) -> dict:
    """{class: (bytes, FLOPs)} of one decode step on a GPU: ``tokens`` new tokens (one per
    sequence), the sequences at ``contexts``; the routed experts' bytes are what the GPU holds
    beside the dense ones (at these batches every slot is read); ``weight_bytes`` is what the GPU
    reads (``shapes.weights_read_per_gpu``): an untied embedding table is gathered, not read."""
    dense_bytes = sizes["router_bytes"] - sizes.get("lookup_bytes", 0)
    keys = keys_read(sizes, contexts)
    return dict(
        dense=(dense_bytes, 2.0 * tokens * sizes["dense_params"]),
        experts=(
            weight_bytes - dense_bytes,
            2.0 * tokens * sizes["top_k"] * sizes["num_moe_layers"] * sizes["expert_params"],
        ),
        attention=(kv_bytes, keys * sizes["attn_flops_per_key"]),
    )


def flop_aware(classes: dict, rate: float, peak_flops: float) -> dict:
    """The FLOP-aware step of ``classes`` ({class: (bytes, FLOPs)}) at an HBM ``rate``: per class
    max(bytes / rate, FLOPs / peak), and their sum."""
    per = {c: max(b / rate, f / peak_flops) for c, (b, f) in classes.items()}
    return dict(step_s=sum(per.values()), per_class_s=per)


def roofline(
    weight_bytes: float,
    kv_bytes: float,
    step_s: float | None,
    rates: dict,
    gpus: int,
    seqs_per_gpu: float,
    mean_ctx: float | None,
    classes: dict | None = None,
    peak_flops: float | None = None,
) -> dict:
    """Bytes-only rooflines at each rate of ``rates``, and with ``classes`` (``step_classes``)
    and the measured ``peak_flops`` the FLOP-aware one at each rate (``flop_aware``)."""
    total = weight_bytes + kv_bytes
    out = dict(
        gpus=gpus,
        weight_bytes_per_gpu=int(weight_bytes),
        kv_bytes_per_step_per_gpu=int(kv_bytes),
        bytes_per_step_per_gpu=int(total),
        sequences_per_gpu=seqs_per_gpu,
        mean_context=mean_ctx,
    )
    for name, rate in rates.items():
        t = total / rate if rate else None
        out[name] = dict(
            rate_Bps=rate,
            step_s=t,
            step_over_roofline=(step_s / t) if (t and step_s) else None,
            roofline_share=(t / step_s) if (t and step_s) else None,
        )
    if classes and peak_flops:
        out["flop_aware"] = {"peak_flops": peak_flops, "classes": {}}
        for name, rate in rates.items():
            fa = flop_aware(classes, rate, peak_flops)
            t = fa["step_s"]
            out["flop_aware"][name] = dict(
                step_s=t,
                step_over_roofline=(step_s / t) if (t and step_s) else None,
                roofline_share=(t / step_s) if (t and step_s) else None,
                per_class_s=fa["per_class_s"],
            )
        out["flop_aware"]["classes"] = {c: dict(bytes=b, flops=f) for c, (b, f) in classes.items()}
    return out


# ------------------------------------------------------------------------------------------
# the HBM copy rate, in its own process per device


def measure_copy(device: str, nbytes: int, iters: int) -> dict:
    import torch

    dev = torch.device(device)
    info = {"device": device}
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        info.update(
            name=torch.cuda.get_device_name(dev), memory_bytes=torch.cuda.get_device_properties(dev).total_memory
        )
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    src.fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        torch.cuda.synchronize(dev)
        sec = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        sec = time.perf_counter() - t0
    # a copy reads and writes every byte
    info.update(copy_bytes=nbytes, iters=iters, rate_Bps=2 * nbytes * iters / sec)
    if dev.type == "cuda":
        del src, dst
        info["peak_flops"] = measure_peak(dev)
    return info


def measure_peak(dev) -> float:
    """FLOP/s of the best of 10 bf16 products of PEAK_GEMM on ``dev`` (after 3 warm-ups)."""
    import torch

    m, k, n = PEAK_GEMM
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2.0 * m * k * n / best


def gpu_facts(gpus: int, smoke: bool) -> list[dict]:
    devices = ["cpu"] if smoke else [f"cuda:{i}" for i in range(gpus)]
    out = []
    for d in devices:
        res, err = run_in_process(measure_copy, (d, (64 << 20) if smoke else (4 << 30), 5 if smoke else 20), 180)
        if err:
            raise RuntimeError(f"measuring the copy rate on {d} failed: {err}")
        out.append(res)
    return out
