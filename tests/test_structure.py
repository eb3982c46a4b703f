"""Guards the layout rules (README.md "Layout"), three floors: `asyncrl` (what every process shares) imports no
other package of the project; a component imports `asyncrl` only, never another component nor the run layer;
the run layer (`asyncrl_run`) may import any of them. No import circle anywhere among the project's modules, and no
function over 60 lines outside the model and the tests.

Everything is read from the AST, so an import inside a function (or under TYPE_CHECKING) counts like one at the
top of a module: a circle broken only by deferring an import is still a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = ("rollout", "gateway", "orchestrator", "envs", "trainer")
RUN_LAYER = "asyncrl_run"
PACKAGES = ("asyncrl", RUN_LAYER) + COMPONENTS
ALLOWED: dict[str, set[str]] = {"asyncrl": {"asyncrl"}, RUN_LAYER: set(PACKAGES),
                                 **{component: {"asyncrl", component} for component in COMPONENTS}}
"""Package -> the project's packages its modules may import."""
MAX_FUNCTION_LINES = 60
LENGTH_EXEMPT = ("asyncrl/model/", "tests/")
"""The model follows the HF reference implementation's structure; tests read best as one scenario each.
bench/ and scripts/ are held to the rule: they are project code that people run and read."""


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of `packages` under `root` (a package is its __init__)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(module: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The project modules `module` imports anywhere in its file -> the line of the first such import.
    `from a import b` names the module a.b when there is one, else a; relative imports are resolved."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [_known_prefix(alias.name, modules) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, path.name == "__init__.py")
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else _known_prefix(base, modules)
                       for alias in node.names]
        else:
            continue
        for target in targets:
            if target is not None and target != module:
                found.setdefault(target, node.lineno)
    return found


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")[: None if is_package else -1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _known_prefix(name: str, modules: dict[str, Path]):
    """The longest prefix of `name` that is a project module (None: not the project's)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def import_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, dict[str, int]]:
    modules = module_files(root, packages)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle per strongly connected component of the graph, as [a, b, ..., a]."""
    cycles = []
    for component in _strongly_connected(graph):
        if len(component) > 1:
            cycles.append(_cycle_through(min(component), component, graph))
    return cycles


def _strongly_connected(graph: dict[str, dict[str, int]]) -> list[set[str]]:
    """Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in graph.get(node, {}):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while not component or member != node:
                member = stack.pop()
                component.add(member)
            components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _cycle_through(start: str, component: set[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """A shortest circle start -> ... -> start inside `component` (breadth first)."""
    parent: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node]):
                if succ == start:
                    path = [node]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return path[::-1] + [start]
                if succ in component and succ not in parent:
                    parent[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"{start} is in no circle of {sorted(component)}")


def describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """'path:line name (N lines)' of every function longer than `limit` lines (def to last line, nested
    functions included in their enclosing one), outside the exempt directories, .venv* and hidden ones."""
    found = []
    for path in _project_files(root):
        relative = path.relative_to(root).as_posix()
        if relative.startswith(LENGTH_EXEMPT):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{relative}:{node.lineno} {node.name} ({lines} lines)")
    return found


def _project_files(root: Path):
    """Every .py file under `root` outside hidden directories (.venv*, .git, ...)."""
    for entry in sorted(root.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            yield from (path for path in sorted(entry.rglob("*.py"))
                        if not any(part.startswith(".") for part in path.relative_to(root).parts))
        elif entry.suffix == ".py":
            yield entry


def layering_violations(graph: dict[str, dict[str, int]], package: str) -> dict[str, list[str]]:
    """Modules of `package` -> the packages they import that ALLOWED does not give it."""
    offenders = {}
    for module, imports in graph.items():
        bad = {target.split(".")[0] for target in imports} - ALLOWED[package]
        if module.split(".")[0] == package and bad:
            offenders[module] = sorted(bad)
    return offenders


@pytest.mark.parametrize("package", PACKAGES)
def test_dependency_rule(package):
    offenders = layering_violations(import_graph(ROOT), package)
    assert not offenders, f"{package} imports what its floor may not: {offenders}"


def test_the_layering_check_finds_a_violation():
    graph = {"gateway.core": {"asyncrl.store": 3, "asyncrl_run.launcher": 9}, "asyncrl.store": {"trainer.data": 2},
             "asyncrl_run.launcher": {"gateway.core": 1, "orchestrator.core": 2, "asyncrl.store": 3}}
    assert layering_violations(graph, "gateway") == {"gateway.core": [RUN_LAYER]}
    assert layering_violations(graph, "asyncrl") == {"asyncrl.store": ["trainer"]}
    assert layering_violations(graph, RUN_LAYER) == {}


def test_no_import_cycles():
    graph = import_graph(ROOT)
    assert {"asyncrl_run.cli", "gateway.server", "trainer.loop", "envs.sdk"} <= graph.keys()  # the whole project is read
    cycles = import_cycles(graph)
    assert not cycles, "import circles:\n" + "\n".join(describe(cycle, graph) for cycle in cycles)


def test_no_function_over_60_lines():
    offenders = long_functions(ROOT)
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(offenders)


def test_the_checks_find_what_they_guard(tmp_path):
    """A circle through a relative, a function-level and a TYPE_CHECKING import is found and named; a long
    function is found; `from pkg import name` of a non-module is an edge to the package."""
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    files = {
        "pkg/__init__.py": "from pkg.sub.b import B\n",
        "pkg/a.py": "def f():\n    from .sub import b\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import C\nB = 1\n",
        "pkg/c.py": "import pkg.a\n" + "def long():\n" + "    x = 1\n" * 60,
        "pkg/d.py": "from pkg import B\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.d"] == {"pkg": 1} and graph["pkg.a"] == {"pkg.sub.b": 2}
    assert import_cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]
    assert describe(["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"], graph) == \
        "pkg.a (line 2) -> pkg.sub.b (line 3) -> pkg.c (line 1) -> pkg.a"
    assert long_functions(tmp_path) == ["pkg/c.py:2 long (61 lines)"]


def test_cli_entry_is_instant_and_lists_commands():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "asyncrl_run.cli", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0 and "train" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "asyncrl_run.cli", "nope"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and "unknown command 'nope'" in bad.stderr
    assert "engine serve" in out.stdout


def test_train_prints_resolved_config_and_rejects_bad_keys():
    import subprocess
    import sys

    job = subprocess.run([sys.executable, "-m", "asyncrl_run.train", "experiment=tiny_demo", "--cfg", "job"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert job.returncode == 0, job.stderr
    assert "name: tiny_demo" in job.stdout and "trainer:" in job.stdout and "${" not in job.stdout
    bad = subprocess.run([sys.executable, "-m", "asyncrl_run.train", "rollout.max_runing_requests=3", "--cfg", "job"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode != 0 and "max_runing_requests" in bad.stderr
