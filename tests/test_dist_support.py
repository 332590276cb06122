"""The distributed tests' harness: workers that skip their checks are not reported as passed."""

from dist_support import run_workers


def _worker_that_checks_nothing(rank: int, store_path: str) -> None:
    return None  # never enters process_group: no check runs


def test_workers_that_ran_no_checks_fail_the_test(tmp_path):
    assert run_workers(_worker_that_checks_nothing, (str(tmp_path / "store"),), "probe") == []
