"""``Client``: the blocking SDK for all three services (see moeserve/client/__init__.py)."""

from __future__ import annotations

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


class Client:
    """A connection to one moeserve service at ``address`` ("host:port").

    token: the bearer token of the admin and balancer services (default: MOESERVE_ADMIN_TOKEN).
    timeout: the default deadline of a call in seconds (generation has none unless given).
    tls / ca_file: connect with TLS (ca_file: the PEM of the CA that signed the server's cert).
    Every method raises :class:`MoeserveError` (``.code`` a grpc.StatusCode) on failure; a call
    is retried only when it reached no server (UNAVAILABLE from the transport), so that no call
    runs twice. A method of a service this address does not serve answers UNIMPLEMENTED with a
    message naming the right one.
    """

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
        self._channel = grpc.secure_channel(target, creds, opts) if creds else grpc.insecure_channel(target, opts)
        self._serving = serving_pb2_grpc.ServingStub(self._channel)
        self._admin = admin_pb2_grpc.AdminStub(self._channel)
        self._balancer = balancer_pb2_grpc.BalancerStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method, request, timeout: float | None | EllipsisType = ...):  # ...: self.timeout
        timeout = self.timeout if timeout is ... else timeout
        pauses = list(_base.RETRY_DELAYS_S)
        while True:
            try:
                return method(request, timeout=timeout, metadata=self._metadata)
            except grpc.RpcError as e:
                pause = _base.retry_pause(e, pauses)
                if pause is None:
                    raise _base.error(e) from None
            time.sleep(pause)

    # -- serving ----------------------------------------------------------------------------

    def generate(
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
        """Generate for prompt text or ``prompt_token_ids``; ``.token_ids`` are the generated ids,
        ``.usage.cached_tokens`` the prompt tokens read from the prefix cache (``cache_salt``:
        share cached blocks only with requests of the same salt)."""
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
        return GenerateResult.from_msg(self._call(self._serving.Generate, req, timeout))

    def generate_stream(
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
        """Yield :class:`GenerateChunk` s as tokens are sampled; leaving the loop early cancels."""
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
                for m in call:
                    started = True
                    yield GenerateChunk.from_msg(m)
                return
            except grpc.RpcError as e:
                pause = None if started else _base.retry_pause(e, pauses)
                if pause is None:
                    raise _base.error(e) from None
            finally:
                call.cancel()
            time.sleep(pause)

    # -- admin ------------------------------------------------------------------------------

    def placement(self) -> Placement:
        """The placement in force: ``.phy2log`` [L, P], ``.version``, ``.layer_versions`` [L],
        ``.num_logical``, ``.num_workers``, ``.workers_per_node``, ``.breakeven`` [L, E]."""
        return placement_from_msg(self._call(self._admin.GetPlacement, admin_pb2.GetPlacementRequest()))

    def apply_placement(
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
        """Migrate to ``phy2log`` [L, P] (or a placement file: moeserve JSON, SGLang .json/.pt)
        live. ``expected_version``: refuse (FAILED_PRECONDITION) unless it is in force;
        ``dry_run``: validate and plan only; ``wait``: return when the migration ended (an
        aborted or failed one raises ABORTED). ``breakeven`` [L, E]: the break-even counts b of
        the data plane's replica rule that take effect with it (None: a phy2log or an SGLang
        file keeps those in force)."""
        req = _base.apply_request(phy2log, expected_version, dry_run, file, file_format, breakeven)
        res = ApplyResult.from_msg(self._call(self._admin.ApplyPlacement, req))
        if wait and not dry_run and res.migration_id:
            mig = self.wait_migration(res.migration_id, timeout or _base.WAIT_TIMEOUT_S)
            res = dataclasses.replace(res, migration=mig)
        return res

    def migration(self, migration_id: str, wait_s: float = 0.0) -> MigrationProgress:
        """A migration's progress; with ``wait_s`` the server answers once it ended, or after wait_s."""
        req = admin_pb2.GetMigrationRequest(migration_id=migration_id, wait_s=wait_s)
        return migration_from_msg(self._call(self._admin.GetMigration, req, max(self.timeout, wait_s + 5)))

    def wait_migration(self, migration_id: str, timeout: float = _base.WAIT_TIMEOUT_S) -> MigrationProgress:
        """Follow a migration to its end; raise ABORTED when it did not finish."""
        deadline = time.monotonic() + timeout
        while True:
            mig = self.migration(migration_id, wait_s=min(5.0, max(0.0, deadline - time.monotonic())))
            if mig.ended:
                if mig.state != MigrationState.DONE:
                    raise MoeserveError(grpc.StatusCode.ABORTED, f"migration {migration_id} {mig.state}: {mig.error}")
                return mig
            if time.monotonic() > deadline:
                raise MoeserveError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"migration {migration_id} still {mig.state} after {timeout:.0f} s",
                )

    def abort_migration(self) -> bool:
        return self._call(self._admin.AbortMigration, admin_pb2.AbortMigrationRequest()).aborted

    def expert_load(self, window_steps: int = 0) -> ExpertLoad:
        """The load window (or its last ``window_steps`` steps) and its balancedness."""
        req = admin_pb2.GetExpertLoadRequest(window_steps=window_steps)
        return ExpertLoad.from_msg(self._call(self._admin.GetExpertLoad, req))

    def dump_load(self) -> LoadDump:
        return LoadDump.from_msg(self._call(self._admin.DumpLoad, admin_pb2.DumpLoadRequest()))

    def status(self) -> ClusterStatus:
        return ClusterStatus.from_msg(self._call(self._admin.GetStatus, admin_pb2.GetStatusRequest()))

    def balancer_settings(self) -> BalancerSettings:
        """The balancer's settings kept on the leader."""
        return BalancerSettings.from_msg(
            self._call(self._admin.GetBalancerSettings, admin_pb2.GetBalancerSettingsRequest())
        )

    def put_balancer_settings(self, settings: BalancerSettings) -> BalancerSettings:
        return BalancerSettings.from_msg(self._call(self._admin.PutBalancerSettings, settings.to_msg()))

    # -- balancer ---------------------------------------------------------------------------

    def rebalance(self, dry_run: bool = False, wait: bool = False, timeout: float | None = None) -> RebalanceResult:
        """Plan now; unless ``dry_run`` apply it (``wait``: answer when the migration ended).
        A rebalance while another one runs raises ABORTED."""
        req = balancer_pb2.RebalanceRequest(dry_run=dry_run, wait=wait)
        t = timeout if timeout is not None else (_base.WAIT_TIMEOUT_S if wait else self.timeout)
        return RebalanceResult.from_msg(self._call(self._balancer.Rebalance, req, t))

    def set_config(
        self, window_steps: int | None = None, step_interval: int | None = None, min_balancedness: float | None = None
    ) -> BalancerStatus:
        req = _base.balancer_config(window_steps, step_interval, min_balancedness)
        return BalancerStatus.from_msg(self._call(self._balancer.SetConfig, req))

    def pause(self) -> BalancerStatus:
        return BalancerStatus.from_msg(self._call(self._balancer.Pause, balancer_pb2.PauseRequest()))

    def resume(self) -> BalancerStatus:
        return BalancerStatus.from_msg(self._call(self._balancer.Resume, balancer_pb2.ResumeRequest()))

    def balancer_status(self) -> BalancerStatus:
        return BalancerStatus.from_msg(
            self._call(self._balancer.GetBalancerStatus, balancer_pb2.GetBalancerStatusRequest())
        )
