"""moeserve.router: the attention side of the model (installed from the top-level ``router/``).

A router rank holds everything but the routed experts: embeddings, attention and KV cache,
norms, the gate, shared experts and the LM head. Router rank 0 (the leader) drives the steps.
"""
