"""cvxpy as a MILP backend, with the HIGHS or the SCIPY solver cvxpy ships with.

The MILP goes in as one vector variable (integer where the MILP says so, bounds on the variable)
and at most three matrix constraints (equalities, lower and upper row bounds). cvxpy passes no
user warm start to these MIP solvers, so neither backend takes one. The HIGHS path reports
HiGHS's dual bound from cvxpy's solver statistics; the SCIPY path reports none.
"""

from __future__ import annotations

import time

import numpy as np

from .base import ERROR, INFEASIBLE, OPTIMAL, TIME_LIMIT, Backend, BackendResult


class _CvxpyBackend(Backend):
    requires = ("cvxpy",)
    WARM_START = False
    solver_name = ""

    def _options(self, time_limit_s: float, mip_gap: float, verbose: bool) -> dict:
        raise NotImplementedError

    def _options_without_presolve(self, options: dict) -> dict | None:
        """The same options with presolve off, to re-check an 'infeasible' answer; None if
        this solver's presolve is trusted."""
        return None

    def _solve(self, milp, *, time_limit_s, mip_gap, warm_start, verbose, progress):
        import cvxpy as cp

        start = time.perf_counter()
        ints = np.nonzero(milp.integrality)[0]
        conts = np.nonzero(~milp.integrality)[0]
        lb = np.where(np.isinf(milp.lb), -1e30, milp.lb)
        ub = np.where(np.isinf(milp.ub), 1e30, milp.ub)
        # two vector variables (cvxpy marks integrality per variable), put together by columns
        parts = []
        if len(ints):
            parts.append((ints, cp.Variable(len(ints), integer=True,
                                            bounds=[lb[ints], ub[ints]])))
        if len(conts):
            parts.append((conts, cp.Variable(len(conts), bounds=[lb[conts], ub[conts]])))
        def times(M):
            return sum(M[:, idx] @ var for idx, var in parts)

        Ar = milp.A.tocsr()
        eq = np.isfinite(milp.row_lo) & (milp.row_lo == milp.row_hi)
        lo = np.isfinite(milp.row_lo) & ~eq
        hi = np.isfinite(milp.row_hi) & ~eq
        cons = []
        for mask, op in ((eq, "=="), (lo, ">="), (hi, "<=")):
            if mask.any():
                lhs = times(Ar[mask].tocsc())
                rhs = (milp.row_lo if op != "<=" else milp.row_hi)[mask]
                cons.append(lhs == rhs if op == "==" else (lhs >= rhs if op == ">=" else lhs <= rhs))
        objective = sum(milp.c[idx] @ var for idx, var in parts) + milp.offset
        prob = cp.Problem(cp.Minimize(objective), cons)
        options = self._options(time_limit_s, mip_gap, verbose)
        prob.solve(solver=self.solver_name, verbose=bool(verbose), **options)
        st = prob.status
        recheck = self._options_without_presolve(options)
        if st in (cp.INFEASIBLE, cp.INFEASIBLE_INACCURATE) and recheck is not None:
            prob.solve(solver=self.solver_name, verbose=bool(verbose), **recheck)
            st = prob.status
        seconds = time.perf_counter() - start
        xv = None
        if all(var.value is not None for _, var in parts):
            xv = np.zeros(milp.num_vars)
            for idx, var in parts:
                xv[idx] = np.asarray(var.value, dtype=float).reshape(-1)
        bound = self._bound(prob)
        if bound is not None:  # cvxpy keeps the constant out of the solver's objective
            bound += milp.offset
        if st == cp.OPTIMAL:
            status = OPTIMAL
        elif st in (cp.INFEASIBLE, cp.INFEASIBLE_INACCURATE):
            status = INFEASIBLE
        elif xv is not None:  # stopped early (time limit) with an incumbent
            status = TIME_LIMIT
        elif st in (cp.USER_LIMIT,) or seconds >= time_limit_s * 0.95:
            status = TIME_LIMIT
        else:
            status = ERROR
        obj = None if xv is None else float(milp.c @ xv + milp.offset)
        return BackendResult(status=status, x=xv, objective=obj, bound=bound, seconds=seconds,
                             first_incumbent_s=None, message=f"cvxpy/{self.solver_name}: {st}")

    def _bound(self, prob):
        return None


class CvxpyHighsBackend(_CvxpyBackend):
    name = "cvxpy"
    description = "cvxpy with its HIGHS solver (no warm start)"
    solver_name = "HIGHS"
    DUAL_BOUND = True

    def _options(self, time_limit_s, mip_gap, verbose):
        return {"time_limit": float(max(time_limit_s, 0.01)), "mip_rel_gap": float(mip_gap),
                "threads": 1, "random_seed": 0}

    def _bound(self, prob):
        stats = prob.solver_stats
        info = None if stats is None else stats.extra_stats
        if isinstance(info, dict):
            info = info.get("info")
        value = getattr(info, "mip_dual_bound", None)
        if value is None or not np.isfinite(value):
            return None
        return float(value)


class CvxpyScipyBackend(_CvxpyBackend):
    name = "cvxpy-scipy"
    description = "cvxpy with its SCIPY solver (scipy.optimize.milp; no warm start, no bound)"
    solver_name = "SCIPY"

    def _options(self, time_limit_s, mip_gap, verbose):
        return {"scipy_options": {"time_limit": float(max(time_limit_s, 0.01)),
                                  "mip_rel_gap": float(mip_gap), "disp": bool(verbose),
                                  "method": "highs"}}

    def _options_without_presolve(self, options):
        # The HiGHS 1.12 inside scipy 1.17 declares some feasible MILPs infeasible in presolve
        # when they arrive through cvxpy's reformulation (tests/test_solver_exact.py, seed 123:
        # the store-all schedule fits, presolve says infeasible, the same model without presolve
        # is optimal; highspy 1.15 gets it right). So an 'infeasible' is checked once without it.
        return {"scipy_options": {**options["scipy_options"], "presolve": False}}
