"""``moeserve up`` as a subprocess for tests (``moeserve.ops.procs.UpProcess``): start, wait for
"ready", reach its services, find its children, stop it."""

from __future__ import annotations

import threading
from pathlib import Path

from moeserve.client import Client
from moeserve.ops import ports
from moeserve.ops.procs import UpProcess, children_of, cmdline

__all__ = ["TOKEN", "Up", "alive", "children_of", "cmdline", "free_ports", "stream_all"]

TOKEN = "test-token"


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports outside the ephemeral range: a port from ``bind(0)`` may be
    handed to a rank's outgoing connection before the server that is to use it binds it."""
    return ports.free_ports(n)


def alive(pid: int) -> bool:
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


class Up(UpProcess):
    """``moeserve up --model DIR FLAGS... --admin-token TOKEN`` (ports picked by up, one thread per
    BLAS library), ready when constructed."""

    def __init__(self, model_dir, *flags: str, startup_timeout_s: float = 240.0):
        super().__init__(
            model_dir,
            *flags,
            token=TOKEN,
            env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
        )
        self.wait_ready(startup_timeout_s)

    def logs(self) -> str:
        return self.tail()

    @property
    def port(self) -> int:
        return int(self.serving.rsplit(":", 1)[1])

    @property
    def admin_port(self) -> int:
        return int(self.admin.rsplit(":", 1)[1])

    @property
    def balancer_port(self) -> int:
        return int(self.balancer.rsplit(":", 1)[1])

    def clients(self, timeout: float = 60.0) -> tuple[Client, Client, Client]:
        return (
            Client(self.serving, timeout=timeout),
            Client(self.admin, TOKEN, timeout=timeout),
            Client(self.balancer, TOKEN, timeout=timeout),
        )


def stream_all(client: Client, prompts, max_tokens: int, results: list, errors: list, **kw) -> list[threading.Thread]:
    """One thread per prompt streaming its generation into results[i] (token ids, finish reason)."""

    def run(i, p):
        try:
            ids, reason = [], None
            for ch in client.generate_stream(prompt_token_ids=p, max_tokens=max_tokens, temperature=0.0, **kw):
                ids.extend(ch.token_ids)
                reason = ch.finish_reason or reason
            results[i] = (ids, reason)
        except Exception as e:  # reported by the test
            errors.append((i, e))

    threads = [threading.Thread(target=run, args=(i, p), daemon=True) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    return threads
