"""PuLP as a MILP backend: its bundled CBC, or HiGHS.

The MILP becomes one LpVariable per column and one LpConstraint per row (two for a ranged row).
The objective constant stays out of the solver (it is added back here), so the bound read from
the solver is comparable. CBC takes a warm start (PuLP writes it as a MIP start file) and reports
its lower bound only in its log, which is read from a temporary file. CBC does not check its time
limit while it solves the root LP, so it can overrun the limit on large models. PuLP's HiGHS
takes no warm start; its dual bound is read from the highspy object PuLP leaves behind.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
import warnings

import numpy as np

from .base import ERROR, INFEASIBLE, OPTIMAL, TIME_LIMIT, Backend, BackendResult


def _build(milp, warm_start):
    import pulp

    prob = pulp.LpProblem("monetlike", pulp.LpMinimize)
    width = len(str(max(milp.num_vars - 1, 0)))
    xs = []
    for i in range(milp.num_vars):
        lo = None if np.isinf(milp.lb[i]) else float(milp.lb[i])
        hi = None if np.isinf(milp.ub[i]) else float(milp.ub[i])
        cat = pulp.LpInteger if milp.integrality[i] else pulp.LpContinuous
        v = prob.add_variable(f"x{i:0{width}d}", lowBound=lo, upBound=hi, cat=cat)
        if warm_start is not None:
            v.setInitialValue(float(round(warm_start[i]) if milp.integrality[i]
                                    else warm_start[i]))
        xs.append(v)
    nz = np.nonzero(milp.c)[0]
    prob += pulp.LpAffineExpression([(xs[i], float(milp.c[i])) for i in nz])
    A = milp.A.tocsr()
    for r in range(milp.num_rows):
        s, e = A.indptr[r], A.indptr[r + 1]
        expr = pulp.LpAffineExpression([(xs[j], float(a)) for j, a in
                                        zip(A.indices[s:e], A.data[s:e])])
        lo, hi = milp.row_lo[r], milp.row_hi[r]
        if np.isfinite(lo) and lo == hi:
            prob += pulp.LpConstraint(expr, pulp.LpConstraintEQ, f"r{r}", float(lo))
            continue
        if np.isfinite(lo):
            prob += pulp.LpConstraint(expr, pulp.LpConstraintGE, f"r{r}", float(lo))
        if np.isfinite(hi):
            prob += pulp.LpConstraint(expr, pulp.LpConstraintLE, f"r{r}u" if np.isfinite(lo)
                                      else f"r{r}", float(hi))
    return prob, xs


def _values(xs) -> np.ndarray | None:
    vals = [v.varValue for v in xs]
    if any(v is None for v in vals):
        return None
    return np.array(vals, dtype=float)


# With a MIP start, CBC's preprocessing stays off. On a 13-op random DAG of the test suite
# (tests/test_solver_exact.py, random_dag seed 888), started from the least-memory schedule
# (objective 108), CBC reported a schedule of 79 as proven optimal (gap 0) with preprocessing
# on, where 78 is optimal (HiGHS, and CBC without the start or with preprocessing off). MIP
# starts and preprocessing interact in CBC: coin-or/Cbc#282.
WARM_START_OPTIONS = ("preprocess off",)


class PulpCbcBackend(Backend):
    name = "cbc"
    description = "PuLP with its bundled CBC (warm start; bound parsed from CBC's log)"
    requires = ("pulp",)
    WARM_START = DUAL_BOUND = True

    def _solve(self, milp, *, time_limit_s, mip_gap, warm_start, verbose, progress):
        import pulp

        start = time.perf_counter()
        prob, xs = _build(milp, warm_start)
        fd, log_path = tempfile.mkstemp(prefix="monetlike-cbc-", suffix=".log")
        os.close(fd)
        try:
            with warnings.catch_warnings():
                # PuLP 3.3 deprecates PULP_CBC_CMD, but it is the only way to its bundled CBC
                warnings.simplefilter("ignore", DeprecationWarning)
                solver = pulp.PULP_CBC_CMD(msg=bool(verbose), timeLimit=max(1, int(time_limit_s)),
                                           gapRel=float(mip_gap), threads=1,
                                           warmStart=warm_start is not None, logPath=log_path,
                                           options=(list(WARM_START_OPTIONS)
                                                    if warm_start is not None else []))
            prob.solve(solver)
            with open(log_path, encoding="utf-8", errors="replace") as f:
                log = f.read()
        finally:
            os.unlink(log_path)
        seconds = time.perf_counter() - start
        x = _values(xs)
        sol = prob.sol_status
        bound = _cbc_bound(log)
        stopped = re.search(r"Result - Stopped on (time|iterations|nodes)", log) is not None
        if prob.status == pulp.LpStatusInfeasible or "Result - Problem proven infeasible" in log:
            status, x = INFEASIBLE, None
        elif prob.status == pulp.LpStatusOptimal and not stopped and sol == pulp.LpSolutionOptimal:
            status = OPTIMAL
        elif x is not None and sol in (pulp.LpSolutionIntegerFeasible, pulp.LpSolutionOptimal):
            status = TIME_LIMIT
        elif stopped:
            status, x = TIME_LIMIT, None
        else:
            status, x = ERROR, None
        obj = None if x is None else float(milp.c @ x + milp.offset)
        if bound is not None:
            bound += milp.offset
        elif status == OPTIMAL and obj is not None:
            # CBC stops when (incumbent - bound) <= gapRel * |incumbent|
            bound = obj - float(mip_gap) * abs(obj - milp.offset) if mip_gap > 0 else obj
        return BackendResult(status=status, x=x, objective=obj, bound=bound, seconds=seconds,
                             message=f"CBC: {pulp.LpStatus[prob.status]}")


def _cbc_bound(log: str) -> float | None:
    m = re.search(r"Lower bound:\s*(-?[0-9.eE+-]+)", log)
    if m:
        try:
            return float(m.group(1))
        except ValueError:
            return None
    return None


class PulpHighsBackend(Backend):
    name = "pulp-highs"
    description = "PuLP with HiGHS (no warm start; HiGHS's dual bound)"
    requires = ("pulp", "highspy")
    WARM_START = False
    DUAL_BOUND = True

    def _solve(self, milp, *, time_limit_s, mip_gap, warm_start, verbose, progress):
        import highspy
        import pulp

        start = time.perf_counter()
        prob, xs = _build(milp, None)
        solver = pulp.HiGHS(msg=bool(verbose), timeLimit=float(max(time_limit_s, 0.01)),
                            gapRel=float(mip_gap), threads=1)
        prob.solve(solver)
        seconds = time.perf_counter() - start
        h = prob.solverModel
        ms = h.getModelStatus()
        info = h.getInfo()
        has_x = info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible
        x = _values(xs) if has_x else None
        bound = info.mip_dual_bound if np.isfinite(info.mip_dual_bound) else None
        if bound is not None:
            bound += milp.offset
        if ms == highspy.HighsModelStatus.kOptimal:
            status = OPTIMAL
        elif ms == highspy.HighsModelStatus.kInfeasible:
            status, x = INFEASIBLE, None
        elif ms in (highspy.HighsModelStatus.kTimeLimit, highspy.HighsModelStatus.kInterrupt):
            status = TIME_LIMIT
        else:
            status = ERROR
        obj = None if x is None else float(milp.c @ x + milp.offset)
        return BackendResult(status=status, x=x, objective=obj, bound=bound, seconds=seconds,
                             message=f"PuLP/HiGHS: {h.modelStatusToString(ms)}")
