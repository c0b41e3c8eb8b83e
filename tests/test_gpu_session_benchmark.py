"""benchmarks/gpu_session.py: a GPU session's open targets in one call within a time budget.
The runs themselves are GPU benchmarks; here a fake runner and clock hold the order, the
budget (what does not fit is skipped and said, later targets still tried), each target's
environment, JSON path and timeout, the set-up first, and the refusals of bad arguments."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def gs():
    spec = importlib.util.spec_from_file_location("gpu_session_bench", BENCH / "gpu_session.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


class FakeGPU:
    """A runner that takes each command's expected time on a fake clock and records the call."""

    def __init__(self, gs, rcs=None, setup_s=20.0, setup_rc=0):
        self.gs, self.now, self.calls, self.rcs = gs, 0.0, [], dict(rcs or {})
        self.setup_s, self.setup_rc = setup_s, setup_rc

    def clock(self):
        return self.now

    def run(self, cmd, env, timeout, log):
        self.calls.append((cmd, env, timeout))
        if cmd[0].endswith("gpu-setup"):
            self.now += self.setup_s
            return self.setup_rc
        name = Path(cmd[cmd.index("--json") + 1]).stem
        self.now += self.gs.TARGETS[name].seconds
        return self.rcs.get(name, 0)


def test_targets_run_in_order_within_the_budget_and_what_does_not_fit_is_skipped(gs, tmp_path, monkeypatch):
    monkeypatch.setenv("MOESERVE_GIT_COMMIT", "abc1234")
    gpu = FakeGPU(gs, rcs={"grouped-routing": 3})
    names = ["rows-per-pass", "fp8-ernie28-bm32", "prefix", "grouped-routing"]  # ~70, 150, 200, 40 s
    report = gs.run_session(names, 300, str(tmp_path), runner=gpu.run, clock=gpu.clock, card="NVIDIA H100")
    assert [Path(c[0] if len(c) == 1 else c[1]).name for c, _, _ in gpu.calls] == [
        "gpu-setup",
        "expert_kernel.py",
        "serving.py",
        "norm_kernels.py",
    ]
    rows = {r["target"]: r for r in report["targets"]}
    assert rows["prefix"]["skipped"] == "needs ~200 s, 60 s left" and "rc" not in rows["prefix"]
    assert rows["rows-per-pass"]["rc"] == 0 and rows["grouped-routing"]["rc"] == 3 and report["failed"]
    # each target: its own JSON in the folder, its environment on top of the session's, a timeout of what is left
    cmd, env, timeout = gpu.calls[2]
    assert cmd[-2:] == ["--json", str(tmp_path / "fp8-ernie28-bm32.json")]
    assert env["MOESERVE_EXPERT_BLOCK_M"] == "32" and env["MOESERVE_GIT_COMMIT"] == "abc1234"
    assert "MOESERVE_EXPERT_BLOCK_M" not in gpu.calls[1][1]
    assert timeout == 300 - 20 - 70 - 5
    assert rows["fp8-ernie28-bm32"]["command"].startswith("MOESERVE_EXPERT_BLOCK_M=32 python3 benchmarks/serving.py")
    assert json.loads((tmp_path / "session.json").read_text()) == report
    assert "== rows-per-pass: " in (tmp_path / "session.log").read_text()


def test_h200_targets_run_first_on_an_h200_and_are_skipped_naming_any_other_card(gs, tmp_path, monkeypatch):
    monkeypatch.setenv("MOESERVE_GIT_COMMIT", "abc1234")
    for card, want in (
        ("NVIDIA H200", ["prefix", "grouped-routing", "rows-per-pass"]),
        ("NVIDIA H100 80GB HBM3", ["rows-per-pass"]),
    ):
        gpu = FakeGPU(gs)
        report = gs.run_session(
            ["rows-per-pass"], 600, str(tmp_path / card), runner=gpu.run, clock=gpu.clock,
            h200=["prefix", "grouped-routing"], card=card,
        )  # fmt: skip
        ran = [Path(c[c.index("--json") + 1]).stem for c, _, _ in gpu.calls if "--json" in c]
        assert ran == want and report["card"] == card and not report["failed"]
        skipped = [r for r in report["targets"] if "skipped" in r]
        if "H200" in card:
            assert skipped == []
        else:
            assert [r["skipped"] for r in skipped] == [f"needs an H200, this is {card}"] * 2


def test_a_failed_setup_runs_nothing(gs, tmp_path, monkeypatch):
    monkeypatch.setenv("MOESERVE_GIT_COMMIT", "abc1234")
    gpu = FakeGPU(gs, setup_rc=1)
    report = gs.run_session(["grouped-routing"], 300, str(tmp_path), runner=gpu.run, clock=gpu.clock, card="")
    assert report["failed"] and report["setup"]["rc"] == 1 and report["targets"] == [] and len(gpu.calls) == 1


def test_every_target_names_a_benchmark_of_this_folder_that_writes_json(gs):
    for name, tg in gs.TARGETS.items():
        script = BENCH / tg.argv[0]
        assert script.exists(), name
        text = script.read_text()  # --json of its own, of fp8_linears' graph arguments or of servinglib's
        assert '"--json"' in text or "add_graph_args" in text or "servinglib.args" in text, name
        assert all(k.startswith("MOESERVE_") for k in tg.env), name


def test_every_targets_switches_pass_their_own_checks(gs, monkeypatch):
    """A GPU minute is not spent on a value a worker or router would refuse at start: each
    target's MOESERVE_ settings go through the check of the code that reads them."""
    from moeserve import kernels
    from moeserve.expert_worker import store as store_mod
    from moeserve.router import graphs

    checks = {
        "MOESERVE_FP8_PREFILL_BLOCK_M": lambda: (
            store_mod.fp8_prefill_block_m.cache_clear(),
            store_mod.fp8_prefill_block_m(),
        ),
        "MOESERVE_EXPERT_BLOCK_M": lambda: (
            store_mod.expert_block_m_setting.cache_clear(),
            store_mod.expert_block_m_setting(),
        ),
        "MOESERVE_MIXED_TOKEN_BUCKETS": graphs.mixed_token_buckets,
        "MOESERVE_FP8_A8_TUNING": lambda: kernels.parse_tuning(os.environ["MOESERVE_FP8_A8_TUNING"], "x", fp8=True),
        "MOESERVE_EXPERT_KERNEL": store_mod.expert_kernel_mode,
    }
    checked = set()
    try:
        for name, tg in gs.TARGETS.items():
            for key, value in tg.env.items():
                if key in checks:
                    monkeypatch.setenv(key, value)
                    try:
                        checks[key]()
                    except ValueError as e:
                        pytest.fail(f"target {name}: {e}")
                    checked.add(key)
                    monkeypatch.delenv(key)
    finally:
        store_mod.fp8_prefill_block_m.cache_clear()
        store_mod.expert_block_m_setting.cache_clear()
    assert {"MOESERVE_FP8_PREFILL_BLOCK_M", "MOESERVE_MIXED_TOKEN_BUCKETS", "MOESERVE_FP8_A8_TUNING"} <= checked


@pytest.mark.parametrize(
    "args,message",
    [
        (["prefix", "nope"], "unknown targets ['nope']: allowed prefix, prefix-learn-lead, fp8-scout8"),
        ([], "name at least one target (--list)"),
        (["prefix", "--budget", "0"], "--budget must be 1 .. 3600 seconds, got 0"),
        (["--h200", "prefix,nope"], "unknown targets ['nope']"),
    ],
)
def test_bad_arguments_are_refused_by_name(gs, args, message, capsys):
    with pytest.raises(SystemExit) as e:
        gs.main(args)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_dry_run_says_what_would_be_skipped_and_runs_nothing(gs, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert gs.main(["--dry-run", "--budget", "250", "rows-per-pass", "fp8-ernie28", "grouped-routing"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("runs") and out[1].endswith("runs")  # 20 s of set-up, then 70 and 150
    assert out[2].endswith("would be skipped: needs ~40 s, 10 s left")
    assert not os.listdir(tmp_path)
    assert gs.main(["--list"]) == 0 and "rows-per-pass" in capsys.readouterr().out


def test_the_next_sessions_commands_in_the_readme_run_every_target_on_the_card_it_is_for(gs, capsys, monkeypatch):
    """benchmarks/README.md's plan for the next GPU session: each gpu_session command names known
    targets, and as written runs every --h200 target on an H200 and every other target on an
    H100 within its budget (the dry run's arithmetic, each card's list alone)."""
    import re
    import shlex

    text = (BENCH / "README.md").read_text()
    plan = text.split("The next session's calls", 1)[1].split("\n\n", 1)[0]
    commands = [
        shlex.split(c.replace("\n", " ")) for c in re.findall(r"`python3\s+benchmarks/gpu_session\.py\s+([^`]+)`", plan)
    ]
    assert len(commands) >= 2, plan
    for argv in commands:
        h200 = argv[argv.index("--h200") + 1].split(",") if "--h200" in argv else []
        rest = [a for i, a in enumerate(argv) if a != "--h200" and (i == 0 or argv[i - 1] != "--h200")]
        valued = ("--budget", "--out")
        positional = [a for i, a in enumerate(rest) if not a.startswith("--") and (i == 0 or rest[i - 1] not in valued)]
        for card, want in (("NVIDIA H200", h200), ("NVIDIA H100 80GB HBM3", positional)):
            monkeypatch.setattr(gs, "gpu_name", lambda card=card: card)
            assert gs.main(["--dry-run", *argv]) == 0
            lines = capsys.readouterr().out.splitlines()[1 if h200 else 0 :]
            runs = [line.split()[0] for line in lines if line.endswith(": runs")]
            assert runs[: len(want)] == want, (card, argv, lines)
