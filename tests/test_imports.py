"""The import graph (issue 36): no circle between pdserve's modules, an engine that never loads the benchmarks, and
a shipped ``pdserve.bench`` that holds only what ``pdserve bench serve|sweep`` runs (developer benchmarks are
scripts in devbench/).

The graph is read from the source with ``ast``, the folders mapped to packages as pyproject.toml maps them. Every
import counts wherever it stands -- at the top, inside a function (a lazy import), under ``TYPE_CHECKING`` or
``if __name__ == "__main__"`` -- because each is one module needing another. ``from a import b`` is an edge to the
module ``a.b`` when there is one, else to ``a``; the packages a module's name passes through are not edges (a lazy
``__getattr__`` in a package ``__init__`` would otherwise read as a circle it is not).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")
ROOT = Path(__file__).resolve().parent.parent


def _modules() -> dict[str, Path]:
    """{dotted module name: source file} for every module of every mapped package."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found = {}
    for package, folder in mapping.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if "__pycache__" in parts or not (path.parent / "__init__.py").exists():
                continue
            name = ".".join((package, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``name`` (source at ``path``) imports anywhere in its text."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = name if is_package else name.rpartition(".")[0]
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            source = ".".join(p for p in ((base if node.level else ""), node.module or "") if p)
            for alias in node.names:
                target = f"{source}.{alias.name}"
                out.add(target if target in modules else source)
    return {m for m in out if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a -> b -> ... -> a) for each strongly connected group of two or more modules (Tarjan)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group, w = set(), None
            while w != v:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_one_circle(graph, group) for group in groups]


def _one_circle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group (breadth first)."""
    start = min(group)
    paths = {w: [start, w] for w in sorted(graph[start] & group)}
    frontier = list(paths)
    while start not in paths:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return paths[start]


def test_no_module_imports_itself_through_others():
    found = circles(import_graph())
    assert not found, "import circles (a shared definition belongs in a module both import):\n" + \
        "\n".join(" -> ".join(c) for c in found)


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "x": {"y"}, "y": {"d", "x"}}
    assert circles(graph) == [["a", "b", "c", "a"], ["x", "y", "x"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_engine_loads_nothing_from_the_benchmarks():
    """``import pdserve.engine``, then every module of the engine package: no ``pdserve.bench`` module is loaded."""
    engine = sorted(m for m in _modules() if m == "pdserve.engine" or m.startswith("pdserve.engine."))
    code = ("import importlib, sys\n"
            "import pdserve.engine\n"
            "print(sorted(m for m in sys.modules if m.startswith('pdserve.bench')))\n"
            f"for m in {engine!r}:\n"
            "    importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m.startswith('pdserve.bench')))\n")
    run = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines() == ["[]", "[]"], run.stdout


def test_the_shipped_bench_holds_only_what_pdserve_bench_runs():
    """Every module of ``pdserve.bench`` is reached from its CLI; a developer benchmark belongs in devbench/."""
    graph = import_graph()
    reached, todo = set(), ["pdserve.bench", "pdserve.bench.cli"]
    while todo:
        m = todo.pop()
        if m not in reached:
            reached.add(m)
            todo += [w for w in graph[m] if w.startswith("pdserve.bench")]
    shipped = {m for m in graph if m == "pdserve.bench" or m.startswith("pdserve.bench.")}
    assert shipped - reached == set(), "in pdserve.bench but not run by `pdserve bench`: move them to devbench/"
    assert not (ROOT / "devbench" / "__init__.py").exists(), "devbench/ holds scripts, not a package"
