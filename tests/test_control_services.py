"""The one-service-per-process subcommands (what compose and Kubernetes run): `moeserve router`
and `worker` ranks, `frontend` and `balancer`, wired by flags alone, serve like `moeserve up`."""

import os
import secrets
import signal
import subprocess
import sys
import time

import pytest
from cluster_util import prompts_for, reference_generate, reference_model, tiny_checkpoint
from control_util import TOKEN, free_ports

from moeserve.cli.up import wait_serving
from moeserve.client import Client

pytestmark = pytest.mark.slow  # every test here starts processes


@pytest.mark.timeout(300)
def test_ranks_front_end_and_balancer_started_separately_serve_together(tmp_path):
    path = str(tiny_checkpoint(tmp_path / "llama4", "llama4"))
    model = reference_model(path)
    prompt = prompts_for(model.config.vocab_size, lengths=(6,))[0]
    want = reference_generate(model, prompt, 12)
    master, control, port, admin, balancer = free_ports(5)
    env = dict(os.environ, MOESERVE_CONTROL_KEY=secrets.token_hex(16), MOESERVE_ADMIN_TOKEN=TOKEN, OMP_NUM_THREADS="1")
    cluster = ["--model", path, "--routers", "1", "--workers", "2", "--enable-eplb", "--num-redundant-experts", "2"]
    world = ["--world-size", "3", "--master-port", str(master)]
    cmds = [
        ["router", "--rank", "0", *world, *cluster, "--control-port", str(control), "--admin-port", str(admin)],
        ["worker", "--rank", "1", *world, *cluster],
        ["worker", "--rank", "2", *world, *cluster],
        ["frontend", "--port", str(port), "--control-address", f"127.0.0.1:{control}", "--model", path],
        ["balancer", "--balancer-port", str(balancer), "--admin-address", f"127.0.0.1:{admin}"],
    ]
    logs = [open(tmp_path / f"{c[0]}{i}.log", "wb") for i, c in enumerate(cmds)]
    procs = [
        subprocess.Popen([sys.executable, "-m", "moeserve", *c], env=env, stdout=f, stderr=subprocess.STDOUT)
        for c, f in zip(cmds, logs)
    ]
    try:
        for p in (admin, port, balancer):
            wait_serving(f"127.0.0.1:{p}", 180, alive=lambda: all(x.poll() is None for x in procs))
        out = Client(f"127.0.0.1:{port}").generate(prompt_token_ids=prompt, max_tokens=12, ignore_eos=True)
        assert out.token_ids == want
        assert [r.role for r in Client(f"127.0.0.1:{admin}", TOKEN).status().ranks] == ["router", "worker", "worker"]
        assert Client(f"127.0.0.1:{balancer}", TOKEN).rebalance(dry_run=True).base_version == 1
    finally:
        for p in procs[3:] + procs[:1]:  # front end and balancer, then the leader stops all ranks
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        for p in procs:
            try:
                p.wait(max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
        for f in logs:
            f.close()
    assert [p.returncode for p in procs] == [0] * 5, [
        (tmp_path / f"{c[0]}{i}.log").read_text()[-2000:] for i, c in enumerate(cmds)
    ]
