"""The gRPC services of ``proto/moeserve/v1``: the shared server plumbing (server.py), array
conversions (convert.py), the serving front end (frontend.py) and the leader's admin API
(admin.py). The balancer service lives in ``moeserve.balancer.service``.

Nothing in the data plane imports this package: the leader starts the admin server only when
its configuration asks for one, and imports it then.
"""
