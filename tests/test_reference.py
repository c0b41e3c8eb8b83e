"""The DeepSeek-compatible drop-in: same arguments, same outputs as the published policy."""

import numpy as np
import pytest
import torch

from moeserve.balancer.policy import place_reference, rebalance_experts

README_WEIGHT = [
    [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
]
README_PHY2LOG = [
    [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
    [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
]


def test_reproduces_the_readme_example_exactly():
    phy2log, log2phy, logcnt = rebalance_experts(np.array(README_WEIGHT), 16, 4, 2, 8)
    assert phy2log.tolist() == README_PHY2LOG
    assert logcnt.tolist() == [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1], [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]


def test_torch_in_gives_torch_out_with_the_same_values():
    phy2log, log2phy, logcnt = rebalance_experts(torch.tensor(README_WEIGHT), 16, 4, 2, 8)
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.int64 for t in (phy2log, log2phy, logcnt))
    assert phy2log.tolist() == README_PHY2LOG


def test_log2phy_lists_every_replica_once_padded_with_minus_one():
    phy2log, log2phy, logcnt = rebalance_experts(np.array(README_WEIGHT), 16, 4, 2, 8)
    assert log2phy.shape == (2, 12, int(logcnt.max()))
    for layer in range(2):
        for expert in range(12):
            slots = [s for s in log2phy[layer, expert].tolist() if s != -1]
            assert len(slots) == logcnt[layer, expert]
            assert all(phy2log[layer, s] == expert for s in slots)
            assert log2phy[layer, expert, len(slots) :].tolist() == [-1] * (log2phy.shape[2] - len(slots))


def test_hierarchical_variant_keeps_each_group_on_one_node():
    rng = np.random.default_rng(0)
    weight = rng.integers(0, 1000, size=(5, 32)).astype(float)
    phy2log, _, _ = rebalance_experts(weight, 48, num_groups=8, num_nodes=4, num_gpus=8)
    node_of_slot = np.arange(48) // 12
    for layer in range(5):
        for group in range(8):
            assert len(set(node_of_slot[phy2log[layer] // 4 == group])) == 1


def test_global_variant_when_groups_do_not_split_over_nodes():
    weight = np.arange(1, 13, dtype=float)[None]
    phy2log, _, logcnt = rebalance_experts(weight, 16, num_groups=3, num_nodes=2, num_gpus=4)
    assert sorted(set(phy2log[0].tolist())) == list(range(12))
    assert logcnt[0, 11] == 2  # the heaviest expert is replicated


def test_yardstick_wrapper_ignores_current():
    w = np.array(README_WEIGHT, dtype=float)
    assert place_reference(w, 16, 8, 4, 2, None).tolist() == README_PHY2LOG


@pytest.mark.parametrize(
    "args, message",
    [
        ((16, 4, 2, 7), "multiple of num_gpus"),
        ((8, 4, 2, 8), "at least the number of logical experts"),
        ((16, 5, 5, 8), "do not split into num_groups=5"),
        ((16, 4, 4, 6), "multiple of num_gpus"),
        ((16, 0, 2, 8), "num_groups must be a positive integer"),
    ],
)
def test_bad_arguments_raise_value_error_saying_what_is_allowed(args, message):
    with pytest.raises(ValueError, match=message):
        rebalance_experts(np.array(README_WEIGHT), *args)
