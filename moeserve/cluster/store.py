"""The cluster's rendezvous store: a key-value store that only holders of the cluster's secret
can reach (torch's TCPStore authenticates nobody: any local process could steer a recovery).

The leader serves it (:class:`StoreServer`) on ``MASTER_ADDR:MASTER_PORT``; every rank, a
replacement and the launcher talk to it through :class:`AuthStore`, a
``torch.distributed.Store`` that torch.distributed's groups (gloo's and NCCL's rendezvous) use
like any other store. TCP and a shared secret: it works the same when ranks sit on several
hosts (docs/dataplane.md, "The store").

Who sends what on one connection:

    server: b"MSST" + 32-byte nonce                         (within HANDSHAKE_TIMEOUT_S)
    client: HMAC-SHA256(secret, CLIENT + server nonce) + 32-byte nonce
    server: HMAC-SHA256(secret, SERVER + client nonce)      (both sides proved the secret)
    client: request  -> server: answer                      (any number, one at a time)

A peer that fails the challenge is closed before it can read or write a key. A request is a
frame (a 4-byte big-endian length, then the op byte and its fields, each a 4-byte length and
bytes); an answer is a frame of a status byte (0 ok, 1 timed out, 2 error) and fields.
Blocking requests (``get``, ``wait``) carry their timeout; the server answers "timed out"
when it passes. One connection per client thread: a thread that blocks in ``wait`` holds up
no other.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import secrets
import socket
import struct
import threading
import time

import torch.distributed as dist

log = logging.getLogger("moeserve.store")

MAGIC = b"MSST"
NONCE = 32
CLIENT = b"moeserve store client"
SERVER = b"moeserve store server"
HANDSHAKE_TIMEOUT_S = 5.0
MAX_FRAME = 16 << 20
MAX_PENDING = 64  # connections still in their handshake; more are closed at once
SET, GET, ADD, CAS, CHECK, WAIT, DELETE, NUMKEYS = range(1, 9)
OK, TIMED_OUT, ERROR = range(3)
_LEN = struct.Struct(">I")


class StoreError(RuntimeError):
    """The store refused or failed a request (a wrong secret, a peer that is not the store)."""


class StoreTimeout(StoreError):
    """A blocking request's timeout passed before its keys were set."""


def _mac(secret: bytes, label: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, label + nonce, hashlib.sha256).digest()


def _recv(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        out += chunk
    return bytes(out)


def _pack(head: int, fields) -> bytes:
    body = bytes([head]) + b"".join(_LEN.pack(len(f)) + f for f in fields)
    return _LEN.pack(len(body)) + body


def _unpack(sock: socket.socket) -> tuple[int, list[bytes]]:
    (n,) = _LEN.unpack(_recv(sock, 4))
    if not 1 <= n <= MAX_FRAME:
        raise ConnectionError(f"a frame of {n} bytes")
    body = _recv(sock, n)
    fields, i = [], 1
    while i < n:
        if i + 4 > n:
            raise ConnectionError("a field runs past its frame")
        (k,) = _LEN.unpack(body[i : i + 4])
        if i + 4 + k > n:
            raise ConnectionError("a field runs past its frame")
        fields.append(body[i + 4 : i + 4 + k])
        i += 4 + k
    return body[0], fields


def _b(v) -> bytes:
    return v.encode() if isinstance(v, str) else bytes(v)


# -- the server (the leader) -----------------------------------------------------------------


class StoreServer:
    """The store on ``sock`` (bound and listening), for peers that hold ``secret``."""

    def __init__(self, sock: socket.socket, secret: bytes):
        if not secret:
            raise ValueError("the store needs the cluster's secret")
        self._sock = sock
        self._secret = secret
        self._data: dict[bytes, bytes] = {}
        self._cond = threading.Condition()
        self._pending = threading.BoundedSemaphore(MAX_PENDING)
        self.refused = 0  # connections that failed the challenge
        self.address = sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._accept, name="store", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if not self._pending.acquire(blocking=False):
                conn.close()  # a flood of handshakes holds nothing up
                continue
            threading.Thread(target=self._serve, args=(conn,), name="store-conn", daemon=True).start()

    def _handshake(self, conn: socket.socket) -> bool:
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            nonce = secrets.token_bytes(NONCE)
            conn.sendall(MAGIC + nonce)
            answer = _recv(conn, 32 + NONCE)
            if not hmac.compare_digest(answer[:32], _mac(self._secret, CLIENT, nonce)):
                self.refused += 1
                return False
            conn.sendall(_mac(self._secret, SERVER, answer[32:]))
            conn.settimeout(None)
            return True
        except (OSError, ConnectionError):
            self.refused += 1
            return False
        finally:
            self._pending.release()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            if not self._handshake(conn):
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                try:
                    op, fields = _unpack(conn)
                except (OSError, ConnectionError):
                    return
                try:
                    status, out = self._handle(op, fields)
                except Exception as e:  # a malformed request from a peer that holds the secret
                    status, out = ERROR, [f"{type(e).__name__}: {e}".encode()]
                try:
                    conn.sendall(_pack(status, out))
                except OSError:
                    return

    def _wait_for(self, keys: list[bytes], timeout_ms: int) -> bool:
        deadline = time.monotonic() + timeout_ms / 1000
        while not all(k in self._data for k in keys):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._cond.wait(left)
        return True

    def _handle(self, op: int, f: list[bytes]) -> tuple[int, list[bytes]]:
        d = self._data
        with self._cond:
            if op == SET:
                d[f[0]] = f[1]
                self._cond.notify_all()
                return OK, []
            if op == GET:
                if not self._wait_for([f[0]], int(f[1])):
                    return TIMED_OUT, [f[0]]
                return OK, [d[f[0]]]
            if op == ADD:
                value = int(d.get(f[0], b"0")) + int(f[1])
                d[f[0]] = str(value).encode()
                self._cond.notify_all()
                return OK, [d[f[0]]]
            if op == CAS:
                key, expected, desired = f
                current = d.get(key)
                if current == expected or current is None and expected == b"":
                    d[key] = desired
                    self._cond.notify_all()
                    return OK, [desired]
                return OK, [current if current is not None else expected]
            if op == CHECK:
                return OK, [b"1" if all(k in d for k in f) else b"0"]
            if op == WAIT:
                if not self._wait_for(f[1:], int(f[0])):
                    return TIMED_OUT, f[1:]
                return OK, []
            if op == DELETE:
                return OK, [b"1" if d.pop(f[0], None) is not None else b"0"]
            if op == NUMKEYS:
                return OK, [str(len(d)).encode()]
        raise ValueError(f"unknown store request {op}")

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass


def serve(host: str, port: int, secret: bytes, backlog: int = 512) -> StoreServer:
    """The store on (host, port), bound to that address alone (never every interface)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    return StoreServer(sock, secret)


# -- the client (every rank) -----------------------------------------------------------------


class AuthStore(dist.Store):
    """The store at (host, port) as a ``torch.distributed.Store``, after proving ``secret``;
    ``timeout`` bounds connecting (the leader may start after the other ranks) and every
    blocking request without one of its own."""

    def __init__(self, host: str, port: int, secret: bytes, timeout: datetime.timedelta):
        super().__init__()
        self.host, self.port = host, port
        self._secret = secret
        self._timeout_s = timeout.total_seconds()
        self._local = threading.local()
        self._conn()  # a wrong secret or no store fails here, not in the first rendezvous

    def _conn(self) -> socket.socket:
        sock = getattr(self._local, "sock", None)
        if sock is not None:
            return sock
        deadline = time.monotonic() + self._timeout_s
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=HANDSHAKE_TIMEOUT_S)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise StoreError(
                        f"no store at {self.host}:{self.port} within {self._timeout_s:.0f} s: {e}"
                    ) from None
                time.sleep(0.1)
        try:
            hello = _recv(sock, len(MAGIC) + NONCE)
            if not hello.startswith(MAGIC):
                raise StoreError(f"{self.host}:{self.port} is not a moeserve store")
            nonce = secrets.token_bytes(NONCE)
            sock.sendall(_mac(self._secret, CLIENT, hello[len(MAGIC) :]) + nonce)
            proof = _recv(sock, 32)
        except (OSError, ConnectionError) as e:
            sock.close()
            raise StoreError(
                f"the store at {self.host}:{self.port} refused this rank's secret (or failed: {e}); "
                "every rank needs the cluster's secret"
            ) from None
        if not hmac.compare_digest(proof, _mac(self._secret, SERVER, nonce)):
            sock.close()
            raise StoreError(f"the store at {self.host}:{self.port} does not hold the cluster's secret")
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._local.sock = sock
        return sock

    def _call(self, op: int, *fields: bytes) -> list[bytes]:
        sock = self._conn()
        try:
            sock.sendall(_pack(op, fields))
            status, out = _unpack(sock)
        except (OSError, ConnectionError) as e:
            self._local.sock = None
            sock.close()
            raise StoreError(f"the store at {self.host}:{self.port} went away: {e}") from None
        if status == TIMED_OUT:
            raise StoreTimeout(f"timed out waiting for {b', '.join(out).decode(errors='replace')} in the store")
        if status != OK:
            raise StoreError(b"".join(out).decode(errors="replace"))
        return out

    def _ms(self, timeout=None) -> bytes:
        if timeout is None:  # the store's own (torch.distributed sets it per group)
            own = getattr(self, "timeout", None)
            seconds = own.total_seconds() if isinstance(own, datetime.timedelta) else self._timeout_s
        else:
            seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
        return str(max(0, int(seconds * 1000))).encode()

    # torch.distributed.Store's interface

    def set(self, key, value) -> None:
        self._call(SET, _b(key), _b(value))

    def get(self, key) -> bytes:
        return self._call(GET, _b(key), self._ms())[0]

    def add(self, key, value: int) -> int:
        return int(self._call(ADD, _b(key), str(int(value)).encode())[0])

    def compare_set(self, key, expected_value, desired_value) -> bytes:
        return self._call(CAS, _b(key), _b(expected_value), _b(desired_value))[0]

    def check(self, keys) -> bool:
        return self._call(CHECK, *(_b(k) for k in keys))[0] == b"1"

    def wait(self, keys, timeout=None) -> None:
        self._call(WAIT, self._ms(timeout), *(_b(k) for k in keys))

    def delete_key(self, key) -> bool:
        return self._call(DELETE, _b(key))[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call(NUMKEYS)[0])

    # moeserve's own

    def get_now(self, key) -> bytes | None:
        """The value of ``key``, or None when it is not set (no waiting)."""
        try:
            return self._call(GET, _b(key), b"0")[0]
        except StoreTimeout:
            return None


__all__ = ["AuthStore", "StoreServer", "StoreError", "StoreTimeout", "serve"]
