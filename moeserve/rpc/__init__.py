"""Generated gRPC code of ``proto/moeserve/v1`` (``python -m moeserve.rpc.generate``).

Only the service modules, the client SDK and the CLI import this package; the data plane never
does (the GPU machines have no protobuf compiler, and the step loop has no use for it).
"""
