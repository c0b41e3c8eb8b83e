"""On a GPU: how many times the serving path's Triton kernels compile, and whether they agree
with their torch references. One H200, under a minute:

    python3 benchmarks/gpu_compiles.py

1. The start-up warm-ups (``kernels.warm_up_expert_mlp``, ``sampling.warm_up``) run; their
   compiles are counted.
2. A sweep of step shapes runs: expert MLPs of 1-2,048 rows at every rows-per-pass a step can
   pick, race sampling of batches 1-256 with and without top-k, and paged attention for decode,
   prefill and mixed steps of 1-256 sequences. Its compiles are counted by kernel: the expert
   kernels and the race should add none, and attention at most one per launch configuration.
3. Each kernel's output is compared with its torch path on one case (expert MLP: the slot
   loop; GPT-OSS's experts, biases and the clamped SwiGLU: torch's ops around
   ``torch._grouped_mm``; attention, also with a sliding window and sinks: the torch path;
   race: the torch race, token for token).

``moeserve.kernels.compilelog`` counts the compiles (Triton's JIT hooks, as ranks log them). Prints
a table and writes JSON (``--json``, default benchmarks/results/gpu-compiles.json).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402


def batch_of(lens, starts, block_size, device):
    from moeserve.models.paged import PagedBatch

    need = [math.ceil((s + n) / block_size) for s, n in zip(starts, lens)]
    ids, tables = list(range(sum(need) + 2)), []
    for k in need:
        tables.append(ids[:k] + [0] * random.Random(k).randrange(3))
        ids = ids[k:]
    return PagedBatch.build(lens, starts, tables, block_size, device), sum(need) + 2


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu-compiles.json")
    )
    p.add_argument(
        "--cpu-check",
        action="store_true",
        help="run the script's code on the CPU under Triton's interpreter at small sizes (no compiles "
        "happen there: a check of the script, not a measurement)",
    )
    a = p.parse_args()
    if a.cpu_check:
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print("gpu_compiles.py needs a CUDA device (or --cpu-check)", file=sys.stderr)
        return 2
    dev = torch.device("cpu" if a.cpu_check else "cuda")
    small = a.cpu_check
    from moeserve import kernels as K
    from moeserve import sampling as S
    from moeserve.expert_worker.store import expert_act, expert_block_m_for, grouped_forward, grouped_mm_forward
    from moeserve.kernels import compilelog
    from moeserve.models.attention import attention_config, paged_attention_torch, paged_attention_triton
    from moeserve.models.moe import ExpertSpec

    logging.getLogger(compilelog.__name__).setLevel(logging.ERROR)  # counted here, not logged
    compilelog.watch()
    COMPILES = compilelog.counts
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out: dict = {
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter check)",
        "torch": torch.__version__,
    }
    t0 = time.perf_counter()

    # 1. warm-ups
    spec = ExpertSpec(
        hidden_size=64 if small else 1024,
        intermediate_size=32 if small else 512,
        dtype=torch.float32 if small else torch.bfloat16,
    )
    slots = 16
    layers = [spec.views(torch.randn(slots, spec.numel, device=dev).to(spec.dtype) * 0.05) for _ in range(2)]
    K.warm_up_expert_mlp(layers[0]["gate_up"], layers[0]["down"])
    v = 3_000 if small else 202_048
    S._warm_up_race(v, dev) if small else S.warm_up(v, dev)
    sync()
    out["warm_up_compiles"] = dict(COMPILES)
    out["warm_up_s"] = time.perf_counter() - t0
    COMPILES.clear()

    # 2. the sweep
    t1 = time.perf_counter()
    recv = torch.randn(2048 if small else 8192, spec.hidden_size, device=dev).to(spec.dtype)
    for pairs in [1, 7, 16, 100, 256, slots * 33, slots * 64]:
        bm = expert_block_m_for(pairs, slots, "auto")
        per = [pairs // slots + (1 if i < pairs % slots else 0) for i in range(slots)]
        offs = torch.tensor(per, device=dev).cumsum(0).to(torch.int32)
        for w in layers:
            if bm:
                K.expert_mlp(recv, w["gate_up"], w["down"], offs, bm)
    mix = [S.SamplingParams(temperature=0.8, seed=1), S.SamplingParams(temperature=0.7, top_k=40, seed=3)]
    for b in [1, 2, 3, 16, 17] if small else [1, 2, 3, 16, 17, 64, 255, 256]:
        for k in (1, 2):
            params = [mix[(i * k) % 2] if k == 2 else mix[0] for i in range(b)]
            st = S.SamplingTensors.build(params, list(range(b)), [3] * b, dev)
            S.sample(torch.randn(b, v, device=dev), st, backend="triton")
    hq, hkv, d, bs = (4, 2, 16, 16) if small else (40, 8, 128, 16)
    adtype = torch.float32 if small else torch.bfloat16
    rng = random.Random(0)
    configs = set()
    for s in [1, 2, 3, 17] if small else list(range(1, 40)) + [63, 64, 65, 128, 255, 256]:
        for lens, starts in (
            ([1] * s, [rng.randrange(0, 300 if small else 3000) for _ in range(s)]),
            ([rng.randrange(1, 90) for _ in range(s)], [rng.choice([0, rng.randrange(0, 300)]) for _ in range(s)]),
        ):
            batch, blocks = batch_of(lens, starts, bs, dev)
            q = torch.randn(batch.num_tokens, hq, d, device=dev, dtype=adtype)
            pool = torch.randn(blocks * bs, hkv, d, device=dev, dtype=adtype)
            cfg = attention_config(
                batch, hq, hkv, d, None if small else torch.cuda.get_device_properties(dev).multi_processor_count
            )
            configs.add((cfg["BM"], cfg["NS"]))
            for chunk in (None, 8192):
                paged_attention_triton(q, pool, pool, batch, scale=d**-0.5, chunk=chunk)
                configs.add((cfg["BM"], cfg["NS"], chunk))
    sync()
    out["sweep_compiles"] = dict(COMPILES)
    out["attention_launch_configurations"] = len({c for c in configs if len(c) == 3})
    out["sweep_s"] = time.perf_counter() - t1

    # 3. agreement with the torch paths
    w = layers[0]
    per = [5, 0, 17, 3] + [1] * (slots - 4)
    offs = torch.tensor(per, device=dev).cumsum(0).to(torch.int32)
    x = recv[: sum(per)]
    got = K.expert_mlp(x, w["gate_up"], w["down"], offs, 32)[: sum(per)].float()
    want = grouped_forward(spec, x, w, per, offs).float()
    out["expert_mlp_max_abs_err"] = float((got - want).abs().max())
    out["expert_mlp_max_abs"] = float(want.abs().max())
    ospec = ExpertSpec(spec.hidden_size, spec.intermediate_size, "clamped_swiglu", True, spec.dtype)
    ow = ospec.views((torch.randn(slots, ospec.numel, device=dev) * 0.05).to(spec.dtype))
    ow["gate_up_bias"].normal_()
    ow["down_bias"].normal_()
    act = expert_act(ospec, ow)
    before = dict(COMPILES)
    K.warm_up_expert_mlp(ow["gate_up"], ow["down"], None, spec.dtype, act)
    out["gpt_oss_expert_warm_up_compiles"] = {k: v - before.get(k, 0) for k, v in COMPILES.items()}
    got = K.expert_mlp(x, ow["gate_up"], ow["down"], offs, 32, act=act)[: sum(per)].float()
    ref = grouped_mm_forward(ospec, x, ow, offs) if dev.type == "cuda" else grouped_forward(ospec, x, ow, per, offs)
    out["gpt_oss_expert_mlp_max_abs_err"] = float((got - ref[: sum(per)].float()).abs().max())
    out["gpt_oss_expert_mlp_max_abs"] = float(ref.float().abs().max())
    batch, blocks = batch_of([1, 37, 1, 200], [500, 0, 40, 100], bs, dev)
    q = torch.randn(batch.num_tokens, hq, d, device=dev, dtype=adtype)
    kp = torch.randn(blocks * bs, hkv, d, device=dev, dtype=adtype)
    vp = torch.randn(blocks * bs, hkv, d, device=dev, dtype=adtype)
    at = paged_attention_triton(q, kp, vp, batch, scale=d**-0.5, chunk=None).float()
    ar = paged_attention_torch(q, kp, vp, batch, scale=d**-0.5, chunk=None, softmax_fp32=True).float()
    out["attention_max_abs_err"] = float((at - ar).abs().max())
    sinks = torch.randn(hq, device=dev)
    at = paged_attention_triton(q, kp, vp, batch, scale=d**-0.5, chunk=None, window=128, sinks=sinks).float()
    ar = paged_attention_torch(
        q, kp, vp, batch, scale=d**-0.5, chunk=None, softmax_fp32=True, window=128, sinks=sinks
    ).float()
    out["attention_window_sinks_max_abs_err"] = float((at - ar).abs().max())
    nb = 8 if small else 64
    params = [mix[i % 2] for i in range(nb)]
    st = S.SamplingTensors.build(params, list(range(nb)), [7] * nb, dev)
    logits = torch.randn(nb, v, device=dev)
    out["race_tokens_equal_torch"] = bool(
        torch.equal(S.sample(logits, st, backend="triton"), S.sample(logits, st, backend="torch"))
    )
    out["elapsed_s"] = time.perf_counter() - t0

    print("| phase | compiles by kernel | s |\n|---|---|---|")
    print(f"| warm-ups | {out['warm_up_compiles']} | {out['warm_up_s']:.1f} |")
    print(f"| sweep | {out['sweep_compiles']} | {out['sweep_s']:.1f} |")
    print(f"attention launch configurations in the sweep: {out['attention_launch_configurations']}")
    print(
        f"expert MLP vs slot loop: max abs err {out['expert_mlp_max_abs_err']:.3g} "
        f"(max abs {out['expert_mlp_max_abs']:.3g}); attention vs torch: max abs err "
        f"{out['attention_max_abs_err']:.3g}; race tokens equal torch's: {out['race_tokens_equal_torch']}"
    )
    print(
        f"GPT-OSS experts vs grouped_mm: max abs err {out['gpt_oss_expert_mlp_max_abs_err']:.3g} (max abs "
        f"{out['gpt_oss_expert_mlp_max_abs']:.3g}), warm-up compiles {out['gpt_oss_expert_warm_up_compiles']}; "
        f"attention with a window and sinks vs torch: max abs err {out['attention_window_sinks_max_abs_err']:.3g}"
    )
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
