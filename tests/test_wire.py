"""moeserve.wire: values survive the trip through their messages, a malformed matrix says what is
wrong, and the SDK built on it imports no server code."""

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from moeserve import wire
from moeserve.client import EplbInfo, ModelInfo, RankInfo
from moeserve.placement import MigrationProgress, MigrationState, Placement
from moeserve.rpc import admin_pb2, common_pb2


def test_a_placement_round_trips():
    p = Placement(
        np.array([[0, 1, 2, 0], [2, 1, 0, 1]]),
        num_logical=3,
        num_workers=2,
        workers_per_node=1,
        version=7,
        layer_versions=[7, 6],
    )
    msg = wire.placement_msg(p)
    assert msg.num_logical_experts == 3 and (msg.phy2log.rows, msg.phy2log.cols) == (2, 4)
    back = wire.placement_from_msg(admin_pb2.Placement.FromString(msg.SerializeToString()))
    assert back == p and back.layer_versions.tolist() == [7, 6]


@pytest.mark.parametrize("state", list(MigrationState))
def test_a_migration_round_trips_in_every_state(state):
    m = MigrationProgress(
        "m-1",
        state,
        "why" if state == MigrationState.FAILED else "",
        target_version=4,
        moves_total=10,
        moves_done=3,
        bytes_total=1 << 40,
        bytes_done=1 << 20,
        layers_total=5,
        layers_committed=2,
    )
    msg = wire.migration_msg(m)
    assert common_pb2.MigrationProgress.State.Name(msg.state) == state.name
    back = wire.migration_from_msg(common_pb2.MigrationProgress.FromString(msg.SerializeToString()))
    assert back == m and back.state is state and back.ended == state.ended


def test_a_migration_with_an_unknown_state_is_an_error():
    with pytest.raises(ValueError, match="'m-2' has state 0"):
        wire.migration_from_msg(common_pb2.MigrationProgress(migration_id="m-2"))


def test_a_malformed_matrix_is_refused_with_its_shape():
    m = common_pb2.Int64Matrix(rows=2, cols=3, values=[1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match=r"phy2log says shape \(2, 3\) but holds 5 values"):
        wire.from_int64_matrix(m, "phy2log")
    with pytest.raises(ValueError, match=r"2-D array, got shape \(3,\)"):
        wire.int64_matrix([1, 2, 3])
    a = np.arange(6).reshape(2, 3)
    np.testing.assert_array_equal(wire.from_int64_matrix(wire.int64_matrix(a)), a)


def test_placement_balancedness_is_of_the_predicted_worker_load():
    load = np.array([[4.0, 2.0, 2.0], [0.0, 0.0, 0.0]])
    b = wire.balancedness_from_msg(wire.placement_balancedness(load, np.array([[0, 1, 2, 0], [0, 1, 2, 0]]), 2))
    np.testing.assert_allclose(b.per_layer, [1.0, 1.0])  # expert 0 split over both workers
    assert (b.mean, b.sum_ratio) == (1.0, 1.0)
    b = wire.balancedness_from_msg(wire.worker_balancedness_msg([[3, 1], [0, 0]]))
    np.testing.assert_allclose(b.per_layer, [2 / 3, 1.0])  # layer 1 has no tokens: 1.0
    assert b.mean == pytest.approx(2 / 3) and b.sum_ratio == pytest.approx(2 / 3)


@pytest.mark.parametrize(
    "cls,msg", [(RankInfo, admin_pb2.RankInfo), (ModelInfo, admin_pb2.ModelInfo), (EplbInfo, admin_pb2.EplbInfo)]
)
def test_the_status_parts_have_the_fields_of_their_messages(cls, msg):
    assert [f.name for f in dataclasses.fields(cls)] == [f.name for f in msg.DESCRIPTOR.fields]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_sdk_imports_no_server_code_and_no_torch():
    code = (
        "import sys\nimport moeserve.client\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith(("
        "'moeserve.services', 'moeserve.router', 'moeserve.cluster')))\nassert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stdout + out.stderr
