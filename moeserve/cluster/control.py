"""The local channel to the leader's engine: a socket on 127.0.0.1 with an auth key.

The launcher (``LocalCluster``) and the serving front end reach the engine through it, so API
load never runs on the step-driver thread (vLLM's API-server / engine-core split). Each call
opens its own connection; the leader serves each connection on a thread of its own. Messages
are pickled tuples (``multiprocessing.connection``, authenticated with the cluster's key):

    ("generate", [GenerateRequest, ...]) -> ("event", i, event)* ("end",)
    ("placement",) ("plan", phy2log, expected_version) ("apply", phy2log, expected_version)
    ("migration", id) ("wait_migration", id, timeout_s) ("abort_migration",) ("expert_load",)
    ("total_load",) ("status",) ("slot_digests",) ("stop",)
                                       -> ("ok", value) | ("error", kind, message)

A client that closes its connection while generating cancels its requests, also while they
are still waiting for a slot (the leader polls the connection). ``GenerateStream.cancel()``
does that from any thread, waking a thread blocked reading the stream.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
from multiprocessing.connection import Client, Connection, Listener

from moeserve.router.leader import EplbDisabled
from moeserve.router.migration import StaleVersion
from moeserve.router.scheduler import QueueFull, validate_request

log = logging.getLogger("moeserve.control")

ERROR_KINDS = {ValueError: "invalid", StaleVersion: "stale", QueueFull: "queue_full"}


class ClusterError(RuntimeError):
    """The cluster failed or went away (a rank died, the leader stopped)."""


class RemoteError(Exception):
    """An error the engine answered with: ``kind`` is one of invalid, stale, queue_full,
    precondition, unavailable, not_found."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def raise_remote(kind: str, message: str):
    if kind == "invalid":
        raise ValueError(message)
    if kind == "stale":
        raise StaleVersion(message)
    if kind == "queue_full":
        raise QueueFull(message)
    raise RemoteError(kind, message)


class ControlServer:
    """Serves the engine on the leader; ``address`` is (host, port)."""

    def __init__(self, engine, authkey: bytes, host: str = "127.0.0.1", port: int = 0):
        self.engine = engine
        # A deep backlog: the front end opens one connection per request, dozens at once; with
        # Listener's default of 1 the kernel drops handshakes and a client can wait forever.
        self.listener = Listener((host, port), authkey=authkey, backlog=512)
        self.address = self.listener.address
        self._thread = threading.Thread(target=self._accept, name="control-accept", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def write_address(self, path: str) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"host": self.address[0], "port": self.address[1]}, f)
        os.replace(tmp, path)

    def close(self) -> None:
        try:
            self.listener.close()
        except OSError:
            pass

    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except (OSError, EOFError):
                return
            except Exception as e:                          # a failed handshake (bad key): keep serving
                log.warning("control connection refused: %s", e)
                continue
            threading.Thread(target=self._serve, args=(conn,), name="control-conn", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        try:
            while True:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    return
                if msg[0] == "generate":
                    self._generate(conn, msg[1])
                else:
                    conn.send(self._call(msg))
        finally:
            conn.close()

    def _call(self, msg) -> tuple:
        e = self.engine
        try:
            op = msg[0]
            if op == "placement":
                return ("ok", e.placement())
            if op == "plan":
                return ("ok", e.plan_placement(msg[1], msg[2]).summary())
            if op == "apply":
                return ("ok", e.apply_placement(msg[1], msg[2]).summary())
            if op in ("migration", "wait_migration"):
                mig = e.migration(msg[1])
                if mig is None:
                    return ("error", "not_found", f"no migration with id {msg[1]!r}")
                if op == "wait_migration":
                    mig.done.wait(msg[2])
                return ("ok", mig.summary())
            if op == "abort_migration":
                return ("ok", e.abort_migration())
            if op == "expert_load":
                return ("ok", e.expert_load())
            if op == "total_load":
                return ("ok", e.total_load())
            if op == "status":
                return ("ok", e.status())
            if op == "slot_digests":
                return ("ok", e.slot_digests())
            if op == "stop":
                e.request_stop()
                return ("ok", None)
            return ("error", "invalid", f"unknown control operation {op!r}")
        except (ValueError, StaleVersion, QueueFull) as ex:
            return ("error", ERROR_KINDS[type(ex)], str(ex))
        except EplbDisabled as ex:
            return ("error", "precondition", str(ex))
        except RuntimeError as ex:
            return ("error", "unavailable", str(ex))

    def _generate(self, conn: Connection, reqs) -> None:
        seqs = []
        try:
            for r in reqs:                                   # all or nothing: validate before admitting any
                validate_request(r, self.engine.shape.vocab_size, self.engine.cfg.limits)
            for r in reqs:
                seqs.append(self.engine.submit(r))
        except (ValueError, QueueFull, RuntimeError) as ex:
            for s in seqs:
                self.engine.cancel(s)
            kind = "invalid" if isinstance(ex, ValueError) else "queue_full" if isinstance(ex, QueueFull) else "unavailable"
            conn.send(("error", kind, str(ex)))
            return
        # One thread per request stream: forward each sequence's events as they come.
        outq = queue.SimpleQueue()
        pumps = [threading.Thread(target=_pump, args=(i, s, outq), daemon=True) for i, s in enumerate(seqs)]
        for p in pumps:
            p.start()
        open_ = len(seqs)
        try:
            while open_:
                try:
                    i, ev = outq.get(timeout=0.2)
                except queue.Empty:
                    if conn.poll(0):                         # the client closed (or wrote): it is gone
                        conn.recv()
                    continue
                conn.send(("event", i, ev))
                if ev[0] in ("done", "error"):
                    open_ -= 1
            conn.send(("end",))
        except (OSError, EOFError, BrokenPipeError):
            for s in seqs:                                   # the client went away: cancel its requests
                self.engine.cancel(s)


def _pump(i: int, seq, outq) -> None:
    while True:
        ev = seq.events.get()
        outq.put((i, ev))
        if ev[0] in ("done", "error"):
            return


class ControlClient:
    """Calls the engine over the local channel. ``on_failure()`` returns the cluster's error
    (or None) when a connection breaks, so callers see why."""

    def __init__(self, address: tuple[str, int], authkey: bytes, on_failure=lambda: None):
        self.address = tuple(address)
        self.authkey = authkey
        self.on_failure = on_failure

    def _connect(self) -> Connection:
        try:
            return Client(self.address, authkey=self.authkey)
        except OSError as e:
            raise ClusterError(self.on_failure() or f"cannot reach the leader at {self.address}: {e}") from e

    def call(self, *msg):
        conn = self._connect()
        try:
            conn.send(msg)
            reply = conn.recv()
        except (EOFError, OSError) as e:
            raise ClusterError(self.on_failure() or f"the leader closed the connection: {e}") from e
        finally:
            conn.close()
        if reply[0] == "ok":
            return reply[1]
        raise_remote(reply[1], reply[2])

    def generate_stream(self, reqs):
        """Yield (request index, event) until every request is done; closing the generator
        early cancels the requests that are still running."""
        stream = self.open_stream(reqs)
        try:
            yield from stream
        finally:
            stream.close()

    def open_stream(self, reqs) -> "GenerateStream":
        """Submit ``reqs`` and return their event stream (see :class:`GenerateStream`)."""
        conn = self._connect()
        try:
            conn.send(("generate", list(reqs)))
        except (EOFError, OSError) as e:
            conn.close()
            raise ClusterError(self.on_failure() or f"the leader closed the connection: {e}") from e
        return GenerateStream(conn, self.on_failure)


class GenerateStream:
    """Iterates (request index, event) until every request is done; raises ValueError /
    QueueFull when the leader refused the requests. ``cancel()`` (any thread) cancels the
    requests still running and ends the iteration quietly."""

    def __init__(self, conn: Connection, on_failure):
        self._conn = conn
        self._on_failure = on_failure
        self.cancelled = False
        self._closed = False
        self._lock = threading.Lock()

    def __iter__(self):
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError) as e:
                if self.cancelled:
                    return
                raise ClusterError(self._on_failure() or f"the leader closed the connection: {e}") from e
            if msg[0] == "end":
                return
            if msg[0] == "error":
                raise_remote(msg[1], msg[2])
            yield msg[1], msg[2]

    def cancel(self) -> None:
        with self._lock:
            if self.cancelled or self._closed:
                return
            self.cancelled = True
            try:                          # shutdown wakes a reader blocked in recv(); close alone would not
                s = socket.socket(fileno=os.dup(self._conn.fileno()))
                try:
                    s.shutdown(socket.SHUT_RDWR)
                finally:
                    s.close()
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._conn.close()
