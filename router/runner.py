"""A router rank's share of a step: attention, gate and shared experts for its sequences.

Dimension letters: T new tokens of this router in the step, S its sequences in the step, B the
sequences that sample a token, H hidden, V vocabulary.

The router holds everything of the model but the routed experts (``load_model(...,
load_experts=False)``), one paged KV pool, and per sequence its block table and sampling
parameters. Sequences are pinned to one router for their whole life; the leader says which,
and which KV blocks each one gains (the runner never allocates). A step runs every sequence
through the model at once (batched attention over the block tables), then samples the rows
that need a token in one call on the device.
"""
from __future__ import annotations

import numpy as np
import torch

from moeserve.dataplane.exchange import idle_walk
from moeserve.profiling import span
from moeserve.dataplane.protocol import RouterWork
from moeserve.models.paged import PagedBatch, PagedKVCache
from moeserve.router.dispatcher import DistributedExperts
from moeserve.sampling import SamplingParams, SamplingTensors, sample


class RouterRunner:
    """Runs ``RouterWork`` on the router-side model with the distributed experts backend.
    ``num_blocks`` x ``block_size``: the rank's KV pool as the leader allocates it.

    With ``graphs`` (``max_num_seqs``, ``max_model_len``; see ``moeserve.router.graphs``) decode
    steps replay CUDA graphs; the pool then has one more block, the padded rows' scratch block."""

    def __init__(self, model, experts: DistributedExperts, num_blocks: int, block_size: int,
                 graphs: tuple[int, int] | None = None):
        self.model = model
        self.experts = experts
        self.device = experts.exchange.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.cache: PagedKVCache = model.new_paged_cache(num_blocks + (1 if graphs else 0), block_size)
        self.graphs = None
        if graphs:
            from moeserve.router.graphs import DecodeGraphs
            self.graphs = DecodeGraphs(model, self.cache, experts, block_size, *graphs)
        self.tables: dict[int, list[int]] = {}             # seq id -> block ids
        self.params: dict[int, SamplingParams] = {}
        self._applied_step = -1                             # the step whose block updates are in the tables

    def release(self, seq_ids) -> None:
        for sid in seq_ids:
            self.tables.pop(sid, None)
            self.params.pop(sid, None)

    @torch.inference_mode()
    def run(self, work: RouterWork, step: int) -> tuple[dict[int, int], dict[int, np.ndarray]]:
        """Run one step; returns (sampled token per sequence that samples, requested logits per sequence)."""
        self.release(work.release)
        self.experts.step = step
        info = self.model.moe_info
        if not work.seqs:
            idle_walk(self.experts.exchange, info.num_moe_layers, self.model.config.hidden_size,
                      info.expert_spec.dtype, self.experts.store, maps=self.experts.maps)
            return {}, {}
        if step != self._applied_step:                       # a step run again after a lost peer: applied already
            for sw in work.seqs:
                if sw.start == 0:                             # new, or recomputed after a preemption
                    self.tables[sw.seq_id] = list(sw.new_blocks)
                    self.params[sw.seq_id] = sw.sampling
                else:
                    self.tables[sw.seq_id].extend(sw.new_blocks)
            self._applied_step = step
        if (self.graphs is not None and all(len(sw.token_ids) == 1 and sw.sample and sw.return_logits != "all"
                                             for sw in work.seqs)
                and self.graphs.fits(len(work.seqs), [self.tables[sw.seq_id] for sw in work.seqs])):
            with span("batch_build"):
                ids = [sw.token_ids[0] for sw in work.seqs]
                self._check_ids(ids)
            logits = self.graphs.run(ids, [sw.start for sw in work.seqs],
                                     [self.tables[sw.seq_id] for sw in work.seqs], step)             # [S, V]
            return self._sample(work.seqs, logits.float())
        with span("batch_build"):
            flat = [t for sw in work.seqs for t in sw.token_ids]
            self._check_ids(flat)
            ids = torch.tensor(flat, dtype=torch.long).to(self.device, non_blocking=True)           # [T]
            batch = PagedBatch.build([len(sw.token_ids) for sw in work.seqs], [sw.start for sw in work.seqs],
                                     [self.tables[sw.seq_id] for sw in work.seqs], self.block_size, self.device)
        hidden = self.model.step(ids, batch, self.cache, experts=self.experts, check_ids=False)  # [T, H]
        rows = [i for i, sw in enumerate(work.seqs) if sw.sample]
        tokens, out_logits = {}, {}
        if rows:
            with span("lm_head"):
                last = batch.last_token_index[torch.tensor(rows, device=batch.last_token_index.device)]
                logits = self.model.logits(hidden.index_select(0, last)).float()                    # [B, V]
            tokens, out_logits = self._sample([work.seqs[i] for i in rows], logits)
        starts = np.cumsum([0] + [len(sw.token_ids) for sw in work.seqs])
        for i, sw in enumerate(work.seqs):
            if sw.return_logits == "all":
                out_logits[sw.seq_id] = self.model.logits(hidden[starts[i]:starts[i + 1]]).float().cpu().numpy()
        return tokens, out_logits

    def _sample(self, sampled, logits: torch.Tensor) -> tuple[dict[int, int], dict[int, np.ndarray]]:
        """Sample one token per sequence of ``sampled`` from fp32 ``logits`` [B, V] (row j is
        sampled[j]'s), in one call on the device; also the logits asked for with "last"."""
        tokens, out_logits = {}, {}
        with span("sampling"):
            st = SamplingTensors.build([self.params[sw.seq_id] for sw in sampled],
                                       [self.params[sw.seq_id].seed for sw in sampled],
                                       [sw.out_pos for sw in sampled], self.device)
            for sw, tok in zip(sampled, sample(logits, st).tolist()):      # the step's one host read
                tokens[sw.seq_id] = tok
        for j, sw in enumerate(sampled):
            if sw.return_logits == "last":
                out_logits[sw.seq_id] = logits[j:j + 1].cpu().numpy()
        return tokens, out_logits

    def _check_ids(self, ids: list[int]) -> None:
        """Token ids in range, checked on the host (the leader validated prompts; sampled ids
        come from the vocabulary: a failure here is a bug, never a user's error)."""
        v = self.model.config.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= v):
            raise ValueError(f"token id out of range 0..{v - 1} in a decode step: {[i for i in ids if not 0 <= i < v][:4]}")
