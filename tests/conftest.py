"""Suite-wide settings: one torch thread (the CI machine has 2 cores and runs tests serially);
Triton kernels run in Triton's interpreter (no GPU here). TRITON_INTERPRET is read when Triton
defines its kernels, so it is set before anything imports Triton."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory):
    """The demo's checkpoint (Llama 4, 2 hot experts per MoE layer), written once per session."""
    from moeserve.demo import ensure_checkpoint

    folder, _ = ensure_checkpoint(tmp_path_factory.mktemp("demo-cache"))
    return folder


def pytest_terminal_summary(terminalreporter):
    """The live compose test's phase times and image size, in the run's log (tests/test_compose_live.py)."""
    import sys

    mod = sys.modules.get("test_compose_live")
    lines = getattr(mod, "SUMMARY", None) if mod is not None else None
    if lines:
        terminalreporter.section("live compose cluster")
        for line in lines:
            terminalreporter.line(line)
