"""The arrows between moeserve's parts (docs/architecture.md): which part may import which, and
the page itself held to the code.

Forbidden arrows, two checks: a static one over every import statement of the source tree,
function-level (lazy) imports included, so an arrow that only a rarely taken path would follow
is still seen; and a live one, importing each part in a fresh interpreter and looking at
``sys.modules``.

The page: every file its parts table names exists and every module is named there; every file
and symbol of its concept table exists (symbols found with ``ast``); every arrow its diagram
draws is an import that the code has. Each check is shown to fail on a page that is wrong.
"""

import ast
import json
import re
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


@pytest.mark.slow
def test_importing_a_rank_and_its_roles_loads_no_grpc_or_protobuf():
    assert _hits(set(_fresh_import(RANK_START)), GRPC) == []


@pytest.mark.slow
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


# -- docs/architecture.md against the code --------------------------------------------------------

DOC = ROOT / "docs" / "architecture.md"
SOURCE_FOLDERS = tuple(FOLDERS)  # where the parts table's files live


def _section(text: str, title: str) -> str:
    """The body of the ``## title`` section of a markdown page."""
    start = text.index(f"\n## {title}\n") + len(title) + 5
    end = text.find("\n## ", start)
    return text[start : end if end >= 0 else len(text)]


def _table(section: str) -> list[list[str]]:
    """The body rows of the first markdown table in ``section``, as lists of cells."""
    rows = [line for line in section.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in row.strip().strip("|").split("|")] for row in rows]
    return cells[2:]  # after the header and the |---| line


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _definitions(path: Path) -> set[str]:
    """Names defined in a module: top-level functions, classes and assigned names, and for each
    class ``Class.member`` for its methods, class attributes and ``self.member`` assignments."""
    tree = ast.parse(path.read_text())

    def targets(node) -> list[ast.expr]:
        if isinstance(node, ast.Assign):
            return list(node.targets)
        if isinstance(node, ast.AnnAssign):
            return [node.target]
        return []

    def names(t: ast.expr) -> list[str]:
        if isinstance(t, ast.Name):
            return [t.id]
        if isinstance(t, ast.Tuple):
            return [n for e in t.elts for n in names(e)]
        return []

    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        for t in targets(node):
            out.update(names(t))
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    out.add(f"{node.name}.{item.name}")
                for t in targets(item):
                    out.update(f"{node.name}.{n}" for n in names(t))
            for sub in ast.walk(node):
                for t in targets(sub):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        out.add(f"{node.name}.{t.attr}")
    return out


def concept_rows(text: str) -> list[tuple[str, list[tuple[str, list[str]]]]]:
    """The concept table: (concept, [(file, [symbol, ...]), ...]) per row. Each ``;``-separated
    part of the second cell names a file, then symbols defined in it, all in backticks."""
    rows = []
    for concept, where in _table(_section(text, "Where each concept lives")):
        parts = []
        for part in where.split(";"):
            ticked = _ticked(part)
            if ticked:
                parts.append((ticked[0], ticked[1:]))
        rows.append((concept, parts))
    return rows


def concept_problems(text: str) -> list[str]:
    """What the concept table names that the code does not have."""
    problems = []
    for concept, parts in concept_rows(text):
        if not parts:
            problems.append(f"{concept!r}: names no file")
        for path, symbols in parts:
            if "/" not in path or not path.endswith(".py"):
                problems.append(f"{concept!r}: {path!r} should be a file's path from the repository root")
                continue
            if not (ROOT / path).is_file():
                problems.append(f"{concept!r}: {path} does not exist")
                continue
            defined = _definitions(ROOT / path)
            problems += [f"{concept!r}: {path} does not define {s}" for s in symbols if s not in defined]
    return problems


def parts_table_files(text: str) -> tuple[set[Path], list[str]]:
    """Every file the parts table names (resolved: a folder cell's file, or a name in the last
    cell relative to the row's folder or to the repository root), and what does not exist."""
    named, problems = set(), []
    for part, folders, what in (row[:3] for row in _table(_section(text, "The parts"))):
        roots = [ROOT / f for f in _ticked(folders) if f.split("/")[0] in SOURCE_FOLDERS]
        if not roots:
            problems.append(f"{part!r}: no source folder or file in {folders!r}")
        for r in roots:
            if r.is_file():
                named.add(r)
            elif not r.is_dir():
                problems.append(f"{part!r}: {r.relative_to(ROOT)} does not exist")
        for name in _ticked(what):
            if not name.endswith(".py"):
                continue
            found = [c for c in [ROOT / name, *(r / name for r in roots if r.is_dir())] if c.is_file()]
            if found:
                named.add(found[0])
            else:
                problems.append(f"{part!r}: {name} is in none of {[str(r.relative_to(ROOT)) for r in roots]}")
    return named, problems


# Part names of the arrows diagram -> module prefix; a part is every module under its prefix.
ALIASES = {
    "SDK": "moeserve.client",
    "CLI": "moeserve.cli",
    "engine": "moeserve.router.engine",
    "policy": "moeserve.balancer.policy",
    "metrics": "moeserve.ops.metrics",
}
# Parts that live inside another part's folder and are not part of it.
CARVED_OUT = {"moeserve.router": ("moeserve.router.engine",)}


def _prefix(part: str) -> str:
    head, _, tail = part.partition(".")
    if head in ALIASES:
        return ALIASES[head] + (f".{tail}" if tail else "")
    return f"moeserve.{part}"


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _in_part(module: str, prefix: str) -> bool:
    return _under(module, prefix) and not any(_under(module, c) for c in CARVED_OUT.get(prefix, ()))


def drawn_arrows(text: str) -> list[tuple[str, str]]:
    """(A, B) for every arrow of the ```-fenced diagram in "The arrows": each line is a chain
    ``A ─► B, C ─► D`` (a comma list on each side; parentheses are comments)."""
    block = re.search(r"```\n(.*?)```", _section(text, "The arrows"), re.S)
    assert block, "docs/architecture.md, The arrows: no ```-fenced diagram"
    arrows = []
    for line in block.group(1).splitlines():
        line = re.sub(r"\([^)]*\)", "", line)
        if "─►" not in line:
            continue
        sides = [[p.strip() for p in side.split(",") if p.strip()] for side in line.split("─►")]
        for left, right in zip(sides, sides[1:]):
            arrows += [(a, b) for a in left for b in right]
    return arrows


def arrow_problems(text: str, imports: dict[str, set[str]] = IMPORTS) -> list[str]:
    """The drawn arrows that the code lacks (or whose part names no module)."""
    problems = []
    for a, b in drawn_arrows(text):
        pa, pb = _prefix(a), _prefix(b)
        unknown = [
            f"{name!r} names no module" for name, p in ((a, pa), (b, pb)) if not any(_under(m, p) for m in MODULES)
        ]
        if unknown:
            problems += [f"{a} ─► {b}: {u}" for u in unknown]
            continue
        if not any(_in_part(m, pa) and not _in_part(i, pa) and _in_part(i, pb) for m in MODULES for i in imports[m]):
            problems.append(f"{a} ─► {b}: no module of {pa} imports {pb}")
    return problems


def test_every_file_and_symbol_of_the_concept_table_exists():
    assert concept_problems(DOC.read_text()) == []


def test_the_concept_table_says_where_load_is_counted_read_and_summed():
    (row,) = [parts for concept, parts in concept_rows(DOC.read_text()) if "load" in concept]
    files = {path for path, _ in row}
    assert {"router/dispatcher.py", "router/engine/leader.py"} <= files


def test_the_concept_table_check_sees_a_missing_symbol_and_a_missing_file():
    text = DOC.read_text()
    bad = text.replace("`choose_slots`", "`choose_slot`").replace("`router/engine/blocks.py`", "`router/blocks.py`")
    problems = concept_problems(bad)
    assert any("does not define choose_slot" in p for p in problems)
    assert any("router/blocks.py does not exist" in p for p in problems)


def test_every_file_of_the_parts_table_exists_and_every_module_is_named():
    named, problems = parts_table_files(DOC.read_text())
    assert problems == []
    modules = {p for p in MODULES.values() if p.name != "__init__.py"}
    assert sorted(str(p.relative_to(ROOT)) for p in modules - named) == []


def test_every_drawn_arrow_is_an_import_the_code_has():
    assert drawn_arrows(DOC.read_text()), "the diagram draws no arrow"
    assert arrow_problems(DOC.read_text()) == []


def test_the_arrow_check_sees_an_arrow_the_code_lacks():
    text = DOC.read_text()
    bad = text.replace(" policy ─► placement", " policy ─► placement, dataplane").replace(
        " SDK ─► wire", " SDK ─► router, wire"
    )
    problems = arrow_problems(bad)
    assert "policy ─► dataplane: no module of moeserve.balancer.policy imports moeserve.dataplane" in problems
    assert "SDK ─► router: no module of moeserve.client imports moeserve.router" in problems
    assert arrow_problems(text.replace(" demo ─► SDK", " demo ─► nowhere, SDK"))[0].startswith("demo ─► nowhere")
