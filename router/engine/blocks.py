"""The KV blocks of every router, counted on the leader (the routers only use the ids it hands out).

Dimension letters: N blocks of one router, B tokens per block (``block_size``).

Each router rank holds one paged KV pool of N blocks (``moeserve.models.paged.PagedKVCache``);
a sequence pinned to that router owns a list of block ids, its *block table*: token i of the
sequence lives in block ``table[i // B]`` at offset ``i % B``. The leader allocates and frees
blocks as it schedules, so admission, preemption and KV usage are decided in one place and the
header only names the blocks a sequence gains in a step. A block is identified by its id alone
and holds no per-sequence state, so sharing full blocks between sequences by the hash of their
tokens (prefix caching) can be added later without changing the pool.
"""

from __future__ import annotations


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` tokens."""
    return -(-tokens // block_size)


class BlockAllocator:
    """Free list of one router's N blocks. Not thread-safe: the scheduler holds its lock."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out the lowest id first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` block ids; the caller checked ``num_free`` first."""
        if n > len(self._free):
            raise RuntimeError(f"{n} blocks asked for, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        return out

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
