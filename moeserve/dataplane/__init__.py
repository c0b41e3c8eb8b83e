"""The data plane: what every rank runs in lockstep, free of gRPC and protobuf.

``exchange`` (topology, the replica rule, the Exchange interface), ``collective`` and ``nvlink``
(the two exchanges), ``protocol`` (the step header and each rank's result) and ``step`` (the
step loop and a rank's state). docs/dataplane.md describes the protocol."""
