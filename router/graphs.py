"""Decode steps as CUDA graphs: a router's whole forward, one replay per step.

Dimension letters: S sequences of the step (one new token each), Bk the bucket (the captured
batch size, S <= Bk), MB block-table width (ceil(max_model_len / block_size)), V vocabulary,
L MoE layers, K top-k.

An eager decode step costs the host a few hundred kernel launches and the Python around them
(~3 ms per Llama 4 layer on an H200 host, measured with ``MOESERVE_PROFILE``); the GPU work of
the same step is a fraction of that. ``DecodeGraphs`` captures ``model.step`` + the LM head for
a padded batch of Bk sequences and replays it:

- inputs live in static device buffers (ids, positions, slot mapping, block tables, lengths),
  filled by two pinned host-to-device copies per step; ids the leader has not seen yet (the
  tokens of the step before, asynchronous steps) are taken from the runner's ``tok_buf`` on the
  device before the replay;
- padded rows (S .. Bk-1) are sequences of one token at position 0 whose k/v go to a scratch
  block no sequence owns (the runner's pool has one block more than the leader allocates);
  they attend to themselves only, and the exchange sends none of their (token, k) pairs: the
  route kernels read N = S * K from the exchange's per-layer argument rows, set before each
  replay, so neither the experts' load nor any worker sees them;
- the direct exchange (``moeserve.dataplane.nvlink``) records its kernels and barriers into the
  step's graph; a peer that runs the same layer eagerly (an idle router, a worker) meets the
  same barriers in the same order;
- graphs are keyed by (Bk, NS), NS the attention's key-split count (a launch shape that depends
  on the longest sequence); a key's first use runs the padded batch eagerly (compiles kernels,
  warms cuBLAS), its second use captures, later uses replay. A capture that fails turns graphs
  off for the rank's life (logged once), and the step runs eagerly.

Sampling stays outside the graph (its per-request parameters change every step); it reads
the first S rows of the graph's logits. Every graph, decode or mixed, writes its logits into
one static buffer [Bmax, V] (``logits_out``, allocated with the other static buffers, outside
the graphs' memory pool), so the pool holds only a step's temporaries, which graphs share. A
logits tensor of each graph's own would stay allocated in the pool for the rank's life:
sum(Bk) x V values over all keys, about 13 GB for Scout's vocabulary of 202,048 at
``max_num_seqs`` 1,024, which the KV pool's sizing does not count (it ran the rank out of
memory while capturing at start, on an 80 GB H100).

**Mixed steps** (decodes with prefill chunks, T new tokens over S sequences) replay graphs of
their own, keyed by (Tk, Sk): T padded to a token bucket (``mixed_buckets``: 128 ... 2,048, at
most ``max_num_batched_tokens``; ``MOESERVE_MIXED_TOKEN_BUCKETS`` names others), S to 16, 64 or
``max_seqs``. Padded sequences have no new token and no key (they launch no attention tile);
padded tokens belong to no sequence, write their k/v to the scratch block and send no (token, k)
pair, so their rows, computed row by row and never read, touch no real row; the LM head reads
each sequence's last token (Sk rows). The attention runs its prefill launch shape (one key
segment) whatever the step's longest chunk, so that a key's graph serves every step of its
bucket. Steps of more tokens than the largest bucket, and steps that need every prompt token's
logits, run eagerly; so does a DeepSeek-V3 (latent attention) step. A mixed capture that fails
turns mixed graphs off, not decode graphs.

Off CUDA (the CPU tests) nothing is captured: every step runs the padded batch eagerly through
the same buffers, which is how the padding is checked against unpadded steps.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import numpy as np
import torch

from moeserve.kernels import cudagraph
from moeserve.models.attention import MAX_SEGMENTS, MIN_KEYS_PER_SEGMENT, attention_config
from moeserve.models.paged import PagedBatch, block_table

log = logging.getLogger(__name__)


def bucket_sizes(max_seqs: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, the multiples of 16 below ``max_seqs``, and ``max_seqs``."""
    small = [b for b in (1, 2, 4, 8) if b < max_seqs]
    return small + list(range(16, max_seqs, 16)) + [max_seqs]


MIXED_TOKENS = (128, 256, 512, 1024, 2048)  # token buckets of mixed-step graphs (larger: eager)
MIXED_SEQS = (16, 64)  # sequence buckets below max_seqs
MIXED_TOKENS_MAX = 16384  # the largest token bucket MOESERVE_MIXED_TOKEN_BUCKETS may name


def mixed_token_buckets() -> tuple[int, ...]:
    """``MOESERVE_MIXED_TOKEN_BUCKETS``: the token buckets of mixed-step graphs, a comma list of
    increasing token counts 1 .. ``MIXED_TOKENS_MAX`` (default ``MIXED_TOKENS``). A measurement
    switch: a step of 2,048-token chunk and its decodes (2,112 tokens and more) is past the
    default's largest bucket and runs eagerly, its host's launches in the step's wall time;
    larger buckets capture it at the cost of padding (each bucket a graph per sequence bucket,
    and a graph pool for the largest). Read when a router builds its graphs; anything else is
    refused by name."""
    v = os.environ.get("MOESERVE_MIXED_TOKEN_BUCKETS", "")
    if not v:
        return MIXED_TOKENS
    allowed = f"a comma list of increasing token counts from 1 to {MIXED_TOKENS_MAX}, e.g. 128,512,2048,4096"
    try:
        vals = tuple(int(x) for x in v.split(","))
    except ValueError:
        vals = ()
    if not vals or not all(1 <= t <= MIXED_TOKENS_MAX for t in vals) or any(a >= b for a, b in zip(vals, vals[1:])):
        raise ValueError(f"MOESERVE_MIXED_TOKEN_BUCKETS={v!r}: allowed {allowed}")
    return vals


def mixed_buckets(
    max_seqs: int, max_tokens: int, token_buckets: tuple[int, ...] | None = None
) -> tuple[list[int], list[int]]:
    """The token and sequence buckets of mixed-step graphs for a step budget of ``max_tokens``
    new tokens (``max_num_batched_tokens``) and ``max_seqs`` sequences; none when
    ``max_tokens`` is 0. ``token_buckets``: default ``mixed_token_buckets()``."""
    if max_tokens <= 0:
        return [], []
    buckets = token_buckets or mixed_token_buckets()
    tokens = sorted({t for t in buckets if t < max_tokens} | {min(max_tokens, buckets[-1])})
    return tokens, sorted({x for x in MIXED_SEQS if x < max_seqs} | {max_seqs})


def applies(model, exchange, store, enforce_eager: bool) -> tuple[bool, str]:
    """Whether a rank can run whole-step graphs: (ok, why not)."""
    if enforce_eager:
        return False, "enforce_eager"
    if model.device.type != "cuda":
        return False, "not on CUDA"
    if getattr(exchange, "kind", "") != "nvlink" or not getattr(exchange, "graphs", False):
        return False, "needs the direct exchange with graphs"
    if store is not None and not getattr(store, "capturable", False):
        return False, "this rank's expert compute reads counts back to the host (fp32 or biases)"
    return True, ""


class DecodeGraphs:
    """Whole decode steps of one router as CUDA graphs (see the module docstring).

    model: the router-side model; cache: the runner's ``PagedKVCache`` whose last block is the
    scratch block; experts: the ``DistributedExperts`` backend; max_seqs: the largest batch
    captured; max_model_len: bounds each block table (MB columns).
    """

    def __init__(self, model, cache, experts, block_size: int, max_seqs: int, max_model_len: int, max_tokens: int = 0):
        self.model, self.cache, self.experts = model, cache, experts
        self.exchange = getattr(experts, "exchange", None)  # None: a model's local experts (tests)
        self.cuda = model.device.type == "cuda"
        self.block_size = block_size
        self.scratch = cache.num_blocks - 1
        self.sizes = bucket_sizes(max_seqs)
        self.mb = -(-max_model_len // block_size)
        self.top_k = model.moe_info.top_k
        c = model.config
        self.heads = (c.num_heads, c.num_kv_heads, c.head_dim)
        self.sms = torch.cuda.get_device_properties(model.device).multi_processor_count if self.cuda else None
        bmax = self.sizes[-1]
        self.bmax = bmax
        dev = model.device
        # int64: ids, positions, slot mapping, last index, tok_buf entry of a pending id (-1: none)
        # [5, Bmax]; int32: tables [Bmax, MB], seq_lens [Bmax], query_start [Bmax + 1].
        self.longs = torch.zeros(5, bmax, dtype=torch.long, device=dev)
        self.ints = torch.zeros(bmax * self.mb + 2 * bmax + 1, dtype=torch.int32, device=dev)
        self.h_longs = torch.zeros(5, bmax, dtype=torch.long)
        self.h_ints = torch.zeros(self.ints.numel(), dtype=torch.int32)
        if self.cuda:
            self.h_longs, self.h_ints = self.h_longs.pin_memory(), self.h_ints.pin_memory()
        self._copied: torch.cuda.Event | None = None  # event of the last host-to-device copy
        self.graphs: dict = {}  # (Bk, NS) or ("mixed", Tk, Sk) -> (CUDAGraph, logits_out[:rows])
        # every step's logits, graph or eager (the same product either way): [Bmax, V] in the LM head's dtype
        head = model.lm_head.weight
        self.logits_out = torch.empty(bmax, head.shape[0], dtype=head.dtype, device=dev)
        self.seen: set = set()
        self.pool: torch.cuda._POOL_HANDLE | None = None
        self.disabled = ""
        self.replays = 0
        self.captures = 0
        # mixed steps (max_tokens: the step's token budget; 0 or a latent-attention model: none)
        self.mixed_tokens, self.mixed_seqs = mixed_buckets(bmax, 0 if c.mla is not None else max_tokens)
        tmax = self.mixed_tokens[-1] if self.mixed_tokens else 0
        self.m_longs = torch.zeros(5, max(tmax, bmax) if tmax else 0, dtype=torch.long, device=dev)
        self.m_ints = torch.zeros((bmax * self.mb + 2 * bmax + 1) if tmax else 0, dtype=torch.int32, device=dev)
        self.m_hlongs = torch.zeros(self.m_longs.shape, dtype=torch.long)
        self.m_hints = torch.zeros(self.m_ints.shape, dtype=torch.int32)
        if self.cuda and tmax:
            self.m_hlongs, self.m_hints = self.m_hlongs.pin_memory(), self.m_hints.pin_memory()
        self.mixed_disabled = ""
        if self.exchange is not None:
            self.exchange.prepare_step_graphs(model.moe_info.num_moe_layers)

    def _ns(self, b: int, max_seq_len: int) -> int:
        hq, hkv, d = self.heads
        return attention_config(
            SimpleNamespace(max_query_len=1, num_tokens=b, num_seqs=b, max_seq_len=max_seq_len), hq, hkv, d, self.sms
        )["NS"]

    def warmup_keys(self) -> list[tuple[int, int]]:
        """(bucket, longest sequence) pairs that reach every graph key (bucket, NS) a decode step
        of up to ``max_model_len`` tokens can use: the attention's split count NS changes only
        where the longest sequence passes 2 * ns * MIN_KEYS_PER_SEGMENT."""
        top = self.mb * self.block_size
        lens, ns = {1, top}, 1
        while ns <= MAX_SEGMENTS:
            lens.add(min(top, 2 * ns * MIN_KEYS_PER_SEGMENT))
            ns *= 2
        keys: dict[tuple[int, int], int] = {}
        for b in self.sizes:
            for msl in sorted(lens):
                keys.setdefault((b, self._ns(b, msl)), msl)
        decode = [(b, msl) for (b, _), msl in keys.items()]
        # a mixed-step key (Tk, Sk) as (Tk, -Sk): the header's warm-up pair (its second number < 0)
        return decode + [(t, -x) for t in self.mixed_tokens for x in self.mixed_seqs]

    def warmup(self, b: int, max_seq_len: int, step: int) -> None:
        """One decode step of bucket ``b`` whose ``b`` rows all live in the scratch block, at
        position ``max_seq_len - 1``: a key's first call runs eagerly (compiles), its second
        captures, as in serving. The rows' pairs reach the experts like a real step's (the
        caller discards their load). ``max_seq_len < 0``: a mixed step of ``b`` tokens over
        ``-max_seq_len`` sequences (``warmup_keys``), every token in the scratch block."""
        if max_seq_len < 0:
            seqs = -max_seq_len
            num_new = [b // seqs + (i < b % seqs) for i in range(seqs)]
            blocks = [self.scratch] * -(-max(num_new) // self.block_size)
            self.run_mixed((b, seqs), [0] * b, None, num_new, [0] * seqs, [blocks] * seqs, step)
            return
        blocks = [self.scratch] * -(-max_seq_len // self.block_size)
        self.run([0] * b, [max_seq_len - 1] * b, [blocks] * b, step)

    def fits(self, num_seqs: int, tables: list[list[int]]) -> bool:
        return not self.disabled and 0 < num_seqs <= self.bmax and all(len(t) <= self.mb for t in tables)

    def _fill(
        self, ids: list[int], starts: list[int], tables: list[list[int]], b: int, src: list[int] | None = None
    ) -> None:
        """Write the step's inputs, padded to ``b`` rows, into the static device buffers."""
        if self._copied is not None:
            self._copied.synchronize()  # the pinned buffers are free again
        s, bs, mb = len(ids), self.block_size, self.mb
        hl = self.h_longs.numpy()
        hi = self.h_ints.numpy()
        st = np.asarray(starts, dtype=np.int64)
        table = block_table(tables, b, mb)
        table[s:, 0] = self.scratch
        hl[0, :s] = ids
        hl[0, s:b] = 0
        hl[1, :s] = st
        hl[1, s:b] = 0
        hl[2, :s] = table[np.arange(s), st // bs].astype(np.int64) * bs + st % bs
        hl[2, s:b] = self.scratch * bs
        hl[3, :b] = np.arange(b)
        hl[4, :s] = -1 if src is None else src
        o = self.bmax * mb
        hi[: b * mb] = table.reshape(-1)
        hi[o : o + s] = st + 1
        hi[o + s : o + b] = 1
        hi[o + self.bmax : o + self.bmax + b + 1] = np.arange(b + 1)
        self.longs.copy_(self.h_longs, non_blocking=self.cuda)
        self.ints.copy_(self.h_ints, non_blocking=self.cuda)
        if self.cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _batch(
        self, longs: torch.Tensor, ints: torch.Tensor, t: int, n: int, max_query_len: int, max_seq_len: int
    ) -> PagedBatch:
        """The PagedBatch over static buffers ``longs``, ``ints`` (``_fill``'s or ``_fill_mixed``'s
        layout) of ``t`` tokens in ``n`` sequences."""
        o = self.bmax * self.mb
        return PagedBatch(
            num_tokens=t,
            num_seqs=n,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            block_size=self.block_size,
            positions=longs[1, :t],
            slot_mapping=longs[2, :t],
            block_tables=ints[: n * self.mb].view(n, self.mb),
            seq_lens=ints[o : o + n],
            query_start=ints[o + self.bmax : o + self.bmax + n + 1],
            last_token_index=longs[3, :n],
        )

    def _forward(self, key: tuple, max_query_len: int, max_seq_len: int) -> torch.Tensor:
        """The padded step of ``key`` through the static buffers: logits [Bk, V] of a decode
        key (b, NS), of each sequence's last token [Sk, V] of a mixed key ("mixed", Tk, Sk)."""
        mixed = key[0] == "mixed"
        longs, ints = (self.m_longs, self.m_ints) if mixed else (self.longs, self.ints)
        t, n = key[1:] if mixed else (key[0], key[0])
        hidden = self.model.step(
            longs[0, :t],
            self._batch(longs, ints, t, n, max_query_len, max_seq_len),
            self.cache,
            experts=self.experts if self.exchange is not None else None,
            check_ids=False,
        )  # [T, H]
        rows = hidden.index_select(0, longs[3, :n]) if mixed else hidden
        return self.model.logits_into(rows, self.logits_out[: rows.shape[0]])

    def run(
        self,
        ids: list[int],
        starts: list[int],
        tables: list[list[int]],
        step: int,
        src: list[int] | None = None,
        runner=None,
    ) -> torch.Tensor:
        """One decode step of S sequences (token ``ids[s]`` at position ``starts[s]``, block
        table ``tables[s]``, which already covers it; where ``src[s] >= 0`` the token is
        ``runner.tok_buf[src[s]]`` on the device instead). Returns logits [S, V] in the model's
        dtype: a view valid until the next call."""
        s = len(ids)
        b = next(x for x in self.sizes if x >= s)
        msl = int(max(starts)) + 1
        self._fill(ids, starts, tables, b, src)
        if src is not None:
            self.longs[0, :s] = runner.select_ids(self.longs[0, :s], self.longs[4, :s])
        return self._launch((b, self._ns(b, msl)), s, step, 1, msl)[:s]

    def _launch(self, key: tuple, t: int, step: int, max_query_len: int, max_seq_len: int) -> torch.Tensor:
        """Run ``key``'s padded step of ``t`` real tokens (their buffers filled): replay its graph,
        or capture it on its second use, or (first use, CPU, a failed capture) run it eagerly."""
        if self.exchange is not None:
            self.experts.step = step
            self.exchange.set_step_args(t * self.top_k, self.experts.router + step)
        entry = self.graphs.get(key)
        if entry is None and key in self.seen and self.cuda:
            entry = self._capture(key, max_query_len, max_seq_len)
        if entry is None:  # first use (or capture failed, or CPU): eagerly, padded
            self.seen.add(key)
            if self.exchange is not None:
                self.exchange.valid_pairs = t * self.top_k
            try:
                return self._forward(key, max_query_len, max_seq_len)
            finally:
                if self.exchange is not None:
                    self.exchange.valid_pairs = None
        entry[0].replay()
        self.replays += 1
        return entry[1]

    def _capture(self, key: tuple, max_query_len: int, max_seq_len: int):
        mixed = key[0] == "mixed"
        try:
            torch.cuda.synchronize(self.model.device)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            g = torch.cuda.CUDAGraph()
            # thread_local: the NCCL watchdog thread's event queries must not invalidate the capture
            with cudagraph.capture(g, pool=self.pool, capture_error_mode="thread_local"):
                logits = self._forward(key, max_query_len, max_seq_len)
        except Exception as e:  # noqa: BLE001 - any capture failure: stay eager
            if self.exchange is not None:
                self.exchange._in_flight = False  # a layer dispatched inside the failed capture
            why = f"{type(e).__name__}: {e}"
            if mixed:  # mixed steps run eagerly from now on, decode graphs stay
                self.mixed_disabled = why
                log.warning(
                    "CUDA graph capture of a mixed step of %d tokens over %d sequences failed; mixed steps run "
                    "eagerly from now on (decode graphs stay): %s",
                    key[1],
                    key[2],
                    why,
                )
            else:
                self.disabled = why
                log.warning(
                    "CUDA graph capture of a decode step of %d sequences failed; decode runs eagerly from now on: %s",
                    key[0],
                    why,
                )
            return None
        self.captures += 1
        self.graphs[key] = (g, logits)
        return self.graphs[key]

    # -- mixed steps ----------------------------------------------------------------------

    def mixed_key(self, num_new: list[int], tables: list[list[int]]) -> tuple[int, int] | None:
        """The (Tk, Sk) graph key of a step of these sequences, or None when it runs eagerly."""
        t, n = sum(num_new), len(num_new)
        if self.disabled or self.mixed_disabled or not self.mixed_tokens or t > self.mixed_tokens[-1]:
            return None
        if n > self.bmax or any(len(x) > self.mb for x in tables):
            return None
        return next(x for x in self.mixed_tokens if x >= t), next(x for x in self.mixed_seqs if x >= n)

    def _fill_mixed(self, ids, src, num_new, starts, tables, tk: int, sk: int) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the pinned buffers are free again
        bs, mb = self.block_size, self.mb
        t, n = len(ids), len(num_new)
        hl, hi = self.m_hlongs.numpy(), self.m_hints.numpy()
        nn = np.asarray(num_new, dtype=np.int64)
        st = np.asarray(starts, dtype=np.int64)
        qs = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(nn, out=qs[1:])
        seq_of = np.repeat(np.arange(n), nn)
        pos = np.repeat(st - qs[:-1], nn) + np.arange(t)  # each token's absolute position
        table = np.zeros((sk, mb), dtype=np.int32)
        for i, x in enumerate(tables):
            table[i, : len(x)] = x
        hl[0, :t] = ids
        hl[0, t:tk] = 0
        hl[1, :t] = pos
        hl[1, t:tk] = 0
        hl[2, :t] = table[seq_of, pos // bs].astype(np.int64) * bs + pos % bs
        hl[2, t:tk] = self.scratch * bs  # padded tokens: the scratch block
        hl[3, :n] = qs[1:] - 1  # each sequence's last new token
        hl[3, n:sk] = 0
        hl[4, :t] = -1 if src is None else src
        o = self.bmax * mb
        hi[: sk * mb] = table.reshape(-1)
        hi[o : o + n] = st + nn
        hi[o + n : o + sk] = 0  # padded sequences: no key, no new token
        q = o + self.bmax
        hi[q : q + n + 1] = qs
        hi[q + n + 1 : q + sk + 1] = t
        self.m_longs.copy_(self.m_hlongs, non_blocking=self.cuda)
        self.m_ints.copy_(self.m_hints, non_blocking=self.cuda)
        if self.cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def run_mixed(
        self,
        key: tuple[int, int],
        ids: list[int],
        src: list[int] | None,
        num_new: list[int],
        starts: list[int],
        tables: list[list[int]],
        step: int,
        runner=None,
    ) -> torch.Tensor:
        """One mixed step: sequence s computes ``num_new[s]`` new tokens from position
        ``starts[s]`` (their ids in order in ``ids``; where ``src[j] >= 0`` token j is
        ``runner.tok_buf[src[j]]`` on the device), block table ``tables[s]``. Returns the logits
        of each sequence's last new token [S, V] in the model's dtype: a view valid until the
        next call. ``key``: the step's ``mixed_key`` (not None)."""
        tk, sk = key
        t, n = len(ids), len(num_new)
        self._fill_mixed(ids, src, num_new, starts, tables, tk, sk)
        if src is not None:
            self.m_longs[0, :t] = runner.select_ids(self.m_longs[0, :t], self.m_longs[4, :t])
        if self.cuda:  # the attention's prefill launch shape for every step of the key
            mql, msl = tk, self.mb * self.block_size
        else:  # the step's own sizes (the torch attention pads to them)
            mql, msl = max(num_new), max(st + x for st, x in zip(starts, num_new))
        return self._launch(("mixed", tk, sk), t, step, mql, msl)[:n]
