"""Child processes that moeserve starts as ``python -m MODULE`` (the ranks, the front end, the
balancer, ``up`` under the demo): each imports the very moeserve its parent runs, whatever
folder it is started from.

``python -m`` puts the working directory first on ``sys.path``. Started from a folder that
holds a checkout as ``moeserve/`` (a plain ``git clone`` names the folder after the project),
the child would import that folder, which has no ``__init__.py``, as a namespace package in
place of the installed moeserve. So children run with ``-P`` (no working directory on the path)
and find moeserve through ``PYTHONPATH``, led by the folder the parent imported it from.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

import moeserve


def module_command(module: str, *args: str) -> list[str]:
    """The command line that runs ``module`` (``python -m``) in a child, with ``args``."""
    return [sys.executable, "-P", "-m", module, *args]


def source_root() -> str:
    """The folder this process imported moeserve from (the one that holds ``moeserve/``)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(moeserve.__file__)))


def child_env(env: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``env`` (default: this process's environment) and ``extra``, with ``PYTHONPATH`` led by
    :func:`source_root`, so that a child started with :func:`module_command` imports the same
    moeserve (an installed one, an editable one or a bare source checkout alike)."""
    out = dict(os.environ if env is None else env, **extra)
    root = source_root()
    rest = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    out["PYTHONPATH"] = os.pathsep.join([root, *rest])
    return out
