"""Importing a file of scripts/ or examples/ in a test: neither folder is a package."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_module(path, name: str):
    """The file at `path`, executed as a fresh module `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def load_script(stem: str):
    """scripts/<stem>.py, with scripts/ on sys.path for the sibling modules it imports
    (bench_doc, bench_solver)."""
    scripts = str(ROOT / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    return load_module(ROOT / "scripts" / f"{stem}.py", f"{stem}_under_test")


def load_example(stem: str):
    """examples/<stem>.py."""
    return load_module(ROOT / "examples" / f"{stem}.py", f"example_{stem}")
