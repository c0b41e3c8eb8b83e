"""The baseline: transformers' ``AutoModelForCausalLM.from_config`` (random init) and ``generate``
(greedy, ``min_new_tokens`` = ``max_new_tokens``) at the burst's batch, in a process of its own;
reported beside moeserve, not a target."""

from __future__ import annotations

import os
import time

from servinglib.common import run_in_process
from servinglib.roofline import kv_bytes_read, roofline
from servinglib.shapes import TINY


def hf_generate(model_dir: str, device: str, dtype_name: str, prompts: list, new_tokens: int, pad: int) -> dict:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    dev = torch.device(device)
    dtype = getattr(torch, dtype_name)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    cfg = AutoConfig.from_pretrained(model_dir)
    t = time.perf_counter()
    with dev:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval()
    init_s = time.perf_counter() - t
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # what a decode step reads: every weight but an untied input embedding (a gather of a row
    # per token; a tied one is the LM head's product)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == emb.weight.data_ptr()
    read_bytes = weight_bytes - (0 if tied else emb.weight.numel() * emb.weight.element_size())
    ids = torch.tensor(prompts, dtype=torch.long, device=dev)
    mask = torch.ones_like(ids)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def gen(n, rows=None):
        x, m = (ids, mask) if rows is None else (ids[:rows], mask[:rows])
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=x,
                attention_mask=m,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=pad,
                use_cache=True,
            )
        sync()
        return time.perf_counter() - t0, out.shape[1] - x.shape[1]

    gen(2, rows=min(8, len(prompts)))  # warm-up
    prefill_s, _ = gen(1)
    total_s, made = gen(new_tokens)
    step = (total_s - prefill_s) / (made - 1) if made > 1 else None
    return dict(
        transformers=transformers.__version__,
        init_s=init_s,
        weight_bytes=weight_bytes,
        read_bytes=read_bytes,
        prefill_s=prefill_s,
        total_s=total_s,
        new_tokens=made,
        step_s=step,
        peak_memory_bytes=torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
    )


def run_transformers(model_dir: str, sizes: dict, a, rates: dict, plans: dict) -> dict:
    res: dict = dict(kind="transformers", gpus=0 if a.smoke else 1, error=None, burst=None, online=None, roofline=None)
    prompts = [p for _, _, p, _ in plans["burst"]]
    device = "cpu" if a.smoke else "cuda:0"
    out, err = run_in_process(
        hf_generate,
        (model_dir, device, a.dtype, prompts, a.burst_output, int(TINY["pad_token_id"] if a.smoke else 0)),
        a.hf_timeout,
    )
    if err:
        res["error"] = err.splitlines()[0] if err else err
        res["error_detail"] = err
        print(f"[transformers] failed: {res['error']}", flush=True)
        return res
    n, new = len(prompts), out["new_tokens"]
    res["run"] = out
    res["burst"] = dict(
        requests=n,
        prompt_tokens=a.burst_prompt,
        output_tokens_per_request=new,
        output_tokens=n * new,
        wall_s=out["total_s"],
        output_tok_s=n * new / out["total_s"],
        prefill_s=out["prefill_s"],
        steady_step_s=out["step_s"],
    )
    ctx = a.burst_prompt + new / 2
    kv = kv_bytes_read(sizes, [int(round(ctx))]) * n
    res["roofline"] = roofline(out["read_bytes"], kv, out["step_s"], rates, 1, n, ctx)
    print(
        f"[transformers] {res['burst']['output_tok_s']:.0f} tok/s, step {1e3 * (out['step_s'] or 0):.2f} ms", flush=True
    )
    return res
