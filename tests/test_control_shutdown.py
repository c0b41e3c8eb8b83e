"""SIGTERM on `moeserve up` lets in-flight requests finish, refuses new ones, and
then every process of the cluster exits (no orphans)."""

import signal
import time

import grpc
import pytest
from cluster_util import prompts_for, reference_generate, reference_model, tiny_checkpoint
from control_util import Up, alive, children_of, stream_all

from moeserve.client import Client, MoeserveError

pytestmark = pytest.mark.slow  # every test here starts processes

MAX_TOKENS = 48


@pytest.mark.timeout(300)
def test_sigterm_lets_in_flight_requests_finish_then_every_process_exits(tmp_path):
    path = tiny_checkpoint(tmp_path / "llama4", "llama4")
    model = reference_model(path)
    prompts = prompts_for(model.config.vocab_size, lengths=(4, 7, 3, 9, 5, 6, 2, 8), seed=11)
    want = [reference_generate(model, p, MAX_TOKENS) for p in prompts]
    up = Up(path, "--routers", "1", "--workers", "2", "--grace-period", "60")
    try:
        serving, admin, _ = up.clients()
        pids = [up.proc.pid] + children_of(up.proc.pid)
        assert len(pids) == 1 + 3 + 2  # up, 3 ranks, front end, balancer
        results, errors = [None] * len(prompts), []
        threads = stream_all(serving, prompts, MAX_TOKENS, results, errors, ignore_eos=True)
        while admin.status().running < len(prompts):  # every request is in flight
            time.sleep(0.02)
        up.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(MoeserveError) as e:  # the front end takes nothing new
            Client(up.serving, timeout=5).generate(prompt_token_ids=[5, 6], max_tokens=2)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert [r[0] for r in results] == want  # in-flight requests finished, whole
        assert all(r[1] == "length" for r in results)
        assert up.proc.wait(90) == 0
        deadline = time.monotonic() + 30
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if alive(p)], "orphans left behind"
        # and each process closed what it had open: no task left pending when its loop ended
        assert "Task was destroyed but it is pending" not in up.tail(lines=10**6, limit=10**8)
    finally:
        up.stop()
