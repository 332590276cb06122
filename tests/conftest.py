"""Fixtures shared by the test modules."""

from __future__ import annotations

import os

import pytest
import torch

from fuzz_models import settle_heap


def pytest_configure(config):
    """Under pytest-xdist (the default run, pyproject.toml) each worker process has one of the
    2 cores: one intra-op thread each, or the two workers' OpenMP threads spin against each
    other."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


def pytest_collection_modifyitems(session, config, items):
    """Tests marked slow first (a stable sort). The workers take whole files in collection
    order (--dist loadfile); the fuzzer, minutes in one file, collected near the end kept one
    worker busy alone while the other had finished."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="module", autouse=True)
def settled_heap():
    """Each module starts with what is alive (torch, transformers, the test modules, what
    earlier modules cached) moved out of the garbage collector's view. Measurements and profiles
    run a full collection each (monetlike.measure, monetlike.core.allocator), whose cost grows
    with every object the process holds: 0.26 s each with these imports, most of the fuzzer's
    time. Tensors made in the module are still seen (gc.get_objects, used to find the storages
    alive at a step's start, skips only the frozen objects); objects frozen and dropped later
    are not collected, a few per module."""
    settle_heap()
    yield


@pytest.fixture
def one_thread():
    """One intra-op thread for the test. Other processes share the 2 cores; OpenMP threads
    spinning against them make timings (and so test durations) swing tenfold, and measured
    profiles (costs timed per Op) need a steady clock. Modules opt in with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def full_search():
    """solve with no shortcut past the MILP (solver_cases.no_search_shortcuts)."""
    from solver_cases import no_search_shortcuts

    with no_search_shortcuts():
        yield
