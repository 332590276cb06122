"""The MILP, written once as solver-neutral sparse data, and the map between its solutions and
Schedules.

`Formulation(graph, budget, mode=..., objective=...)` builds a `MILP`: minimise c.x + offset
subject to row_lo <= A x <= row_hi, lb <= x <= ub, integrality. Columns and rows come in named
blocks; docs/formulation.md states every block's equation with the same names, and must be kept
identical to this file. The backends only translate a MILP; they know nothing of graphs.

The model encodes the simulator's rules exactly (docs/execution-model.md): for every feasible
0/1 assignment, each memory row's activity is at least the simulator's memory at that point, with
equality when the continuous helper columns sit at their least feasible values (which `encode`
computes), and the objective is exactly the simulator's step time. What keeps it small and fast:
- only variables that can matter (analysis.GraphFacts: a Value past its horizon is never held, an
  op is a recompute candidate only while one of its outputs can matter);
- memory inside a backward stage written as running sums (one continuous column per point, O(1)
  nonzeros per change of residency) instead of one full sum per point;
- dominance cuts that keep an optimal schedule (no useless residency, no useless or duplicate
  recomputation), so bounds from this model are valid lower bounds;
- recompute-support cuts (solver/cuts.py), valid inequalities that the search separates from LP
  solutions and passes in as `support_cuts`: they cut off the LP's ramps (a Value made resident
  by tiny recomputations at many stages), which left GoogLeNet's LP bound 3 points low.
"""

from __future__ import annotations

import bisect
import dataclasses
import math

import numpy as np

from .analysis import GraphFacts, dominates
from .canonical import canonicalize, residency
from .cuts import SupportCut
from .formulation_rows import FormulationRows, MemRow
from .graph import OpGraph
from .milp import MILP, Builder, pow2_scale
from .schedule import Schedule, StageSchedule

OBJECTIVES = ("time", "peak")
OFFLOAD_MODES = ("full",)  # offload is an operator choice, and only mode 'full' chooses operators


def offload_obstacle(mode: str, host_bandwidth: float | None) -> str | None:
    """Why a solve cannot offload: "mode" (not one of OFFLOAD_MODES), "link" (the graph has no
    device<->host bandwidth to price a copy), or None."""
    if mode not in OFFLOAD_MODES:
        return "mode"
    if host_bandwidth is None:
        return "link"
    return None


class Formulation(FormulationRows):
    """The schedule MILP for one graph, budget, mode and objective.

    objective="time": minimise the step time subject to every memory point <= budget.
    objective="peak": minimise the peak (column P); the budget is ignored.
    should_stop: a callable asked as the build goes (milp.Builder); when it returns True the
    build raises milp.BuildStopped (a large graph's build took minutes on a loaded machine).
    """

    def __init__(self, graph: OpGraph, budget: int | None = None, *, mode: str = "full",
                 objective: str = "time", running_sums: bool = True,
                 recompute_points: "frozenset[tuple[int, int]] | None" = None,
                 offload: bool = False, support_cuts: "frozenset[SupportCut]" = frozenset(),
                 facts: GraphFacts | None = None, should_stop=None):
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        obstacle = offload_obstacle(mode, graph.host_bandwidth) if offload else None
        if obstacle == "mode":
            raise ValueError(f"offload is an operator choice of mode 'full', not of {mode!r}")
        if obstacle == "link":
            raise ValueError(f"offload=True needs the graph's host_bandwidth (bytes per second of "
                             f"the device<->host link), but {graph.model} has none (profiled on "
                             f"{graph.cost_provenance or 'an unknown device'}); profile on a GPU, "
                             f"pass host_bandwidth= to profile, or solve without offload")
        self.offload = offload
        if objective == "time" and budget is None:
            raise ValueError("objective 'time' needs a budget")
        self.graph, self.budget, self.mode, self.objective = graph, budget, mode, objective
        # `facts`: the caller's, when it has them for this graph and mode (they are not cheap)
        self.facts = (facts if facts is not None and facts.graph is graph and facts.mode == mode
                      else GraphFacts(graph, mode))
        self.running_sums = running_sums
        self.recompute_points = None if recompute_points is None else frozenset(recompute_points)
        """None: a memory row at every candidate recomputation. A set of (stage, op): rows only
        there, a relaxation (valid for bounds) whose solutions the simulator must check; the
        lazy-row loop in search/branch_and_bound.py adds the points they violate."""
        self.support_cuts = frozenset(support_cuts)
        """Recompute-support cuts (solver/cuts.py) to add as rows: valid inequalities, chosen by
        separation from LP solutions; they change no 0/1 solution, only the relaxation."""
        g = graph
        self.T = len(g.backward_order)
        # Scale memory to about 4096 units at the budget (or the store-all size) and time to
        # about 1000 units for a store-all step: both powers of two, so exact.
        ref_mem = budget if budget else sum(v.bytes for v in g.values) + g.fixed_bytes
        self.mem_scale = max(1.0, pow2_scale(ref_mem / 4096.0, 1.0))
        t0 = sum(op.impls[0].fwd_time for op in g.ops) + sum(
            g.ops[k].impls[0].bwd_time for k in g.backward_order)
        self.time_scale = pow2_scale(1000.0, t0) if t0 > 0 else 1.0
        self.mem_rows: list[MemRow] = []
        self.const_peak = 0
        """The largest memory of a point with no decision in it (and where it is)."""
        self.const_peak_where = ""
        self.infeasible_points: list[tuple[str, int]] = []
        """Points whose fixed memory alone exceeds the budget (time objective only)."""
        self._defined: list[tuple[int, int]] = []  # (column, defining equality row), in order
        self.full_sum_nnz = 0
        """With running sums: the nonzeros the stage memory rows would have as full sums."""
        self.milp = self._build(should_stop)

    # -- helpers -------------------------------------------------------------------------------
    def _impl(self, j: int, i: int):
        return self.graph.ops[j].impls[i]

    def _uniform(self, j: int, attrs) -> bool:
        vals = {tuple(getattr(self._impl(j, i), a) for a in attrs) for i in self.facts.impls[j]}
        return len(vals) == 1

    def _choice_terms(self, j: int, fn, scale: float):
        """(constant, terms): fn(impl) summed over op j's impl choice."""
        impls = self.facts.impls[j]
        if len(impls) == 1:
            return fn(self._impl(j, impls[0])), []
        return 0, [(self.M[j, i], fn(self._impl(j, i)) / scale) for i in impls]

    # -- build ---------------------------------------------------------------------------------
    def _build(self, should_stop=None) -> MILP:
        """The columns, block by block, then the rows (formulation_rows.py), in the order of
        docs/formulation.md."""
        self._cand_sets = [set(c) for c in self.facts.candidates]
        self._stage_ops = set(self.graph.backward_order)
        b = Builder(should_stop)
        offset = self._impl_columns(b)
        self._resident_columns(b)
        self._recompute_columns(b)
        self._recompute_impl_columns(b)
        self.O: dict[int, int] = {}
        self.Fe: dict[tuple[int, int], int] = {}
        if self.offload:
            self._offload_columns(b)
            self._fetch_columns(b)
        self._alive_backward_columns(b)
        self._held_past_columns(b)
        self._alive_in_stage_columns(b)
        self._stage_memory_columns(b)
        self._internals_columns(b)
        self.P = None
        if self.objective == "peak":
            self._peak_column(b)
            offset = 0.0  # the schedule's time is read off decode
        self._rows(b)
        return b.finish(offset)

    def _peak_column(self, b: Builder) -> None:
        """P >= every memory point (the mem_* rows), the objective alone: time costs go."""
        b.cost = [0.0] * len(b.cost)
        b.var_block("peak")
        self.P = b.var("P", integer=False, ub=math.inf, cost=1.0)

    def _impl_columns(self, b: Builder) -> float:
        """M[j,i]: op j runs Impl i; an op with one Impl adds a constant to the objective (the
        offset, returned)."""
        g, f, ts, stage_ops = self.graph, self.facts, self.time_scale, self._stage_ops
        ops = g.ops
        offset = 0.0
        b.var_block("impl")  # M[j,i]: op j runs Impl i
        self.M: dict[tuple[int, int], int] = {}
        for op in ops:
            impls = f.impls[op.id]
            for i in impls:
                im = op.impls[i]
                seconds = im.fwd_time + (im.bwd_time if op.id in stage_ops else 0.0)
                if len(impls) == 1:
                    offset += seconds * ts
                else:
                    self.M[op.id, i] = b.var(f"M[{op.id},{i}]", cost=seconds * ts)
        return offset

    def _resident_columns(self, b: Builder) -> None:
        """S[t,v]: Value v resident entering stage t (t=0: kept by the forward pass)."""
        g, f = self.graph, self.facts
        values, hz = g.values, f.horizon
        b.var_block("resident")  # S[t,v]: Value v resident entering stage t (t=0: kept)
        self.S: dict[tuple[int, int], int] = {}
        for v in values:
            for t in range(hz[v.id] + 1):
                self.S[t, v.id] = b.var(f"S[{t},{v.id}]")

    def _recompute_columns(self, b: Builder) -> None:
        """R[t,j]: op j recomputed just before stage t."""
        g, f, ts = self.graph, self.facts, self.time_scale
        ops, ohz = g.ops, f.op_horizon
        b.var_block("recompute")  # R[t,j]: op j recomputed just before stage t
        self.R: dict[tuple[int, int], int] = {}
        self.split_ops = {j for j in range(len(ops)) if len(f.impls[j]) > 1 and not self._uniform(
            j, ("rerun_time", "recompute_transient", "overwrites"))}
        for j in range(len(ops)):
            cost = 0.0 if j in self.split_ops else self._impl(j, f.impls[j][0]).rerun_time * ts
            for t in range(ohz[j] + 1):
                self.R[t, j] = b.var(f"R[{t},{j}]", cost=cost)

    def _recompute_impl_columns(self, b: Builder) -> None:
        """RI[t,j,i] = R[t,j] and M[j,i], for ops whose Impls differ."""
        f, ts = self.facts, self.time_scale
        b.var_block("recompute_impl")  # RI[t,j,i] = R[t,j] and M[j,i] (ops whose Impls differ)
        self.RI: dict[tuple[int, int, int], int] = {}
        for (t, j) in list(self.R):
            if j in self.split_ops:
                for i in f.impls[j]:
                    self.RI[t, j, i] = b.var(f"RI[{t},{j},{i}]", integer=False,
                                             cost=self._impl(j, i).rerun_time * ts)

    def _offload_columns(self, b: Builder) -> None:
        """O[v]: v copied to host in the forward pass (offload=True; costs bytes / bandwidth)."""
        f, ts = self.facts, self.time_scale
        b.var_block("offload")
        for v in self.graph.values:
            if f.scheduled[v.id] and f.horizon[v.id] >= 0:
                self.O[v.id] = b.var(f"O[{v.id}]", cost=self._transfer(v.id) * ts)

    def _fetch_columns(self, b: Builder) -> None:
        """Fe[t,v]: v copied back from host at the start of stage t (costs bytes / bandwidth)."""
        b.var_block("fetch")
        for v in self.O:
            for t in range(self.facts.horizon[v] + 1):
                self.Fe[t, v] = b.var(f"Fe[{t},{v}]", cost=self._transfer(v) * self.time_scale)

    def _alive_backward_columns(self, b: Builder) -> None:
        """Y[t,v] = S[t+1,v] or (the chosen Impl of stage t saves v)."""
        g, f = self.graph, self.facts
        b.var_block("alive_backward")  # Y[t,v] = S[t+1,v] or (the chosen Impl of stage t saves v)
        self.Y: dict[tuple[int, int], int] = {}
        for t, need in enumerate(f.need):
            k = g.backward_order[t]
            for v, needers in need.items():
                if len(needers) < len(f.impls[k]):
                    self.Y[t, v] = b.var(f"Y[{t},{v}]", integer=False)

    def _held_past_columns(self, b: Builder) -> None:
        """H[t,v,i] = S[t+1,v] and M[k_t,i], for v released early by Impl i of stage t's op."""
        g, f, T, ms = self.graph, self.facts, self.T, self.mem_scale
        values, sched = g.values, f.scheduled
        # A saved Value that Impl i of stage t's op frees before its backward's peak, held past
        # the stage: H[t,v,i] = S[t+1,v] and M[k_t,i] (an op with one allowed Impl uses S).
        # Model outputs are always held: their bytes come back as constants. (Graph inputs are
        # fixed memory, never a stage's: the simulator adds nothing for them.)
        b.var_block("held_past")
        self.H: dict[tuple[int, int, int], int] = {}
        self._held_past: list[tuple[int, list]] = []  # per stage: (constant, [(column, coef)])
        for t in range(T):
            k = g.backward_order[t]
            const, cols = 0, []
            one = len(f.impls[k]) == 1
            for i in f.impls[k]:
                for v in self._impl(k, i).early_release:
                    byt = values[v].bytes
                    if values[v].producer is None:
                        continue
                    if not sched[v]:
                        if one:
                            const += byt
                        else:
                            cols.append((self.M[k, i], byt / ms))
                    elif (t + 1, v) not in self.S:
                        continue  # past its horizon: never held after the stage
                    elif one:
                        cols.append((self.S[t + 1, v], byt / ms))
                    else:
                        self.H[t, v, i] = b.var(f"H[{t},{v},{i}]", integer=False)
                        cols.append((self.H[t, v, i], byt / ms))
            self._held_past.append((const, cols))

    def _alive_in_stage_columns(self, b: Builder) -> None:
        """G[t,v,u] = v resident just before its user u runs in stage t."""
        g, f, T, cand_sets = self.graph, self.facts, self.T, self._cand_sets
        values, hz, cands = g.values, f.horizon, f.candidates
        # Alive-after-production columns: G[t,v,u] = v still resident just before user u runs in
        # stage t = Y-expression or R[t,u'] for some user u' >= u.
        b.var_block("alive_in_stage")
        self.G: dict[tuple[int, int, int], int] = {}
        self._alive_plan: list[list[tuple[int, list]]] = []  # per stage: (v, segments)
        for t in range(T):
            b.check()  # a loop over every Value that may add no column
            plan = []
            C = cands[t]
            pos = {j: l for l, j in enumerate(C)}
            L = len(C)
            for v in values:
                if hz[v.id] < t:
                    continue
                yexpr = self._y_expr(t, v.id)
                p = v.producer
                lp = bisect.bisect_right(C, p)
                segs = []  # (first position, last position, term) ; term: ('c',) | ('v', col) | None
                if lp > 0:
                    segs.append((0, lp - 1, ("v", self.S[t, v.id])))
                    if (t, v.id) in self.Fe:  # fetched: resident from the stage start too
                        segs.append((0, lp - 1, ("v", self.Fe[t, v.id])))
                start = lp
                us = [u for u in g.users[v.id] if u in cand_sets[t]]
                for idx, u in enumerate(us):
                    end = pos[u]
                    if yexpr == ("c",):
                        term = ("c",)
                    elif idx == len(us) - 1 and yexpr is None:
                        term = ("v", self.R[t, u])  # alive exactly when its last user runs
                    else:
                        term = ("v", b.var(f"G[{t},{v.id},{u}]", integer=False))
                        self.G[t, v.id, u] = term[1]
                    segs.append((start, end, term))
                    start = end + 1
                segs.append((start, L, yexpr))
                plan.append((v.id, us, yexpr, segs))
            self._alive_plan.append(plan)

    def _stage_memory_columns(self, b: Builder) -> None:
        """Lm[t,l]: bytes of scheduled Values alive at point l of stage t (running sums)."""
        f, T = self.facts, self.T
        cands = f.candidates
        if self.running_sums:
            b.var_block("stage_memory")  # Lm[t,l]: bytes of scheduled Values alive at point l
            self.Lm: dict[tuple[int, int], int] = {}
            for t in range(T):
                for l in range(len(cands[t]) + 1):
                    self.Lm[t, l] = b.var(f"Lm[{t},{l}]", integer=False, ub=math.inf)

    def _internals_columns(self, b: Builder) -> None:
        """IF[j], IB[t]: internals held before forward op j / during stage t, when Impls differ."""
        g, T, stage_ops = self.graph, self.T, self._stage_ops
        ops = g.ops
        # Internals held, when an Impl choice changes them: IF[j] before forward op j, IB[t] at
        # stage t (running sums, so a row carries one column instead of one per op).
        b.var_block("internals")
        var_int = [j for j in stage_ops if not self._uniform(j, ("internal_bytes",))]
        self.IF: dict[int, int] = {}
        self.IB: dict[int, int] = {}
        if var_int:
            for j in range(len(ops)):
                self.IF[j] = b.var(f"IF[{j}]", integer=False, ub=math.inf)
            for t in range(T):
                self.IB[t] = b.var(f"IB[{t}]", integer=False, ub=math.inf)
        self._var_int = var_int

    def _freed(self, j: int, im) -> int:
        """Output bytes Impl `im` of op j does not allocate (in place: analysis.inplace_freed)."""
        return self.facts.out_bytes[j] if im.overwrites is not None else 0

    def _transfer(self, v: int) -> float:
        """Seconds to copy Value v between device and host memory (one way)."""
        return self.graph.values[v].bytes / self.graph.host_bandwidth

    def _y_expr(self, t: int, v: int):
        """Is v alive at stage t's backward point: ('c',) always, ('v', col) a column, None never."""
        f = self.facts
        k = self.graph.backward_order[t]
        needers = f.need[t].get(v, ())
        if needers and len(needers) == len(f.impls[k]):
            return ("c",)
        if needers:
            return ("v", self.Y[t, v])
        if (t + 1, v) in self.S:
            return ("v", self.S[t + 1, v])
        return None


    # -- solutions <-> schedules ---------------------------------------------------------------
    def seconds(self, x: np.ndarray) -> float:
        """The step time the solution claims, in seconds."""
        if self.objective == "peak":
            return self._time_of(x)
        return self.milp.objective(x) / self.time_scale

    def _time_of(self, x: np.ndarray) -> float:
        s = self.decode(x)
        g = self.graph
        total = sum(g.ops[j].impls[i].fwd_time for j, i in enumerate(s.impl))
        total += sum(g.ops[k].impls[s.impl[k]].bwd_time for k in g.backward_order)
        total += sum(g.ops[j].impls[s.impl[j]].rerun_time
                     for st in s.stages for j in st.recompute)
        total += sum(self._transfer(v) for v in s.offload)
        total += sum(self._transfer(v) for st in s.stages for v in st.fetch)
        return total

    def claimed_peak(self, x: np.ndarray) -> int:
        """The largest memory any point claims for solution x, in bytes."""
        act = self.milp.A @ x
        peak = self.const_peak
        for mr in self.mem_rows:
            a = act[mr.row]
            if self.P is not None:
                a += x[self.P]
            peak = max(peak, mr.const + int(round(a * self.mem_scale)))
        return peak

    def decode(self, x: np.ndarray) -> Schedule:
        """The Schedule a (rounded) solution vector describes."""
        g, f = self.graph, self.facts
        on = lambda col: x[col] > 0.5  # noqa: E731
        impl = []
        for j in range(len(g.ops)):
            choices = f.impls[j]
            impl.append(choices[0] if len(choices) == 1 else
                        max(choices, key=lambda i: x[self.M[j, i]]))
        resident = [set() for _ in range(self.T + 1)]
        for (t, v), col in self.S.items():
            if on(col):
                resident[t].add(v)
        stages = []
        rec = [[] for _ in range(self.T)]
        for (t, j), col in self.R.items():
            if on(col):
                rec[t].append(j)
        fetch = [set() for _ in range(self.T)]
        for (t, v), col in self.Fe.items():
            if on(col):
                fetch[t].add(v)
        for t, k in enumerate(g.backward_order):
            made = {w for j in rec[t] for w in g.ops[j].outputs if f.scheduled[w]}
            present = resident[t] | made | fetch[t]
            stages.append(StageSchedule(op=k, recompute=tuple(sorted(rec[t])),
                                        drop=tuple(sorted(present - resident[t + 1])),
                                        fetch=tuple(sorted(fetch[t]))))
        return Schedule(fingerprint=g.fingerprint, graph_summary=g.summary(), impl=tuple(impl),
                        forward_keep=tuple(sorted(resident[0])), stages=tuple(stages),
                        budget_bytes=self.budget, mode=self.mode,
                        cost_provenance=g.cost_provenance,
                        offload=tuple(sorted(v for v, col in self.O.items() if on(col))))

    def encode(self, schedule: Schedule) -> np.ndarray:
        """A full solution vector for `schedule` (made canonical first), with every helper column
        at its least feasible value, so the memory rows equal the simulator's memory. Raises
        ValueError if the schedule cannot be described (an Impl outside this mode's choices)."""
        g, f = self.graph, self.facts
        impl = list(schedule.impl)
        for j, i in enumerate(impl):
            if i not in f.impls[j]:
                better = [a for a in f.impls[j] if dominates(g.ops[j].impls[a], g.ops[j].impls[i])]
                if not better:
                    raise ValueError(f"op {j} uses Impl {i}, not among the {self.mode} mode's "
                                     f"choices {f.impls[j]}")
                impl[j] = better[0]
        if schedule.offload and not self.offload:
            raise ValueError("the schedule offloads Values to host memory; this formulation was "
                             "built without offload (offload=False)")
        schedule = canonicalize(g, dataclasses.replace(schedule, impl=tuple(impl)), f)
        impl = list(schedule.impl)  # canonicalize reverts an in-place Impl that cannot run
        for j, i in enumerate(impl):
            if i not in f.impls[j]:
                raise ValueError(f"op {j}: Impl {i} is not among the {self.mode} mode's choices "
                                 f"{f.impls[j]}")
        r = residency(g, schedule, f)
        x = np.zeros(self.milp.num_vars)
        for (j, i), col in self.M.items():
            x[col] = 1.0 if impl[j] == i else 0.0
        for (t, v), col in self.S.items():
            x[col] = 1.0 if v in r.resident[t] else 0.0
        for t in range(self.T):
            for v in r.resident[t]:
                if (t, v) not in self.S:
                    raise ValueError(f"value {v} resident at stage {t} is past its horizon")
        for (t, j), col in self.R.items():
            x[col] = 1.0 if j in r.recompute[t] else 0.0
        for t in range(self.T):
            for j in r.recompute[t]:
                if (t, j) not in self.R:
                    raise ValueError(f"op {j} recomputed at stage {t} is not a candidate")
        for v, col in self.O.items():
            x[col] = 1.0 if v in schedule.offload else 0.0
        for t in range(self.T):
            for v in r.fetch[t]:
                if (t, v) not in self.Fe:
                    raise ValueError(f"value {v} fetched at stage {t} is past its horizon")
                x[self.Fe[t, v]] = 1.0
        for (t, j, i), col in self.RI.items():
            x[col] = x[self.R[t, j]] * x[self.M[j, i]]
        for (t, v, i), col in self.H.items():
            x[col] = x[self.S[t + 1, v]] * x[self.M[g.backward_order[t], i]]
        for (t, v), col in self.Y.items():
            k = g.backward_order[t]
            need = 1.0 if impl[k] in f.need[t][v] else 0.0
            keep = x[self.S[t + 1, v]] if (t + 1, v) in self.S else 0.0
            x[col] = max(need, keep)
        for t in range(self.T):
            for v, us, yexpr, segs in self._alive_plan[t]:
                acc = 0.0 if yexpr is None else (1.0 if yexpr == ("c",) else x[yexpr[1]])
                for u in reversed(us):
                    acc = max(acc, x[self.R[t, u]])
                    if (t, v, u) in self.G:
                        x[self.G[t, v, u]] = acc
        A = self.milp.A.tocsr()
        # Python lists, not numpy items: the same arithmetic in the same order, twice as quick
        # (the encoding took 9.9 s after a 48.7 s build of 782 ops, and cannot be stopped)
        rows = [row for _, row in self._defined]
        sub = A[rows] if rows else A
        ptr, idx, vals = sub.indptr.tolist(), sub.indices.tolist(), sub.data.tolist()
        lo, xs = self.milp.row_lo[rows].tolist(), x.tolist()
        for i, (col, _) in enumerate(self._defined):  # running sums, in definition order
            own, rest = 0.0, 0
            for k in range(ptr[i], ptr[i + 1]):
                if idx[k] == col:
                    own = vals[k]
                else:
                    rest += vals[k] * xs[idx[k]]
            xs[col] = x[col] = (lo[i] - rest) / own
        if self.P is not None:
            x[self.P] = 0.0
            act = A @ x
            x[self.P] = max((act[mr.row] + mr.const / self.mem_scale for mr in self.mem_rows),
                            default=0.0)
            x[self.P] = max(x[self.P], self.const_peak / self.mem_scale)
        return x

    def stats(self) -> dict:
        m = self.milp
        return {"variables": m.num_vars, "integer_variables": m.num_integer,
                "constraints": m.num_rows, "nonzeros": m.nnz}

