"""``moeserve up --api-server-count N``: N serving front-end processes on one serving port and
one HTTP port (SO_REUSEPORT), each with its own metrics port; connections spread over them, the
tokens are the same whichever serves, and a lost one is started again while the others serve."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import pytest
from control_util import Up, alive, cmdline
from ops_util import samples, scrape

from moeserve.client import Client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from moeserve.models import init_model

    return str(init_model(tmp_path_factory.mktemp("m"), "llama4", seed=1))


def _served(port: int) -> float:
    """Requests a front end finished, from its own metrics."""
    return sum(samples(scrape(port), "moeserve_requests_total").values())


def _http_completion(base: str) -> list[int]:
    body = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "return_token_ids": True})
    req = urllib.request.Request(
        f"{base}/completions", body.encode(), {"content-type": "application/json"}, method="POST"
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]


def test_two_front_ends_share_the_ports_serve_the_same_tokens_and_one_lost_is_restarted(model, tmp_path):
    up = Up(
        model,
        "--api-server-count",
        "2",
        "--http-port",
        "0",
        "--metrics-port",
        "0",
        "--served-model-name",
        "m",
        "--max-model-len",
        "128",
    )
    try:
        _, admin, _ = up.clients()
        ports = admin.status().metrics_ports
        assert {"frontend", "frontend1"} <= set(ports)
        fronts = up.children_named("frontend")
        assert len(fronts) == 2 and all("--reuse-port" in cmdline(p) for p in fronts)
        assert "front end 1" in up.output()  # the metrics list names each

        # every connection is new: the kernel spreads them over both processes
        want = None
        for _ in range(24):
            with Client(up.serving, timeout=60) as c:
                out = c.generate(prompt_token_ids=PROMPT, max_tokens=6, temperature=0.0)
            want = want or out.token_ids
            assert out.token_ids == want
        base = f"http://{up.address('http').split('//', 1)[1].split('/', 1)[0]}/v1"
        for _ in range(6):
            assert _http_completion(base) == want
        served = {name: _served(ports[name]) for name in ("frontend", "frontend1")}
        assert sum(served.values()) == 30 and min(served.values()) > 0, served

        # one front end killed: up starts it again; the other serves meanwhile
        victim = next(p for p in fronts if f"--metrics-port {ports['frontend1']}" in cmdline(p))
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            now = up.children_named("frontend")
            if len(now) == 2 and victim not in now and not alive(victim):
                break
            with Client(up.serving, timeout=60) as c:  # served by whichever still listens
                assert c.generate(prompt_token_ids=PROMPT, max_tokens=6, temperature=0.0).token_ids == want
            time.sleep(0.2)
        else:
            raise AssertionError(f"the lost front end was not started again:\n{up.logs()}")
        assert "the front end 1 exited" in up.output()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the new one listens on the shared ports again
            try:
                scrape(ports["frontend1"])
                break
            except OSError:
                time.sleep(0.2)
        for _ in range(8):
            with Client(up.serving, timeout=60) as c:
                assert c.generate(prompt_token_ids=PROMPT, max_tokens=6, temperature=0.0).token_ids == want
    finally:
        assert up.stop() == 0
    assert not any(alive(p) for p in fronts)


def test_a_front_end_count_outside_its_range_is_refused(model, capsys):
    from moeserve.cli import main

    assert main(["up", "--model", model, "--api-server-count", "0"]) == 2
    assert "--api-server-count must be 1 .. 64 front-end processes, got 0" in capsys.readouterr().err
