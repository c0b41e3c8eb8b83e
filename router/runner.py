"""A router rank's share of a step: attention, gate and shared experts for its sequences.

Dimension letters: T new tokens of this router in the step, H hidden, V vocabulary.

The router holds everything of the model but the routed experts (``load_model(...,
load_experts=False)``), a KV cache and a sampler per sequence. Sequences are pinned to one
router for their whole life (their KV cache lives here); the leader says which.
"""
from __future__ import annotations

import numpy as np
import torch

from moeserve.dataplane.protocol import RouterWork
from moeserve.models import StepBatch
from moeserve.sampling import Sampler
from moeserve.dataplane.exchange import idle_walk
from moeserve.router.dispatcher import DistributedExperts


class RouterRunner:
    """Runs ``RouterWork`` on the router-side model with the distributed experts backend."""

    def __init__(self, model, experts: DistributedExperts):
        self.model = model
        self.experts = experts
        self.cache = model.new_cache()
        self.samplers: dict[int, Sampler] = {}
        self.device = experts.exchange.device

    def release(self, seq_ids) -> None:
        for sid in seq_ids:
            self.cache.release(sid)
            self.samplers.pop(sid, None)

    @torch.inference_mode()
    def run(self, work: RouterWork, step: int) -> tuple[dict[int, int], dict[int, np.ndarray]]:
        """Run one step; returns (sampled token per sequence, requested logits per sequence)."""
        self.release(work.release)
        self.experts.step = step
        info = self.model.moe_info
        if not work.seqs:
            idle_walk(self.experts.exchange, info.num_moe_layers, self.model.config.hidden_size,
                      info.expert_spec.dtype, self.experts.store, maps=self.experts.maps)
            return {}, {}
        for sw in work.seqs:
            if sw.sampling is not None:
                self.samplers[sw.seq_id] = Sampler(sw.sampling)
        ids = torch.tensor([t for sw in work.seqs for t in sw.token_ids], dtype=torch.long, device=self.device)  # [T]
        batch = StepBatch(seq_ids=tuple(sw.seq_id for sw in work.seqs), lens=tuple(len(sw.token_ids) for sw in work.seqs),
                          starts=tuple(sw.start for sw in work.seqs))
        hidden = self.model.step(ids, batch, self.cache, experts=self.experts)                           # [T, H]
        ends = np.cumsum(batch.lens)
        last = torch.tensor(ends - 1, dtype=torch.long, device=self.device)
        logits = self.model.logits(hidden.index_select(0, last)).float()                                 # [B, V]
        tokens, out_logits = {}, {}
        for i, sw in enumerate(work.seqs):
            tokens[sw.seq_id] = self.samplers[sw.seq_id].sample(logits[i])
            if sw.return_logits == "last":
                out_logits[sw.seq_id] = logits[i:i + 1].cpu().numpy()
            elif sw.return_logits == "all":
                lo = int(ends[i]) - len(sw.token_ids)
                out_logits[sw.seq_id] = self.model.logits(hidden[lo:int(ends[i])]).float().cpu().numpy()
        return tokens, out_logits
