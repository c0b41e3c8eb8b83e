"""Readiness: whether the cluster can take a request now, for every service's health.

Every service's grpc.health (its own name and "") and the HTTP API's ``/health`` say SERVING /
200 only while the cluster can take a request, and NOT_SERVING / 503 otherwise, for one of
these reasons (:data:`REASONS`):

- ``step_stalled``: the leader's step loop has completed no step for :func:`stall_deadline`
  seconds (a rank stopped or a collective hangs): requests would only queue and time out;
- ``leader_unreachable``: the leader does not answer (the front end asks over the local
  channel, the balancer through the admin API);
- ``cluster_failed``: the leader reports that the cluster failed (a rank died).

Each process looks once a second (:data:`POLL_S`): the admin service reads ``engine.status()``
in the leader's own process, the front end asks the leader's status over the local channel, the
balancer calls the admin API's GetStatus and watches its step count. ``moeserve_ready`` and
``moeserve_not_ready_reason{reason}`` (docs/metrics.md) say what each process decided and why.
A server that drains at shutdown says NOT_SERVING whatever this says.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from grpc_health.v1 import health_pb2

log = logging.getLogger("moeserve.services")

STALL_S = 5.0  # the least time without a step that counts as a stall
POLL_S = 1.0
PROBE_TIMEOUT_S = 3.0
REASONS = ("step_stalled", "leader_unreachable", "cluster_failed")  # as moeserve.ops.metrics.READY_REASONS


def stall_deadline(heartbeat_s: float | None = None) -> float:
    """Seconds without a completed step after which the step loop counts as stalled: 5 s, or 5
    heartbeats when the heartbeat is longer than a second (an idle leader steps every heartbeat)."""
    return max(STALL_S, 5 * heartbeat_s) if heartbeat_s else STALL_S


def engine_verdict(status, heartbeat_s: float | None = None):
    """The verdict on an ``EngineStatus``: None (ready) or (reason, what happened)."""
    if status.error:
        return "cluster_failed", f"the cluster failed: {status.error}"
    age = float(getattr(status, "last_step_age_s", 0.0) or 0.0)
    deadline = stall_deadline(heartbeat_s)
    if age > deadline:
        return "step_stalled", (
            f"the leader's step loop has completed no step for {age:.1f} s "
            f"(more than {deadline:.1f} s): a rank stopped or a collective hangs"
        )
    return None


class StepWatch:
    """A stall seen from outside the leader: the step count did not move for the deadline."""

    def __init__(self, deadline_s: float = STALL_S):
        self.deadline_s = deadline_s
        self._step: int | None = None
        self._since = time.monotonic()

    def verdict(self, step: int, error: str = ""):
        if error:
            return "cluster_failed", f"the cluster failed: {error}"
        now = time.monotonic()
        if step != self._step:
            self._step, self._since = step, now
            return None
        age = now - self._since
        if age > self.deadline_s:
            return "step_stalled", (
                f"the leader's step count stayed at {step} for {age:.1f} s (more than "
                f"{self.deadline_s:.1f} s): a rank stopped or a collective hangs"
            )
        return None


class Readiness:
    """Polls ``probe`` (an async callable returning None when the cluster can take a request,
    else (reason, what happened); raising counts as ``leader_unreachable``) every ``poll_s``
    and sets the health of the servers attached to it; ``metrics``: a
    moeserve.ops.metrics.ReadinessMetrics or None. ``ready``, ``reason`` and ``detail`` say what
    the last look found (not ready until the first look)."""

    def __init__(
        self, probe: Callable[[], Awaitable], metrics=None, poll_s: float = POLL_S, timeout_s: float = PROBE_TIMEOUT_S
    ):
        self.probe = probe
        self.metrics = metrics
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self.ready = False
        self.reason: str | None = "leader_unreachable"
        self.detail = "not checked yet"
        self._servers: list = []
        self._task: asyncio.Task | None = None

    def attach(self, server) -> None:
        """A ServiceServer whose health follows this readiness (it calls :meth:`start`)."""
        self._servers.append(server)

    async def check(self) -> bool:
        try:
            verdict = await asyncio.wait_for(self.probe(), self.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            verdict = "leader_unreachable", f"the leader does not answer: {type(e).__name__}: {e}"
        await self._apply(verdict)
        return self.ready

    async def _apply(self, verdict) -> None:
        ready = verdict is None
        reason, detail = (None, "") if ready else verdict
        if ready != self.ready or reason != self.reason:
            if ready:
                log.info("ready again: the cluster takes requests")
            else:
                log.warning("not ready (%s): %s", reason, detail)
        self.ready, self.reason, self.detail = ready, reason, detail
        if self.metrics is not None:
            self.metrics.set(reason)
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for server in self._servers:
            for name in ("", server.service):
                await server.health.set(name, status)

    async def start(self) -> None:
        """Look once now, then every ``poll_s`` on the running loop (idempotent)."""
        if self._task is not None:
            return
        self._task = asyncio.get_running_loop().create_task(self._run())
        await self.check()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one look end the watch
                log.exception("readiness check failed")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None


def engine_probe(engine, heartbeat_s: float | None = None):
    """A probe for the leader's own process: ``engine.status()`` read directly."""

    async def probe():
        return engine_verdict(engine.status(), heartbeat_s)

    return probe


def channel_probe(client, on_status=None):
    """A probe for the front end: the leader's status over the local channel (AsyncEngineClient);
    ``on_status`` also gets each status (vLLM's scheduler gauges, ``moeserve.ops.vllm_metrics``)."""

    async def probe():
        status = await client.call("status")
        if on_status is not None:
            on_status(status)
        return engine_verdict(status)

    return probe


__all__ = [
    "Readiness",
    "StepWatch",
    "REASONS",
    "STALL_S",
    "POLL_S",
    "stall_deadline",
    "engine_verdict",
    "engine_probe",
    "channel_probe",
]
