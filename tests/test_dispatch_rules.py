"""The dispatch wire format's rules, without processes: replica choice and row layouts."""

import numpy as np
import pytest
import torch

from moeserve.dataplane.exchange import RecvCounts, Topology, choose_slots, count, slot_major_index
from moeserve.router.dispatcher import RouterMaps


def maps_for(phy2log, num_logical, max_replicas):
    return RouterMaps(np.asarray([phy2log]), num_logical, max_replicas)


def test_replicas_get_an_even_split_even_when_k_shares_a_factor_with_the_replica_count():
    # Expert 0 is every token's first choice (k = 0) and has 3 replicas; K = 6 pairs per token.
    # The flat-index rule would send every such pair to one replica; the per-expert ordinal
    # splits them 10/10/10.
    t, k, e = 30, 6, 8
    ids = torch.stack(
        [
            torch.tensor([0] + list(np.random.default_rng(i).choice(np.arange(1, e), k - 1, replace=False)))
            for i in range(t)
        ]
    )
    phy2log = [0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 1, 2]
    m = maps_for(phy2log, e, 4)
    slots = choose_slots(ids, m.log2phy[0], m.logcnt[0], offset=5)
    per_slot = torch.bincount(slots, minlength=len(phy2log))
    assert per_slot[:3].tolist() == [10, 10, 10]
    # Every pair lands on a slot holding its logical expert.
    assert torch.equal(torch.tensor(phy2log)[slots], ids.reshape(-1))


def test_replica_counts_differ_by_at_most_one_and_offset_rotates_the_remainder():
    ids = torch.zeros(7, 1, dtype=torch.long)  # 7 pairs to expert 0, 2 replicas
    m = maps_for([0, 1, 0, 1], 2, 3)
    a = torch.bincount(choose_slots(ids, m.log2phy[0], m.logcnt[0], 0), minlength=4)
    b = torch.bincount(choose_slots(ids, m.log2phy[0], m.logcnt[0], 1), minlength=4)
    assert sorted([a[0].item(), a[2].item()]) == [3, 4]
    assert a[0].item() == b[2].item() and a[2].item() == b[0].item()


def test_no_pairs_gives_no_slots():
    m = maps_for([0, 1], 2, 1)
    assert choose_slots(torch.empty(0, 2, dtype=torch.long), m.log2phy[0], m.logcnt[0], 0).numel() == 0


def test_router_maps_list_replicas_in_slot_order_padded_with_minus_one():
    m = maps_for([2, 0, 2, 1, 2, 0], 3, 4)
    assert m.logcnt[0].tolist() == [2, 1, 3]
    assert m.log2phy[0].tolist() == [[1, 5, -1, -1], [3, -1, -1, -1], [0, 2, 4, -1]]
    m.set_layer(0, [0, 1, 2, 0, 1, 2])
    assert m.logcnt[0].tolist() == [2, 2, 2]
    assert m.log2phy[0, 2].tolist() == [2, 5, -1, -1]


def test_slot_major_index_groups_rows_of_all_sources_by_slot():
    # 3 source ranks, 2 slots; received layout = source-major blocks, slots ascending inside.
    counts = torch.tensor([[2, 1], [0, 3], [1, 0]])
    labels = []  # (source, slot) of each received row
    for src in range(3):
        for slot in range(2):
            labels += [(src, slot)] * int(counts[src, slot])
    index, per_slot, offs = slot_major_index(RecvCounts(counts.numpy(), counts))
    assert per_slot == [3, 4] and offs.tolist() == [3, 7]
    regrouped = [labels[i] for i in index.tolist()]
    assert [s for _, s in regrouped] == [0, 0, 0, 1, 1, 1, 1]
    assert [src for src, _ in regrouped] == [0, 0, 2, 0, 1, 1, 1]  # sources keep their order inside a slot


@pytest.mark.parametrize(
    "routers,workers,colocated,slots,err",
    [
        (1, 3, False, 8, r"\(E \+ R\) % W != 0"),
        (2, 3, True, 6, "must equal workers"),
        (0, 1, False, 4, "at least one router"),
    ],
)
def test_topology_rejects_impossible_shapes_naming_the_rule(routers, workers, colocated, slots, err):
    with pytest.raises(ValueError, match=err):
        Topology.build(routers, workers, colocated, slots)


def test_topology_ranks_in_both_layouts():
    d = Topology.build(2, 3, False, 9)
    assert d.router_ranks == (0, 1) and d.worker_ranks == (2, 3, 4) and d.world_size == 5 and d.slots_per_worker == 3
    assert d.worker_index(3) == 1 and d.router_index(3) is None and not d.colocated
    c = Topology.build(2, 2, True, 8)
    assert c.router_ranks == c.worker_ranks == (0, 1) and c.world_size == 2 and c.colocated


def test_count_matches_bincount():
    v = torch.tensor([3, 0, 3, 1, 3])
    assert count(v, 5).tolist() == torch.bincount(v, minlength=5).tolist() == [1, 1, 0, 3, 0]
