"""The packages' floors (DESIGN.md section 2): each module imports only the floors below its own.

monetlike/, bottom up: core (torch mechanisms), capture (model -> GraphModule), impls (operator
implementations), then profile and runtime (siblings: neither imports the other), then the entry
points (wrapper, optimize, check, cli, ...). `solver` sits below all of monetlike and never
imports torch. Every project import counts, at the top of a module or inside a function: a
function-level import is how an upward arrow hides, so there are none (move the code instead).
"""

from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROJECT = ("monetlike", "solver")

# (floor number, module prefix); the longest matching prefix decides. Entry points are what is
# left at monetlike's root. Siblings share a number and may not import each other.
MONETLIKE_FLOORS = [
    (0, "monetlike.core"),
    (1, "monetlike.capture"),
    (2, "monetlike.impls"),
    (3, "monetlike.profile"),
    (3, "monetlike.runtime"),
    (4, "monetlike"),
]


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
    """Every import of a project module in `path` (or in `source`, read as that file)."""
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
                if target.split(".")[0] in PROJECT or target.split(".")[0] == "torch":
                    edges.append(Edge(module, target, node.lineno, id(node) in in_function))
    return edges


def floor_of(module: str, floors) -> tuple[int, str]:
    number, prefix = max(((n, p) for n, p in floors
                          if module == p or module.startswith(p + ".")), key=lambda f: len(f[1]))
    return number, prefix


def floor_violations(edges: list[Edge], floors) -> list[str]:
    bad = []
    for e in edges:
        if e.target.split(".")[0] != "monetlike":
            continue
        if e.in_function:
            bad.append(f"{e.source}:{e.line} imports {e.target} inside a function")
            continue
        (src_floor, src_room), (dst_floor, dst_room) = floor_of(e.source, floors), floor_of(
            e.target, floors)
        if e.target == "monetlike" and e.source != "monetlike":
            bad.append(f"{e.source}:{e.line} imports the package root (a higher floor)")
        elif dst_floor > src_floor or (dst_floor == src_floor and dst_room != src_room):
            bad.append(f"{e.source}:{e.line} ({src_room}, floor {src_floor}) imports "
                       f"{e.target} ({dst_room}, floor {dst_floor})")
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


def package_edges(package: str) -> list[Edge]:
    files = sorted((ROOT / package).rglob("*.py"))
    assert len(files) > 10  # the walk found the package
    return [e for f in files for e in import_edges(f)]


def test_monetlike_imports_only_lower_floors():
    bad = floor_violations(package_edges("monetlike"), MONETLIKE_FLOORS)
    assert not bad, "imports against the floors (DESIGN.md section 2):\n" + "\n".join(bad)


@pytest.mark.parametrize("package", PROJECT)
def test_no_import_cycles(package):
    # A package's __init__ imports its children; a child importing its own package's __init__
    # back is an arrow up, counted by the floor test, so cycles are read between modules.
    edges = [e for e in package_edges(package)
             if not (e.target == e.source.rsplit(".", 1)[0] and not e.source.endswith("__init__"))]
    assert not cycles(edges), cycles(edges)


def test_solver_never_imports_torch_or_monetlike():
    bad = [f"{e.source}:{e.line} imports {e.target}" for e in package_edges("solver")
           if e.target.split(".")[0] in ("torch", "monetlike")]
    assert not bad, "\n".join(bad)


# The checks themselves, on deliberate violations, so that they can fail.
@pytest.mark.parametrize("path, source, expected", [
    ("monetlike/core/allocator.py", "from ..profile import costs\n",
     "monetlike.core.allocator:1 (monetlike.core, floor 0) imports monetlike.profile.costs "
     "(monetlike.profile, floor 3)"),
    ("monetlike/profile/costs.py", "from ..runtime import plan\n",
     "monetlike.profile.costs:1 (monetlike.profile, floor 3) imports monetlike.runtime.plan "
     "(monetlike.runtime, floor 3)"),
    ("monetlike/impls/relu.py", "def f():\n    from ..core import recompute\n",
     "monetlike.impls.relu:2 imports monetlike.core.recompute inside a function"),
    ("monetlike/runtime/plan.py", "import monetlike\n",
     "monetlike.runtime.plan:1 imports the package root (a higher floor)"),
])
def test_an_upward_import_is_caught(path, source, expected):
    assert floor_violations(import_edges(ROOT / path, source), MONETLIKE_FLOORS) == [expected]


def test_a_downward_import_passes():
    edges = import_edges(ROOT / "monetlike/wrapper.py",
                         "from .runtime import plan\nfrom .core import recompute\nimport solver\n")
    assert [e.target for e in edges] == ["monetlike.runtime.plan", "monetlike.core.recompute",
                                         "solver"]
    assert floor_violations(edges, MONETLIKE_FLOORS) == []


def test_a_cycle_is_found():
    edges = [Edge("solver.a", "solver.b", 1, False), Edge("solver.b", "solver.c", 1, False),
             Edge("solver.c", "solver.a", 1, False), Edge("solver.c", "solver.d", 1, False)]
    assert cycles(edges) == [["solver.a", "solver.b", "solver.c"]]
