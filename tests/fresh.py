"""Run a function in a fresh interpreter without paying for torch's import each time: a
forkserver that has imported torch, torchvision, monetlike and solver (nothing else run) forks
one child per call, so tensors and state that the suite's process holds never reach it. A
subprocess per call imported them again: 5 s of CPU each here."""

from __future__ import annotations

import concurrent.futures
import multiprocessing

PRELOAD = ["torch", "torchvision", "monetlike", "solver"]
_context = None


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def forkserver():
    """The multiprocessing context whose server has the imports preloaded (one server per
    process: the distributed tests' workers start from it too, start_method="forkserver")."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def run_fresh(fn, *args, timeout: float = 900):
    """fn(*args) in a child forked from the preloaded server (one intra-op thread); its result,
    or its exception raised here. `fn` must be importable by name (a module-level function)."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=forkserver(),
                                                initializer=_one_thread) as pool:
        return pool.submit(fn, *args).result(timeout=timeout)
