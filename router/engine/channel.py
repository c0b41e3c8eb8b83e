"""The local channel to the leader's engine: the :class:`~moeserve.router.engine.api.EngineAPI`
over a TCP socket with a shared key, for the launcher and the serving front end.

Who sends what, in order, on one connection (a call or a stream opens its own; a session
carries many streams):

    server: b"MSCH" + 32-byte nonce                      (handshake, within HANDSHAKE_TIMEOUT_S)
    client: HMAC-SHA256(key, server nonce) + 32-byte nonce
    server: HMAC-SHA256(key, client nonce)               (both sides proved they hold the key)
    client: ("call", method, args, kwargs)  -> server: ("ok", value) | ("error", EngineError)
        or  ("generate", [GenerateRequest, ...])
                                            -> server: ("event", i, Event)* ("end",) | ("error", EngineError)
        or  ("session",), then any number of, in any order:
            client: ("submit", sid, [GenerateRequest, ...])   (sid: the client's id of the stream)
            client: ("cancel", sid)
            server: ("events", [(sid, i, Event | int), ...])  (every event of a step, one frame;
                                                               a plain Token as its id)
            server: ("error", sid, EngineError)               (a submit refused; nothing of it runs)

A session is how the serving front end talks to the leader: all its streams share one
connection, and the events of a step leave the leader as one frame (the step driver hands them
to the loop once per step, not once per token). A stream ends when each of its requests has
had its Finished or Failed event; closing the session cancels every stream still open in it.

Every message after the handshake is a frame: an 8-byte big-endian length, then a pickle of
plain values (the api module's dataclasses, numpy arrays). Pickle is read only after the peer
proved it holds the key. ``method`` must be one of ``api.REMOTE_METHODS``; errors are the api's
exception classes, so a caller here catches exactly what an in-process caller would. Every
connection sends with TCP_NODELAY (a step's frame leaves at once). A request's first token
carries the wall clock of each hop (``api.HopTimes``): the client stamps its write of the
submit and its read of the event's frame, the server its read of the submit and its write of
the frame (the engine stamps the rest), so the front end can tell where its TTFT went.

The server runs every connection as a task of one asyncio loop on one thread: a slow or silent
peer (a connect without a handshake, a half-sent frame) holds only its own task, never the
accept loop, and a streamed request costs no thread: the step driver hands each event to the
loop (``call_soon_threadsafe``). Engine calls that may block (``wait_migration``,
``slot_digests``) run on a small thread pool. A client that closes its connection while
generating cancels its requests, also while they wait for a slot.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import json
import logging
import os
import pickle
import secrets
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from moeserve.router.engine.api import (
    REMOTE_METHODS,
    EngineAPI,
    EngineError,
    Event,
    Failed,
    Finished,
    FirstToken,
    GenerateRequest,
    InvalidRequest,
    RemoteEngineAPI,
    Token,
    Unavailable,
    after_delivery,
)

log = logging.getLogger("moeserve.channel")

HANDSHAKE_TIMEOUT_S = 30.0  # generous: a loaded leader may take a while; a silent peer holds only its task
MAGIC = b"MSCH"
NONCE = 32
_LEN = struct.Struct(">Q")


class ClusterError(Unavailable):
    """The cluster failed or went away (a rank died, the leader stopped)."""


def _mac(key: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, nonce, hashlib.sha256).digest()


def _frame(msg) -> bytes:
    body = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(body)) + body


def _no_delay(sock) -> None:
    """Send each frame at once (TCP_NODELAY). asyncio sets it only on sockets whose ``proto`` is
    IPPROTO_TCP, and ``socket.create_server`` makes the listener (so every accepted socket) with
    proto 0: with Nagle's algorithm on, the leader held each step's event frame until the front
    end acknowledged the one before (a delayed ACK: up to 40 ms), on the first token's way out."""
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _error_msg(e: BaseException) -> tuple:
    """An exception as the channel sends it: the api's own classes as they are, anything else
    as Unavailable (the engine failed under the call)."""
    if isinstance(e, EngineError):
        return ("error", e)
    return ("error", Unavailable(f"{type(e).__name__}: {e}"))


# -- server (the leader) ----------------------------------------------------------------------


class ChannelServer:
    """Serves ``engine`` on (host, port) to peers that hold ``authkey``; ``address`` is the
    bound (host, port)."""

    def __init__(self, engine: EngineAPI, authkey: bytes, host: str = "127.0.0.1", port: int = 0):
        self.engine = engine
        self.authkey = authkey
        self._sock = socket.create_server((host, port), backlog=512)
        self.address = self._sock.getsockname()[:2]
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="channel-call")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="channel", daemon=True)
        self._server: asyncio.Server | None = None

    def start(self) -> None:
        self._thread.start()

    def write_address(self, path: str) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"host": self.address[0], "port": self.address[1]}, f)
        os.replace(tmp, path)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop serving: close the listener, end every connection's task, stop the loop."""
        if not self._thread.is_alive():
            return

        async def shutdown():
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._loop.stop()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop)
        self._thread.join(timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, sock=self._sock))
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            _no_delay(writer.get_extra_info("socket"))
            if not await self._handshake(reader, writer):
                return
            frame = await _read_frame(reader)
            received = time.time()
            msg = pickle.loads(frame)
            if msg[0] == "generate":
                await self._generate(msg[1], reader, writer, received)
            elif msg[0] == "session":
                await _Session(self.engine, reader, writer).run()
            elif msg[0] == "call":
                writer.write(_frame(await self._call(msg[1], msg[2], msg[3])))
                await writer.drain()
            else:
                writer.write(_frame(_error_msg(InvalidRequest(f"unknown channel message {msg[0]!r}"))))
                await writer.drain()
        except (
            ConnectionError,
            OSError,
            EOFError,
            asyncio.IncompleteReadError,
            pickle.UnpicklingError,
            asyncio.CancelledError,
        ):
            pass  # the peer went away, spoke garbage, or the server stops
        except Exception:  # never let one connection take the loop down
            log.exception("channel connection failed")
        finally:
            writer.close()

    async def _handshake(self, reader, writer) -> bool:
        nonce = secrets.token_bytes(NONCE)
        try:
            writer.write(MAGIC + nonce)
            await writer.drain()
            reply = await asyncio.wait_for(reader.readexactly(2 * NONCE), HANDSHAKE_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError):
            return False
        if not hmac.compare_digest(reply[:NONCE], _mac(self.authkey, nonce)):
            log.warning("channel connection refused: wrong key")
            return False
        writer.write(_mac(self.authkey, reply[NONCE:]))
        await writer.drain()
        return True

    async def _call(self, method: str, args: tuple, kwargs: dict) -> tuple:
        if method not in REMOTE_METHODS:
            return _error_msg(InvalidRequest(f"unknown engine method {method!r} (allowed: {sorted(REMOTE_METHODS)})"))
        fn = getattr(self.engine, method)
        try:
            return ("ok", await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(*args, **kwargs)))
        except Exception as e:
            return _error_msg(e)

    async def _generate(self, reqs: list[GenerateRequest], reader, writer, received: float = 0.0) -> None:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def sink_of(i: int):
            def sink(ev: Event) -> None:  # on the step driver's thread
                try:
                    loop.call_soon_threadsafe(events.put_nowait, (i, ev))
                except RuntimeError:  # the loop is closed (shutdown): nobody listens
                    pass

            return sink

        seqs = []
        try:  # all or nothing
            for i, r in enumerate(reqs):
                seqs.append(self.engine.submit(r, sink_of(i)))
        except Exception as e:
            for s in seqs:
                self.engine.cancel(s)
            writer.write(_frame(_error_msg(e)))
            await writer.drain()
            return
        gone = asyncio.ensure_future(reader.read(1))  # b"" at EOF: the client closed, so it is gone
        open_ = len(seqs)
        try:
            while open_:
                get = asyncio.ensure_future(events.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    raise ConnectionResetError("the client closed the stream")
                i, ev = get.result()
                _stamp(ev, received, time.time())
                writer.write(_frame(("event", i, ev)))
                await writer.drain()
                if isinstance(ev, (Finished, Failed)):
                    open_ -= 1
            writer.write(_frame(("end",)))
            await writer.drain()
        except (ConnectionError, OSError, asyncio.CancelledError):
            for s in seqs:  # the client went away (or the server stops): cancel
                self.engine.cancel(s)
        finally:
            gone.cancel()


class _Session:
    """The server side of one session (see the module docstring): a reader of submits and
    cancels, and a writer that sends every event the step driver produced since its last
    frame as one frame."""

    def __init__(self, engine: EngineAPI, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.engine, self.reader, self.writer = engine, reader, writer
        self.loop = asyncio.get_running_loop()
        self.lock = threading.Lock()
        self.pending: list = []  # (sid, i, Event), appended by the step driver
        self.wake = asyncio.Event()
        self.streams: dict = {}  # sid -> [open request count, [Sequence, ...], when its submit was read]

    def _sink(self, sid: int, i: int):
        def sink(ev: Event) -> None:  # on the step driver's thread
            with self.lock:
                first = not self.pending
                self.pending.append((sid, i, ev))
            # one wake-up per batch of events, not per event; within a step's delivery at its end
            if first and not after_delivery(self, self._wake_writer):
                self._wake_writer()

        return sink

    def _wake_writer(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.wake.set)
        except RuntimeError:  # the loop is closed (shutdown): nobody listens
            pass

    async def run(self) -> None:
        writer_task = asyncio.ensure_future(self._write_events())
        try:
            while True:
                frame = await _read_frame(self.reader)
                received = time.time()  # the submit's hop: HopTimes.received
                msg = pickle.loads(frame)
                if msg[0] == "submit":
                    await self._submit(msg[1], msg[2], received)
                elif msg[0] == "cancel":
                    self._cancel(msg[1])
                else:
                    raise ConnectionError(f"unknown session message {msg[0]!r}")
        finally:
            writer_task.cancel()
            for sid in list(self.streams):  # the client went away (or the server stops): cancel
                self._cancel(sid)

    async def _submit(self, sid: int, reqs: list, received: float = 0.0) -> None:
        seqs: list[object] = []  # the engine's handles, for cancel
        self.streams[sid] = [len(reqs), seqs, received]
        try:  # all or nothing
            for i, r in enumerate(reqs):
                seqs.append(self.engine.submit(r, self._sink(sid, i)))
        except Exception as e:
            for s in seqs:
                self.engine.cancel(s)
            del self.streams[sid]
            self.writer.write(_frame(("error", sid, _error_msg(e)[1])))
            await self.writer.drain()

    def _cancel(self, sid: int) -> None:
        stream = self.streams.pop(sid, None)
        if stream is not None:
            for s in stream[1]:
                self.engine.cancel(s)

    async def _write_events(self) -> None:
        try:
            await self._write_loop()
        except (ConnectionError, OSError):
            self.writer.close()  # the reader then sees EOF and cancels every stream

    async def _write_loop(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            with self.lock:
                batch, self.pending = self.pending, []
            if not batch:
                continue
            now = time.time()
            for sid, _, ev in batch:
                if isinstance(ev, FirstToken):  # before its stream's Finished, in the same batch
                    stream = self.streams.get(sid)
                    _stamp(ev, stream[2] if stream is not None else 0.0, now)
                elif isinstance(ev, (Finished, Failed)):
                    stream = self.streams.get(sid)
                    if stream is not None:
                        stream[0] -= 1
                        if stream[0] <= 0:
                            del self.streams[sid]
            self.writer.write(_frame(("events", _compact(batch))))
            await self.writer.drain()


def _compact(batch: list) -> list:
    """A frame's entries with each plain token (no logits, no prompt logprobs) as its id: a
    pickled int costs the front end a fraction of a dataclass to read (``_expand``)."""
    return [
        (sid, i, ev.token_id)
        if type(ev) is Token and ev.logits is None and ev.prompt_logprobs is None
        else (sid, i, ev)
        for sid, i, ev in batch
    ]


def _stamp(ev: Event, received: float, written: float) -> None:
    """The leader's channel's hops of a first token (``HopTimes``): when it read the request's
    submit and when it writes the event's frame."""
    hops = ev.hops if isinstance(ev, FirstToken) else None
    if hops is not None:
        hops.received, hops.written = received, written


def _read_hops(ev: Event, read: float, sent: float = 0.0) -> None:
    """The front end's hops of a first token: when its channel read the event's frame and (when
    known) when it wrote the request's submit."""
    hops = ev.hops if isinstance(ev, FirstToken) else None
    if hops is not None:
        hops.read = read
        if sent:
            hops.sent = sent


def _first_tokens_first(events: list) -> list:
    """A frame's (stream, index, event) entries with the streams that get their first token in it
    first, each stream's own entries in their order: the consumers of a frame's events wake in
    the order they were handed them, and a first token (TTFT) should not wait behind every
    running stream's next token (1.9 ms of a 30 ms TTFT with ~40 streams, 2026-12-03)."""
    if len(events) < 2:
        return events
    firsts = {sid for sid, _, ev in events if isinstance(ev, FirstToken)}
    if not firsts or len(firsts) == len(events):
        return events
    return [e for e in events if e[0] in firsts] + [e for e in events if e[0] not in firsts]


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    return await reader.readexactly(n)


# -- clients -----------------------------------------------------------------------------------


def _raise(reply: tuple, on_failure):
    if reply[0] == "ok":
        return reply[1]
    err = reply[1]
    if isinstance(err, Unavailable) and on_failure is not None:
        why = on_failure()
        if why:
            raise ClusterError(why) from err
    raise err


class EngineClient(RemoteEngineAPI):
    """The engine's API in another process (what the channel serves: requests stream through
    ``generate_stream``, not submit), over blocking sockets. ``on_failure()`` returns the
    cluster's error (or None) when a connection breaks, so callers see why."""

    def __init__(
        self, address: tuple[str, int], authkey: bytes, on_failure=lambda: None, connect_timeout_s: float = 10.0
    ):
        host, port = address
        self.address = (host, port)
        self.authkey = authkey
        self.on_failure = on_failure
        self.connect_timeout_s = connect_timeout_s

    def _broken(self, e: BaseException, what: str) -> ClusterError:
        return ClusterError(self.on_failure() or f"{what} ({self.address[0]}:{self.address[1]}): {e}")

    def _connect(self) -> socket.socket:
        try:
            sock = socket.create_connection(self.address, timeout=self.connect_timeout_s)
        except OSError as e:
            raise self._broken(e, "cannot reach the leader") from e
        try:
            _no_delay(sock)
            hello = _recv_exactly(sock, len(MAGIC) + NONCE)
            if hello[: len(MAGIC)] != MAGIC:
                raise ConnectionError("not a moeserve channel")
            mine = secrets.token_bytes(NONCE)
            sock.sendall(_mac(self.authkey, hello[len(MAGIC) :]) + mine)
            if not hmac.compare_digest(_recv_exactly(sock, NONCE), _mac(self.authkey, mine)):
                raise ConnectionError("the leader did not prove the channel key")
            sock.settimeout(None)
            return sock
        except (OSError, EOFError) as e:
            sock.close()
            raise self._broken(e, "the leader refused the channel handshake (wrong key?)") from e

    def _call(self, method: str, *args, **kwargs):
        sock = self._connect()
        try:
            sock.sendall(_frame(("call", method, args, kwargs)))
            reply = pickle.loads(_recv_frame(sock))
        except (OSError, EOFError) as e:
            raise self._broken(e, "the leader closed the connection") from e
        finally:
            sock.close()
        return _raise(reply, self.on_failure)

    def placement(self):
        return self._call("placement")

    def plan_placement(self, target, expected_version=None):
        return self._call("plan_placement", target, expected_version)

    def apply_placement(self, target, expected_version=None):
        return self._call("apply_placement", target, expected_version)

    def migration(self, migration_id):
        return self._call("migration", migration_id)

    def wait_migration(self, migration_id, timeout_s):
        return self._call("wait_migration", migration_id, timeout_s)

    def abort_migration(self):
        return self._call("abort_migration")

    def expert_load(self, window_steps=None):
        return self._call("expert_load", window_steps)

    def total_load(self):
        return self._call("total_load")

    def total_worker_load(self):
        return self._call("total_worker_load")

    def status(self):
        return self._call("status")

    def slot_digests(self, timeout_s: float = 60.0):
        return self._call("slot_digests", timeout_s)

    def router_maps(self, timeout_s: float = 60.0):
        return self._call("router_maps", timeout_s)

    def request_stop(self):
        return self._call("request_stop")

    def generate_stream(self, reqs):
        """Yield (request index, Event) until every request ended; closing the generator early
        cancels the requests that are still running."""
        stream = self.open_stream(reqs)
        try:
            yield from stream
        finally:
            stream.close()

    def open_stream(self, reqs) -> GenerateStream:
        """Submit ``reqs`` and return their event stream (see :class:`GenerateStream`)."""
        sock = self._connect()
        try:
            sent = time.time()
            sock.sendall(_frame(("generate", list(reqs))))
        except OSError as e:
            sock.close()
            raise self._broken(e, "the leader closed the connection") from e
        return GenerateStream(sock, self, sent)


class GenerateStream:
    """Iterates (request index, Event) until every request ended; raises the engine's error
    when it refused the requests. ``cancel()`` (any thread) cancels the requests still running
    and ends the iteration quietly."""

    def __init__(self, sock: socket.socket, client: EngineClient, sent: float = 0.0):
        self._sock = sock
        self._client = client
        self._sent = sent
        self.cancelled = False
        self._closed = False
        self._lock = threading.Lock()

    def __iter__(self):
        while True:
            try:
                frame = _recv_frame(self._sock)
            except (OSError, EOFError) as e:
                if self.cancelled:
                    return
                raise self._client._broken(e, "the leader closed the connection") from e
            read = time.time()
            msg = pickle.loads(frame)
            if msg[0] == "end":
                return
            if msg[0] == "error":
                _raise(msg, self._client.on_failure)
            _read_hops(msg[2], read, self._sent)
            yield msg[1], msg[2]

    def cancel(self) -> None:
        with self._lock:
            if self.cancelled or self._closed:
                return
            self.cancelled = True
            try:  # shutdown wakes a reader blocked in recv(); close alone would not
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._sock.close()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError("the connection closed")
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> bytes:
    (n,) = _LEN.unpack(_recv_exactly(sock, _LEN.size))
    return _recv_exactly(sock, n)


class _ClientSession:
    """The client side of a session: one connection, one reader task that routes each event
    to its stream's queue. Once broken, every open stream gets the error and the next
    ``generate`` opens a new session."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.queues: dict[int, asyncio.Queue] = {}
        self.broken: ClusterError | None = None
        self.task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        err = ClusterError("the channel to the leader closed")
        try:
            while True:
                frame = await _read_frame(self.reader)
                read = time.time()  # the event's hop: HopTimes.read
                msg = pickle.loads(frame)
                if msg[0] == "events":
                    for sid, i, ev in _first_tokens_first(msg[1]):
                        q = self.queues.get(sid)
                        if q is not None:
                            if type(ev) is int:  # a plain token (_compact)
                                ev = Token(ev)
                            else:
                                _read_hops(ev, read)
                            q.put_nowait((i, ev))
                elif msg[0] == "error":
                    q = self.queues.get(msg[1])
                    if q is not None:
                        q.put_nowait((None, msg[2]))
        except (OSError, EOFError, asyncio.IncompleteReadError, pickle.UnpicklingError) as e:
            err = ClusterError(f"the leader closed the connection: {e}")
        except asyncio.CancelledError:
            pass
        finally:
            self.broken = err
            for q in self.queues.values():
                q.put_nowait((None, err))
            self.writer.close()

    def send(self, msg) -> None:
        if self.broken is not None:
            raise self.broken
        self.writer.write(_frame(msg))


class AsyncEngineClient:
    """The channel from an asyncio program (the serving front end), on the caller's event loop
    with no thread of its own: each call is a connection; every stream shares one session
    connection (see the module docstring)."""

    def __init__(self, address: tuple[str, int], authkey: bytes, connect_timeout_s: float = 10.0):
        host, port = address
        self.address = (host, port)
        self.authkey = authkey
        self.connect_timeout_s = connect_timeout_s
        self._session_obj: _ClientSession | None = None
        self._session_lock: asyncio.Lock | None = None
        self._sids = itertools.count(1)

    async def _session(self) -> _ClientSession:
        if self._session_lock is None:
            self._session_lock = asyncio.Lock()
        async with self._session_lock:
            s = self._session_obj
            if s is None or s.broken is not None:
                reader, writer = await self._connect()
                try:
                    writer.write(_frame(("session",)))
                    await writer.drain()
                except OSError as e:
                    writer.close()
                    raise ClusterError(f"the leader closed the connection: {e}") from e
                s = self._session_obj = _ClientSession(reader, writer)
            return s

    async def close(self) -> None:
        """Close the session (cancelling its streams on the leader) and wait for its reader
        task to end, so that nothing of it is left pending when the event loop closes."""
        s, self._session_obj = self._session_obj, None
        if s is not None:
            s.task.cancel()
            s.writer.close()
            try:
                await s.task  # the reader swallows its cancellation, unless it never started
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if me is not None and me.cancelling():  # the caller's own cancellation
                    raise

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(*self.address), self.connect_timeout_s)
        except (TimeoutError, OSError) as e:
            raise ClusterError(f"cannot reach the leader at {self.address[0]}:{self.address[1]}: {e}") from e
        try:
            hello = await asyncio.wait_for(reader.readexactly(len(MAGIC) + NONCE), HANDSHAKE_TIMEOUT_S)
            if hello[: len(MAGIC)] != MAGIC:
                raise ConnectionError("not a moeserve channel")
            mine = secrets.token_bytes(NONCE)
            writer.write(_mac(self.authkey, hello[len(MAGIC) :]) + mine)
            await writer.drain()
            proof = await asyncio.wait_for(reader.readexactly(NONCE), HANDSHAKE_TIMEOUT_S)
            if not hmac.compare_digest(proof, _mac(self.authkey, mine)):
                raise ConnectionError("the leader did not prove the channel key")
        except (TimeoutError, OSError, EOFError, asyncio.IncompleteReadError) as e:
            writer.close()
            raise ClusterError(f"the leader refused the channel handshake: {e}") from e
        return reader, writer

    async def call(self, method: str, *args, **kwargs):
        reader, writer = await self._connect()
        try:
            writer.write(_frame(("call", method, args, kwargs)))
            await writer.drain()
            reply = pickle.loads(await _read_frame(reader))
        except (OSError, EOFError, asyncio.IncompleteReadError) as e:
            raise ClusterError(f"the leader closed the connection: {e}") from e
        finally:
            writer.close()
        return _raise(reply, None)

    async def generate(self, reqs: list[GenerateRequest]):
        """Async iterator of (request index, Event) until every request ended (its Finished or
        Failed event). Leaving the iteration early (break, cancellation) cancels the requests
        on the leader; a broken session raises ClusterError in every stream it carried."""
        batches = self.generate_batches(reqs)
        try:
            async for batch in batches:
                for item in batch:
                    yield item
        finally:
            await batches.aclose()

    async def generate_batches(self, reqs: list[GenerateRequest]):
        """:meth:`generate`, a list at a time: every (request index, Event) that arrived by the
        time the caller asks, at least one, in order. A front end that fell behind the leader
        (steps come faster than it writes their tokens) gets each stream's backlog at once and
        sends it as one message, so its cost per token falls as it falls behind."""
        reqs = list(reqs)
        session = await self._session()
        sid = next(self._sids)
        queue: asyncio.Queue = asyncio.Queue()
        session.queues[sid] = queue
        open_, ended = len(reqs), False
        try:
            try:
                sent = time.time()  # the submit's hop: HopTimes.sent
                session.send(("submit", sid, reqs))
                await session.writer.drain()
            except OSError as e:
                raise ClusterError(f"the leader closed the connection: {e}") from e
            while open_:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                out: list = []
                for i, ev in items:
                    if i is None:  # the submit was refused, or the session broke
                        if out:  # what came before goes out first; the error with the next ask
                            yield out
                        ended = True
                        raise ev
                    if isinstance(ev, (Finished, Failed)):
                        open_ -= 1
                    elif isinstance(ev, FirstToken) and ev.hops is not None:
                        ev.hops.sent = sent
                    out.append((i, ev))
                yield out
            ended = True
        finally:
            session.queues.pop(sid, None)
            if not ended and session.broken is None:
                try:
                    session.send(("cancel", sid))  # no drain: this may run while the generator closes
                except (ClusterError, OSError, RuntimeError):
                    pass


__all__ = ["ChannelServer", "EngineClient", "AsyncEngineClient", "GenerateStream", "ClusterError", "Event"]
