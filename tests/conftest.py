"""Suite-wide settings: one torch thread (the CI machine has 2 cores and runs tests serially)."""
import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory):
    """The demo's checkpoint (Llama 4, 2 hot experts per MoE layer), written once per session."""
    from moeserve.demo import ensure_checkpoint
    folder, _ = ensure_checkpoint(tmp_path_factory.mktemp("demo-cache"))
    return folder
