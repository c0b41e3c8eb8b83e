"""Clusters of router and expert-worker ranks: launcher, rank entry point, step protocol.

``from moeserve.cluster import LocalCluster`` (see launcher.py). The protocol is described
in docs/dataplane.md. Nothing here imports the generated gRPC code.
"""


def __getattr__(name):
    # Lazy, so that ``python -m moeserve.cluster.rank`` does not import the launcher.
    if name in ("LocalCluster", "Generation"):
        from moeserve.cluster import launcher

        return getattr(launcher, name)
    if name == "ClusterError":
        from moeserve.router.engine.channel import ClusterError

        return ClusterError
    raise AttributeError(name)


__all__ = ["LocalCluster", "Generation", "ClusterError"]
