"""The roofline: the bytes a GPU reads per decode step (its weights and the KV the step reads)
over the HBM rate, the datasheet's and that of a large device-to-device copy measured here."""

from __future__ import annotations

import time

from servinglib.common import run_in_process

DATASHEET_HBM_BPS = 4.8e12  # H200 SXM: 4.8 TB/s

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


def kv_bytes_read(sizes: dict, contexts) -> float:
    """KV bytes one decode step reads for sequences at these context lengths (a chunked-attention
    layer reads only the current chunk, a sliding-window layer only its window)."""
    total = 0.0
    windows = sizes.get("windows") or [None] * len(sizes["chunked"])
    for ctx in contexts:
        for chunked, window in zip(sizes["chunked"], windows):
            n = (ctx - 1) % sizes["chunk"] + 1 if chunked and sizes["chunk"] else ctx
            if window:
                n = min(n, window)
            total += n * sizes["kv_layer_token"]
    return total


def roofline(
    weight_bytes: float,
    kv_bytes: float,
    step_s: float | None,
    rates: dict,
    gpus: int,
    seqs_per_gpu: float,
    mean_ctx: float | None,
) -> dict:
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
    return info


def gpu_facts(gpus: int, smoke: bool) -> list[dict]:
    devices = ["cpu"] if smoke else [f"cuda:{i}" for i in range(gpus)]
    out = []
    for d in devices:
        res, err = run_in_process(measure_copy, (d, (64 << 20) if smoke else (4 << 30), 5 if smoke else 20), 180)
        if err:
            raise RuntimeError(f"measuring the copy rate on {d} failed: {err}")
        out.append(res)
    return out
