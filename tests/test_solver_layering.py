"""The solver package's layering: it never imports torch, and its modules import each other
without a circle (each rule in one home, the search above the rules it starts from)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

SOLVER = pathlib.Path(__file__).resolve().parent.parent / "solver"


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(SOLVER.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path) -> set[str]:
    """The solver modules `path` imports, at module level or inside functions."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "solver":
                continue
            out.add(mod)
            for alias in node.names:  # `from . import lns` names a module
                out.add(f"{mod}.{alias.name}")
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "solver"}
    return out


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in SOLVER.rglob("*.py")}
    # an edge to a package means its __init__; keep only edges to real modules
    return {m: {d for d in _imports(p) if d in modules and d != m} for m, p in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_solver_modules_import_each_other_without_a_circle():
    graph = _graph()
    # package __init__ files re-export their modules; an edge from a module to its own
    # package's __init__ is the only kind that would close a circle through them
    for m in graph:
        graph[m] = {d for d in graph[m] if not m.startswith(d + ".")}
    assert "solver.search.pipeline" in graph and "solver.rules.simple" in graph
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph))}"


def test_the_cycle_finder_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_solver_never_imports_torch():
    code = ("import sys, solver, solver.search, solver.baselines, solver.rules.warmstart, "
            "solver.backends; sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=SOLVER.parent).returncode == 0
