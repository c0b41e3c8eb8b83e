"""The paged KV cache and one step's attention metadata (``PagedBatch``).

Dimension letters: T new tokens in a step (all sequences, flattened), S sequences in a step,
Lyr decoder layers, N = num_blocks * block_size flat slots of a pool, B block_size,
MB blocks in the longest block table of a step, Hkv key/value heads, D head dim.

Keys and values live in fixed pools, one k and one v tensor [Lyr, N, Hkv, D]; a sequence owns
no tensor, only a list of physical block ids (its block table) that the caller keeps (the router
runner: it allocates and frees blocks, and may later share a block between sequences for
prefix caching, which nothing here prevents: the pools hold no per-sequence state). Token p of
a sequence lives at flat slot ``block_table[p // B] * B + p % B`` of every layer's pool.

A step's metadata is built on the host once (``PagedBatch.build``), copied to the device in one
transfer, and shared by every layer: each layer writes its new k/v at ``slot_mapping`` and reads
keys only through ``block_tables`` (``moeserve.models.attention``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch


class PagedKVCache:
    """k, v pools per decoder layer: [Lyr, N, Hkv, D] with N = num_blocks * block_size flat
    slots (slot = block * block_size + offset), in the model's dtype and device.

    Allocated zeroed: a partially filled block's unused slots are read (then masked) by the
    vectorised torch path, and 0 * NaN from uninitialised memory would leak into the output.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        for name, val in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
        ):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"PagedKVCache: {name} must be an integer >= 1, found {val!r}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)  # [Lyr, N, Hkv, D]
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)  # [Lyr, N, Hkv, D]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block costs over all layers, keys and values: what a memory budget divides by."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a step's new keys and values k, v [T, Hkv, D] at flat slots ``slot_mapping`` [T]
        of one layer (one index_copy per pool). Rewriting the same slots is harmless, so a step
        that failed half way can be retried."""
        self.k[layer].index_copy_(0, slot_mapping, k)
        self.v[layer].index_copy_(0, slot_mapping, v)


def block_table(
    tables: list, rows: int, width: int, dtype=np.int32, held: np.ndarray | None = None, flat: np.ndarray | None = None
) -> np.ndarray:
    """[rows, width] of ``dtype``: row i holds ``tables[i]`` (block ids, at most ``width``) then
    zeros; rows past len(tables) zeros. One flat copy of every id and one masked store, not a
    numpy store per sequence (which took ~1.3 ms of a 256-sequence decode step's host time on an
    H200 host). ``held`` (each table's length) and ``flat`` (their ids, concatenated) when the
    caller has them."""
    out = np.zeros((rows, width), dtype=dtype)
    n = len(tables)
    if n:
        if held is None:
            held = np.fromiter(map(len, tables), dtype=np.int64, count=n)
        if flat is None:
            flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=dtype, count=int(held.sum()))
        out[:n][np.arange(width)[None, :] < held[:, None]] = flat  # row-major: each row's ids in order
    return out


# Whether ``PagedBatch.build`` marks a step's trailing fresh prompts (``FreshSuffix``): only the
# ``flash`` and ``sdpa`` prefill backends read them, so ``moeserve.models.attention`` turns this on from
# ``MOESERVE_ATTENTION_PREFILL`` and the default path builds nothing for it.
SPLIT_FRESH = {"on": False}


@dataclass(frozen=True, eq=False)
class FreshSuffix:
    """The sequences at the end of a step that start at position 0 (new prompts, no cached
    prefix): their keys are exactly the step's own new keys, so a dense varlen attention over
    the step's k and v serves them (``moeserve.models.attention``, ``MOESERVE_ATTENTION_PREFILL``).
    The sequences before them keep the paged kernel, as ``head``."""

    first_seq: int  # index of the suffix's first sequence (host)
    first_token: int  # its first new token's row in the step (host)
    lens: tuple[int, ...]  # each suffix sequence's new tokens, its whole length (host)
    cu_seqlens: torch.Tensor  # IntTensor [F + 1]: cumulative new tokens of the suffix, from 0
    head: PagedBatch | None  # the sequences before it (views of the step's tensors), None when none

    @property
    def max_len(self) -> int:
        """The longest sequence of the suffix."""
        return max(self.lens)


@dataclass(frozen=True, eq=False)  # eq=False: tensors have no truth value; a batch compares by identity
class PagedBatch:
    """One step's attention metadata, built on the host once per step, moved to the device in
    one copy, shared by all layers. S sequences, T new tokens (the step's input_ids [T] hold
    sequence 0's new tokens, then sequence 1's, ...).

    An empty batch (S = T = 0) is allowed: a router rank with nothing to do still takes part in
    every MoE layer's exchange.
    """

    num_tokens: int  # T (host)
    num_seqs: int  # S (host)
    max_query_len: int  # max new tokens of a sequence (host; 0 when S = 0)
    max_seq_len: int  # max seq_lens (host; 0 when S = 0)
    block_size: int  # B, which the cache must share (host)
    positions: torch.Tensor  # LongTensor [T]: absolute position of every new token
    slot_mapping: torch.Tensor  # LongTensor [T]: flat slot where each new token's k/v is written
    block_tables: torch.Tensor  # IntTensor [S, MB]: physical block ids of each sequence (padding: 0)
    seq_lens: torch.Tensor  # IntTensor [S]: tokens in the cache after this step (start + new)
    query_start: torch.Tensor  # IntTensor [S + 1]: cumulative new tokens (cu_seqlens)
    last_token_index: torch.Tensor  # LongTensor [S]: flat index of each sequence's last new token
    fresh: FreshSuffix | None = None  # the step's trailing fresh prompts (``build`` with SPLIT_FRESH on)

    @classmethod
    def build(
        cls,
        lens: list[int],
        starts: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        *,
        num_blocks: int | None = None,
    ) -> PagedBatch:
        """Sequence s gets ``lens[s]`` (>= 1) new tokens at positions ``starts[s] ..`` (its tokens
        ``0 .. starts[s]-1`` are already in the cache); ``block_tables[s]`` must cover
        ``starts[s] + lens[s]`` tokens (extra entries are allowed). With ``num_blocks`` every
        block id is also checked against the pool (an id out of range would be an illegal
        memory access in the Triton kernel).
        """
        lens_a = np.asarray(list(lens), dtype=np.int64).reshape(-1)  # [S]
        starts_a = np.asarray(list(starts), dtype=np.int64).reshape(-1)  # [S]
        tables = [t if isinstance(t, list) else list(t) for t in block_tables]
        s = len(lens_a)
        if not len(starts_a) == len(tables) == s:
            raise ValueError(
                f"PagedBatch: lens, starts and block_tables need one entry per sequence, "
                f"found {s}, {len(starts_a)}, {len(tables)}"
            )
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"PagedBatch: block_size must be an integer >= 1, found {block_size!r}")
        if s and lens_a.min() < 1:
            raise ValueError(f"PagedBatch: every sequence needs >= 1 new token, found lens {lens_a.tolist()}")
        if s and starts_a.min() < 0:
            raise ValueError(f"PagedBatch: starts must be >= 0, found {starts_a.tolist()}")
        seq_lens = starts_a + lens_a  # [S]
        held = np.fromiter(map(len, tables), dtype=np.int64, count=s)  # [S] blocks in each table
        need = -(-seq_lens // block_size)
        short = np.flatnonzero(held < need)
        if len(short):
            i = int(short[0])
            raise ValueError(
                f"PagedBatch: sequence {i} holds {int(seq_lens[i])} tokens after the step, "
                f"which needs {int(need[i])} blocks of {block_size}, but its block table has {int(held[i])}"
            )
        flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64, count=int(held.sum()))
        outside = (flat < 0) | (flat >= num_blocks) if num_blocks is not None else flat < 0
        if outside.any():
            i = int(np.repeat(np.arange(s), held)[np.argmax(outside)])
            bound = f"0..{num_blocks - 1}" if num_blocks is not None else ">= 0"
            raise ValueError(f"PagedBatch: sequence {i} has block ids outside {bound}: {list(map(int, tables[i]))}")
        mb = int(held.max()) if s else 0
        table = block_table(tables, s, mb, np.int64, held, flat)  # [S, MB], padding 0

        t_total = int(lens_a.sum())
        query_start = np.zeros(s + 1, dtype=np.int64)  # [S + 1]
        np.cumsum(lens_a, out=query_start[1:])
        seq_of_token = np.repeat(np.arange(s), lens_a)  # [T]
        positions = np.arange(t_total) - query_start[:-1][seq_of_token] + starts_a[seq_of_token]  # [T]
        slot_mapping = table[seq_of_token, positions // block_size] * block_size + positions % block_size
        last = query_start[1:] - 1  # [S]

        # the longest run of sequences at the end that start at position 0 (the scheduler puts
        # newly admitted prompts last): their cumulative lengths ride in the same transfer
        trailing = 0
        if SPLIT_FRESH["on"]:
            trailing = int(np.argmin(starts_a[::-1] == 0)) if s and starts_a.any() else s
        first = s - trailing
        cu_fresh = query_start[first:] - query_start[first] if trailing else query_start[:0]

        # One host buffer, one transfer: the int64 fields first, then the int32 ones (converted
        # on the device by one cast, then viewed); every field is a view of those two tensors.
        host = np.concatenate([positions, slot_mapping, last, table.reshape(-1), seq_lens, query_start, cu_fresh])
        buf = torch.from_numpy(host)
        device = torch.device(device)
        if device.type == "cuda":
            buf = buf.pin_memory().to(device, non_blocking=True)
        else:
            buf = buf.to(device)
        longs, ints = buf[: 2 * t_total + s], buf[2 * t_total + s :].to(torch.int32)
        o = np.cumsum([0, s * mb, s, s + 1, len(cu_fresh)])
        positions_t, slots_t, last_t = longs[:t_total], longs[t_total : 2 * t_total], longs[2 * t_total :]
        tables_t, lens_t, qs_t = ints[o[0] : o[1]].view(s, mb), ints[o[1] : o[2]], ints[o[2] : o[3]]
        fresh = None
        if trailing:
            t0 = int(query_start[first])
            head = None
            if first:  # the sequences before the suffix: views of the same tensors
                head = cls(
                    num_tokens=t0,
                    num_seqs=first,
                    max_query_len=int(lens_a[:first].max()),
                    max_seq_len=int(seq_lens[:first].max()),
                    block_size=block_size,
                    positions=positions_t[:t0],
                    slot_mapping=slots_t[:t0],
                    last_token_index=last_t[:first],
                    block_tables=tables_t[:first],
                    seq_lens=lens_t[:first],
                    query_start=qs_t[: first + 1],
                )
            fresh = FreshSuffix(first, t0, tuple(lens_a[first:].tolist()), ints[o[3] : o[4]], head)
        return cls(
            num_tokens=t_total,
            num_seqs=s,
            max_query_len=int(lens_a.max()) if s else 0,
            max_seq_len=int(seq_lens.max()) if s else 0,
            block_size=block_size,
            positions=positions_t,
            slot_mapping=slots_t,
            last_token_index=last_t,
            block_tables=tables_t,
            seq_lens=lens_t,
            query_start=qs_t,
            fresh=fresh,
        )
