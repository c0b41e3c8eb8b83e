"""Suite-wide settings: one torch thread (the CI machine has 2 cores and .ci/run runs two test
files at a time, one per pytest-xdist worker);
Triton kernels run in Triton's interpreter (no GPU here). TRITON_INTERPRET is read when Triton
defines its kernels, so it is set before anything imports Triton."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # as moeserve/__init__.py says, before any grpc import

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


# -- Triton's interpreter: a row's dot product must not depend on the rows beside it ----------
#
# On a GPU each row of a `tl.dot` tile sums its K products in one order whatever the tile's row
# count (BM), and the kernels rely on it: a step's rows per pass follow its slot count, so an
# expert row must come out bitwise the same at 16, 32 and 64 rows per pass (EPLB on = off).
# Triton's interpreter computes `tl.dot` with numpy's matmul, that is the host's BLAS, and that
# is not row-invariant on every CPU: OpenBLAS's Haswell and Zen kernels (the ones it picks on an
# AMD EPYC with AVX-512) round a row differently at 16, 32 and 64 rows. The suite's dot sums
# each row's products in K order, in the accumulator's dtype, independent of the rows around it.


def _row_invariant_dot(a, b, dtype):
    out = np.zeros((*a.shape[:-1], b.shape[-1]), dtype=dtype)
    a = a.astype(dtype, copy=False)
    b = b.astype(dtype, copy=False)
    for k in range(a.shape[-1]):
        out += a[..., k : k + 1] * b[..., k : k + 1, :]
    return out


def _install_row_invariant_dot():
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime import interpreter
    except ImportError:  # .ci/run installs Triton; without it the kernels' tests fail by name
        return
    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        acc = d.data.dtype
        if not np.issubdtype(acc, np.floating):
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        a_data, b_data = a.data, b.data
        if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or (
            b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()
        ):
            a_data = interpreter._convert_float(a_data, a.dtype, interpreter.tl.float16, None).view(np.float16)
            b_data = interpreter._convert_float(b_data, b.dtype, interpreter.tl.float16, None).view(np.float16)
        return interpreter.TensorHandle(_row_invariant_dot(a_data, b_data, acc) + d.data, d.dtype.scalar)

    builder.create_dot = create_dot


_install_row_invariant_dot()


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


# -- the fast loop: every test that starts a process is marked slow --------------------------
#
# `pytest -m "not slow"` is the fast loop. A test that starts a process (a cluster, `moeserve
# up`, a fresh interpreter), or uses a fixture that did, fails here unless it is marked slow,
# so the mark cannot drift out of date.

import multiprocessing.process  # noqa: E402
import subprocess  # noqa: E402

_SPAWNS: list[str] = []  # what started processes since the last look
_PROCESS_FIXTURES: set[str] = set()  # fixtures whose setup started a process
_FIXTURE_STACK: list[str] = []
_orig_execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]
_orig_process_start = multiprocessing.process.BaseProcess.start


def _recording_execute_child(self, args, *rest, **kw):
    if "fc-list" not in str(args):  # matplotlib builds its font cache once per machine: not the test's process
        _SPAWNS.append(str(args)[:120])
    return _orig_execute_child(self, args, *rest, **kw)


def _recording_process_start(self):
    _SPAWNS.append(f"multiprocessing {self.name}")
    return _orig_process_start(self)


subprocess.Popen._execute_child = _recording_execute_child  # type: ignore[attr-defined]
multiprocessing.process.BaseProcess.start = _recording_process_start  # type: ignore[method-assign]


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    _FIXTURE_STACK.append(fixturedef.argname)
    before = len(_SPAWNS)
    try:
        yield
    finally:
        _FIXTURE_STACK.pop()
        if len(_SPAWNS) > before:
            _PROCESS_FIXTURES.add(fixturedef.argname)
            _PROCESS_FIXTURES.update(_FIXTURE_STACK)  # the fixtures that asked for it start processes too


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item._spawns_before = len(_SPAWNS)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when != "teardown" or item.get_closest_marker("slow") is not None or report.failed:
        return
    spawned = len(_SPAWNS) > item._spawns_before
    fixtures = sorted(_PROCESS_FIXTURES.intersection(item.fixturenames))
    if spawned or fixtures:
        why = f"fixtures {fixtures} start processes" if fixtures else f"it started {_SPAWNS[item._spawns_before]}"
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} starts processes ({why}): mark it @pytest.mark.slow, so that the fast loop "
            f'(pytest -m "not slow") leaves it out'
        )


# The longest test files first (their wall time on the 2-core CI machine), so that .ci/run's
# two workers (--dist loadfile hands out files in collection order) end together instead of
# one finishing the live compose test alone: the longest-first rule of scheduling.
LONGEST_FIRST = (
    "test_compose_live.py",
    "test_soak.py",
    "test_serving_benchmark.py",
    "test_reliability.py",
    "test_cluster_faults.py",
    "test_structured_output.py",
    "test_cli_serve.py",
    "test_clients_tools.py",
    "test_cluster_nodes.py",
    "test_control_rebalance.py",
    "test_cli_serve_families.py",
    "test_cluster_exact.py",
)


def pytest_collection_modifyitems(config, items):
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: the rest keep theirs
