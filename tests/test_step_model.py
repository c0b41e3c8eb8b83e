"""The step-time model (balancer/policy/cost.py): monotone, its table's format and errors, and the
calibration command's plumbing (CPU, --smoke)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moeserve.balancer.policy import make_policy, place
from moeserve.balancer.policy.cost import (
    FORMAT,
    StepModel,
    StepModelError,
    expected_busy,
    layer_times,
    load_table,
    parse_table,
    worker_times,
)
from moeserve.balancer.policy.rule import plan_breakeven, rule_times

ROOT = Path(__file__).resolve().parent.parent
MODEL = StepModel("H200", "scout", 5120, 8192, 2, 4.0e12, 6.0e14, 5e-6, 2e-5)


def entry(**kw):
    e = dict(
        gpu="NVIDIA H200",
        shape="llama4-scout",
        hidden_size=5120,
        intermediate_size=8192,
        dtype_bytes=2,
        hbm_bytes_per_s=4.0e12,
        matmul_flops_per_s=6.0e14,
        slot_overhead_s=5e-6,
        layer_overhead_s=2e-5,
    )
    e.update(kw)
    return e


def test_more_busy_slots_or_more_pairs_never_predict_less_time():
    busy = np.arange(0, 33)[:, None]
    pairs = np.geomspace(1, 1e5, 60)[None, :]
    t = MODEL.time(busy, pairs)
    assert (np.diff(t, axis=0) >= 0).all() and (np.diff(t, axis=1) >= 0).all()
    # memory-bound at a few pairs, compute-bound at many
    assert MODEL.time(8, 8) == pytest.approx(2e-5 + 8 * 5e-6 + 8 * MODEL.expert_bytes / 4.0e12)
    assert MODEL.time(1, 1e5) == pytest.approx(2e-5 + 5e-6 + 1e5 * MODEL.flops_per_pair / 6.0e14)


def test_more_tokens_on_a_placement_never_predict_less_time():
    rng = np.random.default_rng(0)
    load = rng.integers(0, 400, (6, 16)).astype(float)
    plan = place(load, 32, 8)
    base = layer_times(MODEL, load, plan, 8, steps=4)
    more = load.copy()
    more[:, rng.integers(0, 16)] += 500
    assert (layer_times(MODEL, more, plan, 8, steps=4) >= base - 1e-15).all()
    assert (worker_times(MODEL, load * 3, plan, 8, steps=4) >= worker_times(MODEL, load, plan, 8, steps=4)).all()


def test_busy_probability_is_poisson_from_the_window_mean_and_a_histogram_agrees_at_the_extremes():
    phy2log = np.array([[0, 1, 0, 2]])  # expert 0 on two slots
    load = np.array([[8.0, 1.0, 0.0]])
    p = expected_busy(load, phy2log, steps=4)
    assert p[0].tolist() == pytest.approx([1 - np.exp(-1.0), 1 - np.exp(-0.25), 1 - np.exp(-1.0), 0.0])
    hist = np.zeros((1, 3, 6))
    hist[0, 0, 5] = 4  # expert 0: 16..31 tokens every step
    hist[0, 1, 0] = 4  # expert 1: never
    hist[0, 2, 1] = 4  # expert 2: exactly one token each step
    h = expected_busy(None, phy2log, histogram=hist)
    assert h[0, 1] == 0.0 and h[0, 3] == 1.0 and h[0, 0] == pytest.approx(1.0, abs=1e-4)


def test_the_table_loads_and_finds_its_entries(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": FORMAT, "measured_on": "x", "entries": [entry(), entry(shape="ernie")]}))
    table = load_table(path)
    assert table.get("NVIDIA H200", "llama4-scout").expert_bytes == 3 * 5120 * 8192 * 2
    with pytest.raises(KeyError, match="the table has: .*'llama4-scout'.*'ernie'"):
        table.get("NVIDIA H200", "deepseek")


@pytest.mark.parametrize(
    "doc, message",
    [
        ([], "is a JSON object"),
        ({"format": "v0", "entries": [entry()]}, f"format must be '{FORMAT}'"),
        ({"format": FORMAT, "entries": []}, "entries must be a non-empty list"),
        ({"format": FORMAT, "entries": [entry()], "colour": 1}, r"unknown keys \['colour'\]; allowed"),
        ({"format": FORMAT, "entries": [7]}, r"entries\[0\] must be an object"),
        (
            {"format": FORMAT, "entries": [{k: v for k, v in entry().items() if k != "hbm_bytes_per_s"}]},
            r"entries\[0\] lacks \['hbm_bytes_per_s'\]",
        ),
        ({"format": FORMAT, "entries": [entry(hbm_bytes_per_s=0)]}, r"hbm_bytes_per_s must be > 0"),
        ({"format": FORMAT, "entries": [entry(slot_overhead_s=-1e-6)]}, r"slot_overhead_s must be >= 0"),
        ({"format": FORMAT, "entries": [entry(matmul_flops_per_s="fast")]}, "must be a finite number"),
        ({"format": FORMAT, "entries": [entry(hidden_size=0)]}, "hidden_size must be a positive integer"),
        ({"format": FORMAT, "entries": [entry(dtype_bytes=2.0)]}, "dtype_bytes must be a positive integer"),
        ({"format": FORMAT, "entries": [entry(gpu="")]}, "gpu must be a non-empty string"),
        ({"format": FORMAT, "entries": [entry(speed=1)]}, r"unknown keys \['speed'\]"),
        ({"format": FORMAT, "entries": [entry(), entry()]}, "a second entry for gpu"),
    ],
)
def test_a_bad_table_says_what_is_wrong_and_what_is_allowed(doc, message):
    with pytest.raises(StepModelError, match=message):
        parse_table(doc)


def test_a_file_that_is_not_json_or_missing_is_named(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(StepModelError, match="bad.json is not JSON"):
        load_table(bad)
    with pytest.raises(StepModelError, match="cannot read"):
        load_table(tmp_path / "missing.json")


def test_layer_overhead_is_optional():
    e = entry()
    del e["layer_overhead_s"]
    assert parse_table({"format": FORMAT, "entries": [e]}).entries[0].layer_overhead_s == 0.0


def test_the_committed_example_table_loads_and_says_it_is_not_a_gpu():
    table = load_table(ROOT / "benchmarks" / "results" / "step_model_cpu_example.json")
    assert "cpu" in table.measured_on.lower() and "not" in table.note.lower()


@pytest.mark.slow
def test_calibrate_smoke_runs_on_cpu_and_writes_a_table_that_loads(tmp_path):
    out = tmp_path / "sm.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "calibrate.py"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    assert "measured us" in run.stdout and "model us" in run.stdout
    table = load_table(out)
    assert table.entries[0].shape == "smoke-tiny" and "SMOKE" in table.note


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("steps", [1, 16, 256])
def test_the_cost_aware_policy_never_predicts_a_slower_slowest_worker_than_doing_nothing(seed, steps):
    rng = np.random.default_rng(seed)
    policy = make_policy(step_model=MODEL)
    load = np.stack([rng.permutation(4096 * steps / np.arange(1, 17) ** 1.2) for _ in range(8)]).round()
    current = place(rng.permutation(load, axis=1), 32, 8)
    plan = policy(load, 32, 8, 1, 1, current, steps=steps)
    # under the data plane's replica rule, each placement with the break-even counts planned for it
    before = rule_times(MODEL, load, current, 8, plan_breakeven(MODEL, load, current, 8, steps), steps)
    after = rule_times(MODEL, load, plan, 8, plan_breakeven(MODEL, load, plan, 8, steps), steps)
    moved = (plan != current).any(1)
    assert (after[moved] < before[moved]).all()
    assert (after <= before + 1e-15).all()
    assert (plan != current).sum() <= int(0.1 * plan.size)


def test_the_cost_aware_policy_without_steps_plans_for_token_balance_as_before():
    rng = np.random.default_rng(3)
    load = np.stack([rng.permutation(4096 / np.arange(1, 17)) for _ in range(8)]).round()
    current = place(rng.permutation(load, axis=1), 32, 8)
    assert (make_policy(step_model=MODEL)(load, 32, 8, 1, 1, current) == place(load, 32, 8, 1, 1, current)).all()


def test_the_cost_aware_policy_rejects_bad_steps_and_histograms():
    load = np.ones((2, 4))
    pol = make_policy(step_model=MODEL)
    cur = place(load, 8, 2)
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        pol(load, 8, 2, 1, 1, cur, steps=0)
    with pytest.raises(ValueError, match=r"histogram must be \[layers, experts, bins\]"):
        pol(load, 8, 2, 1, 1, cur, steps=4, histogram=np.ones((2, 3, 4)))
