"""solver/'s floors: every module sits on one floor and imports only its own floor or lower ones,
only at the top of the module, and never torch (a graph profiled on a GPU box is solved on any
CPU box). Read from the source with `ast`, imports inside functions included, so an upward
import cannot hide in a function.

Floors, bottom up (a new module is given its floor here, or the test fails):
  base        the IR, units, errors, the release rule, canonical form, the simulator, analysis
  model       the MILP (milp, formulation, formulation_rows) and the bounds written beside it
              (cuts, stage_bound)
  backends    the MILP solvers the formulation is handed to
  rules       schedules built without a MILP (solver/rules/)
  search      the pipeline and its strategies (solver/search/)
  entry       the baselines and the package's own __init__
"""

from __future__ import annotations

import ast
import pathlib

import pytest

SOLVER = pathlib.Path(__file__).resolve().parent.parent / "solver"

FLOORS = ["base", "model", "backends", "rules", "search", "entry"]
MODULE_FLOOR = {
    "solver.errors": "base", "solver.units": "base", "solver.graph": "base",
    "solver.schedule": "base", "solver.release": "base", "solver.canonical": "base",
    "solver.simulate": "base", "solver.analysis": "base", "solver.least_budget": "base",
    "solver.milp": "model", "solver.formulation": "model", "solver.formulation_rows": "model",
    "solver.cuts": "model", "solver.stage_bound": "model",
    "solver.baselines": "entry", "solver": "entry",
}
PACKAGE_FLOOR = {"solver.backends": "backends", "solver.rules": "rules",
                 "solver.search": "search"}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SOLVER.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def floor_of(module: str) -> str | None:
    if module in MODULE_FLOOR:
        return MODULE_FLOOR[module]
    for package, floor in PACKAGE_FLOOR.items():
        if module == package or module.startswith(package + "."):
            return floor
    return None


def imports(source: str, name: str, is_package: bool, modules: set[str]):
    """(line, imported module, at top level) for every import in one module's source. `from P
    import a` names the module P.a where that is one, else P."""
    package = name if is_package else name.rpartition(".")[0]
    tree = ast.parse(source)
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, id(node) in top
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                yield node.lineno, sub if sub in modules else mod, id(node) in top


def violations(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Every import of `sources` ({module: (source, is_package)}) that breaks a floor rule."""
    modules = set(sources)
    out = []
    for name, (source, is_package) in sorted(sources.items()):
        floor = floor_of(name)
        if floor is None:
            out.append(f"{name}: on no floor; give it one in tests/test_solver_floors.py")
            continue
        for line, target, at_top in imports(source, name, is_package, modules):
            root = target.split(".")[0]
            if root == "torch":
                out.append(f"{name}:{line} imports {target}; solver never imports torch")
            if root != "solver":
                continue
            if not at_top:
                out.append(f"{name}:{line} imports {target} inside a function; import it "
                           f"at the top of the module")
            target_floor = floor_of(target)
            if target_floor is None or FLOORS.index(target_floor) > FLOORS.index(floor):
                out.append(f"{name}:{line} ({floor}) imports {target} ({target_floor}), a "
                           f"higher floor; move the shared code down to {floor} or lower")
    return out


def solver_sources() -> dict[str, tuple[str, bool]]:
    return {module_name(p): (p.read_text(), p.name == "__init__.py")
            for p in SOLVER.rglob("*.py")}


def test_solver_modules_import_only_their_own_floor_or_lower():
    sources = solver_sources()
    assert {"solver.search.pipeline", "solver.rules.simple", "solver.formulation",
            "solver"} <= set(sources)
    assert violations(sources) == []


@pytest.mark.parametrize("module,source,expected", [
    # the model floor reaching up to a backend
    ("solver.formulation", "from .backends.base import Backend\n",
     ["solver.formulation:1 (model) imports solver.backends.base (backends), a higher floor; "
      "move the shared code down to model or lower"]),
    # a rule reaching up to the search, hidden in a function
    ("solver.rules.simple", "def f():\n    from ..search import lns\n",
     ["solver.rules.simple:2 imports solver.search.lns inside a function; import it at the "
      "top of the module",
      "solver.rules.simple:2 (rules) imports solver.search.lns (search), a higher floor; "
      "move the shared code down to rules or lower"]),
    # `from .. import x` names the module x, not the package's __init__
    ("solver.search.local", "from .. import cuts\nfrom . import lns\n", []),
    # but a name of the package's __init__ is the entry floor
    ("solver.search.local", "from .. import solve\n",
     ["solver.search.local:1 (search) imports solver (entry), a higher floor; move the shared "
      "code down to search or lower"]),
    ("solver.graph", "import torch.fx as fx\n",
     ["solver.graph:1 imports torch.fx; solver never imports torch"]),
    ("solver.new_module", "", ["solver.new_module: on no floor; give it one in "
                               "tests/test_solver_floors.py"]),
])
def test_the_checker_finds_each_broken_rule(module, source, expected):
    sources = {m: ("", p) for m, (_, p) in solver_sources().items()}
    sources[module] = (source, False)
    assert violations(sources) == expected
