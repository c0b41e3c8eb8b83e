"""Child processes that moeserve starts as ``python -m MODULE`` (the ranks, the front end, the
balancer, ``up`` under the demo, the tests and the benchmarks): each imports the very moeserve
its parent runs, whatever folder it is started from.

``python -m`` puts the working directory first on ``sys.path``. Started from a folder that
holds a checkout as ``moeserve/`` (a plain ``git clone`` names the folder after the project),
the child would import that folder, which has no ``__init__.py``, as a namespace package in
place of the installed moeserve. So children run with ``-P`` (no working directory on the path)
and find moeserve through ``PYTHONPATH``, led by the folder the parent imported it from.

:class:`UpProcess` is the one launcher of ``moeserve up`` as a child process.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from collections.abc import Mapping


def describe_exit(code: int) -> str:
    """A child's exit status in words: "code 1", "signal SIGKILL"."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def set_death_signal() -> None:
    """Run in the child before exec: SIGKILL it when the launcher's thread dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def module_command(module: str, *args: str) -> list[str]:
    """The command line that runs ``module`` (``python -m``) in a child, with ``args``."""
    return [sys.executable, "-P", "-m", module, *args]


def source_root() -> str:
    """The folder this process imported moeserve from (the one that holds ``moeserve/``)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # .../moeserve/ops/procs.py


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment and ``extra``, with ``PYTHONPATH`` led by :func:`source_root`,
    so that a child started with :func:`module_command` imports the same moeserve (an installed
    one, an editable one or a bare source checkout alike) and finds what its parent finds on
    ``PATH`` (Triton's launcher builds with the compiler and linker there)."""
    out = dict(os.environ, **extra)
    root = source_root()
    rest = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    out["PYTHONPATH"] = os.pathsep.join([root, *rest])
    return out


def children_of(pid: int) -> list[int]:
    """The direct children of ``pid`` (Linux, from /proc)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        try:
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                out.append(int(name))
        except (ValueError, IndexError):
            continue
    return out


def cmdline(pid: int) -> str:
    """The command line of ``pid``, its arguments joined by spaces ("" when it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class UpProcess:
    """``moeserve up --model MODEL FLAGS...`` as a child process: the demo's, the tests', the
    soak's and the benchmarks' one launcher.

    Started at once with :func:`module_command` and :func:`child_env` (``env``: extra variables),
    its output in ``LOG_DIR/up.out`` (``log_dir``, default a new temporary folder, also gets
    every process's log through ``--log-dir``); :meth:`wait_ready` waits for the line "ready".
    Ports left at 0 are picked by ``up`` (outside the ephemeral range, ``moeserve.ops.ports``);
    :attr:`serving`, :attr:`admin`, :attr:`balancer` and :attr:`http` are the addresses it
    printed, :meth:`metrics_lines` its list of metrics endpoints. ``http_port`` (None: no HTTP
    API) adds ``--http-port``. ``token``: the admin token (default: a random one).
    ``new_session``: ``up`` in a session of its own (a Ctrl-C at the terminal reaches only the
    caller, which stops it in order); ``die_with_parent``: SIGKILLed when the thread that started it
    ends (Linux: start it from a thread that outlives it). :meth:`stop` sends SIGTERM and waits,
    then kills."""

    def __init__(
        self,
        model: str | os.PathLike[str],
        *flags: str,
        log_dir: str | os.PathLike[str] | None = None,
        token: str | None = None,
        port: int = 0,
        admin_port: int = 0,
        balancer_port: int = 0,
        http_port: int | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        new_session: bool = False,
        die_with_parent: bool = True,
    ):
        import secrets
        import subprocess
        import tempfile

        self.token = token if token is not None else secrets.token_urlsafe(18)
        self.log_dir = str(log_dir) if log_dir is not None else tempfile.mkdtemp(prefix="moeserve-up-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.out_path = os.path.join(self.log_dir, "up.out")
        ports = ["--port", str(port), "--admin-port", str(admin_port), "--balancer-port", str(balancer_port)]
        if http_port is not None:
            ports += ["--http-port", str(http_port)]
        self.cmd = [
            *module_command("moeserve", "up"),
            "--model",
            str(model),
            *ports,
            f"--admin-token={self.token}",  # "=": a token may start with "-"
            "--log-dir",
            self.log_dir,
            *flags,
        ]
        self.new_session = new_session
        preexec = set_death_signal if die_with_parent else None
        with open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen(
                self.cmd,
                cwd=cwd,
                env=child_env(**{"PYTHONUNBUFFERED": "1", **(env or {})}),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=new_session,
                preexec_fn=preexec,
            )
        self.started = time.monotonic()
        self.startup_s: float | None = None
        self._addresses: dict[str, str] = {}

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        """What ``up`` printed so far."""
        try:
            with open(self.out_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def ready(self) -> bool:
        return "ready" in (line.strip() for line in self.output().splitlines())

    def wait_ready(self, timeout_s: float, poll_s: float = 0.1) -> UpProcess:
        """Wait until ``up`` printed "ready" (then :attr:`startup_s` is set); when it exits first or
        ``timeout_s`` passes: stop it and raise RuntimeError with the tail of every log."""
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"moeserve up did not become ready (logs in {self.log_dir}):\n{self.tail()}")
            time.sleep(poll_s)
        self.startup_s = time.monotonic() - self.started
        return self

    def address(self, name: str) -> str:
        """The address ``up`` printed for ``name`` (serving, admin, balancer, http)."""
        if name not in self._addresses:
            for line in self.output().splitlines():
                parts = line.split()
                if len(parts) >= 2 and parts[0] == name:
                    self._addresses[name] = parts[1]
                    break
            else:
                raise RuntimeError(f"moeserve up printed no {name} address:\n{self.output()}")
        return self._addresses[name]

    @property
    def serving(self) -> str:
        return self.address("serving")

    @property
    def admin(self) -> str:
        return self.address("admin")

    @property
    def balancer(self) -> str:
        return self.address("balancer")

    @property
    def http(self) -> str:
        """The HTTP API's base URL (``http://HOST:PORT``, no ``/v1``)."""
        return self.address("http").removesuffix("/v1")

    def metrics_lines(self) -> list[str]:
        """Each process's metrics endpoint as ``up`` listed it: "ROLE  http://HOST:PORT/metrics"."""
        return [line.split(None, 1)[1] for line in self.output().splitlines() if line.startswith("metrics ")]

    def tail(self, lines: int = 40, limit: int = 12000) -> str:
        """The last ``lines`` lines of every file in the log folder (up.out and each process's
        log), at most the last ``limit`` characters of them all."""
        parts = []
        for name in sorted(os.listdir(self.log_dir)) if os.path.isdir(self.log_dir) else []:
            try:
                with open(os.path.join(self.log_dir, name), errors="replace") as f:
                    text = f.readlines()[-lines:]
            except OSError:
                continue
            parts.append(f"--- {name} ---\n{''.join(text)}")
        return "\n".join(parts)[-limit:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def children(self) -> list[int]:
        """The pids of ``up``'s direct children (the ranks, the front end, the balancer)."""
        return children_of(self.proc.pid)

    def child(self, word: str) -> int | None:
        """The pid of the child whose command line has ``moeserve <word>`` (frontend, balancer)."""
        pids = self.children_named(word)
        return pids[0] if pids else None

    def children_named(self, word: str) -> list[int]:
        """The pids of every child whose command line has ``moeserve <word>`` (the front ends of
        ``--api-server-count``)."""
        return [pid for pid in self.children() if f"moeserve {word}" in cmdline(pid)]

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (``up`` drains and stops its processes in order), then SIGKILL after
        ``timeout_s``; the exit code."""
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                if self.new_session:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                else:
                    self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> UpProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
