"""moeserve: expert-parallel Mixture-of-Experts serving with online EPLB.

Shared code lives here (configuration, models, checkpoint reading, the placement type, the
data plane, the client SDK and the CLI). The services are installed beside it as
``moeserve.router``, ``moeserve.expert_worker`` and ``moeserve.balancer`` (top-level folders
``router/``, ``expert_worker/`` and ``balancer/`` in the repository; docs/architecture.md).
"""

import os as _os

from moeserve.version import __version__

# moeserve forks only to exec (its ranks, replacements, the front end: preexec_fn sets their death
# signal, so subprocess forks instead of spawning). gRPC's fork handlers would then run in the
# child before its exec, with the parent's pollers: a fork while another thread calls into gRPC
# aborted the child ("epoll_wait error: Bad file descriptor", SIGABRT) under load. Off unless the
# user asks for them; read when gRPC initialises, so this holds where moeserve is imported first.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    """vLLM's offline API (``from moeserve import LLM, SamplingParams``; moeserve.llm), imported
    on first use so that ``import moeserve`` stays light."""
    if name in ("LLM", "SamplingParams"):
        # By name, not an import statement: the package itself (which every module's import
        # passes through) does not depend on the offline API and what it starts.
        import importlib

        return getattr(importlib.import_module("moeserve.llm"), name)
    raise AttributeError(f"module 'moeserve' has no attribute {name!r}")


# Run from a source checkout (a bare copy of the repository on a GPU machine, or a rank started
# with the checkout as its working directory), this folder shadows the installed package and its
# package-dir mapping: make the top-level service folders moeserve's subpackages here too.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isfile(
    _os.path.join(_root, "router", "__init__.py")
):
    __path__.append(_root)
