"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest
import torch


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
