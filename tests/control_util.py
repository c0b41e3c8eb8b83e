"""``moeserve up`` as a subprocess for tests: start, wait for "ready", reach its services, find
its children, stop it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from moeserve.client import Client
from moeserve.ops import ports

TOKEN = "test-token"


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports outside the ephemeral range: a port from ``bind(0)`` may be
    handed to a rank's outgoing connection before the server that is to use it binds it."""
    return ports.free_ports(n)


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                out.append(int(d.name))
    return out


def cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


class Up:
    """``moeserve up --model DIR ... --port P --admin-port A --balancer-port B --admin-token T``."""

    def __init__(self, model_dir, *flags: str, startup_timeout_s: float = 240.0):
        self.port, self.admin_port, self.balancer_port = free_ports(3)
        self.log_dir = tempfile.mkdtemp(prefix="moeserve-up-")
        self.out_path = os.path.join(self.log_dir, "up.out")
        self.cmd = [
            sys.executable,
            "-m",
            "moeserve",
            "up",
            "--model",
            str(model_dir),
            "--port",
            str(self.port),
            "--admin-port",
            str(self.admin_port),
            "--balancer-port",
            str(self.balancer_port),
            "--admin-token",
            TOKEN,
            "--log-dir",
            self.log_dir,
            *flags,
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        with open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
        deadline = time.monotonic() + startup_timeout_s
        while "ready" not in self.output().split():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"moeserve up did not become ready:\n{self.output()}\n{self.logs()}")
            time.sleep(0.1)

    def output(self) -> str:
        return Path(self.out_path).read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n" + p.read_text(errors="replace")[-3000:] for p in sorted(Path(self.log_dir).glob("*.log"))
        )

    @property
    def serving(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def admin(self) -> str:
        return f"127.0.0.1:{self.admin_port}"

    @property
    def balancer(self) -> str:
        return f"127.0.0.1:{self.balancer_port}"

    def clients(self, timeout: float = 60.0) -> tuple[Client, Client, Client]:
        return (
            Client(self.serving, timeout=timeout),
            Client(self.admin, TOKEN, timeout=timeout),
            Client(self.balancer, TOKEN, timeout=timeout),
        )

    def child(self, word: str) -> int | None:
        """The pid of the child whose command line has ``moeserve <word>``."""
        for pid in children_of(self.proc.pid):
            if f"moeserve {word}" in cmdline(pid):
                return pid
        return None

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


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
