"""The placement type: validation, derived tables, moves, files, balancedness."""

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeserve.placement import Move, Placement, balancedness, load_from_sglang, model_balancedness, worker_load

# 2 layers, 4 logical experts, 6 slots on 3 workers (2 slots each), one node
P2L = [[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 0, 0]]


def placement(p2l=P2L, e=4, w=3, wpn=None, **kw):
    return Placement(np.array(p2l), e, w, wpn, **kw)


# ---- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(p2l=[0, 1, 2, 3]), "2-D"),
        (dict(p2l=[[0, 1, 2, 4, 0, 1], P2L[1]]), r"layer 0 slot 3: logical expert id 4 is out of range 0\.\.3"),
        (dict(p2l=[[0, 1, 2, 2, 0, 1], P2L[1]]), "layer 0: logical expert 3 has no replica"),
        (dict(w=4), "6 slots per layer do not split evenly over 4 workers"),
        (dict(wpn=2), "3 workers do not split into nodes of 2"),
        (dict(e=7), "6 slots cannot hold 7 logical experts"),
        (dict(version=-1), "version must be a non-negative integer"),
        (dict(version=2, layer_versions=[1, -1]), "layer_versions must be non-negative"),
        (dict(layer_versions=[0]), r"layer_versions must have shape \(2,\)"),
        (dict(p2l=np.array(P2L) + 0.5), "integer logical expert ids"),
    ],
)
def test_invalid_placements_are_rejected_with_what_was_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        placement(**kwargs)


def test_arrays_are_copied_and_read_only():
    src = np.array(P2L)
    p = placement(src)
    src[0, 0] = 3
    assert p.phy2log[0, 0] == 0
    with pytest.raises(ValueError):
        p.phy2log[0, 0] = 1


def test_slot_worker_and_node_helpers():
    p = Placement(np.tile(np.arange(8), (1, 2)), 8, 4, workers_per_node=2)
    assert p.slots_per_worker == 4 and p.num_nodes == 2
    assert p.worker_of_slot(5) == 1 and p.node_of_worker(3) == 1 and p.node_of_slot(9) == 1
    assert p.worker_of_slot(np.arange(16)).tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4


# ---- derived tables --------------------------------------------------------------------------


def test_logcnt_counts_replicas():
    assert placement().logcnt().tolist() == [[2, 2, 1, 1], [3, 1, 1, 1]]


def test_log2phy_lists_slots_ascending_padded_to_the_callers_width():
    t = placement().log2phy(4)
    assert t.shape == (2, 4, 4)
    assert t[0].tolist() == [[0, 4, -1, -1], [1, 5, -1, -1], [2, -1, -1, -1], [3, -1, -1, -1]]
    assert t[1, 0].tolist() == [3, 4, 5, -1]


def test_log2phy_narrower_than_a_replica_count_is_an_error():
    with pytest.raises(
        ValueError, match="layer 1: logical expert 0 has 3 replicas, more than the table width max_replicas=2"
    ):
        placement().log2phy(2)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_tables_agree_for_random_placements(data):
    layers = data.draw(st.integers(1, 4))
    e = data.draw(st.integers(1, 12))
    w = data.draw(st.integers(1, 4))
    s = data.draw(st.integers(-(-e // w), -(-e // w) + 3))
    p = w * s
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    rows = [rng.permutation(np.concatenate([np.arange(e), rng.integers(0, e, p - e)])) for _ in range(layers)]
    pl = Placement(np.array(rows), e, w)
    cnt = pl.logcnt()
    table = pl.log2phy(int(cnt.max()))
    for l in range(layers):
        for x in range(e):
            slots = table[l, x][table[l, x] >= 0]
            assert len(slots) == cnt[l, x]
            assert (pl.phy2log[l, slots] == x).all()


# ---- balancedness ----------------------------------------------------------------------------


def test_balancedness_splits_an_experts_load_evenly_over_its_replicas():
    # layer 0: experts 0 (load 4) and 1 (load 2) have a replica on workers 0 and 2 each;
    # layer 1: expert 0 (load 6) has three replicas, on workers 1, 2 and 2
    load = np.array([[4.0, 2.0, 3.0, 3.0], [6.0, 1.0, 1.0, 1.0]])
    wl = worker_load(load, np.array(P2L), 3)
    assert wl.tolist() == [[2 + 1, 3 + 3, 2 + 1], [1 + 1, 1 + 2, 2 + 2]]
    assert np.allclose(balancedness(load, np.array(P2L), 3), [4 / 6, 3 / 4])


def test_a_layer_without_tokens_counts_one_and_is_left_out_of_the_mean():
    load = np.array([[4.0, 2.0, 3.0, 3.0], [0.0, 0.0, 0.0, 0.0]])
    assert balancedness(load, np.array(P2L), 3)[1] == 1.0
    m = model_balancedness(load, np.array(P2L), 3)
    assert m["mean"] == pytest.approx(4 / 6)
    assert m["sum_ratio"] == pytest.approx(4 / 6)


def test_model_balancedness_reports_the_mean_and_vllms_sum_ratio():
    load = np.array([[4.0, 2.0, 3.0, 3.0], [6.0, 1.0, 1.0, 1.0]])
    m = model_balancedness(load, np.array(P2L), 3)
    assert m["mean"] == pytest.approx((4 / 6 + 3 / 4) / 2)
    assert m["sum_ratio"] == pytest.approx((4 + 3) / (6 + 4))


def test_placement_balancedness_checks_the_load_shape():
    with pytest.raises(ValueError, match=r"load has shape \(2, 3\), expected \(2, 4\)"):
        placement().balancedness(np.ones((2, 3)))


# ---- moves -----------------------------------------------------------------------------------


def test_diff_lists_only_slots_whose_expert_changes():
    old = placement()
    assert old.diff(old, 10) == []
    new = old.replace([[0, 1, 2, 3, 1, 1], P2L[1]])
    assert new.version == 1
    assert old.diff(new, 10) == [Move(0, 4, 1, 2, 2, 10)]  # worker 2 holds expert 1 already


# 4 workers of 2 slots, 2 workers per node: w0 {0, 1}  w1 {2, 4} | w2 {3, 0}  w3 {4, 1}
OLD = [0, 1, 2, 4, 3, 0, 4, 1]


def one_move(new_row):
    old = Placement([OLD], 5, 4, workers_per_node=2)
    (move,) = old.diff(old.replace([new_row]), expert_bytes=7)
    return move


def test_move_source_is_the_destination_worker_when_it_holds_the_expert():
    move = one_move([0, 1, 2, 4, 3, 0, 4, 4])  # w3 slot 7 takes expert 4, w3 has it
    assert (move.slot, move.logical, move.src_worker, move.dst_worker, move.nbytes) == (7, 4, 3, 3, 7)
    assert move.local


def test_move_source_on_the_destinations_node_beats_one_elsewhere():
    assert one_move([4, 1, 2, 4, 3, 0, 4, 1]).src_worker == 1  # w0 takes 4: w1 (node 0), not w3
    assert one_move([0, 1, 2, 4, 3, 4, 4, 1]).src_worker == 3  # w2 takes 4: w3 (node 1), not w1


def test_move_source_on_another_node_when_no_nearer_holder():
    move = one_move([0, 1, 2, 4, 3, 2, 4, 1])  # w2 takes 2, held only by w1
    assert (move.src_worker, move.local) == (1, False)


def test_moves_spread_their_sends_over_the_holders():
    # expert 0 sits on workers 0 and 1 (one worker per node); workers 2..5 each take a replica
    old = Placement([[0, 1, 0, 2, 3, 3, 4, 4, 5, 5, 6, 6]], 7, 6, workers_per_node=1)
    new = old.replace([[0, 1, 0, 2, 3, 0, 4, 0, 5, 0, 6, 0]])
    assert [m.src_worker for m in old.diff(new, 1)] == [0, 1, 0, 1]


def test_diff_rejects_placements_of_another_shape():
    with pytest.raises(ValueError, match="differ in shape or topology"):
        placement().diff(Placement(np.array(P2L), 4, 1), 1)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_applying_the_moves_gives_the_new_placement(data):
    e, w = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 4))
    s = max(data.draw(st.integers(1, 4)), -(-e // w))
    p = w * s
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))

    def rand_row():
        return rng.permutation(np.concatenate([np.arange(e), rng.integers(0, e, p - e)]))

    wpn = data.draw(st.sampled_from([d for d in range(1, w + 1) if w % d == 0]))
    old = Placement(np.array([rand_row(), rand_row()]), e, w, wpn)
    new = old.replace(np.array([rand_row(), rand_row()]))
    rows = old.phy2log.copy()
    for m in old.diff(new, 3):
        assert m.logical in old.phy2log[m.moe_layer][np.arange(p) // s == m.src_worker]
        assert m.dst_worker == m.slot // s
        if m.logical in old.phy2log[m.moe_layer][np.arange(p) // s == m.dst_worker]:
            assert m.local
        rows[m.moe_layer, m.slot] = m.logical
    assert (rows == new.phy2log).all()


# ---- files -----------------------------------------------------------------------------------


def test_json_round_trip_keeps_everything(tmp_path):
    p = placement(wpn=3, version=4, layer_versions=[4, 2])
    assert Placement.from_json(p.to_json()) == p
    p.save(tmp_path / "p.json")
    assert Placement.load(tmp_path / "p.json") == p


def test_json_that_is_not_a_placement_is_rejected():
    with pytest.raises(ValueError, match="not a placement"):
        Placement.from_json('{"phy2log": [[0]]}')
    with pytest.raises(ValueError, match="invalid JSON"):
        Placement.from_json("{")


def sglang_map():
    # 4 decoder layers, layer 0 dense (SGLang writes its trivial map there), 1..3 MoE
    return [[p % 4 for p in range(6)], [0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 0, 0], [0, 0, 1, 1, 2, 3]]


@pytest.mark.parametrize("suffix", [".json", ".pt"])
def test_reads_an_sglang_physical_to_logical_map_by_decoder_layer(tmp_path, suffix):
    path = tmp_path / f"loc{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps({"physical_to_logical_map": sglang_map()}))
    else:
        torch.save({"physical_to_logical_map": torch.tensor(sglang_map())}, path)
    p = Placement.from_sglang(path, moe_layer_ids=[1, 2, 3], num_logical=4, num_workers=3, num_decoder_layers=4)
    assert p.phy2log.tolist() == sglang_map()[1:]


def test_sglang_map_with_a_dense_row_holding_garbage_is_rejected(tmp_path):
    rows = sglang_map()
    rows[0][2] = 9
    path = tmp_path / "loc.json"
    path.write_text(json.dumps({"physical_to_logical_map": rows}))
    with pytest.raises(ValueError, match="dense decoder layer 0 slot 2 holds 9"):
        Placement.from_sglang(path, [1, 2, 3], 4, 3)


def test_sglang_map_with_an_invalid_moe_row_names_the_problem(tmp_path):
    rows = sglang_map()
    rows[2] = [0, 0, 0, 0, 1, 2]
    path = tmp_path / "loc.json"
    path.write_text(json.dumps({"physical_to_logical_map": rows}))
    with pytest.raises(ValueError, match="layer 1: logical expert 3 has no replica"):
        Placement.from_sglang(path, [1, 2, 3], 4, 3)


def test_sglang_layer_ids_must_fit_the_file(tmp_path):
    path = tmp_path / "loc.json"
    path.write_text(json.dumps({"physical_to_logical_map": sglang_map()}))
    with pytest.raises(ValueError, match="moe_layer_ids must lie in 0..3"):
        Placement.from_sglang(path, [1, 2, 4], 4, 3)
    with pytest.raises(ValueError, match="expected num_decoder_layers=5"):
        Placement.from_sglang(path, [1, 2, 3], 4, 3, num_decoder_layers=5)
    with pytest.raises(ValueError, match="strictly increasing"):
        Placement.from_sglang(path, [2, 1], 4, 3)


def test_an_sglang_load_file_is_not_a_placement(tmp_path):
    path = tmp_path / "dump.json"
    path.write_text(json.dumps({"logical_count": [[1, 2]]}))
    with pytest.raises(ValueError, match="holds logical_count .load., not a placement"):
        Placement.from_sglang(path, [0], 2, 1)


@pytest.mark.parametrize("suffix", [".json", ".pt"])
def test_reads_sglang_logical_count_summing_leading_dims_and_dropping_dense_rows(tmp_path, suffix):
    counts = np.zeros((2, 3, 4))  # [steps, decoder layers, experts]
    counts[:, 1] = [[1, 2, 3, 4], [10, 20, 30, 40]]
    counts[:, 2] = [[5, 0, 0, 0], [5, 1, 0, 0]]
    path = tmp_path / f"dump{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps({"logical_count": counts.tolist()}))
    else:
        torch.save({"rank": 0, "logical_count": torch.tensor(counts, dtype=torch.int32)}, path)
    load = load_from_sglang(path, moe_layer_ids=[1, 2], num_logical=4)
    assert load.tolist() == [[11, 22, 33, 44], [10, 1, 0, 0]]


def test_sglang_counts_in_a_dense_layer_mean_the_layer_ids_are_wrong(tmp_path):
    counts = np.ones((3, 4))
    path = tmp_path / "dump.json"
    path.write_text(json.dumps({"logical_count": counts.tolist()}))
    with pytest.raises(ValueError, match="decoder layer 0 is not in moe_layer_ids but has 4 routed tokens"):
        load_from_sglang(path, [1, 2])


def test_unknown_sglang_file_types_are_rejected(tmp_path):
    path = tmp_path / "loc.yaml"
    path.write_text("x")
    with pytest.raises(ValueError, match="allowed: .json, .pt"):
        load_from_sglang(path, [0])
    with pytest.raises(ValueError, match="no such file"):
        load_from_sglang(tmp_path / "missing.json", [0])


def test_layer_versions_may_run_ahead_of_the_version_while_a_migration_commits_layer_by_layer():
    p = Placement(np.array([[0, 1], [1, 0]]), num_logical=2, num_workers=1, version=2, layer_versions=[3, 2])
    assert p.layer_versions.tolist() == [3, 2] and p.version == 2


def test_worker_balancedness_from_measured_worker_loads():
    from moeserve.placement import worker_balancedness

    b = worker_balancedness(np.array([[2, 2], [4, 1], [0, 0]]))  # the idle layer counts 1.0, left out of means
    np.testing.assert_allclose(b["per_layer"], [1.0, 0.625, 1.0])
    assert b["mean"] == pytest.approx(0.8125) and b["sum_ratio"] == pytest.approx(4.5 / 6)
