"""The KV blocks of every router, counted on the leader (the routers only use the ids it hands out),
and the prefix cache over them.

Dimension letters: N blocks of one router, B tokens per block (``block_size``).

Each router rank holds one paged KV pool of N blocks (``moeserve.models.paged.PagedKVCache``);
a sequence pinned to that router owns a list of block ids, its *block table*: token i of the
sequence lives in block ``table[i // B]`` at offset ``i % B``. The leader allocates and frees
blocks as it schedules, so admission, preemption and KV usage are decided in one place and the
header only names the blocks a sequence gains in a step. A block is identified by its id alone
and holds no per-sequence state, so full blocks are shared between sequences by the hash of
their tokens (prefix caching, docs/engine.md): block i of a sequence is named by
``sha256(hash of block i - 1, its B token ids)``, block 0's parent being the *root* of the
request (its ``cache_salt``, and anything else that changes the keys and values of the same
tokens), so a hash names the whole prefix up to the end of its block.

Per router, a block is *empty* (free, holding nothing reusable), *referenced* by the sequences
whose block tables hold it (a count), or *cached and idle*: free, but still holding the keys and
values of its hash, kept in least-recently-used order and evicted (its hash forgotten) only when
no empty block is left. Idle blocks count as free. Only full blocks get a hash, never a
sequence's last, partial block, so a block that a sequence still writes is never shared.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` tokens."""
    return -(-tokens // block_size)


def prefix_root(cache_salt: str = "") -> bytes:
    """The parent hash of a request's first block: requests of different roots never share a
    block (a tenant's ``cache_salt``; a model adapter or a multimodal input would join here)."""
    return hashlib.sha256(b"moeserve prefix cache 1\0" + json.dumps([cache_salt]).encode()).digest()


def extend_hashes(hashes: list[bytes], tokens, block_size: int, root: bytes) -> None:
    """Append to ``hashes`` (the hashes of the first full blocks of ``tokens``, in order) the
    hash of every further full block of ``tokens``."""
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), len(tokens) // block_size):
        chunk = array("q", tokens[i * block_size : (i + 1) * block_size]).tobytes()
        parent = hashlib.sha256(parent + chunk).digest()
        hashes.append(parent)


class BlockAllocator:
    """One router's N blocks: the empty ones, reference counts, and with ``caching`` the hash
    of every cached block and the least-recently-used order of the idle ones. Not thread-safe:
    the scheduler holds its lock."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self._empty = list(range(num_blocks - 1, -1, -1))  # pop() hands out the lowest id first
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # cached block -> its hash
        self._block_of: dict[bytes, int] = {}  # hash -> the cached block holding it
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; least recently used first
        self.evictions = 0  # cached blocks whose hash was forgotten to make room

    @property
    def num_free(self) -> int:
        """Blocks that ``allocate`` can hand out: the empty and the idle cached ones."""
        return len(self._empty) + len(self._idle)

    @property
    def num_used(self) -> int:
        """Blocks some sequence's block table holds."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding a hash (referenced or idle)."""
        return len(self._block_of)

    def allocate(self, n: int) -> list[int]:
        """``n`` block ids, each referenced once: empty blocks first, then the least recently
        used idle cached blocks, whose hashes are forgotten; the caller checked ``num_free``."""
        if n > self.num_free:
            raise RuntimeError(f"{n} blocks asked for, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._empty:
                b = self._empty.pop()
            else:
                b, _ = self._idle.popitem(last=False)
                del self._block_of[self._hash_of.pop(b)]
                self.evictions += 1
            self._refs[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each of ``blocks`` (a block table). A block left without one
        becomes idle when it is cached, empty otherwise; the table's tail is evicted first (the
        end of a prompt is the part other requests share least)."""
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            if b in self._hash_of:
                self._idle[b] = None
            else:
                self._empty.append(b)

    def match(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes`` (a sequence's block hashes in
        order): what a new sequence can start its block table with."""
        out = []
        if self.caching:
            for h in hashes:
                b = self._block_of.get(h)
                if b is None:
                    break
                out.append(b)
        return out

    def num_idle(self, blocks: list[int]) -> int:
        """How many of ``blocks`` are idle (counted in ``num_free`` until ``share`` takes them)."""
        return sum(1 for b in blocks if not self._refs[b])

    def share(self, blocks: list[int]) -> None:
        """One more reference to each of ``blocks`` (cached blocks a sequence starts with); an
        idle block leaves the idle order."""
        for b in blocks:
            if not self._refs[b]:
                del self._idle[b]
            self._refs[b] += 1

    def cache(self, block: int, h: bytes) -> None:
        """Name the full, referenced ``block`` by its hash ``h`` so that later sequences can
        share it. When another block holds ``h`` already (two sequences computed the same
        prefix at once), ``block`` stays unnamed and becomes empty when freed."""
        if self.caching and h not in self._block_of and block not in self._hash_of:
            self._block_of[h] = block
            self._hash_of[block] = h
