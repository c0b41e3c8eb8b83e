"""The step's block-table array (moeserve.models.paged.block_table), built in one masked store:
each row the sequence's block ids in order, zeros after them and in padding rows, as the
per-sequence loop it replaced built it; PagedBatch still names a short table or an id out of
range by its sequence."""

import numpy as np
import pytest

from moeserve.models.paged import PagedBatch, block_table


def loop_table(tables, rows, width, dtype):
    out = np.zeros((rows, width), dtype=dtype)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t
    return out


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_the_table_equals_the_per_sequence_fill(dtype):
    rng = np.random.default_rng(0)
    tables = [list(rng.integers(0, 1000, size=n)) for n in (3, 0, 7, 1, 7, 2)]
    got = block_table(tables, 9, 8, dtype)
    assert got.dtype == dtype and got.shape == (9, 8)
    assert np.array_equal(got, loop_table(tables, 9, 8, dtype))
    assert got[1].sum() == 0 and got[6:].sum() == 0  # an empty table and the padding rows
    assert np.array_equal(block_table([], 2, 3), np.zeros((2, 3), np.int32))
    assert np.array_equal(block_table([(5, 6), [7]], 2, 2), [[5, 6], [7, 0]])  # any sequences of ints


def test_a_batch_still_names_what_is_wrong_by_sequence():
    ok = PagedBatch.build([1, 2], [3, 0], [[4], [9]], block_size=4, num_blocks=10)
    assert ok.block_tables.tolist() == [[4], [9]]
    with pytest.raises(ValueError, match="sequence 1 holds 6 tokens after the step, which needs 2 blocks of 4"):
        PagedBatch.build([1, 6], [3, 0], [[4], [9]], block_size=4, num_blocks=10)
    with pytest.raises(ValueError, match=r"sequence 1 has block ids outside 0..9: \[9, 10\]"):
        PagedBatch.build([1, 5], [3, 0], [[4], [9, 10]], block_size=4, num_blocks=10)
    with pytest.raises(ValueError, match=r"sequence 0 has block ids outside >= 0: \[-1\]"):
        PagedBatch.build([1], [3], [[-1]], block_size=4)
