"""Tests reach the code through its public names and seams, not its privates: no test
monkeypatches a `_name` (a private rewritten under a test pins the code's insides, and a rename
silently stops the patch from applying) or imports one from monetlike/ or solver/. Where a test
needs to stand in for a part (Inductor, the clock), the code offers it under a public name."""

from __future__ import annotations

import ast
import pathlib

import pytest

TESTS = pathlib.Path(__file__).resolve().parent
PROJECT = ("monetlike", "solver")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(source: str) -> list[str]:
    """Each `monkeypatch.setattr` of a private name and each private name imported from the
    project, as 'line N: what'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("setattr", "delattr") \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "monkeypatch":
            names = [a.value for a in node.args[:2]
                     if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if any(_private(n.rsplit(".", 1)[-1]) for n in names):
                found.append(f"line {node.lineno}: monkeypatch.{node.func.attr} of {names[-1]}")
        elif isinstance(node, ast.ImportFrom) and node.module \
                and node.module.split(".")[0] in PROJECT:
            found += [f"line {node.lineno}: from {node.module} import {a.name}"
                      for a in node.names if _private(a.name)]
    return found


@pytest.mark.parametrize("path", sorted(TESTS.glob("*.py")), ids=lambda p: p.name)
def test_no_test_patches_or_imports_a_private_name(path):
    assert private_uses(path.read_text()) == []


@pytest.mark.parametrize("source, expected", [
    ("monkeypatch.setattr(pipeline, '_build_stop', f)",
     ["line 1: monkeypatch.setattr of _build_stop"]),
    ("monkeypatch.setattr('solver.search.pipeline._search', f)",
     ["line 1: monkeypatch.setattr of solver.search.pipeline._search"]),
    ("from solver.compiled import GreedyPath, _starts",
     ["line 1: from solver.compiled import _starts"]),
    ("monkeypatch.setattr(pipeline, 'build_stop', f)\nfrom torch.utils import _pytree\n"
     "monkeypatch.setattr(m, '__call__', f)", []),
])
def test_a_private_patch_or_import_is_found(source, expected):
    assert private_uses(source) == expected
