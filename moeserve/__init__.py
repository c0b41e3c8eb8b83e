"""moeserve: expert-parallel Mixture-of-Experts serving with online EPLB.

Shared code lives here (configuration, models, checkpoint reading, the placement type, the
dispatch wire format, the client SDK and the CLI). The services are installed beside it as
``moeserve.router``, ``moeserve.expert_worker`` and ``moeserve.balancer`` (top-level folders
``router/``, ``expert_worker/`` and ``balancer/`` in the repository).
"""

__version__ = "0.1.0"
