"""The varlen step batch and the KV cache of the single-process decoder.

Dimension letters: T tokens in a step (all sequences, flattened), S sequences in a step,
L tokens held for a sequence, Hkv key/value heads, D head dim.

A step carries the new tokens of several sequences back to back: a whole prompt (prefill), one
token (decode) or a later chunk all look the same. ``StepBatch.starts[s]`` is the absolute
position of sequence s's first new token, which must equal the tokens already cached for it.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class StepBatch:
    """The sequences of one step: ``seq_ids[s]`` gets ``lens[s]`` new tokens at positions
    ``starts[s] .. starts[s]+lens[s]-1``; the step's input_ids [T] hold them in this order.

    A batch with no sequences is allowed: a router rank with nothing to do still takes part in
    every MoE layer's exchange.
    """

    seq_ids: tuple[Hashable, ...]
    lens: tuple[int, ...]
    starts: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "seq_ids", tuple(self.seq_ids))
        object.__setattr__(self, "lens", tuple(int(n) for n in self.lens))
        object.__setattr__(self, "starts", tuple(int(s) for s in self.starts))
        if not len(self.seq_ids) == len(self.lens) == len(self.starts):
            raise ValueError(
                f"StepBatch: seq_ids, lens and starts must have one entry per sequence, "
                f"found {len(self.seq_ids)}, {len(self.lens)}, {len(self.starts)}"
            )
        if len(set(self.seq_ids)) != len(self.seq_ids):
            raise ValueError(f"StepBatch: seq_ids must be distinct, found {self.seq_ids}")
        if any(n < 1 for n in self.lens):
            raise ValueError(f"StepBatch: every sequence needs >= 1 new token, found lens {self.lens}")
        if any(s < 0 for s in self.starts):
            raise ValueError(f"StepBatch: starts must be >= 0, found {self.starts}")

    @classmethod
    def prefill(cls, seq_ids, lens) -> StepBatch:
        """New sequences, each starting at position 0."""
        seq_ids = tuple(seq_ids)
        return cls(seq_ids, tuple(lens), (0,) * len(seq_ids))

    @property
    def num_tokens(self) -> int:
        return sum(self.lens)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Index of each sequence's first token in the flat step: [S + 1] (last = T)."""
        out = [0]
        for n in self.lens:
            out.append(out[-1] + n)
        return tuple(out)

    @cached_property
    def positions(self) -> torch.Tensor:
        """LongTensor [T]: the absolute position of every token of the step."""
        if not self.lens:
            return torch.zeros(0, dtype=torch.long)
        return torch.cat([torch.arange(s, s + n) for s, n in zip(self.starts, self.lens)])

    @cached_property
    def last_token_index(self) -> torch.Tensor:
        """LongTensor [S]: flat index of each sequence's last new token (where to take logits)."""
        return torch.tensor(self.offsets[1:], dtype=torch.long) - 1


class KVCache:
    """Keys and values per sequence and decoder layer, stored at absolute positions.

    Buffers grow by doubling. ``write`` stores a step's keys at positions ``start ..`` of the
    layer's buffer (so a step that failed half way can simply be retried); ``commit`` advances
    the sequence lengths once the whole step went through. Chunked-attention layers keep every
    key too; attention reads only the chunk it needs.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self._len: dict[Hashable, int] = {}
        self._k: dict[Hashable, list[torch.Tensor | None]] = {}
        self._v: dict[Hashable, list[torch.Tensor | None]] = {}

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._len

    @property
    def seq_ids(self) -> tuple[Hashable, ...]:
        return tuple(self._len)

    def length(self, seq_id: Hashable) -> int:
        """Tokens cached for ``seq_id`` (KeyError when the cache does not hold it)."""
        if seq_id not in self._len:
            raise KeyError(f"sequence {seq_id!r} is not in the KV cache")
        return self._len[seq_id]

    def release(self, seq_id: Hashable) -> None:
        """Free a sequence's keys and values (no-op when it is not held)."""
        for d in (self._len, self._k, self._v):
            d.pop(seq_id, None)

    def begin(self, batch: StepBatch) -> None:
        """Check a step against the cache; sequences starting at 0 that are not held are created."""
        for sid, start in zip(batch.seq_ids, batch.starts):
            held = self._len.get(sid)
            if held is None and start != 0:
                raise ValueError(f"sequence {sid!r} is not in the KV cache, so its start must be 0, found {start}")
            if held is not None and start != held:
                raise ValueError(f"sequence {sid!r} has {held} cached tokens but the step starts it at {start}")
        for sid in batch.seq_ids:
            if sid not in self._len:
                self._len[sid] = 0
                self._k[sid] = [None] * self.num_layers
                self._v[sid] = [None] * self.num_layers

    def write(
        self, layer: int, seq_id: Hashable, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [n, Hkv, D] at positions start..start+n-1 of one layer.

        Returns views of all keys and values of the sequence in that layer: [start + n, Hkv, D].
        """
        end = start + k.shape[0]
        buf_k, buf_v = self._k[seq_id][layer], self._v[seq_id][layer]
        if buf_k is None or buf_v is None or buf_k.shape[0] < end:  # (k and v are None together)
            cap = max(16, end, 2 * (0 if buf_k is None else buf_k.shape[0]))
            shape = (cap, self.num_kv_heads, self.head_dim)
            new_k = torch.empty(shape, dtype=self.dtype, device=self.device)
            new_v = torch.empty(shape, dtype=self.dtype, device=self.device)
            if buf_k is not None and buf_v is not None:
                new_k[:start] = buf_k[:start]
                new_v[:start] = buf_v[:start]
            self._k[seq_id][layer], self._v[seq_id][layer] = buf_k, buf_v = new_k, new_v
        buf_k[start:end] = k
        buf_v[start:end] = v
        return buf_k[:end], buf_v[:end]

    def commit(self, batch: StepBatch) -> None:
        """Advance the cached length of every sequence of a step that completed."""
        for sid, start, n in zip(batch.seq_ids, batch.starts, batch.lens):
            self._len[sid] = start + n
