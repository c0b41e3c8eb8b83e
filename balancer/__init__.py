"""moeserve.balancer: the EPLB control plane (installed from the top-level ``balancer/``).

Pure numpy placement policies (no torch.distributed, no gRPC) and, around them, the stateless
balancer service that pulls load from the leader and applies placements through it.
"""
