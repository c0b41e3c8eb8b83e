"""Token sampling, deterministic per request and independent of how requests are batched.

Each request owns a :class:`Sampler` with its own ``torch.Generator``, seeded from the request's
seed, and rows of logits are sampled one at a time: the tokens a request gets depend only on
its own logits and seed, never on which other requests share the step or in which order (the
distributed router batches differently from the single-process model and must get the same
tokens). Dimension letter: V vocabulary size.
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token of a request.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it (> 0).
    top_p:       nucleus sampling: keep the smallest set of most likely tokens whose probability
                 reaches top_p, in (0, 1]; 1 keeps all.
    top_k:       keep the k most likely tokens; 0 keeps all.
    seed:        seeds the request's generator, 0 .. 2**63-1; None draws a random seed.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), found {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = no nucleus filtering), found {p!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = no top-k filtering), found {k!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= MAX_SEED):
            raise ValueError(f"seed must be None or an integer in 0..{MAX_SEED}, found {s!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Turns one row of logits [V] into a token id for one request, with the request's own generator."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbelow(MAX_SEED + 1)
        # Always on the CPU: the same logits give the same token whatever device computed them.
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(self.seed)

    def sample(self, logits: torch.Tensor) -> int:
        """logits [V] (any float dtype, any device; processed in fp32 on the CPU) -> the next token id."""
        p = self.params
        logits = logits.detach().float().cpu()
        if p.greedy:
            return int(torch.argmax(logits))
        scores = logits / p.temperature                                   # [V]
        if p.top_k and p.top_k < scores.numel():
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)     # [V]
            probs = torch.softmax(sorted_scores, dim=-1)
            before = torch.cumsum(probs, dim=-1) - probs                   # mass of strictly more likely tokens
            drop = before >= p.top_p                                        # the most likely token always stays
            scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
