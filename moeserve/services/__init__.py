"""The gRPC services of ``proto/moeserve/v1``: the shared server plumbing (server.py), the one
exception -> status table (errors.py), the gRPC metrics interceptor (metrics.py), the serving
front end (frontend.py) and the leader's admin API (admin.py); proto <-> value conversions are
in ``moeserve.wire``. The balancer service lives in ``moeserve.balancer.service``.

Nothing in the data plane imports this package: the leader starts the admin server only
through ``ClusterConfig.leader_hook`` (``admin.serve_admin``), and imports it then.
"""
