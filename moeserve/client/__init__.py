"""The moeserve client SDK: one client class for all three services.

    from moeserve.client import Client
    out = Client("127.0.0.1:8000").generate(prompt_token_ids=[1, 2, 3], max_tokens=16)
    out.token_ids                                    # the generated ids
    admin = Client("127.0.0.1:8001", token="T")
    p = admin.placement()                            # a moeserve.placement.Placement: .phy2log [L, P], .version
    admin.apply_placement(new_phy2log, expected_version=p.version, wait=True)
    Client("127.0.0.1:8002", token="T").rebalance(dry_run=True)

:class:`Client` blocks; :class:`AsyncClient` has the same methods as coroutines. A call reaches
the service at its address; a method of another service answers UNIMPLEMENTED naming the right
one. Results are frozen dataclasses; placements and migrations are the engine's own value types
(:class:`~moeserve.placement.Placement`, :class:`~moeserve.placement.MigrationProgress`). Every
failure raises :class:`MoeserveError` with ``.code`` (a ``grpc.StatusCode``) and the server's
``.message``. A call is retried only when it reached no server (UNAVAILABLE from the transport,
e.g. a refused connection), so that Generate, ApplyPlacement and Rebalance never run twice.

The SDK imports :mod:`moeserve.wire`, :mod:`moeserve.placement` and the generated code only:
no server code, no torch.
"""

from moeserve.client.aio import AsyncClient
from moeserve.client.sync import Client
from moeserve.client.types import (
    ApplyResult,
    BalancerSettings,
    BalancerStatus,
    ClusterStatus,
    EplbInfo,
    ExpertLoad,
    GenerateChunk,
    GenerateResult,
    LoadDump,
    ModelInfo,
    MoeserveError,
    RankInfo,
    RebalanceResult,
    Usage,
)
from moeserve.placement import MigrationProgress, MigrationState, Placement
from moeserve.wire import Balancedness

__all__ = [
    "AsyncClient",
    "ApplyResult",
    "Balancedness",
    "BalancerSettings",
    "BalancerStatus",
    "Client",
    "ClusterStatus",
    "EplbInfo",
    "ExpertLoad",
    "GenerateChunk",
    "GenerateResult",
    "LoadDump",
    "MigrationProgress",
    "MigrationState",
    "ModelInfo",
    "MoeserveError",
    "Placement",
    "RankInfo",
    "RebalanceResult",
    "Usage",
]
