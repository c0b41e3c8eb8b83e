"""Plumbing shared by the three gRPC services: limits, TLS, auth, health, reflection, uvloop,
graceful shutdown.

Every service is a :class:`ServiceServer`: a ``grpc.aio`` server with

- explicit message-size limits (``max_message_bytes`` both ways; a larger request answers
  RESOURCE_EXHAUSTED and the server goes on),
- grpc.health.v1 (the service's own name and "" are SERVING while it serves; with a
  ``readiness`` (``moeserve.services.readiness``) only while the cluster can take a request)
  and reflection,
- a *service check*: a method of another moeserve service answers UNIMPLEMENTED with a message
  naming the service and the flag of the port that serves it,
- an optional bearer token (metadata ``authorization: Bearer <token>``; health and reflection
  need none, so that orchestrators can probe),
- TLS when given a certificate and key,
- the interceptors passed in (the hook for metrics), before the two above, so that metrics
  count the calls they refuse too,
- a request whose bytes do not parse as the method's message answers INVALID_ARGUMENT (the
  handler never runs), and a handler that raises what it did not map answers INTERNAL with what
  it was (logged), never grpc's UNKNOWN,
- trailing metadata ``moeserve-server: <service>`` on every call a handler answers (aborted
  ones too), so that a client can tell an UNAVAILABLE the server answered (not to be repeated)
  from one of the transport (the call reached no server: safe to retry),
- graceful shutdown: health NOT_SERVING first, then in-flight calls get ``grace_s`` to finish.

Where a service shares a process with other work (the admin API in the leader), it runs in its
own thread on its own uvloop event loop (:class:`ThreadedServer`); a process of its own uses
:func:`serve_forever`, which stops gracefully on SIGTERM and SIGINT.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import inspect
import logging
import signal
import threading
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import uvloop
from google.protobuf import descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from moeserve.rpc import admin_pb2, balancer_pb2, serving_pb2  # noqa: F401  (fill the descriptor pool)
from moeserve.wire import SERVER_METADATA_KEY

if TYPE_CHECKING:
    from moeserve.services.readiness import Readiness

log = logging.getLogger("moeserve.services")

SERVING, ADMIN, BALANCER = "moeserve.v1.Serving", "moeserve.v1.Admin", "moeserve.v1.Balancer"
# service -> (what serves it, the flag of its port)
SERVICE_HOMES = {
    SERVING: ("the serving front end", "--port"),
    ADMIN: ("the admin API of the router leader", "--admin-port"),
    BALANCER: ("the balancer", "--balancer-port"),
}
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
TOKEN_ENV = "MOESERVE_ADMIN_TOKEN"
UNGUARDED = ("/grpc.health.v1.Health/", "/grpc.reflection.")


@dataclass(frozen=True)
class ServerOptions:
    """How a service listens.

    host, port: where (port 0 picks a free port; :attr:`ServiceServer.port` tells which).
    max_message_bytes: the largest message received or sent (``--max-message-bytes``).
    tls_cert, tls_key: PEM files; both or neither. token: the bearer token every call must
    carry (None: no authentication). grace_s: how long in-flight calls may take to finish at
    shutdown. interceptors: more ``grpc.aio.ServerInterceptor`` (metrics). reuse_port: share
    the port with other processes that set it too (SO_REUSEPORT: the kernel spreads the
    connections over them; ``moeserve up --api-server-count``); off, a port in use fails the bind.
    """

    host: str = "127.0.0.1"
    port: int = 0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    tls_cert: str | None = None
    tls_key: str | None = None
    token: str | None = None
    grace_s: float = 30.0
    interceptors: tuple = ()
    reuse_port: bool = False

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535 (0 = any free port), got {self.port}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both a certificate and a key (--tls-cert and --tls-key)")
        if self.token is not None and not self.token:
            raise ValueError("the token must not be empty")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")


def _abort_handler(method: str, code: grpc.StatusCode, message: str):
    """An RPC handler of ``method``'s kind that answers ``code`` with ``message``."""

    async def abort(request, context):
        await context.abort(code, message)

    try:
        service, name = method.lstrip("/").split("/", 1)
        desc = descriptor_pool.Default().FindServiceByName(service).FindMethodByName(name)
        cs, ss = desc.client_streaming, desc.server_streaming
    except (KeyError, ValueError):
        cs = ss = False
    if cs and ss:
        return grpc.stream_stream_rpc_method_handler(abort)
    if cs:
        return grpc.stream_unary_rpc_method_handler(abort)
    if ss:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class ServiceCheck(grpc.aio.ServerInterceptor):
    """A method of another moeserve service answers UNIMPLEMENTED, naming where it is served."""

    def __init__(self, service: str):
        self.service = service

    async def intercept_service(self, continuation, details):
        method = details.method
        other = method.lstrip("/").split("/", 1)[0]
        if other in SERVICE_HOMES and other != self.service:
            what, flag = SERVICE_HOMES[other]
            here, here_flag = SERVICE_HOMES[self.service]
            return _abort_handler(
                method,
                grpc.StatusCode.UNIMPLEMENTED,
                f"{method} is a method of {what} ({flag}); this address serves {here} ({here_flag})",
            )
        return await continuation(details)


class ServerMark(grpc.aio.ServerInterceptor):
    """Sets trailing metadata ``moeserve-server: <service>`` on every call a handler answers.

    The SDK retries only an UNAVAILABLE without it (the transport's: nothing reached a server),
    never one a handler answered: Generate, ApplyPlacement and Rebalance must not run twice.
    The mark is set first thing, before the handler runs, so that it also rides on the calls
    the handler, the service check or the token check abort (``context.abort`` keeps trailing
    metadata set before it).
    """

    def __init__(self, service: str):
        self._mark = ((SERVER_METADATA_KEY, service),)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:  # an unknown method: grpc answers UNIMPLEMENTED
            return None
        kind = next(
            k
            for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
            if getattr(handler, k) is not None
        )
        changes = {kind: self._marking(getattr(handler, kind), details.method)}
        if not handler.request_streaming and handler.request_deserializer is not None:
            changes["request_deserializer"] = _tolerant(handler.request_deserializer)
        return handler._replace(**changes)

    def _marking(self, behavior, method: str):
        mark = self._mark
        if inspect.isasyncgenfunction(behavior):  # a streaming handler that yields its answers

            async def stream(request, context):
                context.set_trailing_metadata(mark)
                if isinstance(request, Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                try:
                    async for item in behavior(request, context):
                        yield item
                except Exception as e:
                    await _internal(context, method, e)

            return stream

        async def call(request, context):  # a unary handler, or one writing with context.write()
            context.set_trailing_metadata(mark)
            if isinstance(request, Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            try:
                return await behavior(request, context)
            except Exception as e:
                await _internal(context, method, e)

        return call


class Malformed:
    """A request whose bytes did not parse as the method's message: the handler is not called,
    the call answers INVALID_ARGUMENT (grpc itself would answer UNKNOWN naming a Python class)."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


def _tolerant(deserialize):
    """``deserialize`` that returns a :class:`Malformed` instead of raising."""
    owner = getattr(deserialize, "__self__", None)
    name = getattr(getattr(owner, "DESCRIPTOR", None), "full_name", "the method's request")

    def parse(data: bytes):
        try:
            return deserialize(data)
        except Exception:
            return Malformed(
                f"the request ({len(data)} bytes) does not parse as a {name} message: the protobuf "
                f"wire format is corrupt"
            )

    return parse


async def _internal(context, method: str, e: Exception):
    """A handler raised something it did not turn into a status: INTERNAL with what it was,
    logged with its traceback (never grpc's UNKNOWN). An abort passes through."""
    if isinstance(e, grpc.aio.AbortError):
        raise e
    log.exception("%s failed", method)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(e).__name__}: {e}")


class BearerAuth(grpc.aio.ServerInterceptor):
    """Every call but health and reflection needs ``authorization: Bearer <token>``."""

    def __init__(self, token: str, service: str):
        self._token = token.encode()
        self.service = service

    async def intercept_service(self, continuation, details):
        if details.method.startswith(UNGUARDED):
            return await continuation(details)
        auth = dict(details.invocation_metadata or ()).get("authorization")
        if auth is None:
            msg = (
                f"{SERVICE_HOMES[self.service][0]} needs a bearer token: send metadata "
                f"'authorization: Bearer <token>' (the token of --admin-token or {TOKEN_ENV})"
            )
        elif not auth.startswith("Bearer "):
            msg = "the authorization metadata must read 'Bearer <token>'"
        elif not hmac.compare_digest(auth[len("Bearer ") :].encode(), self._token):
            msg = "wrong bearer token"
        else:
            return await continuation(details)
        return _abort_handler(details.method, grpc.StatusCode.UNAUTHENTICATED, msg)


def read_file(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read the {what} {path}: {e.strerror}") from None


class ServiceServer:
    """One service on one port. ``add(server)`` registers the servicer(s) on the grpc.aio
    server; ``service`` is the full service name (e.g. ``moeserve.v1.Admin``)."""

    def __init__(self, service: str, add: Callable[[grpc.aio.Server], None], options: ServerOptions):
        self.service = service
        self.options = options
        self._add = add
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self.readiness: Readiness | None = None  # health follows the cluster's

    async def start(self) -> int:
        o = self.options
        # The mark comes first so that it wraps every handler, the refusals included; then the
        # interceptors passed in (metrics), so that they also see the calls the service check
        # and the token check answer themselves.
        interceptors = [ServerMark(self.service), *o.interceptors, ServiceCheck(self.service)]
        if o.token:
            interceptors.append(BearerAuth(o.token, self.service))
        limit = int(o.max_message_bytes)
        self.server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", 1 if o.reuse_port else 0),
            ],
        )
        self._add(self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (self.service, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server,
        )
        addr = f"{o.host}:{o.port}"
        if o.tls_cert:
            assert o.tls_key is not None  # ServerOptions takes both or neither
            creds = grpc.ssl_server_credentials(
                [(read_file(o.tls_key, "TLS key"), read_file(o.tls_cert, "TLS certificate"))]
            )
            self.port = self.server.add_secure_port(addr, creds)
        else:
            self.port = self.server.add_insecure_port(addr)
        if not self.port:
            raise OSError(f"cannot listen on {addr}")
        await self.server.start()
        if self.readiness is not None:  # SERVING only while the cluster can take a request
            self.readiness.attach(self)
            await self.readiness.start()
        else:
            for name in ("", self.service):
                await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("%s listening on %s:%d%s", self.service, o.host, self.port, " (TLS)" if o.tls_cert else "")
        return self.port

    async def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING first, then refuse new calls and give in-flight ones ``grace_s``."""
        if self.server is None:
            return
        if self.readiness is not None:
            self.readiness.stop()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.options.grace_s if grace_s is None else grace_s)

    async def wait(self) -> None:
        assert self.server is not None, "start() first"
        await self.server.wait_for_termination()


async def serve_forever(
    server: ServiceServer,
    on_started: Callable[[int], None] | None = None,
    before_stop: Callable[[], Awaitable[None]] | None = None,
    after_stop: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Run ``server`` until SIGTERM or SIGINT, then shut it down gracefully."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    port = await server.start()
    if on_started:
        on_started(port)
    await stop.wait()
    log.info("%s: shutting down (grace %.0f s)", server.service, server.options.grace_s)
    if before_stop:
        await before_stop()
    await server.stop()
    if after_stop:
        await after_stop()


def run(main: Coroutine[Any, Any, Any]) -> None:
    """Run a service's main coroutine on uvloop."""
    uvloop.run(main)


class ThreadedServer:
    """A ServiceServer on its own uvloop event loop in a daemon thread, for a process whose
    main thread does other work (the leader's step driver)."""

    def __init__(self, server: ServiceServer):
        self.server = server
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=f"grpc-{server.service}", daemon=True)
        self._started = threading.Event()
        self._error: BaseException | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.start())
        except BaseException as e:  # reported to start()
            self._error = e
            self._started.set()
            return
        self._started.set()
        self.loop.run_forever()

    def start(self, timeout_s: float = 30.0) -> int:
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise TimeoutError(f"{self.server.service} did not start within {timeout_s} s")
        if self._error is not None:
            raise self._error
        assert self.server.port is not None  # the server started
        return self.server.port

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, grace_s: float | None = None) -> None:
        """Graceful stop from any other thread; returns when the server has stopped."""
        if not self._thread.is_alive():
            return
        fut = self.submit(self.server.stop(grace_s))
        try:
            fut.result((self.server.options.grace_s if grace_s is None else grace_s) + 10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
