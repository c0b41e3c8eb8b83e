"""The balancer service (``moeserve.v1.Balancer``): a process of its own that closes the loop.

It keeps nothing a restart would lose: the load window, the placement and the steps since it
last changed come from the leader's admin API on every iteration, and its runtime settings
(SetConfig, Pause, Resume) are stored on the leader too (admin Get/PutBalancerSettings), so a
restarted balancer carries on where the old one stopped. Every admin call has a timeout; when
the admin API is briefly unavailable the loop records the error and tries again next time.

A rebalance (from the loop or a Rebalance call) plans with the placement policy
(:func:`moeserve.balancer.policy.make_policy`) on the window's load, starting from the
placement in force, predicts what it buys (:func:`moeserve.balancer.policy.evaluate`), applies
it through ApplyPlacement with ``expected_version`` and follows the migration to its end.

With a step model (``LoopConfig.step_model``, ``--eplb-step-model``; docs/eplb.md) the policy
picks plans by predicted step time, the trigger compares the *step efficiency* of the placement
in force with the threshold and a plan pays by its relative predicted step-time gain
(:mod:`moeserve.balancer.controller`, which prices a placement as the policy does, with the
break-even counts it would take); every plan goes out with its break-even counts per (layer,
expert), ``policy.rule.plan_breakeven`` of the plan, and when a plan does not pay but the counts
the placement in force would take differ from the ones in force, they are applied alone (no
weight moves).
Status and metrics show the predicted step time and the step efficiency beside balancedness.
Only one runs at a time: a Rebalance while one runs (or while any migration runs) answers
ABORTED. The policy runs in a worker thread, so the service stays responsive meanwhile.

Settings are validated like every other input: SetConfig with a negative window or interval, a
NaN or a threshold outside [0, 1] answers INVALID_ARGUMENT saying what is allowed, and so does
the admin API for the settings it stores; settings read back from the leader that a loop could
not run with are ignored (the flags' values stay; ``last_error`` says why), so no stored value
can stop the loop or make Pause fail. The service's health follows the cluster's readiness
(``moeserve.services.readiness``): NOT_SERVING while the admin API does not answer, the cluster
failed, or the leader's step count stands still.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import grpc
import numpy as np

from moeserve.balancer.controller import LoopConfig, pays, step_efficiency, step_gain, trigger
from moeserve.balancer.policy import evaluate, make_policy
from moeserve.balancer.policy.rule import plan_breakeven, rule_times
from moeserve.client import AsyncClient, MoeserveError
from moeserve.placement import MigrationState
from moeserve.rpc import balancer_pb2, balancer_pb2_grpc
from moeserve.services.server import BALANCER, ServerOptions, ServiceServer
from moeserve.wire import int64_matrix, migration_from_msg, migration_msg, placement_balancedness

log = logging.getLogger("moeserve.balancer")


class Busy(Exception):
    """A rebalance or a migration is already running."""


class BalancerService(balancer_pb2_grpc.BalancerServicer):
    """``admin``: an AsyncClient of the leader's admin API (with the token and a short timeout);
    ``config``: the flags' LoopConfig (settings stored on the leader override it);
    ``poll_s``: seconds between loop iterations; ``metrics``: a moeserve.ops.metrics.BalancerMetrics
    (rebalances by result and their duration) or None."""

    def __init__(self, admin: AsyncClient, config: LoopConfig, poll_s: float = 0.5, metrics=None):
        self.admin = admin
        self.metrics = metrics
        self.flags = config
        self.config = config
        self.paused = False
        self.poll_s = poll_s
        self.state = "idle"
        self.rebalances = 0
        self.last_trigger = ""
        self.last_migration_id = ""
        self.last_error = ""
        self.admin_reachable = False
        self.balancedness = 0.0
        self.predicted_step_s = 0.0  # with a step model, of the placement in force, last seen
        self.step_efficiency = 0.0
        self.placement_version = 0
        self.iterations = 0
        self._planned_at: int | None = None  # total_steps when this process last planned
        self._busy = False
        self._running = ""  # the trigger of the rebalance that runs
        self._following = False
        self._task: asyncio.Task | None = None
        self._follow: asyncio.Task | None = None
        self._started_at = 0.0  # when the running rebalance started planning
        self._recorders: set[asyncio.Task] = set()

    # -- settings stored on the leader -------------------------------------------------------

    def _merge(self, s) -> None:
        """``s``: the client.BalancerSettings kept on the leader; None fields keep the flags.
        Values no loop can run with (stored before the admin API checked them) are ignored."""
        c = self.flags
        try:
            self.config = dataclasses.replace(
                c,
                window_steps=c.window_steps if s.window_steps is None else s.window_steps,
                step_interval=c.step_interval if s.step_interval is None else s.step_interval,
                min_balancedness=c.min_balancedness if s.min_balancedness is None else s.min_balancedness,
            )
        except (ValueError, TypeError) as e:
            self.config = c
            self.last_error = f"the settings stored on the leader are ignored: {e}"
            log.warning("%s", self.last_error)
        self.paused = bool(s.paused)

    async def _admin(self, coro):
        """Await an admin call, recording whether the admin API answered."""
        try:
            out = await coro
        except MoeserveError as e:
            if e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self.admin_reachable = False
                self.last_error = str(e)
            raise
        self.admin_reachable = True
        return out

    # -- the loop ---------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        for t in (self._task, self._follow):
            if t is not None:
                t.cancel()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            self.iterations += 1
            try:
                await self._iteration()
                self.last_error = ""
            except Busy:
                pass
            except MoeserveError as e:
                self.last_error = str(e)
                log.warning("balancer loop: %s", e)
            except Exception as e:  # never let one bad iteration end the loop
                self.last_error = f"{type(e).__name__}: {e}"
                log.exception("balancer loop failed an iteration")

    async def _iteration(self) -> None:
        self._merge(await self._admin(self.admin.balancer_settings()))
        if self.paused or self._busy:
            return
        rep = await self._admin(self.admin.expert_load(self.config.window_steps))
        self.balancedness, self.placement_version = rep.predicted.mean, rep.placement_version
        since_plan = None if self._planned_at is None else rep.total_steps - self._planned_at
        efficiency = None
        model = self.config.step_model
        if model is not None and rep.steps > 0:
            placement = await self._admin(self.admin.placement())
            load = rep.load.astype(np.float64)
            if placement.phy2log.shape[0] == load.shape[0]:
                hist = _histogram(rep, load)
                efficiency = await asyncio.to_thread(
                    step_efficiency, self.config, load, placement.phy2log, placement.num_workers, rep.steps, hist
                )
                assert efficiency is not None  # with a step model and steps
                self.step_efficiency = float(efficiency)
                times = await asyncio.to_thread(
                    rule_times,
                    model,
                    load,
                    placement.phy2log,
                    placement.num_workers,
                    np.asarray(placement.breakeven),
                    rep.steps,
                    hist,
                )
                self.predicted_step_s = float(times.sum())
        why = trigger(
            self.config,
            rep.steps,
            rep.steps_since_placement_change,
            since_plan,
            rep.predicted.mean,
            step_efficiency=efficiency,
        )
        if why is not None:
            await self.rebalance(why, dry_run=False, wait=True)

    # -- one rebalance ----------------------------------------------------------------------

    async def rebalance(self, why: str, dry_run: bool, wait: bool, timeout_s: float | None = None):
        """Plan (and apply, and follow) one rebalance; raises Busy when one runs. A dry run
        only reads, so it runs beside anything else."""
        if dry_run:
            resp = await self._plan(why, dry_run=True, wait=False, timeout_s=timeout_s)
            self._record("dry_run", time.monotonic())
            return resp
        if self._busy:
            raise Busy(
                f"a rebalance is already running ({self.state}, trigger {self._running!r}"
                f"{', migration ' + self.last_migration_id if self.state == 'migrating' else ''}); "
                "retry when GetBalancerStatus shows state idle"
            )
        self._busy, self._running = True, why
        self._following = False
        self._started_at = time.monotonic()
        try:
            self.state = "planning"
            resp = await self._plan(why, dry_run=False, wait=wait, timeout_s=timeout_s)
        except Busy:  # another migration runs: this one never started
            raise
        except BaseException:
            self._record("failed", self._started_at)
            raise
        finally:
            if not self._following:
                self._busy = False
                self.state = "idle"
        if not resp.applied:
            self._record("skipped", self._started_at)
            return resp
        mig = migration_from_msg(resp.migration)
        if wait and mig.ended:
            self._record("done" if mig.state == MigrationState.DONE else "failed", self._started_at)
        elif wait:  # the caller's deadline came first: follow on
            task = asyncio.get_running_loop().create_task(self._record_at_end(resp.migration_id, self._started_at))
            self._recorders.add(task)  # a reference, so the task is not collected
            task.add_done_callback(self._recorders.discard)
        return resp

    def _record(self, result: str, started_at: float) -> None:
        if self.metrics is not None:
            self.metrics.record(result, time.monotonic() - started_at)

    async def _record_at_end(self, migration_id: str, started_at: float) -> None:
        try:
            mig = await self._follow_to_end(migration_id, None)
            self._record("done" if mig.state == MigrationState.DONE else "failed", started_at)
        except Exception:
            self._record("failed", started_at)

    async def _plan(self, why: str, dry_run: bool, wait: bool, timeout_s: float | None):
        status = await self._admin(self.admin.status())
        if status.migration is not None and not dry_run:
            raise Busy(
                f"migration {status.migration.migration_id} is running ({status.migration.state}); "
                "rebalance when it ended"
            )
        placement = await self._admin(self.admin.placement())
        rep = await self._admin(self.admin.expert_load(self.config.window_steps))
        if not dry_run:
            self._planned_at = rep.total_steps
        load = rep.load.astype(np.float64)
        cur = placement.phy2log
        workers, wpn = placement.num_workers, placement.workers_per_node
        policy = make_policy(self.config.move_budget, step_model=self.config.step_model)
        steps = int(rep.steps) if self.config.step_model is not None and rep.steps > 0 else None
        hist = _histogram(rep, load) if steps is not None else None  # the routers' per-step counts
        plan = await asyncio.to_thread(
            policy, load, cur.shape[1], workers, 1, workers // wpn, cur, steps=steps, histogram=hist
        )
        plan = np.asarray(plan, dtype=np.int64)
        report = evaluate(load, cur, plan, workers, status.model.expert_bytes)
        resp = balancer_pb2.RebalanceResponse(
            phy2log=int64_matrix(plan),
            balancedness_before=placement_balancedness(load, cur, workers),
            balancedness_after=placement_balancedness(load, plan, workers),
            slots_moved=report.slots_moved,
            slots_moved_across_workers=report.slots_moved_across_workers,
            bytes_moved=report.bytes_moved,
            base_version=placement.version,
        )
        model = self.config.step_model
        b = timed = None
        if model is not None:  # b per (layer, expert), as the policy priced the plan
            # in a worker thread like the policy: at DeepSeek-V3 scale these take about a second
            b = await asyncio.to_thread(plan_breakeven, model, load, plan, workers, int(rep.steps) or None, hist)
            resp.breakeven.CopyFrom(int64_matrix(b))
            timed = await asyncio.to_thread(step_gain, self.config, load, cur, plan, workers, int(rep.steps), hist, b)
            if timed is not None:
                resp.predicted_step_s_before, resp.predicted_step_s_after = timed.before_s, timed.after_s
        if dry_run:
            resp.note = "dry run: nothing applied"
            return resp
        ok, note = pays(
            self.config,
            report.gain,
            report.slots_moved,
            report.slots_moved_across_workers,
            cur.size,
            requested=why == "request",
            step_gain=None if timed is None else timed.gain,
        )
        target = plan
        if not ok:
            if b is not None:  # the counts the placement in force would take
                assert model is not None  # b comes with the step model
                b = await asyncio.to_thread(plan_breakeven, model, load, cur, workers, int(rep.steps) or None, hist)
                resp.breakeven.CopyFrom(int64_matrix(b))
            if b is None or np.array_equal(b, placement.breakeven):
                resp.note = note
                log.info("rebalance (%s) not applied: %s", why, note)
                return resp
            # the plan does not pay, but the step model's break-even counts differ from those in
            # force: apply them alone (no weight moves)
            target = cur
            resp.note = f"{note}; the step model's break-even counts were applied alone"
            resp.phy2log.CopyFrom(int64_matrix(cur))
            resp.balancedness_after.CopyFrom(resp.balancedness_before)
            resp.slots_moved = resp.slots_moved_across_workers = resp.bytes_moved = 0
            if timed is not None:
                resp.predicted_step_s_after = timed.before_s
        applied = await self._admin(self.admin.apply_placement(target, expected_version=placement.version, breakeven=b))
        self.rebalances += 1
        self.last_trigger, self.last_migration_id = why, applied.migration_id
        log.info(
            "rebalance (%s): migration %s, %d slots (%d across workers), balancedness %.4f -> %.4f",
            why,
            applied.migration_id,
            report.slots_moved,
            report.slots_moved_across_workers,
            report.mean_before,
            report.mean_after,
        )
        resp.applied, resp.migration_id = True, applied.migration_id
        self.state = "migrating"
        if wait:
            mig = await self._follow_to_end(applied.migration_id, timeout_s)
            resp.migration.CopyFrom(migration_msg(mig))
        else:
            resp.migration.CopyFrom(migration_msg(applied.migration))
            self._following = True
            self._follow = asyncio.get_running_loop().create_task(self._follow_then_idle(applied.migration_id))
        return resp

    async def _follow_to_end(self, migration_id: str, timeout_s: float | None):
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait = 2.0 if deadline is None else max(0.0, min(2.0, deadline - time.monotonic()))
            try:
                mig = await self._admin(self.admin.migration(migration_id, wait_s=wait))
            except MoeserveError as e:
                if e.code != grpc.StatusCode.UNAVAILABLE:
                    raise
                await asyncio.sleep(0.5)  # the admin API is briefly away: keep following
                continue
            if mig.ended or (deadline is not None and time.monotonic() >= deadline):
                return mig

    async def _follow_then_idle(self, migration_id: str) -> None:
        try:
            mig = await self._follow_to_end(migration_id, None)
            self._record("done" if mig.state == MigrationState.DONE else "failed", self._started_at)
        except Exception as e:
            self.last_error = f"following migration {migration_id}: {e}"
            self._record("failed", self._started_at)
        finally:
            self._busy = False
            self.state = "idle"

    # -- RPCs -------------------------------------------------------------------------------

    async def Rebalance(self, request, context):
        left = context.time_remaining()
        try:
            return await self.rebalance(
                "request", request.dry_run, request.wait, None if left is None else max(0.0, left - 0.5)
            )
        except Busy as e:
            await context.abort(grpc.StatusCode.ABORTED, str(e))
        except MoeserveError as e:
            code = e.code if e.code != grpc.StatusCode.UNAUTHENTICATED else grpc.StatusCode.INTERNAL
            await context.abort(code, f"the admin API answered {e.code.name}: {e.message}")

    def _status(self) -> balancer_pb2.BalancerStatus:
        c = self.config
        return balancer_pb2.BalancerStatus(
            window_steps=c.window_steps,
            step_interval=c.step_interval,
            min_balancedness=c.min_balancedness,
            paused=self.paused,
            state=self.state,
            rebalances=self.rebalances,
            last_trigger=self.last_trigger,
            last_migration_id=self.last_migration_id,
            last_error=self.last_error,
            admin_reachable=self.admin_reachable,
            balancedness=self.balancedness,
            placement_version=self.placement_version,
            loop_iterations=self.iterations,
            step_model="" if c.step_model is None else f"{c.step_model.gpu} / {c.step_model.shape}",
            predicted_step_s=self.predicted_step_s,
            step_efficiency=self.step_efficiency,
        )

    async def _store(self, context, **changes) -> balancer_pb2.BalancerStatus:
        """Merge ``changes`` into the settings kept on the leader, then apply them here."""
        try:
            s = await self._admin(self.admin.balancer_settings())
            s = dataclasses.replace(s, **{k: v for k, v in changes.items() if v is not None})
            self._merge(await self._admin(self.admin.put_balancer_settings(s)))
        except MoeserveError as e:
            code = (
                e.code
                if e.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
                else grpc.StatusCode.UNAVAILABLE
            )
            await context.abort(code, f"cannot store the balancer's settings on the leader: {e.message}")
        return self._status()

    async def SetConfig(self, request, context):
        new = {
            k: getattr(request, k) if request.HasField(k) else None
            for k in ("window_steps", "step_interval", "min_balancedness")
        }
        try:
            dataclasses.replace(self.config, **{k: v for k, v in new.items() if v is not None})
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"balancer settings: {e}")
        if new["window_steps"] is not None:
            try:
                rep = await self._admin(self.admin.expert_load())
            except MoeserveError as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot reach the admin API: {e.message}")
            if new["window_steps"] > rep.window_size:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"window_steps must be in 0..{rep.window_size} (the leader's --eplb-window-size; "
                    f"0 = all), got {new['window_steps']}",
                )
        return await self._store(context, **new)

    async def Pause(self, request, context):
        return await self._store(context, paused=True)

    async def Resume(self, request, context):
        return await self._store(context, paused=False)

    async def GetBalancerStatus(self, request, context):
        return self._status()


async def serve_balancer(
    admin_address: str,
    token: str | None,
    config: LoopConfig,
    options: ServerOptions,
    poll_s: float = 0.5,
    call_timeout_s: float = 5.0,
    ca_file: str | None = None,
    on_started=None,
    process_metrics=None,
) -> None:
    """Run the balancer until SIGTERM (call inside an event loop). ``process_metrics``: the
    process's moeserve.ops.metrics.ProcessMetrics, which gets the balancer's and gRPC metrics."""
    from moeserve.services.readiness import Readiness, StepWatch
    from moeserve.services.server import serve_forever

    admin = AsyncClient(admin_address, token, timeout=call_timeout_s, ca_file=ca_file)
    service = BalancerService(admin, config, poll_s)
    watch = StepWatch()

    async def probe():
        s = await admin.status()
        return watch.verdict(s.step, s.error)

    readiness_metrics = None
    if process_metrics is not None:
        from moeserve.ops.metrics import BalancerMetrics

        service.metrics = BalancerMetrics(
            process_metrics.registry,
            paused=lambda: service.paused,
            admin_reachable=lambda: service.admin_reachable,
            balancedness=lambda: service.balancedness,
            predicted_step_s=(lambda: service.predicted_step_s) if config.step_model is not None else None,
            step_efficiency=(lambda: service.step_efficiency) if config.step_model is not None else None,
        )
        from moeserve.services.metrics import grpc_interceptor

        options = dataclasses.replace(
            options, interceptors=(*options.interceptors, grpc_interceptor(process_metrics, BALANCER))
        )
        from moeserve.ops.metrics import ReadinessMetrics

        readiness_metrics = ReadinessMetrics(process_metrics.registry)
    server = ServiceServer(BALANCER, lambda s: balancer_pb2_grpc.add_BalancerServicer_to_server(service, s), options)
    server.readiness = Readiness(probe, readiness_metrics)

    try:  # the stored settings (Pause) hold from the first answer on
        service._merge(await service._admin(asyncio.wait_for(admin.balancer_settings(), call_timeout_s)))
    except Exception as e:  # the loop reads them on its first iteration
        log.warning("cannot read the balancer's settings from the admin API yet: %s", e)

    def started(port):
        service.start()
        if on_started:
            on_started(port)

    await serve_forever(server, started, before_stop=service.stop, after_stop=admin.close)


def _histogram(rep, load: np.ndarray):
    """The window's per-step count histogram [L, E, K] the routers sent (``ExpertLoad.histogram``),
    when it matches the load's shape and holds steps; else None (the policy then takes the window
    sums as Poisson per step)."""
    hist = getattr(rep, "histogram", None)
    if hist is None or hist.shape[:2] != load.shape or not hist.sum():
        return None
    return hist.astype(np.float64)


__all__ = ["BalancerService", "Busy", "serve_balancer"]
