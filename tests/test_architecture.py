"""The arrows between moeserve's parts (docs/architecture.md): which part may import which.

Two checks: a static one over every import statement of the source tree, function-level (lazy)
imports included, so an arrow that only a rarely taken path would follow is still seen; and a
live one, importing each part in a fresh interpreter and looking at ``sys.modules``.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Installed package name of each source folder (pyproject's package-dir).
FOLDERS = {
    "moeserve": "moeserve",
    "router": "moeserve.router",
    "expert_worker": "moeserve.expert_worker",
    "balancer": "moeserve.balancer",
}

GRPC = (
    "grpc",
    "grpc_health",
    "grpc_reflection",
    "google.protobuf",
    "moeserve.rpc",
    "moeserve.services",
    "moeserve.wire",
    "moeserve.client",
)
SERVING = (
    "moeserve.router",
    "moeserve.expert_worker",
    "moeserve.balancer",
    "moeserve.cluster",
    "moeserve.dataplane",
    "moeserve.services",
    "moeserve.client",
    "moeserve.rpc",
    "moeserve.wire",
    "moeserve.ops.metrics",
    "grpc",
)
# What a rank imports at start (moeserve.cluster.rank.build and serve): its roles' modules.
RANK_START = [
    "moeserve.cluster.rank",
    "moeserve.dataplane.step",
    "moeserve.dataplane.collective",
    "moeserve.dataplane.nvlink",
    "moeserve.router.dispatcher",
    "moeserve.router.runner",
    "moeserve.router.engine.leader",
    "moeserve.router.engine.channel",
    "moeserve.expert_worker.store",
    "moeserve.expert_worker.migration",
    "moeserve.ops.metrics",
    "moeserve.models",
]


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """Every module ``name`` imports anywhere in its body (top level and inside functions)."""
    tree = ast.parse(MODULES[name].read_text())
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES)
    return found


IMPORTS = {m: _imports(m) for m in MODULES}


# Lazy imports that a forbidden-arrow check may pass over, each for a stated reason.
LAZY_OK = {
    ("moeserve.placement", "torch"),  # only to read SGLang's torch.save (.pt) placement files, on the leader
}


def _reachable(start: str) -> set[str]:
    """Modules (ours and third-party) reachable from ``start`` through import statements."""
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        if m in MODULES:
            todo.extend(i for i in IMPORTS[m] if (m, i) not in LAZY_OK)
            parent = m.rpartition(".")[0]  # importing a.b.c runs a/__init__ and a/b/__init__
            if parent:
                todo.append(parent)
    return seen


def _hits(found: set[str], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(m for m in found if any(m == f or m.startswith(f + ".") for f in forbidden))


@pytest.mark.parametrize("start", RANK_START)
def test_the_data_plane_and_rank_start_up_reach_no_grpc_or_protobuf(start):
    assert _hits(_reachable(start), GRPC) == []


def test_the_policy_reaches_no_torch():
    assert _hits(_reachable("moeserve.balancer.policy"), ("torch",)) == []


def test_the_models_reach_no_serving_module():
    assert _hits(_reachable("moeserve.models"), SERVING) == []


def test_the_sdk_reaches_no_server_code():
    assert (
        _hits(
            _reachable("moeserve.client"),
            (
                "moeserve.services",
                "moeserve.router",
                "moeserve.cluster",
                "moeserve.dataplane",
                "moeserve.expert_worker",
            ),
        )
        == []
    )


def _part(module: str) -> str:
    """The part a module belongs to: its package, or a top-level module of moeserve itself."""
    path = MODULES[module]
    return (
        module
        if path.name == "__init__.py"
        else module.rpartition(".")[0]
        if module.count(".") > 1 or module.rpartition(".")[0] != "moeserve"
        else module
    )


def test_no_import_cycle_between_parts():
    edges: dict[str, set[str]] = {}
    for m, imported in IMPORTS.items():
        for target in imported:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and _part(target) != _part(m):
                edges.setdefault(_part(m), set()).add(_part(target))
    # Tarjan's strongly connected components: a component of two or more parts is a cycle.
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    assert cycles == []


def _fresh_import(modules: list[str]) -> list[str]:
    code = "import json, sys\n" + "".join(f"import {m}\n" for m in modules) + "print(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_importing_a_rank_and_its_roles_loads_no_grpc_or_protobuf():
    assert _hits(set(_fresh_import(RANK_START)), GRPC) == []


def test_importing_the_policy_loads_no_torch_and_the_sdk_no_server_code():
    assert _hits(set(_fresh_import(["moeserve.balancer.policy"])), ("torch",)) == []
    assert (
        _hits(
            set(_fresh_import(["moeserve.client"])),
            ("moeserve.services", "moeserve.router", "moeserve.cluster", "torch"),
        )
        == []
    )


def test_the_checker_sees_a_forbidden_arrow():
    """The static check is not vacuous: the admin service does reach gRPC and the engine."""
    assert "grpc" in _hits(_reachable("moeserve.services.admin"), GRPC)
    assert _reachable("moeserve.cluster.launcher") >= {"moeserve.router.engine.channel", "moeserve.config"}


STEP_MESSAGES = ("SeqWork", "RouterWork", "StepHeader", "MigrationOps", "LayerCommit", "MoveOp", "RankResult")


def test_step_messages_with_more_than_one_field_are_built_with_keywords():
    """A step message's fields are named where it is built (a positional SeqWork(...) of nine
    values, three of them bare booleans, is unreadable), in the source tree and in the tests."""
    positional = []
    for path in [*MODULES.values(), *(ROOT / "tests").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in STEP_MESSAGES:
                if len(node.args) > 1:
                    positional.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.func.id}")
    assert positional == []
