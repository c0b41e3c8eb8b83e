"""gRPC server metrics: the interceptor every moeserve gRPC server (serving, admin, balancer)
installs to count its calls and time them.

``moeserve_grpc_server_handled_total{grpc_service, grpc_method, grpc_code}`` and
``moeserve_grpc_server_handling_seconds{grpc_service, grpc_method}`` (docs/metrics.md lists
every metric). They live in the registry of the process's :class:`moeserve.ops.metrics.ProcessMetrics`;
this module is apart from ``moeserve.ops.metrics`` so that a rank's metrics never import gRPC or
protobuf (the data plane's machines may have neither).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
import weakref

import grpc
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2  # noqa: F401  (fills the descriptor pool with grpc.health.v1)
from prometheus_client import CollectorRegistry, Counter, Histogram

from moeserve.rpc import admin_pb2, balancer_pb2, serving_pb2  # noqa: F401  (fill the descriptor pool)

__all__ = ["HEALTH", "GRPC_BUCKETS", "GrpcMetrics", "grpc_interceptor"]

HEALTH = "grpc.health.v1.Health"
GRPC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0)

# One GrpcMetrics per registry: a process's servers share its two families (registering them
# twice would raise).
_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, GrpcMetrics] = weakref.WeakKeyDictionary()
_by_registry_lock = threading.Lock()


def grpc_interceptor(process_metrics, service: str) -> grpc.aio.ServerInterceptor:
    """A ``grpc.aio.ServerInterceptor`` counting the calls of ``service`` (full name, e.g.
    ``moeserve.v1.Admin``) and of health checks in ``process_metrics``' registry (a
    :class:`moeserve.ops.metrics.ProcessMetrics`); its series start at 0 for every method."""
    registry = process_metrics.registry
    with _by_registry_lock:
        m = _by_registry.get(registry)
        if m is None:
            m = _by_registry[registry] = GrpcMetrics(registry)
    return m.interceptor(service)


class GrpcMetrics:
    """Calls handled by the gRPC servers of a process, by service, method and status code."""

    def __init__(self, registry: CollectorRegistry):
        self.handled = Counter(
            "moeserve_grpc_server_handled",
            "gRPC calls completed by the server.",
            ("grpc_service", "grpc_method", "grpc_code"),
            registry=registry,
        )
        self.seconds = Histogram(
            "moeserve_grpc_server_handling_seconds",
            "Time the server took to handle a gRPC call (to the last message of a stream).",
            ("grpc_service", "grpc_method"),
            buckets=GRPC_BUCKETS,
            registry=registry,
        )
        self._known: set[str] = set()
        self._lock = threading.Lock()

    def interceptor(self, service: str) -> grpc.aio.ServerInterceptor:
        for name in (service, HEALTH):
            for method in _methods(name):
                with self._lock:
                    self._known.add(f"/{name}/{method}")
                self.handled.labels(name, method, "OK")
                self.seconds.labels(name, method)
        return _MetricsInterceptor(self)

    def labels_of(self, path: str) -> tuple[str, str]:
        """(service, method) of a known method; ('unknown', 'unknown') for anything else, so a
        client cannot create series at will."""
        if path not in self._known:
            if not _method_exists(path):
                return "unknown", "unknown"
            with self._lock:
                self._known.add(path)
        service, method = path.lstrip("/").split("/", 1)
        return service, method


def _methods(service: str) -> list[str]:
    try:
        return [m.name for m in descriptor_pool.Default().FindServiceByName(service).methods]
    except KeyError:
        return []


def _method_exists(path: str) -> bool:
    try:
        service, method = path.lstrip("/").split("/", 1)
        descriptor_pool.Default().FindServiceByName(service).FindMethodByName(method)
        return True
    except (KeyError, ValueError):
        return False


def _code_of(context, exc: BaseException | None) -> str:
    code = context.code()
    if code is not None:
        return code.name if hasattr(code, "name") else str(code)
    if exc is None:
        return "OK"
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "CANCELLED"
    return "UNKNOWN"


class _MetricsInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, m: GrpcMetrics):
        self.m = m

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        m = self.m
        service, method = m.labels_of(details.method)
        seconds = m.seconds.labels(service, method)

        def record(context, t0: float, exc: BaseException | None) -> None:
            seconds.observe(time.perf_counter() - t0)
            m.handled.labels(service, method, _code_of(context, exc)).inc()

        if handler.unary_unary is not None:
            handler = handler._replace(unary_unary=_wrap_unary(handler.unary_unary, record))
        elif handler.stream_unary is not None:
            handler = handler._replace(stream_unary=_wrap_unary(handler.stream_unary, record))
        elif handler.unary_stream is not None:
            handler = handler._replace(unary_stream=_wrap_stream(handler.unary_stream, record))
        elif handler.stream_stream is not None:
            handler = handler._replace(stream_stream=_wrap_stream(handler.stream_stream, record))
        return handler


def _wrap_unary(behavior, record):
    async def call(request, context):
        t0 = time.perf_counter()
        try:
            out = behavior(request, context)
            if inspect.isawaitable(out):
                out = await out
        except BaseException as e:
            record(context, t0, e)
            raise
        record(context, t0, None)
        return out

    return call


def _wrap_stream(behavior, record):
    if inspect.isasyncgenfunction(behavior):

        async def gen(request, context):
            t0 = time.perf_counter()
            try:
                async for item in behavior(request, context):
                    yield item
            except BaseException as e:
                record(context, t0, e)
                raise
            record(context, t0, None)

        return gen
    return _wrap_unary(behavior, record)  # a coroutine writing with context.write()
