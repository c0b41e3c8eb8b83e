"""A router's per-sequence state for the sampling parameters that change logits before sampling
(min_tokens, logit_bias, presence / frequency / repetition penalties), and the batch's
``sampling.LogitsAdjust`` built from it every step.

Dimension letters: B rows sampled in the step, V vocabulary, C penalty slots of the pool.

A penalized sequence holds one slot of two device pools: ``counts`` int32 [C, V] (how often it
generated each token) and ``seen`` bool [C, V] (its prompt's tokens, for the repetition
penalty). The router never waits for a token to count it: the token a decode samples at output
position p is the one it holds on the device (``RouterRunner.tok_buf``), so the row that samples
position p + 1 adds it to the counts first, in stream order, and the state of step N + 1
depends on the tokens up to step N only (asynchronous steps and CUDA graphs unchanged: this runs
after the graph, beside the sampler). A sequence's slot is filled from the host when it samples
its first token after a (re)start: its prompt's tokens and, for a sequence recomputed after a
preemption, the tokens it had generated (the prefill chunks brought them; the last ``out_pos``
of them are outputs). ``counted`` (the outputs in the counts) makes a step run again after a
lost peer add nothing twice.
"""

from __future__ import annotations

import numpy as np
import torch

from moeserve.sampling import LogitsAdjust


class PenaltyPool:
    """The ``counts`` / ``seen`` pools of one router (grown by doubling) and the free slots."""

    def __init__(self, vocab: int, device: torch.device):
        self.vocab = vocab
        self.device = device
        self.counts = torch.zeros(0, vocab, dtype=torch.int32, device=device)  # [C, V]
        self.seen = torch.zeros(0, vocab, dtype=torch.bool, device=device)  # [C, V]
        self._free: list[int] = []

    def take(self) -> int:
        if not self._free:
            n = self.counts.shape[0]
            grow = max(8, n)
            self.counts = torch.cat([self.counts, self.counts.new_zeros(grow, self.vocab)])
            self.seen = torch.cat([self.seen, self.seen.new_zeros(grow, self.vocab)])
            self._free = list(range(n + grow - 1, n - 1, -1))
        return self._free.pop()

    def give(self, slot: int) -> None:
        self._free.append(slot)


def _ids(values: list[int], device: torch.device) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def build(rows: list[tuple], tok_buf: torch.Tensor, pool: PenaltyPool) -> LogitsAdjust | None:
    """The batch's ``LogitsAdjust`` (None when no row changes its logits). ``rows``: per sampled
    row j, (j, its RouterSeq, the output position it samples, the ``tok_buf`` slot of its input
    token or -1). Updates each penalized sequence's counts first (``_count``)."""
    mask_r: list[int] = []
    mask_i: list[int] = []
    bias_r: list[int] = []
    bias_i: list[int] = []
    bias_v: list[float] = []
    pen = []
    for j, seq, pos, src in rows:
        sp = seq.sampling
        if not sp.adjusts:
            continue
        if pos < sp.min_tokens and sp.stop_ids:
            mask_r.extend([j] * len(sp.stop_ids))
            mask_i.extend(sp.stop_ids)
        for tok, b in sp.logit_bias:
            bias_r.append(j)
            bias_i.append(tok)
            bias_v.append(b)
        if sp.penalized:
            pen.append((j, seq, pos, src))
    if not (mask_r or bias_r or pen):
        return None
    dev = pool.device
    adj: dict = {}
    if mask_r:
        adj.update(mask_rows=_ids(mask_r, dev), mask_ids=_ids(mask_i, dev))
    if bias_r:
        bias = torch.tensor(bias_v, dtype=torch.float32)
        if dev.type == "cuda":
            bias = bias.pin_memory()
        adj.update(bias_rows=_ids(bias_r, dev), bias_ids=_ids(bias_i, dev), bias=bias.to(dev, non_blocking=True))
    if pen:
        _count(pen, tok_buf, pool)
        slots = _ids([seq.pen_slot for _, seq, _, _ in pen], dev)
        params = np.array(
            [
                (s.sampling.presence_penalty, s.sampling.frequency_penalty, s.sampling.repetition_penalty)
                for _, s, _, _ in pen
            ],
            dtype=np.float32,
        ).T.copy()  # [3, Q]
        f = torch.from_numpy(params)
        if dev.type == "cuda":
            f = f.pin_memory()
        f = f.to(dev, non_blocking=True)
        repeat = any(s.sampling.repetition_penalty != 1 for _, s, _, _ in pen)
        adj.update(
            pen_rows=_ids([j for j, _, _, _ in pen], dev),
            counts=pool.counts.index_select(0, slots),
            seen=pool.seen.index_select(0, slots) if repeat else None,
            presence=f[0],
            frequency=f[1],
            repetition=f[2],
        )
    return LogitsAdjust(**adj)


def _count(pen: list[tuple], tok_buf: torch.Tensor, pool: PenaltyPool) -> None:
    """Bring each penalized row's counts up to the outputs before the position it samples: a
    sequence's first sample after a (re)start fills its slot from the tokens the host sent; a
    decode adds the token it holds on the device (the output just before)."""
    dev = pool.device
    add_slots: list[int] = []
    add_src: list[int] = []
    for _, seq, pos, src in pen:
        if seq.counted is None:
            slot = seq.pen_slot if seq.pen_slot is not None else pool.take()
            seq.pen_slot = slot
            known = seq.known or []
            prompt, outputs = known[: len(known) - pos], known[len(known) - pos :]
            pool.counts[slot].zero_()
            pool.seen[slot].zero_()
            if prompt:
                pool.seen[slot].index_fill_(0, _ids(prompt, dev), True)
            if outputs:
                ones = torch.ones(len(outputs), dtype=torch.int32, device=dev)
                pool.counts[slot].index_add_(0, _ids(outputs, dev), ones)
            seq.counted, seq.known = pos, None
        elif seq.counted < pos:
            if pos != seq.counted + 1 or src < 0:
                raise RuntimeError(
                    f"a penalized sequence samples output {pos} with {seq.counted} outputs counted "
                    f"and {'no' if src < 0 else 'a'} token on the device: a bug in the step plan"
                )
            add_slots.append(seq.pen_slot)
            add_src.append(src)
            seq.counted = pos
    if add_slots:
        toks = tok_buf.index_select(0, _ids(add_src, dev))
        ones = torch.ones(len(add_slots), dtype=torch.int32, device=dev)
        pool.counts.index_put_((_ids(add_slots, dev), toks), ones, accumulate=True)


__all__ = ["PenaltyPool", "build"]
