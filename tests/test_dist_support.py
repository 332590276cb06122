"""The distributed tests' harness fails a test whose workers skip their checks."""

import pytest

from dist_support import run_workers


def _worker_that_checks_nothing(rank: int, store_path: str) -> None:
    return None  # never enters process_group: no check runs


def test_workers_that_ran_no_checks_fail_the_test(tmp_path):
    with pytest.raises(AssertionError, match=r"ranks \[0, 1\] exited without running"):
        run_workers(_worker_that_checks_nothing, (str(tmp_path / "store"),), "probe")
