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
the first S rows of the graph's logits.

Off CUDA (the CPU tests) nothing is captured: every step runs the padded batch eagerly through
the same buffers, which is how the padding is checked against unpadded steps.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import torch

from moeserve.kernels import cudagraph
from moeserve.models.attention import MAX_SEGMENTS, MIN_KEYS_PER_SEGMENT, attention_config
from moeserve.models.paged import PagedBatch

log = logging.getLogger(__name__)


def bucket_sizes(max_seqs: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, the multiples of 16 below ``max_seqs``, and ``max_seqs``."""
    small = [b for b in (1, 2, 4, 8) if b < max_seqs]
    return small + list(range(16, max_seqs, 16)) + [max_seqs]


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

    def __init__(self, model, cache, experts, block_size: int, max_seqs: int, max_model_len: int):
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
        self.graphs: dict = {}  # (Bk, NS) -> (CUDAGraph, logits [Bk, V])
        self.seen: set = set()
        self.pool: torch.cuda._POOL_HANDLE | None = None
        self.disabled = ""
        self.replays = 0
        self.captures = 0
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
        return [(b, msl) for (b, _), msl in keys.items()]

    def warmup(self, b: int, max_seq_len: int, step: int) -> None:
        """One decode step of bucket ``b`` whose ``b`` rows all live in the scratch block, at
        position ``max_seq_len - 1``: a key's first call runs eagerly (compiles), its second
        captures, as in serving. The rows' pairs reach the experts like a real step's (the
        caller discards their load)."""
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
        table = np.zeros((b, mb), dtype=np.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
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

    def _batch(self, b: int, max_seq_len: int) -> PagedBatch:
        o = self.bmax * self.mb
        return PagedBatch(
            num_tokens=b,
            num_seqs=b,
            max_query_len=1,
            max_seq_len=max_seq_len,
            block_size=self.block_size,
            positions=self.longs[1, :b],
            slot_mapping=self.longs[2, :b],
            block_tables=self.ints[: b * self.mb].view(b, self.mb),
            seq_lens=self.ints[o : o + b],
            query_start=self.ints[o + self.bmax : o + self.bmax + b + 1],
            last_token_index=self.longs[3, :b],
        )

    def _forward(self, b: int, max_seq_len: int) -> torch.Tensor:
        hidden = self.model.step(
            self.longs[0, :b],
            self._batch(b, max_seq_len),
            self.cache,
            experts=self.experts if self.exchange is not None else None,
            check_ids=False,
        )  # [Bk, H]
        return self.model.logits(hidden)  # [Bk, V]

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
        key = (b, self._ns(b, msl))
        self._fill(ids, starts, tables, b, src)
        if src is not None:
            self.longs[0, :s] = runner.select_ids(self.longs[0, :s], self.longs[4, :s])
        if self.exchange is not None:
            self.experts.step = step
            self.exchange.set_step_args(s * self.top_k, self.experts.router + step)
        entry = self.graphs.get(key)
        if entry is None and key in self.seen and self.cuda:
            entry = self._capture(key, msl)
        if entry is None:  # first use (or capture failed, or CPU): eagerly, padded
            self.seen.add(key)
            if self.exchange is not None:
                self.exchange.valid_pairs = s * self.top_k
            try:
                logits = self._forward(b, msl)
            finally:
                if self.exchange is not None:
                    self.exchange.valid_pairs = None
            return logits[:s]
        entry[0].replay()
        self.replays += 1
        return entry[1][:s]

    def _capture(self, key, max_seq_len: int):
        b, _ = key
        try:
            torch.cuda.synchronize(self.model.device)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            g = torch.cuda.CUDAGraph()
            # thread_local: the NCCL watchdog thread's event queries must not invalidate the capture
            with cudagraph.capture(g, pool=self.pool, capture_error_mode="thread_local"):
                logits = self._forward(b, max_seq_len)
        except Exception as e:  # noqa: BLE001 - any capture failure: stay eager
            if self.exchange is not None:
                self.exchange._in_flight = False  # a layer dispatched inside the failed capture
            self.disabled = f"{type(e).__name__}: {e}"
            log.warning(
                "CUDA graph capture of a decode step of %d sequences failed; decode runs eagerly from now on: %s",
                b,
                self.disabled,
            )
            return None
        self.captures += 1
        self.graphs[key] = (g, logits)
        return self.graphs[key]
