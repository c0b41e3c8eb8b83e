"""moeserve.ops.gcpause: the start-up heap leaves the collector's reach and slow collections are logged."""

import gc
import logging

import pytest

from moeserve.ops import gcpause

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def clean_gc():
    yield
    gc.unfreeze()
    while gcpause._callback in gc.callbacks:
        gc.callbacks.remove(gcpause._callback)
    gcpause._watching = False


def test_freezing_moves_the_heap_out_of_full_collections(clean_gc):
    keep = [[i] for i in range(50_000)]  # long-lived start-up state
    n = gcpause.freeze_startup_heap()
    # frozen objects may still be freed by another thread (none is frozen later): at most n remain
    assert n >= len(keep) and n - 1000 <= gc.get_freeze_count() <= n
    assert not any(o is keep for o in gc.get_objects(2))  # a full collection no longer walks it
    junk = [[i] for i in range(1000)]  # what serving allocates later is collected as usual
    assert any(o is junk for o in gc.get_objects())


def test_a_slow_collection_is_logged_with_its_generation(clean_gc, monkeypatch, caplog):
    gcpause.watch()
    gcpause.watch()  # idempotent: one callback
    assert gc.callbacks.count(gcpause._callback) == 1
    monkeypatch.setattr(gcpause, "SLOW_GC_S", 0.0)
    with caplog.at_level(logging.WARNING, logger=gcpause.__name__):
        gc.collect(1)
    lines = [r.getMessage() for r in caplog.records if "slow garbage collection" in r.getMessage()]
    assert lines and "generation 1 took" in lines[0]
    monkeypatch.setattr(gcpause, "SLOW_GC_S", 10.0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=gcpause.__name__):
        gc.collect(1)
    assert not [r for r in caplog.records if "slow garbage collection" in r.getMessage()]
