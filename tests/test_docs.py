"""The docs as the repository holds them: README.md is an entry page, every link resolves,
nothing cites a file outside the repository or a tracker number, and benchmarks/README.md
lists every benchmark. No process is started: the repository's files are read from disk
(every file under the root except what .gitignore and the tools' own caches ignore)."""

import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    ROOT / "benchmarks" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
README_MAX_LINES = 300

# Files outside the repository that the project once cited, and tracker references. Spelled in
# pieces so that this file does not match them itself.
OUTSIDE = ["DESIGN", "MODELS", "ANCHORS", "STYLE", "FAMILIES"]
CITES_OUTSIDE = re.compile(r"\b(?:" + "|".join(OUTSIDE) + r")\.md\b|\.\./" + "shared")
TRACKER = re.compile(r"\b" + "issue" + r"s?\s+#?\d+|\b" + "must" + r"[- ]show\s+\d+", re.IGNORECASE)


def _ignored_patterns() -> list[str]:
    lines = (ROOT / ".gitignore").read_text().splitlines() if (ROOT / ".gitignore").is_file() else []
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _is_ignored(rel: Path, is_dir: bool, patterns: list[str]) -> bool:
    for pat in patterns:
        dir_only = pat.endswith("/")
        pat = pat.rstrip("/")
        if dir_only and not is_dir:
            continue
        if pat.startswith("/"):
            if fnmatch.fnmatch(rel.as_posix(), pat[1:]):
                return True
        elif fnmatch.fnmatch(rel.name, pat):
            return True
    return False


def repository_files() -> list[Path]:
    """Every file of the working tree that git would track: .git and what .gitignore names are
    left out, and so are folders whose own .gitignore ignores everything (tools' caches)."""
    patterns, out, todo = _ignored_patterns(), [], [ROOT]
    while todo:
        folder = todo.pop()
        own = folder / ".gitignore"
        if folder != ROOT and own.is_file() and "*" in own.read_text().split():
            continue
        for entry in sorted(folder.iterdir()):
            rel = entry.relative_to(ROOT)
            if entry.name == ".git" or _is_ignored(rel, entry.is_dir(), patterns):
                continue
            if entry.is_dir():
                todo.append(entry)
            elif entry.is_file():
                out.append(entry)
    return out


def _text(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


TEXT_FILES = {p: t for p in repository_files() if (t := _text(p)) is not None}


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    s = heading.strip().lower().replace("`", "")
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _headings(page: Path) -> list[str]:
    out, fenced = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            out.append(line.lstrip("#").strip())
    return out


def _links(text: str) -> list[str]:
    """Targets of markdown links and images, outside code blocks and code spans."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text)


def link_problems(page: Path, text: str | None = None) -> list[str]:
    """The links of ``page`` (or of ``text`` as if it were that page) that do not resolve."""
    problems = []
    for target in _links(page.read_text() if text is None else text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(ROOT)}: ({target})"
        if not dest.is_relative_to(ROOT):
            problems.append(f"{where} leaves the repository")
        elif not dest.exists():
            problems.append(f"{where}: {path} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in {_slug(h) for h in _headings(dest)}:
            problems.append(f"{where}: {dest.relative_to(ROOT)} has no heading #{anchor}")
    return problems


def test_the_readme_is_an_entry_page_of_at_most_300_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_to_a_file_in_the_repository(page):
    assert link_problems(page) == []


def test_the_link_check_sees_a_missing_file_and_a_missing_heading():
    page = ROOT / "docs" / "architecture.md"
    text = "[a](nowhere.md) [b](../CONTRIBUTING.md#no-such-heading) [c](https://example.org/x) [d](eplb.md)\n"
    problems = link_problems(page, text)
    assert len(problems) == 2
    assert "nowhere.md does not exist" in problems[0] and "no heading #no-such-heading" in problems[1]


def test_no_file_cites_a_file_outside_the_repository_or_a_tracker_number():
    hits = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p, text in TEXT_FILES.items()
        for n, line in enumerate(text.splitlines(), 1)
        if CITES_OUTSIDE.search(line) or TRACKER.search(line)
    ]
    assert hits == []


def test_the_citation_check_sees_what_it_looks_for():
    for line in [
        "see " + "DESIGN" + ".md",
        "../" + "shared/eval",
        "(" + "issue" + " 15)",
        "Issue" + " #3",
        "must" + " show 1",
    ]:
        assert CITES_OUTSIDE.search(line) or TRACKER.search(line), line
    for line in ["docs/models.md", "an issue with the header", "tiss" + "ue 5"]:
        assert not (CITES_OUTSIDE.search(line) or TRACKER.search(line)), line


def test_the_repository_walk_sees_code_tests_docs_and_configs_and_no_caches():
    rel = {p.relative_to(ROOT).as_posix() for p in TEXT_FILES}
    assert {"README.md", "pyproject.toml", ".ci/run", "tests/test_docs.py", "docs/architecture.md"} <= rel
    assert not [r for r in rel if "__pycache__" in r or r.startswith((".venv/", ".git/"))]


def section_problems(path: Path, text: str) -> list[str]:
    """``docs/NAME.md`` in any file, and ``docs/NAME.md, "Section"`` or a page's link
    ``[..](NAME.md), "Section"``: the page exists, and one of its headings starts with the
    section's words."""
    flat = re.sub(r"\s+", " ", text)
    named = [(ROOT / "docs" / n, s) for n, s in re.findall(r"\bdocs/([\w-]+\.md)\)?(?:, \"([^\"]{1,80})\")?", flat)]
    if path.suffix == ".md":
        named += [(path.parent / t, s) for t, s in re.findall(r"\]\(([\w./-]+\.md)\), \"([^\"]{1,80})\"", flat)]
    problems = []
    for page, section in named:
        if not page.is_file():
            problems.append(f"{path.relative_to(ROOT)}: {page.name} does not exist")
        elif section and not any(h.replace("`", "").startswith(section) for h in _headings(page)):
            problems.append(f'{path.relative_to(ROOT)}: {page.name} has no section "{section}"')
    return problems


def test_every_docs_page_and_section_that_a_file_names_exists():
    here = Path(__file__).resolve()  # its examples name pages that do not exist
    assert [q for p, text in TEXT_FILES.items() if p != here for q in section_problems(p, text)] == []


def test_the_section_check_sees_a_missing_page_and_a_missing_section():
    code = ROOT / "moeserve" / "x.py"
    problems = section_problems(code, '(docs/nowhere.md) (docs/dataplane.md, "No such\n   section")')
    assert problems == [
        "moeserve/x.py: nowhere.md does not exist",
        'moeserve/x.py: dataplane.md has no section "No such section"',
    ]
    page = ROOT / "docs" / "eplb.md"
    assert section_problems(page, '[dataplane.md](dataplane.md), "Migration"') == []
    assert len(section_problems(page, '[dataplane.md](dataplane.md), "Migrations of old"')) == 1


def test_benchmarks_readme_names_every_benchmark_script_and_no_other():
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    rows = [line.split("|")[1].strip() for line in readme.splitlines() if line.startswith("| `")]
    listed = {r.strip("`") for r in rows}
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py")}
    assert sorted(scripts - listed) == [], "benchmarks/README.md does not list these scripts"
    assert sorted(listed - scripts) == [], "benchmarks/README.md lists scripts that do not exist"


# -- the environment variables' table -----------------------------------------------------------

RUNTIME = ("moeserve", "router", "expert_worker", "balancer")  # the packages a cluster runs
ENV_NAME = re.compile(r"MOESERVE_[A-Z0-9_]+")


def env_names_read(root: Path = ROOT) -> set[str]:
    """Every ``MOESERVE_*`` name the runtime packages hold as a whole string constant or pass as
    a keyword (an environment built with ``dict(NAME=...)``), generated code left out: the
    variables their processes read or hand their children."""
    import ast

    names: set[str] = set()
    for package in RUNTIME:
        for path in sorted((root / package).rglob("*.py")):
            if path.name.endswith("_pb2.py") or path.name.endswith("_pb2_grpc.py"):
                continue
            if path.relative_to(root).as_posix() == "moeserve/envs.py":  # the names' list, not a reader
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and ENV_NAME.fullmatch(node.value):
                    names.add(node.value)
                elif isinstance(node, ast.keyword) and node.arg and ENV_NAME.fullmatch(node.arg):
                    names.add(node.arg)
    return names


def env_names_documented(page: Path = ROOT / "docs" / "operations.md") -> set[str]:
    """The names in the first cell of each row of the "Environment variables" table."""
    text = page.read_text()
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `MOESERVE_")]
    return {name for row in rows for name in ENV_NAME.findall(row.split("|")[1])}


def test_the_environment_variables_table_names_every_variable_the_code_reads_and_no_other():
    read, documented = env_names_read(), env_names_documented()
    assert read - documented == set(), (
        f"read by the code, not in docs/operations.md's table: {sorted(read - documented)}"
    )
    assert documented - read == set(), f"in the table, read by no code: {sorted(documented - read)}"
    assert {"MOESERVE_LOG_LEVEL", "MOESERVE_EXPERT_KERNEL", "MOESERVE_AUTHKEY"} <= read  # the walk sees all three forms
    from moeserve import envs

    assert envs.READ == read, f"moeserve/envs.py's READ differs from the code's: {sorted(envs.READ ^ read)}"
    around = "\n".join(
        p.read_text()
        for folder in ("deploy", "scripts", "benchmarks", "tests")
        for p in (ROOT / folder).rglob("*")
        if p.is_file()
        and p.suffix in ("", ".py", ".yml", ".sh")
        and "results" not in p.parts
        and p.name != "test_docs.py"
    )
    assert {n for n in envs.AROUND if n not in around} == set()  # each read around moeserve
    assert envs.AROUND.isdisjoint(read)


def test_the_environment_check_sees_a_new_variable_and_a_stale_row(tmp_path):
    pkg = tmp_path / "moeserve"
    pkg.mkdir()
    (pkg / "a.py").write_text('import os\nX = os.environ.get("MOESERVE_NEW")\nenv = dict(MOESERVE_KW="1")\n')
    (pkg / "admin_pb2.py").write_text('Y = "MOESERVE_GENERATED"\n')
    (pkg / "b.py").write_text('"""Mentions MOESERVE_IN_PROSE in a sentence."""\n')
    assert env_names_read(tmp_path) == {"MOESERVE_NEW", "MOESERVE_KW"}
    page = tmp_path / "ops.md"
    page.write_text(
        "## Environment variables\n\n| v | w |\n|---|---|\n| `MOESERVE_OLD`, `MOESERVE_NEW` | x |\n\n## Next\n| `MOESERVE_AFTER` | y |\n"
    )
    assert env_names_documented(page) == {"MOESERVE_OLD", "MOESERVE_NEW"}


def test_a_moeserve_variable_nothing_reads_is_said_with_the_closest_name(caplog):
    """A typo or a removed switch would change nothing in silence: a cluster's or a service's
    start warns, naming it and the known name it is close to."""
    from moeserve import envs

    env = {
        "MOESERVE_EXPERT_KERNAL": "triton",  # a typo
        "MOESERVE_EXPERT_GRID": "work",  # a measurement switch since removed
        "MOESERVE_EXPERT_KERNEL": "auto",
        "MOESERVE_GIT_COMMIT": "abc",  # the benchmarks'
        "PATH": "/bin",
    }
    with caplog.at_level("WARNING", logger="moeserve.envs"):
        assert envs.warn_unknown(env) == ["MOESERVE_EXPERT_GRID", "MOESERVE_EXPERT_KERNAL"]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2
    assert said[0].startswith("MOESERVE_EXPERT_GRID is set but no moeserve process reads it (a switch since removed?")
    assert said[1].startswith(
        "MOESERVE_EXPERT_KERNAL is set but no moeserve process reads it (did you mean MOESERVE_EXPERT_KERNEL?"
    )
    assert envs.unknown({"MOESERVE_LOG_LEVEL": "debug", "MOESERVE_MODEL": "/m"}) == []


def test_a_service_says_an_unknown_variable_unless_a_launcher_started_it(caplog, monkeypatch):
    """A standalone service (compose's router, worker, frontend, balancer) warns at start; one a
    launcher started (MOESERVE_PARENT_PID) does not repeat what the launcher said."""
    from moeserve.cli import services

    monkeypatch.setenv("MOESERVE_EXPERT_GRID", "work")
    monkeypatch.delenv("MOESERVE_LOG_LEVEL", raising=False)
    for parent, said in (("", 1), ("12345", 0)):
        monkeypatch.setenv("MOESERVE_PARENT_PID", parent)
        caplog.clear()
        with caplog.at_level("WARNING", logger="moeserve.envs"):
            services._logging("frontend")
        assert [r.getMessage()[:20] for r in caplog.records] == ["MOESERVE_EXPERT_GRID"] * said
