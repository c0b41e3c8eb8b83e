"""Numerical probes of one model: which experts each MoE layer chose, and the fp32 noise floor.

Dimension letters: T tokens of a step, K experts per token, P positions of a sequence that were
routed (its prompt and every generated token but the last), n generated tokens, V vocabulary.

The correctness contract compares a cluster's fp32 logits with the single-process model's
within 1e-4. That bound only means something for a model whose own fp32 rounding noise is well
below it: the same model on the same device, run once per prompt and once with every prompt in
one batch, rounds differently (the matrix products have other shapes) and agrees only to its
*floor*. A model with large attention scores (no qk-norm and large weights) amplifies the
rounding of q and k into the softmax and has a floor far above 1e-4, whatever runs it; a model
whose MoE gate has a near-tie may route one token differently in the two runs. :func:`floor`
measures both, for any family and device: the logits' largest difference, and every (prompt,
position, MoE layer) whose chosen expert set differs (a *flip*), with the difference before the
first flip of each prompt.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from moeserve.models.cache import StepBatch
from moeserve.models.paged import PagedBatch


class _Recorded:
    """A MoE block that records the sorted expert ids [T, K] of every route() call."""

    def __init__(self, inner, calls: list):
        self.inner, self.calls = inner, calls

    def route(self, hidden: torch.Tensor):
        r = self.inner.route(hidden)
        self.calls.append(r.ids.sort(dim=-1).values.cpu())
        return r

    def shared(self, hidden: torch.Tensor):
        return self.inner.shared(hidden)

    @property
    def shared_mlp(self):
        return self.inner.shared_mlp


@contextmanager
def recording(model):
    """Within the block, ``calls[m]`` lists the sorted ids [T, K] of each route() of MoE layer m."""
    saved = model.moe_blocks
    calls: list[list[torch.Tensor]] = [[] for _ in saved]
    model.moe_blocks = [_Recorded(b, calls[m]) for m, b in enumerate(saved)]
    try:
        yield calls
    finally:
        model.moe_blocks = saved


@torch.inference_mode()
def decode_alone(model, prompt: list[int], tokens: list[int]) -> tuple[np.ndarray, list[torch.Tensor]]:
    """One prompt through the eager KV cache, then ``tokens[:-1]`` one at a time (teacher
    forced): the float32 logits [n, V] each of ``tokens`` was taken from, and per MoE layer the
    sorted ids [P, K] of every routed position."""
    cache, dev = model.new_cache(), model.device
    ids, start, rows = list(prompt), 0, []
    with recording(model) as calls:
        for i in range(len(tokens)):
            batch = StepBatch(seq_ids=(0,), lens=(len(ids),), starts=(start,))
            hidden = model.step(torch.tensor(ids, device=dev), batch, cache)
            rows.append(model.logits(hidden[-1:])[0].float().cpu().numpy())
            start += len(ids)
            ids = [tokens[i]]
    return np.stack(rows), [torch.cat(c) for c in calls]


@torch.inference_mode()
def decode_batched(
    model, prompts: list[list[int]], tokens: list[list[int]], block_size: int = 16
) -> tuple[list[np.ndarray], list[list[torch.Tensor]]]:
    """Every prompt in one paged step, then one teacher-forced token of each per step (the
    shape of step a router runs, with the paged attention of the model's device): per prompt
    the logits [n, V] and per MoE layer the sorted ids [P, K]."""
    s, n = len(prompts), len(tokens[0])
    need = [-(-(len(p) + n) // block_size) for p in prompts]
    tables = [list(range(sum(need[:i]), sum(need[: i + 1]))) for i in range(s)]
    cache = model.new_paged_cache(sum(need), block_size)
    lens, starts = [len(p) for p in prompts], [0] * s
    ids = [t for p in prompts for t in p]
    logits: list[list[np.ndarray]] = [[] for _ in prompts]
    steps = []
    with recording(model) as calls:
        for i in range(n):
            batch = PagedBatch.build(lens, starts, tables, block_size, device=model.device)
            hidden = model.step(torch.tensor(ids, device=model.device), batch, cache)
            out = model.logits(hidden[batch.last_token_index]).float().cpu().numpy()
            for j in range(s):
                logits[j].append(out[j])
            steps.append(list(lens))
            starts = [a + b for a, b in zip(starts, lens)]
            lens, ids = [1] * s, [tokens[j][i] for j in range(s)]
    per_prompt: list[list[torch.Tensor]] = [[] for _ in prompts]
    for layer_calls in calls:
        parts: list[list[torch.Tensor]] = [[] for _ in prompts]
        for step_lens, ids_tk in zip(steps, layer_calls):
            for j, chunk in enumerate(ids_tk.split(step_lens)):
                parts[j].append(chunk)
        for j in range(s):
            per_prompt[j].append(torch.cat(parts[j]))
    return [np.stack(lg) for lg in logits], per_prompt


@dataclass(frozen=True)
class FloorReport:
    """The two runs' agreement: ``max_dlogit`` over every logit; ``flips`` (prompt, position,
    MoE layer) where the chosen experts differ; ``max_dlogit_before_flip`` over each prompt's
    logits up to its first flip (all of them when it has none)."""

    max_dlogit: float
    flips: tuple[tuple[int, int, int], ...]
    max_dlogit_before_flip: float
    logit_scale: float  # the largest |logit| seen

    def as_dict(self) -> dict:
        return dict(
            max_dlogit=self.max_dlogit,
            flips=[list(f) for f in self.flips],
            max_dlogit_before_flip=self.max_dlogit_before_flip,
            logit_scale=self.logit_scale,
        )


def compare(
    prompts: list[list[int]],
    a: tuple[list[np.ndarray], list[list[torch.Tensor]]],
    b: tuple[list[np.ndarray], list[list[torch.Tensor]]],
) -> FloorReport:
    """Compare two runs of the same prompts and tokens (logits and routing per prompt)."""
    flips, worst, before, scale = [], 0.0, 0.0, 0.0
    for j, prompt in enumerate(prompts):
        la, lb = a[0][j], b[0][j]
        d = np.abs(la - lb).max(axis=-1)  # [n]
        worst, scale = max(worst, float(d.max())), max(scale, float(np.abs(la).max()))
        first = None
        for m, (ia, ib) in enumerate(zip(a[1][j], b[1][j])):
            for pos in (ia != ib).any(dim=-1).nonzero().flatten().tolist():
                flips.append((j, pos, m))
                first = pos if first is None else min(first, pos)
        # logits row i is taken after position len(prompt) - 1 + i was routed
        keep = len(d) if first is None else max(0, first - len(prompt) + 1)
        if keep:
            before = max(before, float(d[:keep].max()))
    return FloorReport(worst, tuple(sorted(flips)), before, scale)


def floor(model, prompts: list[list[int]], n: int) -> tuple[FloorReport, list[list[int]]]:
    """The model's fp32 floor on ``prompts``: greedy decoding of each prompt alone (``n``
    tokens), against the same tokens with every prompt in one batch. Returns the report and the
    greedy tokens of the lone runs."""
    tokens = []
    for p in prompts:
        out = model.generate(torch.tensor([p], device=model.device), max_new_tokens=n, ignore_eos=True)
        tokens.append(out[0, len(p) :].tolist())
    alone = [decode_alone(model, p, t) for p, t in zip(prompts, tokens)]
    a = ([x[0] for x in alone], [x[1] for x in alone])
    return compare(prompts, a, decode_batched(model, prompts, tokens)), tokens
