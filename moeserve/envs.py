"""The ``MOESERVE_*`` environment variables, by name, and a warning for the ones no part of
moeserve reads (docs/operations.md, "Environment variables", says what each does).

Each variable is read and checked where it is used (a bad value is refused by name there); this
module only knows the names, so that a variable set with a typo, or a measurement switch since
removed, is said when a cluster or a service starts instead of changing nothing in silence.
tests/test_docs.py keeps ``READ`` equal to the names the code reads and to the docs' table.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping

# read by moeserve's processes (the packages moeserve, router, expert_worker, balancer)
READ = frozenset(
    {
        "MOESERVE_ADMIN_TOKEN",
        "MOESERVE_API_KEY",
        "MOESERVE_ATTENTION_PREFILL",
        "MOESERVE_ATTENTION_PREFILL_TILING",
        "MOESERVE_AUTHKEY",
        "MOESERVE_CLUSTER_CONFIG",
        "MOESERVE_CONTROL_KEY",
        "MOESERVE_DUMMY_HOT_EXPERTS",
        "MOESERVE_DUMMY_ROUTING",
        "MOESERVE_EPLB_BREAKEVEN",
        "MOESERVE_EXPERT_BLOCK_M",
        "MOESERVE_EXPERT_KERNEL",
        "MOESERVE_EXPERT_TUNING",
        "MOESERVE_FP8_A8_TUNING",
        "MOESERVE_FP8_ACTIVATIONS",
        "MOESERVE_FP8_PREFILL_BLOCK_M",
        "MOESERVE_FP8_TUNING",
        "MOESERVE_FUSED_GROUPED_ROUTING",
        "MOESERVE_FUSED_NORMS",
        "MOESERVE_FUSED_ROUTING",
        "MOESERVE_GATE_SPLIT",
        "MOESERVE_LOG_LEVEL",
        "MOESERVE_MERGED_PROJECTIONS",
        "MOESERVE_METRICS_PORT",
        "MOESERVE_MIXED_TOKEN_BUCKETS",
        "MOESERVE_PACER_LEARN_LEAD",
        "MOESERVE_PARENT_PID",
        "MOESERVE_PROFILE",
        "MOESERVE_RUN_DIR",
        "MOESERVE_STARTUP_TIMEOUT_S",
        "MOESERVE_STREAM_COALESCE",
    }
)
# read around moeserve, not by it: the compose files (ports, model folder, image), the set-up
# script's virtual environment, the benchmarks' record of the commit they ran, the tests' knobs
# (the live compose test's Debian mirror, the idle cluster test's length)
AROUND = frozenset(
    {
        "MOESERVE_BALANCER_PORT",
        "MOESERVE_BASE_IMAGE",
        "MOESERVE_DEBIAN_MIRROR",
        "MOESERVE_GIT_COMMIT",
        "MOESERVE_GRPC_PORT",
        "MOESERVE_HTTP_PORT",
        "MOESERVE_IDLE_TEST_S",
        "MOESERVE_IMAGE_TAG",
        "MOESERVE_MODEL",
        "MOESERVE_VENV",
    }
)

log = logging.getLogger(__name__)


def unknown(environ: Mapping[str, str] | None = None) -> list[str]:
    """The ``MOESERVE_*`` names set in ``environ`` (default: this process's) that nothing reads,
    sorted."""
    env = os.environ if environ is None else environ
    return sorted(k for k in env if k.startswith("MOESERVE_") and k not in READ and k not in AROUND)


def warn_unknown(environ: Mapping[str, str] | None = None) -> list[str]:
    """One warning per unknown ``MOESERVE_*`` name (``unknown``), with the closest known name
    where one is close (a typo); returns the names."""
    names = unknown(environ)
    for name in names:
        close = difflib.get_close_matches(name, sorted(READ), n=1, cutoff=0.85)
        hint = f"did you mean {close[0]}?" if close else "a switch since removed?"
        log.warning("%s is set but no moeserve process reads it (%s the table in docs/operations.md)", name, hint)
    return names
