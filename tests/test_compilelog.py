"""moeserve.kernels.compilelog: Triton's JIT hooks log each compile with its specialization and time."""

import logging

import pytest

from moeserve.kernels import compilelog

pytestmark = pytest.mark.timeout(60)
knobs = pytest.importorskip("triton").knobs


@pytest.fixture
def hooks():
    saved = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook, compilelog._installed)
    knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None
    compilelog._installed = False
    yield
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook, compilelog._installed = saved


def test_a_compile_is_logged_with_its_kernel_and_time(hooks, caplog, monkeypatch):
    assert compilelog.watch() and compilelog.watch()  # idempotent
    monkeypatch.setattr(compilelog, "SLOW_COMPILE_S", -1.0)  # every compile counts as slow
    with caplog.at_level(logging.INFO, logger=compilelog.__name__):
        # what Triton's JITFunction._do_compile calls around a compile
        assert knobs.runtime.jit_cache_hook(key=("k", 1), repr="race_kernel[num_warps=4](S: i32)") is None
        knobs.runtime.jit_post_compile_hook(key=("k", 1), repr="race_kernel[num_warps=4](S: i32)")
    assert compilelog.counts["race_kernel"] >= 1
    rec = [r for r in caplog.records if "while serving" in r.getMessage()]
    assert len(rec) == 1 and rec[0].levelno == logging.WARNING and "race_kernel" in rec[0].getMessage()


def test_hooks_someone_else_set_are_left_alone(hooks):
    def mine(**_):
        return None

    knobs.runtime.jit_cache_hook = mine
    assert not compilelog.watch() and knobs.runtime.jit_cache_hook is mine
