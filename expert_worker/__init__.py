"""moeserve.expert_worker: the routed experts (installed from the top-level ``expert_worker/``).

A worker holds ``P / W`` physical slots per MoE layer, loaded straight from the checkpoint by
logical expert id, runs them as a grouped matmul and moves expert weights to and from peers.
"""
