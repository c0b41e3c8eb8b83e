"""CUDA graph capture while serving, without ``torch.cuda.graph``'s cache flushes.

``torch.cuda.graph`` begins every capture with ``torch.cuda.synchronize()``,
``torch.cuda.empty_cache()`` and ``torch._C._host_emptyCache()``: it hands every cached device
block back to the driver and frees every cached pinned host buffer (each ``cudaFreeHost``
waits for the device). That suits captures made once at start. moeserve also captures lazily
while it serves (a decode bucket's second use, ``moeserve.router.graphs``; an exchange body's
second use in an eager step, ``moeserve.dataplane.nvlink``), and there each flush would make the
next steps allocate everything again. A precaution, not measured: the 2.5-3.8 s eager steps at
the start of a burst on an H200 host were most likely Triton recompiles
(tests/test_triton_specialization.py).

``capture`` keeps the synchronisation (the capture stream must not overlap work enqueued before
it) and the side stream, and leaves the caches alone.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

_streams: dict[int, torch.cuda.Stream] = {}


def _side_stream() -> torch.cuda.Stream:
    dev = torch.cuda.current_device()
    if dev not in _streams:
        _streams[dev] = torch.cuda.Stream()
    return _streams[dev]


@contextmanager
def capture(graph: torch.cuda.CUDAGraph, pool=None, capture_error_mode: str = "thread_local"):
    """Record the CUDA work of the block into ``graph`` (on a side stream, into memory ``pool``
    when given: a ``torch.cuda.graph_pool_handle()``), as ``torch.cuda.graph`` does but without
    emptying the device and pinned-host allocator caches first."""
    torch.cuda.synchronize()
    stream = _side_stream()
    with torch.cuda.stream(stream):
        graph.capture_begin(pool, capture_error_mode=capture_error_mode)
        try:
            yield graph
        finally:
            graph.capture_end()
