"""HiGHS through highspy: the default backend.

The model is passed as one column-wise sparse matrix (no per-variable Python objects). A warm
start goes in with `setSolution` as a full column vector: HiGHS then holds it as its first
incumbent and prunes with it from the root (a partial vector would instead start a sub-MIP).
Progress (incumbent, dual bound) arrives through HiGHS's MIP callbacks. The MIP search in HiGHS is
serial, so the solver runs with one thread and the other core stays free for the caller.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time

import numpy as np

from .base import ERROR, INFEASIBLE, OPTIMAL, TIME_LIMIT, Backend, BackendResult


_FIRST = threading.Lock()
_banner_done = False


def new_highs(highspy, verbose: bool):
    """A highspy.Highs; the first one in a process prints HiGHS's banner to the C stdout before
    any option can be set, so unless `verbose` that one is made with file descriptor 1 pointed at
    /dev/null (and the C buffer flushed before it is restored)."""
    global _banner_done
    with _FIRST:
        if _banner_done or verbose:
            _banner_done = True
            return highspy.Highs()
        sys.stdout.flush()
        saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, 1)
            h = highspy.Highs()
            try:
                ctypes.CDLL(None).fflush(None)
            except (OSError, AttributeError):  # no C library handle here: nothing to flush
                pass
        finally:
            os.dup2(saved, 1)
            os.close(saved)
            os.close(null)
        _banner_done = True
        return h


class HighsBackend(Backend):
    name = "highs"
    description = "HiGHS MIP solver via highspy (warm start, dual bound, progress)"
    requires = ("highspy",)
    WARM_START = True
    DUAL_BOUND = True
    PROGRESS = True
    CALLBACKS = True
    OBJECTIVE_CUTOFF = True

    options: dict = {}
    """Extra HiGHS options (name -> value) applied after the defaults; for experiments."""

    def _solve(self, milp, *, time_limit_s, mip_gap, warm_start, verbose, progress,
               callbacks=None, cutoff=None):
        import highspy

        start = time.perf_counter()
        h = new_highs(highspy, verbose)
        h.setOptionValue("output_flag", bool(verbose))
        h.setOptionValue("log_to_console", bool(verbose))
        h.setOptionValue("time_limit", float(max(time_limit_s, 0.01)))
        h.setOptionValue("mip_rel_gap", float(mip_gap))
        h.setOptionValue("mip_abs_gap", 1e-9)
        h.setOptionValue("threads", 1)
        h.setOptionValue("random_seed", 0)
        if cutoff is not None:
            h.setOptionValue("objective_bound", float(cutoff))
        for k, v in self.options.items():
            h.setOptionValue(k, v)

        lp = highspy.HighsLp()
        n, m = milp.num_vars, milp.num_rows
        inf = highspy.kHighsInf
        lp.num_col_, lp.num_row_ = n, m
        lp.col_cost_ = milp.c
        lp.offset_ = milp.offset
        lp.col_lower_ = np.where(np.isinf(milp.lb), -inf, milp.lb)
        lp.col_upper_ = np.where(np.isinf(milp.ub), inf, milp.ub)
        lp.row_lower_ = np.where(np.isinf(milp.row_lo), -inf, milp.row_lo)
        lp.row_upper_ = np.where(np.isinf(milp.row_hi), inf, milp.row_hi)
        A = milp.A.tocsc()
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = n, m
        lp.a_matrix_.start_ = A.indptr.astype(np.int32)
        lp.a_matrix_.index_ = A.indices.astype(np.int32)
        lp.a_matrix_.value_ = A.data
        lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
                           for i in milp.integrality]
        status = h.passModel(lp)
        if status == highspy.HighsStatus.kError:
            return BackendResult(status=ERROR, x=None, objective=None, bound=None,
                                 seconds=time.perf_counter() - start,
                                 message="HiGHS refused the model (passModel returned an error)")

        first = [None]
        log = []

        def on_improving(e):
            d = e.data_out
            if first[0] is None:
                first[0] = d.running_time
            log.append((d.running_time, d.mip_primal_bound, d.mip_dual_bound))
            if progress is not None:
                progress(d.running_time, d.mip_primal_bound, d.mip_dual_bound)

        def on_logging(e):
            d = e.data_out
            if progress is not None:
                progress(d.running_time, d.mip_primal_bound if np.isfinite(d.mip_primal_bound)
                         else None, d.mip_dual_bound if np.isfinite(d.mip_dual_bound) else None)

        h.cbMipImprovingSolution.subscribe(on_improving)
        if progress is not None:
            h.cbMipLogging.subscribe(on_logging)
        if callbacks is not None:
            _subscribe(h, callbacks, n)

        if warm_start is not None:
            sol = highspy.HighsSolution()
            sol.col_value = np.asarray(warm_start, dtype=float)
            sol.value_valid = True
            h.setSolution(sol)

        h.run()
        seconds = time.perf_counter() - start
        ms = h.getModelStatus()
        info = h.getInfo()
        has_x = info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible
        x = np.array(h.getSolution().col_value) if has_x else None
        bound = info.mip_dual_bound if np.isfinite(info.mip_dual_bound) else None
        obj = info.objective_function_value if has_x else None
        inconsistent = False
        if (x is not None and warm_start is not None
                and abs(milp.objective(x) - obj) > 1e-6 * max(1.0, abs(obj))):
            # HiGHS 1.16 can report the optimum's value while handing back the warm start as its
            # solution (seen on a 37-column model that presolve solved: "Optimal", objective
            # 28.8, the vector's objective the warm start's 31.0). The vector is what the caller
            # uses, so solve again without the warm start.
            rest = time_limit_s - (time.perf_counter() - start)
            if rest > 0.01:
                return self._solve(milp, time_limit_s=rest, mip_gap=mip_gap, warm_start=None,
                                   verbose=verbose, progress=progress, callbacks=callbacks,
                                   cutoff=cutoff)
            obj = milp.objective(x)  # out of time: report the vector it gave, as it is
            inconsistent = True
        if ms == highspy.HighsModelStatus.kOptimal and not inconsistent:
            status = OPTIMAL
        elif ms == highspy.HighsModelStatus.kInfeasible:
            status = INFEASIBLE
        elif inconsistent or ms in (highspy.HighsModelStatus.kTimeLimit,
                                    highspy.HighsModelStatus.kInterrupt,
                                    highspy.HighsModelStatus.kIterationLimit,
                                    highspy.HighsModelStatus.kSolutionLimit):
            status = TIME_LIMIT
        else:
            status = ERROR
        if status == OPTIMAL and obj is not None:
            # proven within mip_rel_gap of obj; presolve-solved models may report no bound
            claimed = obj - float(mip_gap) * abs(obj)
            bound = claimed if bound is None else max(bound, claimed)
        if first[0] is None and warm_start is not None and has_x:
            first[0] = 0.0
        return BackendResult(status=status, x=x, objective=obj, bound=bound, seconds=seconds,
                             first_incumbent_s=first[0], log=log,
                             message=f"HiGHS: {h.modelStatusToString(ms)}")


def _subscribe(h, callbacks, num_vars: int) -> None:
    """Translate HiGHS's MIP callback events into the backend-neutral SearchCallbacks."""
    cb = callbacks
    if cb.on_solution is not None:
        def improving(e):
            x = np.array(e.data_out.mip_solution, dtype=float)
            if len(x) == num_vars:
                cb.on_solution(x)
        h.cbMipImprovingSolution.subscribe(improving)
    if cb.offer is not None:
        def user_solution(e):
            x = cb.offer(e.data_out.mip_primal_bound)
            if x is not None:
                e.data_in.setSolution(x)
                e.data_in.user_has_solution = True
        h.cbMipUserSolution.subscribe(user_solution)
    if cb.on_bound is not None:
        def logging(e):
            if np.isfinite(e.data_out.mip_dual_bound):
                cb.on_bound(e.data_out.mip_dual_bound)
        h.cbMipLogging.subscribe(logging)
    if cb.should_stop is not None:
        def interrupt(e):
            if cb.should_stop(e.data_out.mip_dual_bound):
                e.interrupt()
        h.cbMipInterrupt.subscribe(interrupt)
