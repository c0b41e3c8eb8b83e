"""On one cluster started by `moeserve up` (2 routers, 2 workers, a
skewed checkpoint): rebalances under 32 concurrent streams (through the SDK and by the
balancer's own loop) complete, raise balancedness, change no token and lose no request; the
balancer killed mid-run comes back and its loop resumes while serving goes on; hammering the
admin and balancer APIs during generation changes nothing; and every bad input answers the
right status with a message saying what was wrong, leaving the cluster serving."""

import threading
import time

import grpc
import numpy as np
import pytest
from cluster_util import moe_info, prompts_for, reference_generate, reference_model, tiny_checkpoint
from control_util import TOKEN, Up, alive, stream_all

from moeserve.client import Client, MoeserveError

pytestmark = pytest.mark.slow  # every test here starts processes

STREAMS = 32
MAX_TOKENS = 40
MAX_MODEL_LEN = 256
QUIET = "1000000"  # a step interval the loop never reaches


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tiny_checkpoint(tmp_path_factory.mktemp("hot"), "llama4", num_hidden_layers=6, hot_experts=2)
    info = moe_info(path)
    model = reference_model(path)
    prompts = prompts_for(model.config.vocab_size, lengths=[3 + i % 9 for i in range(STREAMS)], seed=7)
    want = [reference_generate(model, p, MAX_TOKENS) for p in prompts]
    up = Up(
        path,
        "--routers",
        "2",
        "--workers",
        "2",
        "--enable-eplb",
        "--num-redundant-experts",
        "2",
        "--migration-bytes-per-step",
        str(info.expert_bytes),
        "--eplb-step-interval",
        QUIET,
        "--balancer-poll-interval",
        "0.2",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-message-bytes",
        str(1 << 20),
    )
    serving, admin, balancer = up.clients()
    initial = admin.placement().phy2log
    yield dict(
        up=up,
        info=info,
        prompts=prompts,
        want=want,
        serving=serving,
        admin=admin,
        balancer=balancer,
        initial=initial,
        vocab=model.config.vocab_size,
    )
    up.stop()


def back_to_the_skewed_start(s) -> int:
    """Apply the initial placement (slot p holds expert p mod E) again; returns its version."""
    admin = s["admin"]
    if not np.array_equal(admin.placement().phy2log, s["initial"]):
        admin.apply_placement(s["initial"], wait=True)
    return admin.placement().version


def run_streams(s, during=None, prompts=None):
    """Stream every prompt concurrently; ``during()`` runs once tokens flow. Returns its result."""
    prompts = prompts or s["prompts"]
    results, errors = [None] * len(prompts), []
    threads = stream_all(s["serving"], prompts, MAX_TOKENS, results, errors, ignore_eos=True)
    out = None
    if during is not None:
        steps = s["admin"].status().forward_steps
        while s["admin"].status().forward_steps < steps + 3:
            time.sleep(0.02)
        out = during()
    for t in threads:
        t.join(240)
    assert not errors, errors
    assert all(r is not None for r in results), "a request was lost"
    assert [r[0] for r in results] == s["want"][: len(prompts)]  # no token changed
    assert all(r[1] == "length" for r in results)
    return out


@pytest.mark.timeout(400)
def test_an_sdk_rebalance_under_32_streams_completes_raises_balancedness_and_changes_no_token(setup):
    s = setup
    v0 = back_to_the_skewed_start(s)
    res = run_streams(s, during=lambda: s["balancer"].rebalance(wait=True))
    assert res.applied and res.migration.state == "done"
    assert res.balancedness_after.mean > res.balancedness_before.mean
    after = s["admin"].placement()
    assert after.version > v0
    np.testing.assert_array_equal(after.phy2log, res.phy2log)
    # The plan is judged on the window it was made on (above). On the leader's later window the
    # placement in force is not always the more balanced one: a plan made 3 steps into the streams
    # can be worse than the start on the window after them (seen in CI: 0.928 against 0.942),
    # which is the balancer's to fix, not this test's to hide; it reports, not asserts.
    from moeserve.placement import balancedness

    load = s["admin"].expert_load()
    assert load.histogram.shape[:2] == load.load.shape and load.histogram.sum() > 0  # through the SDK
    assert load.slot_busy_steps.shape == after.phy2log.shape
    now = balancedness(load.load, after.phy2log, after.num_workers).mean()
    before = balancedness(load.load, s["initial"], after.num_workers).mean()
    print(f"later window: placement in force {now:.4f}, replaced placement {before:.4f}")


@pytest.mark.timeout(400)
def test_the_balancers_own_loop_rebalances_skewed_traffic_under_32_streams(setup):
    s = setup
    v0 = back_to_the_skewed_start(s)
    before = s["admin"].expert_load().predicted.mean
    n0 = s["balancer"].balancer_status().rebalances
    try:
        run_streams(s, during=lambda: s["balancer"].set_config(step_interval=5))
        deadline = time.monotonic() + 60
        while s["balancer"].balancer_status().rebalances == n0 or s["balancer"].balancer_status().state != "idle":
            assert time.monotonic() < deadline, s["balancer"].balancer_status()
            time.sleep(0.1)
    finally:
        s["balancer"].set_config(step_interval=int(QUIET))
    st = s["balancer"].balancer_status()
    assert st.last_trigger in ("interval", "threshold")
    assert s["admin"].migration(st.last_migration_id).state == "done"
    assert s["admin"].placement().version > v0
    assert s["admin"].expert_load().predicted.mean > before


@pytest.mark.timeout(400)
def test_the_balancer_killed_mid_run_comes_back_serving_never_stops_and_its_loop_resumes(setup):
    s, up = setup, setup["up"]
    v0 = back_to_the_skewed_start(s)
    old = up.child("balancer")
    s["balancer"].pause()  # settings live on the leader: they survive

    def kill_and_wait():
        import os
        import signal

        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 90
        while True:  # `up` starts a new balancer; it finds the settings
            new = up.child("balancer")
            if new not in (None, old):
                try:
                    st = Client(up.balancer, TOKEN, timeout=2).balancer_status()
                    if st.loop_iterations > 2:
                        return new, st
                except MoeserveError:
                    pass
            assert time.monotonic() < deadline, up.logs()
            time.sleep(0.1)

    new, st = run_streams(s, during=kill_and_wait)  # serving went on through the restart
    assert not alive(old)
    assert st.paused and st.rebalances == 0
    b = Client(up.balancer, TOKEN)
    b.set_config(step_interval=5)
    b.resume()
    try:
        run_streams(s, prompts=s["prompts"][:8])
        deadline = time.monotonic() + 60
        while b.balancer_status().rebalances == 0 or b.balancer_status().state != "idle":
            assert time.monotonic() < deadline, b.balancer_status()
            time.sleep(0.1)
    finally:
        b.set_config(step_interval=int(QUIET))
    assert s["admin"].placement().version > v0


@pytest.mark.timeout(400)
def test_hammering_admin_and_balancer_during_generation_changes_nothing(setup):
    s, up = setup, setup["up"]
    back_to_the_skewed_start(s)
    version = s["admin"].placement().version
    calls = [
        lambda a, b: a.placement(),
        lambda a, b: a.expert_load(),
        lambda a, b: a.status(),
        lambda a, b: a.dump_load(),
        lambda a, b: b.balancer_status(),
        lambda a, b: b.rebalance(dry_run=True),
    ]
    done, failures = [], []

    def hammer(k):
        a, b = Client(up.admin, TOKEN, timeout=30), Client(up.balancer, TOKEN, timeout=30)
        for i in range(k, 100, 8):  # 100 calls over 8 threads
            try:
                calls[i % len(calls)](a, b)
                done.append(i)
            except MoeserveError as e:
                failures.append((i, e))

    def during():
        threads = [threading.Thread(target=hammer, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        return not any(t.is_alive() for t in threads)

    assert run_streams(s, during=during), "a hammering thread hung"
    assert not failures, failures
    assert len(done) == 100
    assert s["admin"].placement().version == version


@pytest.mark.timeout(120)
def test_a_stream_whose_client_goes_away_is_cancelled(setup):
    s = setup
    gen = s["serving"].generate_stream(prompt_token_ids=[5, 6, 7], max_tokens=200, ignore_eos=True)
    next(gen), next(gen)
    assert s["admin"].status().running >= 1
    gen.close()  # the client leaves
    deadline = time.monotonic() + 10
    while s["admin"].status().running:
        assert time.monotonic() < deadline
        time.sleep(0.05)


# -- The bad-input table ------------------------------------------------------------------------


def _wrong_shape(s, p):
    s["admin"].apply_placement(p.phy2log[:, :-1], expected_version=p.version)


def _missing(s, p):
    s["admin"].apply_placement(np.where(p.phy2log == 0, 1, p.phy2log), expected_version=p.version)


def _out_of_range(s, p):
    s["admin"].apply_placement(np.where(p.phy2log == 0, 99, p.phy2log), expected_version=p.version)


def _stale(s, p):
    s["admin"].apply_placement(p.phy2log[:, ::-1], expected_version=p.version - 1)


def _oversized(s, p):
    s["serving"].generate(prompt_token_ids=[100_000] * 400_000, max_tokens=1)


def _no_token(s, p):
    Client(s["up"].admin, token=None).placement()


def _wrong_token(s, p):
    Client(s["up"].admin, token="not-the-token").status()


def _balancer_no_token(s, p):
    Client(s["up"].balancer, token=None).rebalance(dry_run=True)


BAD = {  # name: (call, status, what the message says)
    "empty prompt": (
        lambda s, p: s["serving"].generate(prompt_token_ids=[], max_tokens=4),
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompt is empty",
    ),
    "token id outside the vocabulary": (
        lambda s, p: s["serving"].generate(prompt_token_ids=[5, s["vocab"] + 3]),
        grpc.StatusCode.INVALID_ARGUMENT,
        r"outside the vocabulary \[0, 512\)",
    ),
    "max_tokens 0": (
        lambda s, p: s["serving"].generate(prompt_token_ids=[5], max_tokens=0),
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_tokens must be in 1..256, got 0",
    ),
    "max_tokens negative": (
        lambda s, p: s["serving"].generate(prompt_token_ids=[5], max_tokens=-3),
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_tokens must be in 1..256, got -3",
    ),
    "max_tokens above the limit": (
        lambda s, p: s["serving"].generate(prompt_token_ids=[5, 6], max_tokens=MAX_MODEL_LEN),
        grpc.StatusCode.INVALID_ARGUMENT,
        f"exceeds max_model_len {MAX_MODEL_LEN}",
    ),
    "temperature below 0": (
        lambda s, p: s["serving"].generate(prompt_token_ids=[5], temperature=-0.5),
        grpc.StatusCode.INVALID_ARGUMENT,
        "temperature must be a finite number >= 0",
    ),
    "placement of the wrong shape": (_wrong_shape, grpc.StatusCode.INVALID_ARGUMENT, r"shape \(3, 9\), expected"),
    "placement with an expert missing": (_missing, grpc.StatusCode.INVALID_ARGUMENT, "logical expert 0 has no replica"),
    "placement with ids out of range": (_out_of_range, grpc.StatusCode.INVALID_ARGUMENT, "99 is out of range 0..7"),
    "stale version": (_stale, grpc.StatusCode.FAILED_PRECONDITION, "expected placement version"),
    # the serving port receives nothing larger than the largest valid request (here under --max-message-bytes)
    "oversized message": (_oversized, grpc.StatusCode.RESOURCE_EXHAUSTED, r"larger than max \(\d+ vs. \d+\)"),
    "admin call without a token": (_no_token, grpc.StatusCode.UNAUTHENTICATED, "needs a bearer token"),
    "admin call with a wrong token": (_wrong_token, grpc.StatusCode.UNAUTHENTICATED, "wrong bearer token"),
    "balancer call without a token": (_balancer_no_token, grpc.StatusCode.UNAUTHENTICATED, "needs a bearer token"),
}


def still_serving(s, before):
    after = s["admin"].placement()
    assert after.version == before.version
    np.testing.assert_array_equal(after.phy2log, before.phy2log)
    out = s["serving"].generate(prompt_token_ids=s["prompts"][0], max_tokens=8, ignore_eos=True)
    assert out.token_ids == s["want"][0][:8]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_answers_the_right_status_and_changes_nothing(setup, name, monkeypatch):
    monkeypatch.delenv("MOESERVE_ADMIN_TOKEN", raising=False)
    call, code, message = BAD[name]
    before = setup["admin"].placement()
    with pytest.raises(MoeserveError) as e:
        call(setup, before)
    assert e.value.code == code, e.value
    assert e.value.message and __import__("re").search(message, e.value.message), e.value.message
    still_serving(setup, before)


@pytest.mark.timeout(300)
def test_a_rebalance_while_one_runs_is_aborted(setup):
    s = setup
    for _attempt in range(3):  # needs the two to overlap: retry if the first was quick
        back_to_the_skewed_start(s)
        first = {}
        t = threading.Thread(target=lambda: first.update(res=s["balancer"].rebalance(wait=True)))
        results, errors = [None] * 8, []
        streams = stream_all(s["serving"], s["prompts"][:8], MAX_TOKENS, results, errors, ignore_eos=True)
        t.start()
        while s["balancer"].balancer_status().state == "idle" and t.is_alive():
            time.sleep(0.005)
        try:
            s["balancer"].rebalance(wait=True)
            second = None
        except MoeserveError as e:
            second = e
        t.join(120)
        for th in streams:
            th.join(240)
        assert not errors and [r[0] for r in results] == s["want"][:8]
        if second is not None:
            break
    assert second is not None, "the two rebalances never overlapped"
    assert second.code == grpc.StatusCode.ABORTED
    assert "already running" in second.message
    assert first["res"].applied and first["res"].migration.state == "done"
    np.testing.assert_array_equal(s["admin"].placement().phy2log, first["res"].phy2log)  # the first one's plan only


# -- the operator's command line against the same cluster ---------------------------------------


def cli(*args, ok=True):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "moeserve", *args], capture_output=True, text=True, timeout=120)
    if ok:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


@pytest.mark.timeout(300)
def test_the_cli_shows_dumps_and_applies_placements_and_reads_load_and_status(setup, tmp_path):
    import json

    from cluster_util import random_placement

    s, up = setup, setup["up"]
    back_to_the_skewed_start(s)
    auth = ("--admin-token", TOKEN)
    assert "rank 3: worker" in cli("status", "--address", up.admin, *auth).stdout
    shown = json.loads(cli("placement", "show", "--address", up.admin, *auth, "--json").stdout)
    np.testing.assert_array_equal(shown["phy2log"], s["admin"].placement().phy2log)
    cli("placement", "dump", str(tmp_path / "p.json"), "--address", up.admin, *auth)
    dry = cli("placement", "apply", str(tmp_path / "p.json"), "--dry-run", "--address", up.admin, *auth).stdout
    assert "dry run: 0 slot moves" in dry
    # An SGLang expert-location file: indexed by decoder layer (MoE layers 1, 3, 5 of 6).
    info = s["info"]
    target = random_placement(info.num_moe_layers, info.num_logical_experts, info.num_logical_experts + 2, seed=4)
    table = np.tile(np.arange(10) % 8, (6, 1))
    table[list(info.moe_layer_ids)] = target
    (tmp_path / "sglang.json").write_text(json.dumps({"physical_to_logical_map": table.tolist()}))
    out = cli("placement", "apply", str(tmp_path / "sglang.json"), "--address", up.admin, *auth).stdout
    assert "done" in out
    np.testing.assert_array_equal(s["admin"].placement().phy2log, target)
    load = cli("load", "--address", up.admin, *auth, "--dump", str(tmp_path / "load.json")).stdout
    assert "balancedness predicted" in load
    assert np.asarray(json.loads((tmp_path / "load.json").read_text())["total_load"]).shape == (3, 8)
    plan = cli("rebalance", "--dry-run", "--address", up.balancer, *auth).stdout
    assert "not applied: dry run" in plan
    bad = cli("status", "--address", up.admin, "--admin-token", "nope", ok=False)
    assert bad.returncode == 1 and "UNAUTHENTICATED" in bad.stderr


@pytest.mark.timeout(120)
def test_a_generation_past_its_deadline_is_cancelled_on_the_leader(setup):
    s = setup
    with pytest.raises(MoeserveError) as e:
        s["serving"].generate(prompt_token_ids=[5, 6, 7], max_tokens=200, ignore_eos=True, timeout=0.5)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 10
    while s["admin"].status().running:
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.timeout(200)
def test_the_front_end_killed_comes_back_and_clients_that_retry_are_served(setup):
    import os
    import signal

    s, up = setup, setup["up"]
    old = up.child("frontend")
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 90
    served = None
    while served is None:  # a client that retries, as a user would
        assert time.monotonic() < deadline, up.logs()
        try:
            served = Client(up.serving, timeout=10).generate(
                prompt_token_ids=s["prompts"][0], max_tokens=MAX_TOKENS, ignore_eos=True
            )
        except MoeserveError as e:
            assert e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), e
            time.sleep(0.2)
    assert served.token_ids == s["want"][0]
    assert up.child("frontend") not in (None, old) and not alive(old)
