"""Break-even counts travel with the placement: ``Placement.breakeven`` [L, E], each
layer's commit, the admin API and the SDK, the state folder, the balancer with a step model
(``--eplb-step-model``), and its predicted step time in status and metrics."""

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from moeserve.balancer.policy.cost import StepModel
from moeserve.placement import Placement

TOKEN = "tok"
MODEL = StepModel(
    "test-gpu",
    "test",
    hidden_size=512,
    intermediate_size=1024,
    dtype_bytes=2,
    hbm_bytes_per_s=4e12,
    matmul_flops_per_s=7e14,
    slot_overhead_s=4e-6,
    layer_overhead_s=2e-5,
)
PHY2LOG = np.array([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 2, 3], [3, 2, 1, 0, 0, 0]])


def place(b=None, phy2log=PHY2LOG) -> Placement:
    return Placement(phy2log, 4, 2, version=3, breakeven=b)


# ---- the value type -------------------------------------------------------------------------------


def test_a_placement_carries_b_and_checks_its_shape_and_sign():
    p = place()
    assert p.breakeven.shape == (3, 4) and p.breakeven.dtype == np.int64 and not p.breakeven.any()
    b = np.arange(12).reshape(3, 4)
    q = place(b)
    np.testing.assert_array_equal(q.breakeven, b)
    assert not q.breakeven.flags.writeable and q != p and q == place(b.copy())
    assert Placement.from_json(q.to_json()) == q  # files keep it
    legacy = json.loads(p.to_json())
    del legacy["breakeven"]
    assert Placement.from_json(json.dumps(legacy)) == p  # an old file: zeros
    np.testing.assert_array_equal(q.evolve(version=9).breakeven, b)
    np.testing.assert_array_equal(q.replace(PHY2LOG).breakeven, b)
    np.testing.assert_array_equal(p.evolve(breakeven=b).breakeven, b)
    with pytest.raises(ValueError, match=r"breakeven must have shape \(L, E\) = \(3, 4\)"):
        place(np.zeros((3, 5)))
    with pytest.raises(ValueError, match=r"breakeven must have shape \(L, E\) = \(3, 4\)"):
        place(np.zeros(4))
    with pytest.raises(ValueError, match=">= 0.*layer 1 expert 2"):
        place(np.where(np.arange(12).reshape(3, 4) == 6, -1, 0))
    with pytest.raises(ValueError, match="integer"):
        place(np.full((3, 4), 1.5))


# ---- the engine's migrator ------------------------------------------------------------------------


def drive(m, steps=50):
    """Run the migrator's headers as the step driver would (workers' staging always works)."""
    from moeserve.router.engine.migration import Migrator  # noqa: F401

    headers = []
    for _ in range(steps):
        ops = m.header_ops()
        if ops is None and m.active is None:
            break
        if ops is not None:
            headers.append(ops)
            if ops.begin_staging_slots:
                m.on_staging(ops.migration_id, [])
    return headers


def test_a_change_of_b_alone_commits_those_layers_in_one_header_without_staging():
    from moeserve.router.engine.migration import Migrator

    m = Migrator(place(), expert_bytes=100, bytes_per_step=1000)
    b = np.zeros((3, 4), dtype=np.int64)
    b[0], b[2] = 7, [1, 2, 3, 4]
    mig = m.start(m.plan(place(b)))
    assert mig.total_moves == 0 and mig.progress().layers_total == 2
    headers = drive(m)
    assert len(headers) == 1 and headers[0].begin_staging_slots == 0 and headers[0].end
    assert [c.moe_layer for c in headers[0].commits] == [0, 2]
    assert [c.breakeven for c in headers[0].commits] == [(7,) * 4, (1, 2, 3, 4)]
    assert all(c.staged == () for c in headers[0].commits)
    assert mig.done.is_set() and mig.state == "done"
    np.testing.assert_array_equal(m.placement().breakeven, b)
    assert m.placement().version == mig.target_version > 3
    # the same again: nothing changes
    assert m.start(m.plan(place(b))).state == "done"


def test_commits_carry_b_with_the_moves_and_a_plain_phy2log_keeps_the_b_in_force():
    from moeserve.router.engine.migration import Migrator

    b = np.full((3, 4), 5)
    m = Migrator(place(b), expert_bytes=100, bytes_per_step=1000)
    target = PHY2LOG.copy()
    target[1, 4] = 0
    mig = m.start(m.plan(target))  # a phy2log: b stays 5
    commits = [c for h in drive(m) for c in h.commits]
    assert [(c.moe_layer, c.breakeven) for c in commits] == [(1, (5,) * 4)]
    assert mig.state == "done"
    new_b = np.full((3, 4), 9)
    new_b[1] = 4
    target2 = target.copy()
    target2[2, 5] = 1
    mig = m.start(m.plan(Placement(target2, 4, 2, breakeven=new_b)))
    commits = [c for h in drive(m) for c in h.commits]
    assert sorted((c.moe_layer, c.breakeven, len(c.staged)) for c in commits) == [
        (0, (9,) * 4, 0),
        (1, (4,) * 4, 0),
        (2, (9,) * 4, 1),
    ]
    np.testing.assert_array_equal(m.placement().breakeven, new_b)
    np.testing.assert_array_equal(m.placement().phy2log, target2)


def test_an_abort_keeps_the_b_of_uncommitted_layers():
    from moeserve.router.engine.migration import Migrator

    m = Migrator(place(), expert_bytes=100, bytes_per_step=100)
    target = PHY2LOG.copy()
    target[0, 4], target[2, 4] = 3, 1
    mig = m.start(m.plan(Placement(target, 4, 2, breakeven=np.full((3, 4), 2))))
    for _ in range(3):  # begin; layer 0 moves; commits 0 and 1 (b only), layer 2 moves
        ops = m.header_ops()
        if ops.begin_staging_slots:
            m.on_staging(ops.migration_id, [])
    assert m.abort()
    np.testing.assert_array_equal(m.placement().breakeven, [[2] * 4, [2] * 4, [0] * 4])
    assert mig.state == "aborted"


# ---- the step model flag --------------------------------------------------------------------------


def args_for(path, gpu=None, shape=None):
    return SimpleNamespace(eplb_step_model=str(path), eplb_step_model_gpu=gpu, eplb_step_model_shape=shape)


def test_the_step_model_flag_picks_the_entry_for_the_gpu_and_the_model_s_shape(tmp_path):
    from moeserve.cli import UsageError
    from moeserve.cli import flags as F
    from moeserve.models import init_model

    table = "benchmarks/results/step_model_h200.json"
    m = F.step_model(args_for(table, shape="ernie45-21b"))
    assert (m.gpu, m.shape) == ("NVIDIA H200", "ernie45-21b") and m.breakeven_count >= 1
    model_dir = init_model(tmp_path / "tiny", family="llama4", seed=1)
    with pytest.raises(UsageError, match="no entry for this model's shape .*hidden size"):
        F.step_model(args_for(table), str(model_dir), "float32")
    with pytest.raises(UsageError, match="3 entries that fit; pick one with --eplb-step-model-shape"):
        F.step_model(args_for(table))
    with pytest.raises(UsageError, match="no entry for gpu 'NVIDIA B200'"):
        F.step_model(args_for(table, gpu="NVIDIA B200"))
    with pytest.raises(UsageError, match="no entry for shape 'nope'"):
        F.step_model(args_for(table, shape="nope"))
    # the entry whose sizes are the model's
    from moeserve.models import load_config

    mcfg = load_config(model_dir)
    mine = tmp_path / "mine.json"
    mine.write_text(
        json.dumps(
            {
                "format": "moeserve-step-model/1",
                "entries": [
                    dict(
                        MODEL.to_entry(),
                        shape="tiny",
                        hidden_size=mcfg.hidden_size,
                        intermediate_size=mcfg.moe_intermediate_size,
                        dtype_bytes=4,
                    ),
                    dict(
                        MODEL.to_entry(),
                        shape="tiny-bf16",
                        hidden_size=mcfg.hidden_size,
                        intermediate_size=mcfg.moe_intermediate_size,
                        dtype_bytes=2,
                    ),
                ],
            }
        )
    )
    assert F.step_model(args_for(mine), str(model_dir), "float32").shape == "tiny"
    assert F.step_model(args_for(mine), str(model_dir), "bfloat16").shape == "tiny-bf16"
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "moeserve-step-model/1", "entries": [{"gpu": "x"}]}')
    with pytest.raises(UsageError, match="--eplb-step-model: .*entries\\[0\\] lacks"):
        F.step_model(args_for(bad))
    with pytest.raises(UsageError, match="cannot read"):
        F.step_model(args_for(tmp_path / "missing.json"))
    assert F.step_model(SimpleNamespace(eplb_step_model=None)) is None


def test_a_bad_step_model_file_is_exit_code_2_before_anything_starts(tmp_path, capsys):
    from moeserve.cli import main

    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    base = ["balancer", "--admin-address", "127.0.0.1:1", "--admin-token", "t"]
    assert main([*base, "--eplb-step-model", str(bad)]) == 2
    assert "--eplb-step-model" in capsys.readouterr().err
    assert (
        main(
            [
                *base,
                "--eplb-step-model",
                "benchmarks/results/step_model_h200.json",
                "--eplb-step-model-shape",
                "mixtral",
            ]
        )
        == 2
    )
    assert "no entry for shape 'mixtral'" in capsys.readouterr().err


# ---- metrics ---------------------------------------------------------------------------------------


def test_the_balancer_s_metrics_show_predicted_step_time_beside_balancedness():
    from prometheus_client import CollectorRegistry, generate_latest

    from moeserve.ops.metrics import BalancerMetrics

    reg = CollectorRegistry()
    BalancerMetrics(reg, balancedness=lambda: 0.75, predicted_step_s=lambda: 0.0123, step_efficiency=lambda: 0.5)
    text = generate_latest(reg).decode()
    assert "moeserve_balancer_balancedness 0.75" in text
    assert "moeserve_balancer_predicted_step_seconds 0.0123" in text
    assert "moeserve_balancer_step_efficiency 0.5" in text
    reg = CollectorRegistry()
    BalancerMetrics(reg, balancedness=lambda: 0.75)  # no step model: no step-time series
    assert "predicted_step_seconds" not in generate_latest(reg).decode()


# ---- a gloo cluster with the admin API ------------------------------------------------------------

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def admin_cluster(tmp_path_factory):
    from cluster_util import moe_info, prompts_for, reference_generate, reference_model, tiny_checkpoint

    from moeserve.client import Client
    from moeserve.cluster import LocalCluster

    path = tiny_checkpoint(tmp_path_factory.mktemp("llama4-b-admin"), "llama4", num_hidden_layers=4)
    info = moe_info(path)
    model = reference_model(path)
    prompts = prompts_for(model.config.vocab_size, lengths=(4, 7, 2, 11, 6, 3))
    tokens = [reference_generate(model, p, MAX_TOKENS) for p in prompts]
    state_dir = tmp_path_factory.mktemp("state")
    with LocalCluster(
        path,
        routers=2,
        workers=2,
        num_redundant_experts=4,
        migration_bytes_per_step=info.expert_bytes,
        admin_port=0,
        admin_token=TOKEN,
        state_dir=str(state_dir),
    ) as c:
        host, port = c.admin_address
        client = Client(f"{host}:{port}", TOKEN, timeout=60)
        yield dict(
            cluster=c,
            client=client,
            info=info,
            prompts=prompts,
            tokens=tokens,
            state_dir=state_dir,
            address=f"{host}:{port}",
        )
        client.close()


def assert_routers_have(c, phy2log, b):
    maps = c.router_maps()
    assert len(maps) == 2  # every router
    for p2l, got in maps:
        np.testing.assert_array_equal(p2l, phy2log)
        np.testing.assert_array_equal(got, b)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_b_applied_through_the_admin_api_reaches_every_router_and_changes_no_token(admin_cluster):
    from cluster_util import random_placement

    c, client, info = admin_cluster["cluster"], admin_cluster["client"], admin_cluster["info"]
    e, layers = info.num_logical_experts, info.num_moe_layers
    assert_routers_have(c, c.placement().phy2log, np.zeros((layers, e)))
    target = random_placement(layers, e, e + 4, seed=5)
    b = np.random.default_rng(1).integers(0, 6, (layers, e))
    result = {}
    t = threading.Thread(
        target=lambda: result.update(out=c.generate(admin_cluster["prompts"], max_tokens=MAX_TOKENS, ignore_eos=True))
    )
    t.start()
    time.sleep(0.2)
    res = client.apply_placement(target, breakeven=b, wait=True)
    t.join(120)
    assert res.migration.state == "done"
    np.testing.assert_array_equal(res.breakeven, b)
    assert result["out"] == admin_cluster["tokens"]  # fp32 tokens unchanged through it
    assert_routers_have(c, target, b)
    p = client.placement()
    np.testing.assert_array_equal(p.breakeven, b)
    np.testing.assert_array_equal(p.phy2log, target)
    assert c.generate(admin_cluster["prompts"], max_tokens=MAX_TOKENS, ignore_eos=True) == admin_cluster["tokens"]
    # b alone: no weight moves, committed on every router; a phy2log without b keeps it
    b2 = np.full((layers, e), 2)
    res = client.apply_placement(target, breakeven=b2, wait=True)
    assert res.moves == 0 and res.migration.state == "done" and res.migration.layers_total == layers
    assert_routers_have(c, target, b2)
    res = client.apply_placement(random_placement(layers, e, e + 4, seed=6), wait=True)
    np.testing.assert_array_equal(res.breakeven, b2)
    assert_routers_have(c, res.phy2log, b2)
    # the state folder keeps it
    saved = admin_cluster["state_dir"] / "placement.json"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        p = Placement.from_json(saved.read_text())
        if p.version == client.placement().version:
            break
        time.sleep(0.1)
    np.testing.assert_array_equal(p.breakeven, b2)
    assert c.generate(admin_cluster["prompts"], max_tokens=MAX_TOKENS, ignore_eos=True) == admin_cluster["tokens"]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda l, e: np.ones((l, e + 1)), r"breakeven must have shape \(L, E\) = \(2, 8\)"),
        (lambda l, e: np.ones((e, l)), r"breakeven must have shape \(L, E\) = \(2, 8\)"),
        (lambda l, e: -np.ones((l, e)), r">= 0"),
    ],
)
def test_bad_b_is_invalid_argument_and_leaves_the_placement_untouched(admin_cluster, bad, match):
    from moeserve.client import MoeserveError

    c, client, info = admin_cluster["cluster"], admin_cluster["client"], admin_cluster["info"]
    before = client.placement()
    assert (info.num_moe_layers, info.num_logical_experts) == (2, 8)
    b = bad(info.num_moe_layers, info.num_logical_experts)
    for kw in ({}, {"dry_run": True}):
        with pytest.raises(MoeserveError) as ex:
            client.apply_placement(before.phy2log, breakeven=b, **kw)
        assert ex.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert __import__("re").search(match, ex.value.message), ex.value.message
    with pytest.raises(MoeserveError) as ex:  # a file with b of its own
        client.apply_placement(file=_placement_file(admin_cluster, before, b))
    assert ex.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert client.placement() == before
    assert_routers_have(c, before.phy2log, before.breakeven)


def _placement_file(admin_cluster, p, b):
    path = admin_cluster["state_dir"].parent / "bad-b.json"
    d = json.loads(p.to_json())
    d["breakeven"] = np.asarray(b).tolist()
    path.write_text(json.dumps(d))
    return str(path)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_balancer_with_a_step_model_sends_its_break_even_counts(admin_cluster):
    from moeserve.balancer.controller import LoopConfig
    from moeserve.balancer.service import BalancerService
    from moeserve.client import AsyncClient

    c, info = admin_cluster["cluster"], admin_cluster["info"]
    c.generate(admin_cluster["prompts"], max_tokens=MAX_TOKENS, ignore_eos=True)  # a load window
    want = np.full((info.num_moe_layers, info.num_logical_experts), MODEL.breakeven_count)
    assert MODEL.breakeven_count > 2

    async def go():
        admin = AsyncClient(admin_cluster["address"], TOKEN, timeout=30)
        try:
            svc = BalancerService(admin, LoopConfig(step_model=MODEL, move_budget=0.1))
            dry = await svc.rebalance("request", dry_run=True, wait=False)
            resp = await svc.rebalance("request", dry_run=False, wait=True, timeout_s=60)
            await svc._iteration()
            return dry, resp, svc._status()
        finally:
            await admin.close()

    dry, resp, status = asyncio.run(go())
    for r in (dry, resp):
        assert r.HasField("breakeven") and r.predicted_step_s_before > 0 and r.predicted_step_s_after > 0
        np.testing.assert_array_equal(np.asarray(r.breakeven.values).reshape(want.shape), want)
    assert resp.applied, resp.note
    assert_routers_have(c, c.placement().phy2log, want)
    assert status.step_model == "test-gpu / test"
    assert status.predicted_step_s > 0 and 0 < status.step_efficiency <= 1 and status.balancedness > 0
    assert c.generate(admin_cluster["prompts"], max_tokens=MAX_TOKENS, ignore_eos=True) == admin_cluster["tokens"]
