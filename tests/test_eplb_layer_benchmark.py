"""benchmarks/eplb_layer.py (docs/eplb.md, "The layer benchmark"): the sweep's plumbing on CPU
(gloo, 2 ranks, small shapes), the model fit on uniform rows, the replayed replica choice and the deadline guard."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "eplb_layer.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import eplb_layer as B  # noqa: E402


def run(*flags, timeout=300):
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--backend", "gloo", "--ranks", "2", "--smoke", *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("eplb") / "r.json"
    res = run("--json", str(out))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(out.read_text()), res.stdout


@pytest.mark.slow
def test_cpu_sweep_writes_every_policy_and_row(smoke):
    doc, stdout = smoke
    rows = {(r["model"], r["exchange"], r["tokens"], r["zipf"], r["policy"]): r for r in doc["rows"]}
    want = {
        (m, "collective", t, z, p)
        for m in ("scout", "ernie21b")
        for t in (8, 64)
        for z in (0.0, 1.2)
        for p in ("off", "token", "cost")
    }
    assert set(rows) == want and len(doc["rows"]) == len(want)
    for _key, r in rows.items():
        assert len(r["times_ms"]) == 2 and r["median_ms"] > 0 and r["spread"] >= 0  # 2 repeats (smoke)
        assert r["pred_table_ms"] > 0 and r["pred_fit_ms"] > 0 and r["x_ideal"] > 0
        assert len(r["phy2log"]) == 2  # 2 layers (smoke)
    for m in ("scout", "ernie21b"):
        e = B.D.SMALL[m]["experts"]
        assert rows[(m, "collective", 8, 0.0, "off")]["x_ideal"] == 1.0
        for t in (8, 64):
            for z in (0.0, 1.2):
                assert rows[(m, "collective", t, z, "off")]["slots"] == e
                assert rows[(m, "collective", t, z, "token")]["slots"] == e + B.D.SMALL[m]["redundant"]
                assert rows[(m, "collective", t, z, "off")]["breakeven"] == 0
                assert rows[(m, "collective", t, z, "token")]["breakeven"] == 0
                # the cost placement carries the model's b ...
                assert rows[(m, "collective", t, z, "cost")]["breakeven"] == doc["step_models"][m]["breakeven"] > 0
        # ... and at 8 tokens per rank the model says some expert's replicas do not pay (count <= b)
        assert rows[(m, "collective", 8, 1.2, "cost")]["experts_at_or_below_b"] > 0
    assert len(doc["checks"]) == 8 and all(c["ratio"] > 0 for c in doc["checks"])
    assert set(doc["model_error"]) == set(doc["fits"]) == {"scout/collective", "ernie21b/collective"}
    assert doc["skipped"] == [] and len(doc["cases"]) == 4
    assert "cost-aware <= 1.02 x min(off, token)" in stdout and "plumbing only" in stdout


@pytest.mark.slow
def test_deadline_skips_cases_and_still_writes(tmp_path):
    out = tmp_path / "r.json"
    res = run("--deadline-s", "0", "--models", "scout", "--json", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["rows"] == [] and len(doc["skipped"]) == 2


def test_fit_on_uniform_rows_recovers_a_known_model():
    rng = np.random.default_rng(0)
    truth = B.C.StepModel(
        "g",
        "s",
        512,
        1024,
        2,
        hbm_bytes_per_s=2e12,
        matmul_flops_per_s=3e14,
        slot_overhead_s=2e-6,
        layer_overhead_s=5e-5,
    )
    rows = []
    for pairs_per_worker in (16, 128, 1024, 8192, 32768):
        busy = rng.integers(6, 11, size=(4, 2, 2)).astype(float)
        pairs = rng.normal(pairs_per_worker, pairs_per_worker * 0.05, size=(4, 2, 2)).clip(1)
        rows.append(dict(busy=busy, pairs=pairs, median_ms=B.predict_ms(truth, busy, pairs)))
    start = dataclasses.replace(truth, hbm_bytes_per_s=5e11, matmul_flops_per_s=1e15, layer_overhead_s=0.0)
    fitted, err = B.fit_uniform(start, rows)
    assert err < 0.01
    for r in rows:
        assert abs(B.predict_ms(fitted, r["busy"], r["pairs"]) / r["median_ms"] - 1) < 0.02


def test_replay_reads_one_copy_below_breakeven():
    m = dict(B.D.SMALL["scout"])
    e, p = m["experts"], m["experts"] + m["redundant"]
    phy2log = np.concatenate([np.arange(e), np.arange(m["redundant"])])[None, :]  # experts 0..3 doubled
    steps = range(4)
    wide, _ = B.replay(m, phy2log, np.zeros((1, e), np.int64), 64, 0.0, 2, 2, steps)
    alone, pairs = B.replay(m, phy2log, np.full((1, e), 10**6, np.int64), 64, 0.0, 2, 2, steps)
    assert (wide.sum(2) == p).all()  # every copy read without b
    assert (alone.sum(2) == e).all()  # one copy per expert at or below b
    assert (pairs.sum(2) == 2 * 64).all()  # every pair of both routers placed


def test_predict_only_runs_without_ranks(capsys):
    res = B.main(["--predict-only", "--small", "--models", "scout", "--sizes", "8", "--step-model", str(B.CPU_TABLE)])
    assert {(r["policy"], r["zipf"]) for r in res} == {(p, z) for p in B.POLICIES for z in B.ZIPF}
    assert all(r["pred_ms"] > 0 for r in res)
    assert "plumbing only" in capsys.readouterr().out


def test_the_gpu_run_finds_the_h200_entries_of_both_shapes():
    for name, shape, b in (("scout", "llama4-scout", 248), ("ernie21b", "ernie45-21b", 152)):
        m = B.D.MODELS[name]
        model, note = B.pick_model(B.H200_TABLE, "NVIDIA H200", m["hidden"], m["inter"], 2)
        assert (model.gpu, model.shape, model.breakeven_count) == ("NVIDIA H200", shape, b)
        assert note == f"step_model_h200.json: NVIDIA H200 / {shape}"
