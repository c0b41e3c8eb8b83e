"""Per-step load statistics on a router's device (moeserve.router.dispatcher.DistributedExperts,
docs/eplb.md): the unread total, the power-of-two histogram of the replica rule's per-step count
estimate per expert, and the steps each slot got a pair, read in one snapshot; without ranks."""

import numpy as np
import pytest

from moeserve.dataplane.collective import CollectiveExchange
from moeserve.dataplane.exchange import Topology
from moeserve.router.dispatcher import LOAD_BINS, DistributedExperts, RouterMaps

pytestmark = pytest.mark.timeout(60)
L, E, W, P = 2, 4, 2, 6


def experts(routers: int):
    topo = Topology.build(routers, W, routers == W, P)
    phy2log = np.array([[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 3, 3]])
    maps = RouterMaps(phy2log, E, 3)
    return DistributedExperts(CollectiveExchange(topo, 0), maps, 0, L), topo


def count(ex, topo, layer: int, slot: int, n: int):
    """n pairs of this router to global slot ``slot`` in the step (as a dispatch counts them)."""
    ex.sent[layer, int(ex.exchange.slot_position[slot])] += n


def bin_of(c: int) -> int:
    return 0 if c == 0 else min(int(np.floor(np.log2(c))) + 1, LOAD_BINS - 1)


@pytest.mark.parametrize("routers", [1, 2])
def test_steps_are_binned_by_the_rule_estimate_and_busy_slots_counted(routers):
    ex, topo = experts(routers)
    steps = [{(0, 0): 3, (0, 4): 2, (1, 2): 1}, {(0, 1): 40}, {}]  # (layer, slot) -> pairs per step
    for s in steps:
        for (layer, slot), n in s.items():
            count(ex, topo, layer, slot, n)
        ex.end_step()
    logical, worker, n, hist, busy = ex.finish_load(ex.snapshot_load())
    assert n == 3 and hist.shape == (L, E, LOAD_BINS) and busy.shape == (L, P)
    assert (hist.sum(2) == 3).all()  # one bin per (step, expert)
    want = np.zeros((L, E, LOAD_BINS), dtype=np.int64)
    phy2log = ex.maps.phy2log
    for s in steps:
        per_expert = np.zeros((L, E), dtype=np.int64)
        for (layer, slot), c in s.items():
            per_expert[layer, phy2log[layer, slot]] += c
        for layer in range(L):
            for e in range(E):
                want[layer, e, bin_of(per_expert[layer, e] * routers)] += 1  # this router's pairs x routers
    np.testing.assert_array_equal(hist, want)
    assert busy[0, 0] == busy[0, 4] == busy[1, 2] == busy[0, 1] == 1 and busy.sum() == 4
    assert logical[0, 0] == 5 and logical[0, 1] == 40 and logical.sum() == 46
    again = ex.finish_load(ex.snapshot_load())  # read: everything reset
    assert again[2] == 0 and again[3].sum() == 0 and again[4].sum() == 0 and again[0].sum() == 0


def test_counts_past_the_last_bin_land_in_it_and_discard_forgets_everything():
    ex, topo = experts(1)
    count(ex, topo, 0, 0, 1 << 20)
    ex.end_step()
    count(ex, topo, 1, 1, 7)
    ex.discard_load()
    assert ex.sent.sum() == 0
    _, _, n, hist, busy = ex.finish_load(ex.snapshot_load())
    assert n == 0 and hist.sum() == 0 and busy.sum() == 0
    count(ex, topo, 0, 0, 1 << 20)
    ex.end_step()
    hist = ex.finish_load(ex.snapshot_load())[3]
    assert hist[0, 0, LOAD_BINS - 1] == 1 and hist[0, 1, 0] == 1
