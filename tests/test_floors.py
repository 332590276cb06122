"""The packages' floors (DESIGN.md section 2): each module imports only its own floor or lower.

monetlike/, bottom up: core (torch mechanisms), capture (model -> GraphModule), impls (operator
implementations), then profile and runtime (siblings: neither imports the other), then the entry
points (wrapper, optimize, check, cli, ...). solver/, bottom up: base (the IR, units, errors, the
release rule, the simulator), model (the MILP and the bounds written beside it), backends, rules,
search, entry (baselines, the package's __init__). solver sits below all of monetlike and never
imports torch. Every project import counts, at the top of a module or inside a function: a
function-level import is how an upward arrow hides, so there are none (move the code instead).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROJECT = ("monetlike", "solver")

# name -> (floor, room, covers its submodules). A module's floor is its exact entry, else that of
# the longest package entry above it; a module on no floor is an error (give it one here). Rooms
# on one floor may import each other only where they are the same room (profile and runtime are
# siblings that may not).
MONETLIKE_FLOORS = {
    "monetlike.core": (0, "core", True),
    "monetlike.capture": (1, "capture", True),
    "monetlike.impls": (2, "impls", True),
    "monetlike.profile": (3, "profile", True),
    "monetlike.runtime": (3, "runtime", True),
    "monetlike": (4, "entry", True),
}
SOLVER_FLOORS = {
    **{f"solver.{m}": (0, "base", False) for m in (
        "errors", "units", "jsonio", "graph", "schedule", "release", "canonical", "simulate",
        "analysis", "least_budget", "verify")},
    **{f"solver.{m}": (1, "model", False) for m in (
        "milp", "formulation", "formulation_rows", "cuts", "stage_bound", "compiled")},
    "solver.backends": (2, "backends", True),
    "solver.rules": (3, "rules", True),
    "solver.search": (4, "search", True),
    "solver.baselines": (5, "entry", False),
    "solver": (5, "entry", False),
}
FLOORS = {**MONETLIKE_FLOORS, **SOLVER_FLOORS}


@dataclass(frozen=True)
class Edge:
    source: str          # the importing module
    target: str          # the imported module (a package means its __init__)
    line: int
    in_function: bool


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imported(module: str, is_package: bool, node) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        parent = ".".join(base + ([node.module] if node.module else []))
    else:
        parent = node.module or ""
    # `from pkg import sub` imports the module pkg.sub; `from pkg import name` imports pkg.
    return [f"{parent}.{a.name}" if is_module(f"{parent}.{a.name}") else parent
            for a in node.names]


def import_edges(path: pathlib.Path, source: str | None = None) -> list[Edge]:
    """Every import of a project module or of torch in `path` (or in `source`, read as it)."""
    module = module_name(path)
    tree = ast.parse(source if source is not None else path.read_text(), filename=str(path))
    in_function = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function.update(id(n) for n in ast.walk(fn) if n is not fn)
    edges = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target in _imported(module, path.name == "__init__.py", node):
                if target.split(".")[0] in (*PROJECT, "torch"):
                    edges.append(Edge(module, target, node.lineno, id(node) in in_function))
    return edges


def floor_of(module: str) -> tuple[int, str] | None:
    if module in FLOORS:
        return FLOORS[module][:2]
    packages = [name for name, (_, _, covers) in FLOORS.items()
                if covers and module.startswith(name + ".")]
    return FLOORS[max(packages, key=len)][:2] if packages else None


def floor_violations(edges: list[Edge]) -> list[str]:
    bad = []
    for e in edges:
        package = e.source.split(".")[0]
        if e.target.split(".")[0] == "torch":
            if package == "solver":
                bad.append(f"{e.source}:{e.line} imports {e.target}; solver never imports torch")
            continue
        if e.target.split(".")[0] != package:
            continue  # monetlike may import solver (a lower package); solver never monetlike
        if e.in_function:
            bad.append(f"{e.source}:{e.line} imports {e.target} inside a function")
            continue
        if e.target == package and e.source != package:
            bad.append(f"{e.source}:{e.line} imports the package root {package} (a higher "
                       f"floor)")
            continue
        src, dst = floor_of(e.source), floor_of(e.target)
        if src is None or dst is None:
            continue  # reported by test_every_module_is_on_a_floor
        if dst[0] > src[0] or (dst[0] == src[0] and dst[1] != src[1]):
            bad.append(f"{e.source}:{e.line} ({src[1]}, floor {src[0]}) imports {e.target} "
                       f"({dst[1]}, floor {dst[0]})")
    return bad


def cycles(edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if e.target.split(".")[0] in PROJECT and e.target != e.source:
            graph.setdefault(e.source, set()).add(e.target)
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def package_files(package: str) -> list[pathlib.Path]:
    files = sorted((ROOT / package).rglob("*.py"))
    assert len(files) > 10  # the walk found the package
    return files


def package_edges(package: str) -> list[Edge]:
    return [e for f in package_files(package) for e in import_edges(f)]


@pytest.mark.parametrize("package", PROJECT)
def test_every_module_is_on_a_floor(package):
    assert [module_name(f) for f in package_files(package)
            if floor_of(module_name(f)) is None] == []


@pytest.mark.parametrize("package", PROJECT)
def test_modules_import_only_their_own_floor_or_lower(package):
    bad = floor_violations(package_edges(package))
    assert not bad, "imports against the floors (DESIGN.md section 2):\n" + "\n".join(bad)


@pytest.mark.parametrize("package", PROJECT)
def test_no_import_cycles(package):
    # A package's __init__ imports its children; a child importing its own package's __init__
    # back is an arrow up, counted by the floor test, so cycles are read between modules.
    edges = [e for e in package_edges(package)
             if not (e.target == e.source.rsplit(".", 1)[0] and not e.source.endswith("__init__"))]
    assert not cycles(edges), cycles(edges)


def test_solver_never_imports_torch_or_monetlike_at_run_time():
    assert not [e for e in package_edges("solver") if e.target.split(".")[0] == "monetlike"]
    code = ("import sys, solver, solver.search, solver.baselines, solver.rules.warmstart, "
            "solver.backends; sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


# The checks themselves, on deliberate violations, so that they can fail.
@pytest.mark.parametrize("path, source, expected", [
    ("monetlike/core/allocator.py", "from ..profile import costs\n",
     ["monetlike.core.allocator:1 (core, floor 0) imports monetlike.profile.costs "
      "(profile, floor 3)"]),
    ("monetlike/profile/costs.py", "from ..runtime import plan\n",
     ["monetlike.profile.costs:1 (profile, floor 3) imports monetlike.runtime.plan "
      "(runtime, floor 3)"]),
    ("monetlike/impls/relu.py", "def f():\n    from ..core import recompute\n",
     ["monetlike.impls.relu:2 imports monetlike.core.recompute inside a function"]),
    ("monetlike/runtime/plan.py", "import monetlike\n",
     ["monetlike.runtime.plan:1 imports the package root monetlike (a higher floor)"]),
    ("solver/formulation.py", "from .backends.base import Backend\n",
     ["solver.formulation:1 (model, floor 1) imports solver.backends.base (backends, floor 2)"]),
    ("solver/search/local.py", "from .. import solve\n",
     ["solver.search.local:1 imports the package root solver (a higher floor)"]),
    ("solver/search/local.py", "from .. import cuts\nfrom . import lns\n", []),
    ("solver/graph.py", "import torch.fx as fx\n",
     ["solver.graph:1 imports torch.fx; solver never imports torch"]),
])
def test_an_upward_import_is_caught(path, source, expected):
    assert floor_violations(import_edges(ROOT / path, source)) == expected


def test_a_downward_import_passes():
    edges = import_edges(ROOT / "monetlike/wrapper.py",
                         "from .runtime import plan\nfrom .core import recompute\nimport solver\n")
    assert [e.target for e in edges] == ["monetlike.runtime.plan", "monetlike.core.recompute",
                                         "solver"]
    assert floor_violations(edges) == []


def test_a_module_on_no_floor_is_found():
    assert floor_of("solver.new_module") is None
    assert floor_of("solver.rules.new_rule") == (3, "rules")
    assert floor_of("monetlike.new_entry") == (4, "entry")


def test_a_cycle_is_found():
    edges = [Edge("solver.a", "solver.b", 1, False), Edge("solver.b", "solver.c", 1, False),
             Edge("solver.c", "solver.a", 1, False), Edge("solver.c", "solver.d", 1, False)]
    assert cycles(edges) == [["solver.a", "solver.b", "solver.c"]]


MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 150


def _long_parts(path: pathlib.Path) -> list[str]:
    """The file itself if over MAX_FILE_LINES, and each function or method over
    MAX_FUNCTION_LINES (docstring included), as 'path:line name (n lines)'."""
    text = path.read_text()
    rel = path.relative_to(ROOT)
    out = []
    n = len(text.splitlines())
    if n > MAX_FILE_LINES:
        out.append(f"{rel} ({n} lines)")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                out.append(f"{rel}:{node.lineno} {node.name} ({length} lines)")
    return out


@pytest.mark.parametrize("package", ["monetlike", "solver"])
def test_no_file_over_800_lines_and_no_function_over_150(package):
    too_long = [part for path in sorted((ROOT / package).rglob("*.py"))
                for part in _long_parts(path)]
    assert not too_long, f"split these: {too_long}"


def test_a_long_function_is_found(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    path = tmp_path / "m.py"
    path.write_text(f"def f():\n{body}\n")
    assert _long_parts(path) == [f"m.py:1 f ({MAX_FUNCTION_LINES + 1} lines)"]
