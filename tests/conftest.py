"""Suite-wide settings: one torch thread (the CI machine has 2 cores and .ci/run runs two test
files at a time, one per pytest-xdist worker);
Triton kernels run in Triton's interpreter (no GPU here). TRITON_INTERPRET is read when Triton
defines its kernels, so it is set before anything imports Triton."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # as moeserve/__init__.py says, before any grpc import

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
