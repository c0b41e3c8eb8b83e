"""``AsyncClient``: the asyncio SDK, the same methods as :class:`~moeserve.client.Client`."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from types import EllipsisType

import grpc

from moeserve.client import _base
from moeserve.client.types import (
    ApplyResult,
    BalancerSettings,
    BalancerStatus,
    ClusterStatus,
    ExpertLoad,
    GenerateChunk,
    GenerateResult,
    LoadDump,
    MoeserveError,
    RebalanceResult,
)
from moeserve.placement import MigrationProgress, MigrationState, Placement
from moeserve.rpc import admin_pb2, admin_pb2_grpc, balancer_pb2, balancer_pb2_grpc, serving_pb2_grpc
from moeserve.wire import migration_from_msg, placement_from_msg


class AsyncClient:
    """As :class:`~moeserve.client.Client`, with ``async`` methods (``generate_stream`` is an
    async iterator). Create it inside the event loop that uses it."""

    def __init__(
        self,
        address: str,
        token: str | None = None,
        *,
        timeout: float = _base.DEFAULT_TIMEOUT_S,
        tls: bool = False,
        ca_file: str | None = None,
        max_message_bytes: int = 256 << 20,
    ):
        target, creds, opts, self._metadata = _base.channel_args(address, token, tls, ca_file, max_message_bytes)
        self.address = address
        self.timeout = timeout
        self._channel = (
            grpc.aio.secure_channel(target, creds, opts) if creds else grpc.aio.insecure_channel(target, opts)
        )
        self._serving = serving_pb2_grpc.ServingStub(self._channel)
        self._admin = admin_pb2_grpc.AdminStub(self._channel)
        self._balancer = balancer_pb2_grpc.BalancerStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _call(self, method, request, timeout: float | None | EllipsisType = ...):  # ...: self.timeout
        timeout = self.timeout if timeout is ... else timeout
        pauses = list(_base.RETRY_DELAYS_S)
        while True:
            try:
                return await method(request, timeout=timeout, metadata=self._metadata)
            except grpc.RpcError as e:
                pause = _base.retry_pause(e, pauses)
                if pause is None:
                    raise _base.error(e) from None
            await asyncio.sleep(pause)

    # -- serving ----------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids=None,
        max_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_token_ids=(),
        ignore_eos: bool = False,
        cache_salt: str = "",
        timeout: float | None = None,
    ) -> GenerateResult:
        req = _base.generate_request(
            prompt,
            prompt_token_ids,
            max_tokens,
            temperature,
            top_p,
            top_k,
            seed,
            stop_token_ids,
            ignore_eos,
            cache_salt,
        )
        return GenerateResult.from_msg(await self._call(self._serving.Generate, req, timeout))

    async def generate_stream(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids=None,
        max_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_token_ids=(),
        ignore_eos: bool = False,
        cache_salt: str = "",
        timeout: float | None = None,
    ):
        req = _base.generate_request(
            prompt,
            prompt_token_ids,
            max_tokens,
            temperature,
            top_p,
            top_k,
            seed,
            stop_token_ids,
            ignore_eos,
            cache_salt,
        )
        pauses = list(_base.RETRY_DELAYS_S)
        while True:
            call = self._serving.GenerateStream(req, timeout=timeout, metadata=self._metadata)
            started = False  # once a chunk came, the stream reached a server
            try:
                async for m in call:
                    started = True
                    yield GenerateChunk.from_msg(m)
                return
            except grpc.RpcError as e:
                pause = None if started else _base.retry_pause(e, pauses)
                if pause is None:
                    raise _base.error(e) from None
            finally:
                call.cancel()
            await asyncio.sleep(pause)

    # -- admin ------------------------------------------------------------------------------

    async def placement(self) -> Placement:
        return placement_from_msg(await self._call(self._admin.GetPlacement, admin_pb2.GetPlacementRequest()))

    async def apply_placement(
        self,
        phy2log=None,
        *,
        expected_version: int | None = None,
        dry_run: bool = False,
        wait: bool = False,
        file: str | None = None,
        file_format: str | None = None,
        timeout: float | None = None,
        breakeven=None,
    ) -> ApplyResult:
        req = _base.apply_request(phy2log, expected_version, dry_run, file, file_format, breakeven)
        res = ApplyResult.from_msg(await self._call(self._admin.ApplyPlacement, req))
        if wait and not dry_run and res.migration_id:
            mig = await self.wait_migration(res.migration_id, timeout or _base.WAIT_TIMEOUT_S)
            res = dataclasses.replace(res, migration=mig)
        return res

    async def migration(self, migration_id: str, wait_s: float = 0.0) -> MigrationProgress:
        req = admin_pb2.GetMigrationRequest(migration_id=migration_id, wait_s=wait_s)
        return migration_from_msg(await self._call(self._admin.GetMigration, req, max(self.timeout, wait_s + 5)))

    async def wait_migration(self, migration_id: str, timeout: float = _base.WAIT_TIMEOUT_S) -> MigrationProgress:
        deadline = time.monotonic() + timeout
        while True:
            mig = await self.migration(migration_id, wait_s=min(5.0, max(0.0, deadline - time.monotonic())))
            if mig.ended:
                if mig.state != MigrationState.DONE:
                    raise MoeserveError(grpc.StatusCode.ABORTED, f"migration {migration_id} {mig.state}: {mig.error}")
                return mig
            if time.monotonic() > deadline:
                raise MoeserveError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"migration {migration_id} still {mig.state} after {timeout:.0f} s",
                )

    async def abort_migration(self) -> bool:
        return (await self._call(self._admin.AbortMigration, admin_pb2.AbortMigrationRequest())).aborted

    async def expert_load(self, window_steps: int = 0) -> ExpertLoad:
        req = admin_pb2.GetExpertLoadRequest(window_steps=window_steps)
        return ExpertLoad.from_msg(await self._call(self._admin.GetExpertLoad, req))

    async def dump_load(self) -> LoadDump:
        return LoadDump.from_msg(await self._call(self._admin.DumpLoad, admin_pb2.DumpLoadRequest()))

    async def status(self) -> ClusterStatus:
        return ClusterStatus.from_msg(await self._call(self._admin.GetStatus, admin_pb2.GetStatusRequest()))

    async def balancer_settings(self) -> BalancerSettings:
        return BalancerSettings.from_msg(
            await self._call(self._admin.GetBalancerSettings, admin_pb2.GetBalancerSettingsRequest())
        )

    async def put_balancer_settings(self, settings: BalancerSettings) -> BalancerSettings:
        return BalancerSettings.from_msg(await self._call(self._admin.PutBalancerSettings, settings.to_msg()))

    # -- balancer ---------------------------------------------------------------------------

    async def rebalance(
        self, dry_run: bool = False, wait: bool = False, timeout: float | None = None
    ) -> RebalanceResult:
        req = balancer_pb2.RebalanceRequest(dry_run=dry_run, wait=wait)
        t = timeout if timeout is not None else (_base.WAIT_TIMEOUT_S if wait else self.timeout)
        return RebalanceResult.from_msg(await self._call(self._balancer.Rebalance, req, t))

    async def set_config(
        self, window_steps: int | None = None, step_interval: int | None = None, min_balancedness: float | None = None
    ) -> BalancerStatus:
        req = _base.balancer_config(window_steps, step_interval, min_balancedness)
        return BalancerStatus.from_msg(await self._call(self._balancer.SetConfig, req))

    async def pause(self) -> BalancerStatus:
        return BalancerStatus.from_msg(await self._call(self._balancer.Pause, balancer_pb2.PauseRequest()))

    async def resume(self) -> BalancerStatus:
        return BalancerStatus.from_msg(await self._call(self._balancer.Resume, balancer_pb2.ResumeRequest()))

    async def balancer_status(self) -> BalancerStatus:
        return BalancerStatus.from_msg(
            await self._call(self._balancer.GetBalancerStatus, balancer_pb2.GetBalancerStatusRequest())
        )
