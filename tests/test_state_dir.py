"""State that survives restarts: ``--state-dir`` keeps the placement in force and the
balancer's settings (Pause included) and a restart with the same folder starts from them (the
workers load the saved placement's experts: the tokens are the single-process reference's);
``--init-expert-location`` starts from an SGLang expert-location file; a folder or file that
does not fit the cluster is refused at start, naming the file."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cluster_util import prompts_for, random_placement, reference_generate, reference_model, tiny_checkpoint
from control_util import Up

pytestmark = pytest.mark.slow  # every test here starts processes

WORKERS, REDUNDANT = 2, 2
QUIET = "1000000000"  # a step interval the balancer's loop never reaches


def _wait_for(what, cond, timeout_s: float = 40.0, every_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(every_s)


def _sglang_file(path: Path, phy2log: np.ndarray, moe_layer_ids, num_decoder_layers: int) -> Path:
    """An SGLang expert-location JSON: physical_to_logical_map per decoder layer (dense rows: p % E)."""
    e = int(phy2log.max()) + 1
    rows = [[p % e for p in range(phy2log.shape[1])] for _ in range(num_decoder_layers)]
    for m, layer in enumerate(moe_layer_ids):
        rows[layer] = phy2log[m].tolist()
    path.write_text(json.dumps({"physical_to_logical_map": rows}))
    return path


@pytest.mark.timeout(400)
def test_a_restart_restores_the_placement_and_the_paused_balancer(tmp_path):
    from moeserve.models import load_config

    path = str(tiny_checkpoint(tmp_path / "ckpt", "llama4"))
    mcfg = load_config(path)
    layers, experts = mcfg.num_moe_layers, mcfg.num_experts
    model = reference_model(path)
    prompt = prompts_for(model.config.vocab_size, lengths=(9,), seed=2)[0]
    want = reference_generate(model, prompt, 10)
    first = random_placement(layers, experts, experts + REDUNDANT, seed=4)
    init = _sglang_file(tmp_path / "expert-location.json", first, mcfg.moe_layer_ids, mcfg.num_layers)
    state_dir = tmp_path / "state"
    flags = (
        "--workers",
        str(WORKERS),
        "--enable-eplb",
        "--num-redundant-experts",
        str(REDUNDANT),
        "--eplb-step-interval",
        QUIET,
        "--state-dir",
        str(state_dir),
        "--init-expert-location",
        str(init),
    )

    up = Up(path, *flags)
    try:
        serving, admin, balancer = up.clients()
        p = admin.placement()
        np.testing.assert_array_equal(p.phy2log, first)  # --init-expert-location
        assert serving.generate(prompt_token_ids=prompt, max_tokens=10, ignore_eos=True).token_ids == want
        second = random_placement(layers, experts, experts + REDUNDANT, seed=9)
        res = admin.apply_placement(second, wait=True)
        assert res.migration.state == "done"
        assert balancer.pause().paused
        assert balancer.set_config(min_balancedness=0.25).min_balancedness == 0.25
        saved = admin.placement()
        np.testing.assert_array_equal(saved.phy2log, second)
        assert saved.version > p.version
    finally:
        assert up.stop() == 0, up.logs()
    assert sorted(f.name for f in state_dir.iterdir()) == ["balancer.json", "placement.json"]
    assert oct(state_dir.stat().st_mode & 0o777) == "0o700"

    up = Up(path, *flags)  # the same command line again
    try:
        serving, admin, balancer = up.clients()
        p = admin.placement()
        np.testing.assert_array_equal(p.phy2log, second)  # the state folder wins over the file
        assert p.version == saved.version and list(p.layer_versions) == list(saved.layer_versions)
        st = balancer.balancer_status()
        assert st.paused and st.min_balancedness == 0.25
        assert admin.balancer_settings().paused is True
        # The workers hold the restored experts: the tokens are the single-process reference's.
        assert serving.generate(prompt_token_ids=prompt, max_tokens=10, ignore_eos=True).token_ids == want
        third = random_placement(layers, experts, experts + REDUNDANT, seed=11)
        assert admin.apply_placement(third, wait=True).migration.state == "done"
        assert admin.placement().version > saved.version  # versions keep increasing
        _wait_for(
            "placement.json holds the new placement (written off the step driver)",  # replaced atomically:
            lambda: json.loads((state_dir / "placement.json").read_text())["phy2log"] == third.tolist(),
            timeout_s=10,
            every_s=0.02,
        )  # never torn
    finally:
        assert up.stop() == 0, up.logs()


@pytest.mark.timeout(240)
def test_a_state_dir_or_placement_file_that_does_not_fit_is_refused_naming_the_file(tmp_path):
    path = str(tiny_checkpoint(tmp_path / "ckpt", "llama4"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"physical_to_logical_map": [[0, 1, 2]]}))
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / "placement.json").write_text("{torn")
    settings_dir = tmp_path / "settings"
    settings_dir.mkdir()
    (settings_dir / "balancer.json").write_text(
        json.dumps({"format": "moeserve.balancer_settings/1", "step_interval": -1})
    )
    for flags, what in (
        (("--init-expert-location", str(bad)), f"--init-expert-location {bad}"),
        (("--state-dir", str(state_dir)), str(state_dir / "placement.json")),
        (("--state-dir", str(settings_dir)), f"{settings_dir / 'balancer.json'}: step_interval"),
    ):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "moeserve",
                "up",
                "--model",
                path,
                "--workers",
                "2",
                "--enable-eplb",
                "--num-redundant-experts",
                "2",
                *flags,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2 and what in out.stderr and "Traceback" not in out.stderr, out.stderr
