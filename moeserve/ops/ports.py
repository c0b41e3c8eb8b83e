"""Picking free TCP ports that stay free until their server binds them.

A port taken from the kernel with ``bind(port 0)`` lies in the ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 on Linux by default). Between the moment
it is picked and the moment the server that is to use it binds it (``moeserve up`` binds the
serving port only after the ranks have loaded their weights), the kernel may hand the same
port to any outgoing connection or to any other ``bind(0)``: gloo's and NCCL's rendezvous, a
gRPC channel, the leader's local channel all open such sockets. The server then fails with
"Address already in use". ``free_port`` therefore picks below the ephemeral range, where the
kernel never picks on its own; only another explicit choice can collide, and
``free_port`` checks that nothing holds the port at the moment it is picked.

Two explicit choices can still meet: a test (or ``moeserve up``) picks a serving port and
hands it to a process that loads for a while before binding it, and meanwhile that process,
or another cluster on the same host, picks its own rendezvous or metrics port. So a picked
port is also *reserved*: ``free_port`` takes an exclusive ``flock`` on a per-port file in a
per-user directory under the temporary directory and holds it (the kernel drops it when the
process ends) for the process's most recent ``HELD`` picks; every ``free_port``, in any
process of that user, skips a port whose lock another pick holds. A port reserved this way
is free to bind: the lock is advisory and only ``free_port`` reads it.

``check_bindable`` is what ``moeserve up`` runs before loading anything: a port given on the
command line that is already in use is reported at once, not after minutes of loading.
"""

from __future__ import annotations

import os
import random
import socket
import tempfile
from collections import deque

LOWEST = 20000  # below: ports that services commonly own (8000, 9090, 3000, ...)


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range ``(low, high)`` (Linux; the IANA range elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


HELD = 256  # reservations a process keeps: far more than it binds between a pick and its bind

_held: deque[int] = deque()  # file descriptors of this process's reservations, oldest first


def _lock_dir() -> str | None:
    path = os.path.join(tempfile.gettempdir(), f"moeserve-ports-{os.getuid()}")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError:
        return None
    return path


def _reserve(port: int) -> bool:
    """Take this process's reservation of ``port``; False when another pick holds it. Where
    locks cannot be taken (no fcntl, no writable temporary directory) every port counts as
    reservable: the pick is as good as the bind check alone."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return True
    path = _lock_dir()
    if path is None:
        return True
    try:
        fd = os.open(os.path.join(path, f"{port}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _held.append(fd)
    while len(_held) > HELD:
        os.close(_held.popleft())
    return True


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _claim(host: str, port: int) -> bool:
    """Whether ``port`` is free now and this process now holds its reservation."""
    return _bindable(host, port) and _reserve(port)


def free_port(host: str = "127.0.0.1", exclude: tuple[int, ...] | list[int] | set[int] = ()) -> int:
    """A port nothing holds now, outside the ephemeral range (so that no outgoing connection
    or ``bind(0)`` takes it before its server binds it), not in ``exclude`` and not reserved
    by another pick, in this process or another (the module's docstring); it is reserved."""
    low, high = ephemeral_range()
    spans = [(lo, hi) for lo, hi in ((LOWEST, low - 1), (high + 1, 65535)) if hi - lo >= 1000]
    rng = random.SystemRandom()
    for _ in range(400):
        if not spans:
            break
        lo, hi = rng.choice(spans)
        port = rng.randint(lo, hi)
        if port not in exclude and _claim(host, port):
            return port
    with socket.socket() as s:  # no room outside the ephemeral range: let the kernel pick
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports, each as ``free_port`` picks them."""
    out: list[int] = []
    while len(out) < n:
        out.append(free_port(host, exclude=out))
    return out


def free_block(n: int, host: str = "127.0.0.1") -> int:
    """A base port ``M`` with ``M .. M+n-1`` all picked as ``free_port`` picks (free now,
    outside the ephemeral range, reserved): what a flag that numbers its ports from one base
    (``--metrics-port``) needs."""
    low, high = ephemeral_range()
    for _ in range(200):
        base = free_port(host)
        block = range(base, base + n)
        if base + n - 1 > 65535 or any(low <= p <= high for p in block):
            continue
        if all(_claim(host, p) for p in block[1:]):
            return base
    raise OSError(f"no block of {n} free ports outside the ephemeral range on {host}")


def check_bindable(host: str, ports: dict[str, int]) -> None:
    """Raise ``OSError`` naming the first of ``ports`` (what sets it -> port) that cannot be
    bound on ``host`` now, as a server binds it (SO_REUSEADDR: a port in TIME_WAIT is free);
    port 0 and None are skipped."""
    for name, port in ports.items():
        if not port:
            continue
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                raise OSError(
                    e.errno,
                    f"port {port} on {host or '0.0.0.0'} ({name}) is already in use: stop what "
                    f"listens there or choose another port",
                ) from None
