"""Running a test's worker on 2 CPU processes with gloo (test_ddp, test_ddp_overlap, test_fsdp).

Workers rendezvous through a file store under the test's tmp_path (no TCP store-server thread, no
free-port race) and, once every check has passed, leave by `leave_without_finalization`: CI once
saw rank 0 die of SIGABRT in gloo's teardown during interpreter finalization ("terminate called
without an active exception", no Python traceback; pytorch/pytorch#179291). A failing check
still fails the test: the worker raises before it gets there, and the process context reports it.
And a worker that exits without running its checks fails it too: each rank leaves a file saying
its `process_group` body ran to its end, and `run_workers` asserts that every rank's is there.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fresh import forkserver

WORLD = 2
TIMEOUT_S = 240


def _passed_marker(store_path: str, rank: int) -> str:
    return f"{store_path}.passed.{rank}"


def run_workers(worker, args: tuple, what: str) -> list[int]:
    """Run `worker(rank, *args)` on WORLD spawned processes (`args[0]`: the file store's path,
    which the worker gives `process_group`); fail the test after TIMEOUT_S. Returns the ranks
    that ran their checks to the end (the test asserts it is every rank)."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    forkserver()  # workers fork from a server that has imported torch (tests/fresh.py)
    ctx = mp.start_processes(worker, args=args, nprocs=WORLD, join=False,
                             start_method="forkserver")
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"{what} workers did not finish within {TIMEOUT_S} s")
    return [r for r in range(WORLD) if os.path.exists(_passed_marker(args[0], r))]


def leave_without_finalization() -> None:
    """End a worker whose checks all passed, skipping interpreter finalization (see above)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def process_group(store_path: str, rank: int):
    """A worker's gloo process group (one thread per process: two share the 2 cores), through a
    file store (no TCP store-server thread in rank 0, no free-port race); destroyed on the way
    out, and then the worker leaves without finalization if its checks passed."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=WORLD)
    try:
        yield
    finally:
        dist.destroy_process_group()
    with open(_passed_marker(store_path, rank), "w") as f:
        f.write("passed\n")
    leave_without_finalization()
