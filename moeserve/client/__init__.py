"""The moeserve client SDK: one client class for all three services.

    from moeserve.client import Client
    out = Client("127.0.0.1:8000").generate(prompt_token_ids=[1, 2, 3], max_tokens=16)
    out.token_ids                                    # the generated ids
    admin = Client("127.0.0.1:8001", token="T")
    p = admin.placement()                            # .phy2log [L, P], .version
    admin.apply_placement(new_phy2log, expected_version=p.version, wait=True)
    Client("127.0.0.1:8002", token="T").rebalance(dry_run=True)

:class:`Client` blocks; :class:`AsyncClient` has the same methods as coroutines. A call reaches
the service at its address; a method of another service answers UNIMPLEMENTED naming the right
one. Every failure raises :class:`MoeserveError` with ``.code`` (a ``grpc.StatusCode``) and the
server's ``.message``; calls are retried on UNAVAILABLE only.
"""
from moeserve.client.aio import AsyncClient
from moeserve.client.sync import Client
from moeserve.client.types import (ApplyResult, Balancedness, BalancerStatus, ClusterStatus, ExpertLoad, GenerateChunk,
                                   GenerateResult, LoadDump, Migration, MoeserveError, Placement, RebalanceResult, Usage)

__all__ = ["AsyncClient", "ApplyResult", "Balancedness", "BalancerStatus", "Client", "ClusterStatus", "ExpertLoad",
           "GenerateChunk", "GenerateResult", "LoadDump", "Migration", "MoeserveError", "Placement",
           "RebalanceResult", "Usage"]
