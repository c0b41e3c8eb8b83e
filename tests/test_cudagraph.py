"""moeserve.kernels.cudagraph.capture: what it asks of torch.cuda, checked with a stand-in (no GPU here;
the serving benchmark's GPU runs capture for real)."""

import pytest
import torch

from moeserve.kernels import cudagraph

pytestmark = pytest.mark.timeout(60)


class FakeGraph:
    def __init__(self, calls):
        self.calls = calls

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self.calls.append(("begin", pool, capture_error_mode, torch.cuda.current_stream()))

    def capture_end(self):
        self.calls.append(("end",))


@pytest.fixture
def fake_cuda(monkeypatch):
    calls = []
    current = ["default"]

    class Ctx:
        def __init__(self, s):
            self.s = s

        def __enter__(self):
            self.prev, current[0] = current[0], self.s

        def __exit__(self, *a):
            current[0] = self.prev

    def refuse(name):
        def f(*a, **k):
            raise AssertionError(f"capture must not call {name}: it flushes the allocator caches mid-serving")

        return f

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(("sync",)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: "side")
    monkeypatch.setattr(torch.cuda, "stream", Ctx)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: current[0])
    monkeypatch.setattr(torch.cuda, "empty_cache", refuse("torch.cuda.empty_cache"))
    monkeypatch.setattr(torch._C, "_host_emptyCache", refuse("torch._C._host_emptyCache"), raising=False)
    monkeypatch.setattr(cudagraph, "_streams", {})
    return calls


def test_capture_syncs_records_on_a_side_stream_and_keeps_the_caches(fake_cuda):
    g = FakeGraph(fake_cuda)
    with cudagraph.capture(g, pool="pool"):
        fake_cuda.append(("body", torch.cuda.current_stream()))
    assert fake_cuda == [("sync",), ("begin", "pool", "thread_local", "side"), ("body", "side"), ("end",)]
    assert torch.cuda.current_stream() == "default"  # the side stream is left afterwards


def test_a_failing_body_still_ends_the_capture(fake_cuda):
    g = FakeGraph(fake_cuda)
    with pytest.raises(RuntimeError, match="boom"):
        with cudagraph.capture(g):
            raise RuntimeError("boom")
    assert fake_cuda[-1] == ("end",) and torch.cuda.current_stream() == "default"
