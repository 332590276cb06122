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
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from .analysis import GraphFacts, dominates, inplace_freed
from .canonical import canonicalize, residency
from .cuts import SupportCut, support_terms
from .graph import OpGraph
from .schedule import Schedule, StageSchedule

OBJECTIVES = ("time", "peak")


# ----------------------------------------------------------------------------------------------
# Solver-neutral data
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    """A contiguous range of columns or rows sharing one meaning (see docs/formulation.md)."""

    name: str
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class MILP:
    """minimise c.x + offset  s.t.  row_lo <= A x <= row_hi,  lb <= x <= ub,  x_i integer where
    integrality[i]. Infinite bounds are +-inf."""

    c: np.ndarray
    offset: float
    A: sp.csr_matrix
    row_lo: np.ndarray
    row_hi: np.ndarray
    lb: np.ndarray
    ub: np.ndarray
    integrality: np.ndarray
    var_names: tuple[str, ...]
    row_names: tuple[str, ...]
    var_blocks: tuple[Block, ...]
    row_blocks: tuple[Block, ...]

    @property
    def num_vars(self) -> int:
        return len(self.c)

    @property
    def num_rows(self) -> int:
        return self.A.shape[0]

    @property
    def nnz(self) -> int:
        return int(self.A.nnz)

    @property
    def num_integer(self) -> int:
        return int(self.integrality.sum())

    def objective(self, x: np.ndarray) -> float:
        return float(self.c @ x + self.offset)

    def relaxation(self) -> "MILP":
        """The LP relaxation: the same model with every column continuous."""
        return dataclasses.replace(self, integrality=np.zeros_like(self.integrality))

    def violations(self, x: np.ndarray, tol: float = 1e-6) -> list[str]:
        """Human-readable list of the bounds, rows and integralities x violates."""
        out = []
        act = self.A @ x
        for i in np.nonzero((act < self.row_lo - tol) | (act > self.row_hi + tol))[0][:20]:
            out.append(f"row {self.row_names[i]}: {self.row_lo[i]:.6g} <= {act[i]:.6g} <= "
                       f"{self.row_hi[i]:.6g}")
        for i in np.nonzero((x < self.lb - tol) | (x > self.ub + tol))[0][:20]:
            out.append(f"column {self.var_names[i]} = {x[i]:.6g} outside "
                       f"[{self.lb[i]:.6g}, {self.ub[i]:.6g}]")
        frac = np.abs(x - np.round(x)) > tol
        for i in np.nonzero(frac & self.integrality)[0][:20]:
            out.append(f"column {self.var_names[i]} = {x[i]:.6g} is not integral")
        return out

    def block(self, name: str, rows: bool = True) -> Block:
        for b in (self.row_blocks if rows else self.var_blocks):
            if b.name == name:
                return b
        raise KeyError(name)


class _Builder:
    """Collects columns and rows block by block; `finish()` returns the MILP."""

    def __init__(self):
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.integer: list[bool] = []
        self.cost: list[float] = []
        self.names: list[str] = []
        self.var_blocks: list[Block] = []
        self.ri: list[int] = []
        self.ci: list[int] = []
        self.vals: list[float] = []
        self.row_lo: list[float] = []
        self.row_hi: list[float] = []
        self.row_names: list[str] = []
        self.row_blocks: list[Block] = []
        self._var_block = self._row_block = None

    # blocks are contiguous: open one, add, the next open closes it
    def var_block(self, name: str) -> None:
        self._close_var_block()
        self._var_block = (name, len(self.lb))

    def row_block(self, name: str) -> None:
        self._close_row_block()
        self._row_block = (name, len(self.row_lo))

    def _close_var_block(self):
        if self._var_block and len(self.lb) > self._var_block[1]:
            self.var_blocks.append(Block(self._var_block[0], self._var_block[1], len(self.lb)))
        self._var_block = None

    def _close_row_block(self):
        if self._row_block and len(self.row_lo) > self._row_block[1]:
            self.row_blocks.append(Block(self._row_block[0], self._row_block[1],
                                         len(self.row_lo)))
        self._row_block = None

    def var(self, name: str, *, lb=0.0, ub=1.0, integer=True, cost=0.0) -> int:
        self.lb.append(lb)
        self.ub.append(ub)
        self.integer.append(integer)
        self.cost.append(cost)
        self.names.append(name)
        return len(self.lb) - 1

    def row(self, name: str, terms, lo=-math.inf, hi=math.inf) -> int:
        r = len(self.row_lo)
        merged: dict[int, float] = {}
        for c, a in terms:
            merged[c] = merged.get(c, 0.0) + a
        for c, a in merged.items():
            if a != 0.0:
                self.ri.append(r)
                self.ci.append(c)
                self.vals.append(a)
        self.row_lo.append(lo)
        self.row_hi.append(hi)
        self.row_names.append(name)
        return r

    def finish(self, offset: float) -> MILP:
        self._close_var_block()
        self._close_row_block()
        n, m = len(self.lb), len(self.row_lo)
        A = sp.csr_matrix((np.array(self.vals, dtype=float), (np.array(self.ri, dtype=np.int64),
                           np.array(self.ci, dtype=np.int64))), shape=(m, n))
        return MILP(c=np.array(self.cost, dtype=float), offset=offset, A=A,
                    row_lo=np.array(self.row_lo, dtype=float),
                    row_hi=np.array(self.row_hi, dtype=float),
                    lb=np.array(self.lb, dtype=float), ub=np.array(self.ub, dtype=float),
                    integrality=np.array(self.integer, dtype=bool), var_names=tuple(self.names),
                    row_names=tuple(self.row_names), var_blocks=tuple(self.var_blocks),
                    row_blocks=tuple(self.row_blocks))


def _pow2_scale(target: float, ref: float) -> float:
    """A power of two s with ref * s close to target: scaling by it is exact in floating point."""
    if ref <= 0:
        return 1.0
    return 2.0 ** round(math.log2(target / ref))


# ----------------------------------------------------------------------------------------------
# The formulation
# ----------------------------------------------------------------------------------------------
@dataclass
class _MemRow:
    row: int
    const: int
    """Bytes at this point that no decision changes."""
    where: str


class Formulation:
    """The schedule MILP for one graph, budget, mode and objective.

    objective="time": minimise the step time subject to every memory point <= budget.
    objective="peak": minimise the peak (column P); the budget is ignored.
    """

    def __init__(self, graph: OpGraph, budget: int | None = None, *, mode: str = "full",
                 objective: str = "time", running_sums: bool = True,
                 recompute_points: "frozenset[tuple[int, int]] | None" = None,
                 offload: bool = False, support_cuts: "frozenset[SupportCut]" = frozenset(),
                 facts: GraphFacts | None = None):
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        if offload and graph.host_bandwidth is None:
            raise ValueError(f"offload=True needs the graph's host_bandwidth (bytes per second of "
                             f"the device<->host link), but {graph.model} has none (profiled on "
                             f"{graph.cost_provenance or 'an unknown device'}); profile on a GPU, "
                             f"pass host_bandwidth= to profile, or solve without offload")
        if offload and mode != "full":
            raise ValueError(f"offload is an operator choice of mode 'full', not of {mode!r}")
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
        self.mem_scale = max(1.0, _pow2_scale(ref_mem / 4096.0, 1.0))
        t0 = sum(op.impls[0].fwd_time for op in g.ops) + sum(
            g.ops[k].impls[0].bwd_time for k in g.backward_order)
        self.time_scale = _pow2_scale(1000.0, t0) if t0 > 0 else 1.0
        self.mem_rows: list[_MemRow] = []
        self.const_peak = 0
        """The largest memory of a point with no decision in it (and where it is)."""
        self.const_peak_where = ""
        self.infeasible_points: list[tuple[str, int]] = []
        """Points whose fixed memory alone exceeds the budget (time objective only)."""
        self._defined: list[tuple[int, int]] = []  # (column, defining equality row), in order
        self.full_sum_nnz = 0
        """With running sums: the nonzeros the stage memory rows would have as full sums."""
        self.milp = self._build()

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
    def _build(self) -> MILP:
        g, f, b = self.graph, self.facts, _Builder()
        ops, values = g.ops, g.values
        T, ms, ts = self.T, self.mem_scale, self.time_scale
        hz, ohz = f.horizon, f.op_horizon
        sched = f.scheduled
        cands = f.candidates
        cand_sets = [set(c) for c in cands]
        stage_ops = set(g.backward_order)
        offset = 0.0

        # ---- columns ----
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

        b.var_block("resident")  # S[t,v]: Value v resident entering stage t (t=0: kept)
        self.S: dict[tuple[int, int], int] = {}
        for v in values:
            for t in range(hz[v.id] + 1):
                self.S[t, v.id] = b.var(f"S[{t},{v.id}]")

        b.var_block("recompute")  # R[t,j]: op j recomputed just before stage t
        self.R: dict[tuple[int, int], int] = {}
        self.split_ops = {j for j in range(len(ops)) if len(f.impls[j]) > 1 and not self._uniform(
            j, ("rerun_time", "recompute_transient", "overwrites"))}
        for j in range(len(ops)):
            cost = 0.0 if j in self.split_ops else self._impl(j, f.impls[j][0]).rerun_time * ts
            for t in range(ohz[j] + 1):
                self.R[t, j] = b.var(f"R[{t},{j}]", cost=cost)

        b.var_block("recompute_impl")  # RI[t,j,i] = R[t,j] and M[j,i] (ops whose Impls differ)
        self.RI: dict[tuple[int, int, int], int] = {}
        for (t, j) in list(self.R):
            if j in self.split_ops:
                for i in f.impls[j]:
                    self.RI[t, j, i] = b.var(f"RI[{t},{j},{i}]", integer=False,
                                             cost=self._impl(j, i).rerun_time * ts)

        # Offload to host (offload=True): O[v] copies v to host in the forward pass; Fe[t,v]
        # copies it back at the start of stage t. Each copy costs bytes / host_bandwidth.
        self.O: dict[int, int] = {}
        self.Fe: dict[tuple[int, int], int] = {}
        if self.offload:
            b.var_block("offload")
            for v in values:
                if sched[v.id] and hz[v.id] >= 0:
                    self.O[v.id] = b.var(f"O[{v.id}]", cost=self._transfer(v.id) * ts)
            b.var_block("fetch")
            for v in self.O:
                for t in range(hz[v] + 1):
                    self.Fe[t, v] = b.var(f"Fe[{t},{v}]", cost=self._transfer(v) * ts)

        b.var_block("alive_backward")  # Y[t,v] = S[t+1,v] or (the chosen Impl of stage t saves v)
        self.Y: dict[tuple[int, int], int] = {}
        for t, need in enumerate(f.need):
            k = g.backward_order[t]
            for v, needers in need.items():
                if len(needers) < len(f.impls[k]):
                    self.Y[t, v] = b.var(f"Y[{t},{v}]", integer=False)

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

        # Alive-after-production columns: G[t,v,u] = v still resident just before user u runs in
        # stage t = Y-expression or R[t,u'] for some user u' >= u.
        b.var_block("alive_in_stage")
        self.G: dict[tuple[int, int, int], int] = {}
        self._alive_plan: list[list[tuple[int, list]]] = []  # per stage: (v, segments)
        for t in range(T):
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

        if self.running_sums:
            b.var_block("stage_memory")  # Lm[t,l]: bytes of scheduled Values alive at point l
            self.Lm: dict[tuple[int, int], int] = {}
            for t in range(T):
                for l in range(len(cands[t]) + 1):
                    self.Lm[t, l] = b.var(f"Lm[{t},{l}]", integer=False, ub=math.inf)

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

        self.P = None
        if self.objective == "peak":
            # minimise the peak alone: time costs go (the schedule's time is read off decode)
            b.cost = [0.0] * len(b.cost)
            offset = 0.0
            b.var_block("peak")
            self.P = b.var("P", integer=False, ub=math.inf, cost=1.0)

        # ---- rows ----
        b.row_block("impl_choice")  # sum_i M[j,i] = 1
        for j in range(len(ops)):
            if len(f.impls[j]) > 1:
                b.row(f"impl_choice[{j}]", [(self.M[j, i], 1.0) for i in f.impls[j]], 1.0, 1.0)

        b.row_block("recompute_impl")  # R[t,j] = sum_i RI[t,j,i];  RI[t,j,i] <= M[j,i]
        for (t, j), r in self.R.items():
            if j in self.split_ops:
                b.row(f"recompute_split[{t},{j}]",
                      [(r, 1.0)] + [(self.RI[t, j, i], -1.0) for i in f.impls[j]], 0.0, 0.0)
                for i in f.impls[j]:
                    b.row(f"recompute_link[{t},{j},{i}]",
                          [(self.RI[t, j, i], 1.0), (self.M[j, i], -1.0)], hi=0.0)

        b.row_block("recompute_inputs")  # R[t,j] <= S[t,u] + R[t,p(u)] for each input u of j
        for (t, j), r in self.R.items():
            for u in ops[j].inputs:
                if sched[u]:
                    b.row(f"recompute_inputs[{t},{j},{u}]",
                          [(r, 1.0), (self.S[t, u], -1.0)] + self._made(t, u, -1.0), hi=0.0)

        b.row_block("retention")  # S[t+1,v] <= S[t,v] + R[t,p(v)]
        for (t, v), s in self.S.items():
            if (t + 1, v) in self.S:
                b.row(f"retention[{t},{v}]",
                      [(self.S[t + 1, v], 1.0), (s, -1.0)] + self._made(t, v, -1.0), hi=0.0)

        b.row_block("backward_needs")  # S[t,v] + R[t,p(v)] >= [chosen Impl of stage t saves v]
        for t, need in enumerate(f.need):
            k = g.backward_order[t]
            for v, needers in need.items():
                terms = [(self.S[t, v], 1.0)] + self._made(t, v, 1.0)
                if len(needers) == len(f.impls[k]):
                    b.row(f"backward_needs[{t},{v}]", terms, lo=1.0)
                else:
                    b.row(f"backward_needs[{t},{v}]",
                          terms + [(self.M[k, i], -1.0) for i in needers], lo=0.0)

        b.row_block("alive_backward")  # Y[t,v] >= S[t+1,v];  Y[t,v] >= sum_{i saves v} M[k_t,i]
        for (t, v), y in self.Y.items():
            k = g.backward_order[t]
            if (t + 1, v) in self.S:
                b.row(f"alive_backward_keep[{t},{v}]", [(y, 1.0), (self.S[t + 1, v], -1.0)],
                      lo=0.0)
            b.row(f"alive_backward_need[{t},{v}]",
                  [(y, 1.0)] + [(self.M[k, i], -1.0) for i in f.need[t][v]], lo=0.0)

        b.row_block("held_past")  # H[t,v,i] >= S[t+1,v] + M[k_t,i] - 1
        for (t, v, i), h in self.H.items():
            b.row(f"held_past[{t},{v},{i}]", [(h, 1.0), (self.S[t + 1, v], -1.0),
                                               (self.M[g.backward_order[t], i], -1.0)], lo=-1.0)

        b.row_block("alive_in_stage")  # G[t,v,u_i] >= R[t,u_i];  G[t,v,u_i] >= G[t,v,u_i+1] / Y
        for t in range(T):
            for v, us, yexpr, segs in self._alive_plan[t]:
                for idx, u in enumerate(us):
                    if (t, v, u) not in self.G:
                        continue
                    gcol = self.G[t, v, u]
                    b.row(f"alive_user[{t},{v},{u}]", [(gcol, 1.0), (self.R[t, u], -1.0)], lo=0.0)
                    if idx + 1 < len(us):
                        nxt = self.G.get((t, v, us[idx + 1]))
                        nxt_term = ("v", nxt) if nxt is not None else ("v", self.R[t, us[idx + 1]])
                    else:
                        nxt_term = yexpr
                    if nxt_term is not None and nxt_term[0] == "v":
                        b.row(f"alive_next[{t},{v},{u}]", [(gcol, 1.0), (nxt_term[1], -1.0)],
                              lo=0.0)

        # ---- dominance cuts: each keeps an optimal schedule (docs/formulation.md section 4) ----
        b.row_block("useful_residency")  # S[t,v] <= S[t+1,v] + need + sum_{users u} R[t,u]
        for (t, v), s in self.S.items():
            k = g.backward_order[t]
            needers = f.need[t].get(v, ())
            if needers and len(needers) == len(f.impls[k]):
                continue
            terms = [(s, 1.0)] + [(self.M[k, i], -1.0) for i in needers]
            if (t + 1, v) in self.S:
                terms.append((self.S[t + 1, v], -1.0))
            terms += [(self.R[t, u], -1.0) for u in g.users[v] if u in cand_sets[t]]
            b.row(f"useful_residency[{t},{v}]", terms, hi=0.0)

        b.row_block("useful_recompute")  # R[t,j] <= sum_{outputs w} (S[t+1,w] + need + R users)
        for (t, j), r in self.R.items():
            k = g.backward_order[t]
            terms = [(r, 1.0)]
            skip = False
            for w in ops[j].outputs:
                if not sched[w] or hz[w] < t:
                    continue
                needers = f.need[t].get(w, ())
                if needers and len(needers) == len(f.impls[k]):
                    skip = True
                    break
                terms += [(self.M[k, i], -1.0) for i in needers]
                if (t + 1, w) in self.S:
                    terms.append((self.S[t + 1, w], -1.0))
                terms += [(self.R[t, u], -1.0) for u in g.users[w] if u in cand_sets[t]]
            if not skip:
                b.row(f"useful_recompute[{t},{j}]", terms, hi=0.0)

        b.row_block("no_duplicate")  # R[t,j] + S[t,w] <= 1 for an op with a single output w
        for (t, j), r in self.R.items():
            outs = ops[j].outputs
            if len(outs) == 1 and sched[outs[0]] and (t, outs[0]) in self.S:
                b.row(f"no_duplicate[{t},{j}]", [(r, 1.0), (self.S[t, outs[0]], 1.0)], hi=1.0)

        # In-place Impls (docs/formulation.md): the Value x that Impl i of op j overwrites is gone
        # once j has run, so no chosen Impl may save it and it is never held across a stage
        # boundary (nor offloaded). Without a column M[j,i] (the op's only Impl) the rows fix
        # the other side to 0.
        b.row_block("inplace_saved")  # M[j,i] + M[k,i'] <= 1 for every Impl i' of k saving x
        for (j, i), x in f.overwrites.items():
            for k in g.backward_order:
                if k == j:
                    continue
                for i2 in f.impls[k]:
                    if x in ops[k].impls[i2].saved:
                        self._at_most_one(b, f"inplace_saved[{j},{i},{k},{i2}]",
                                          [self.M.get((j, i)), self.M.get((k, i2))])
        b.row_block("inplace_resident")  # S[t,x] + M[j,i] <= 1;  O[x] + M[j,i] <= 1
        for (j, i), x in f.overwrites.items():
            for t in range(hz[x] + 1):
                self._at_most_one(b, f"inplace_resident[{t},{j},{i}]",
                                  [self.S[t, x], self.M.get((j, i))])
            if x in self.O:
                self._at_most_one(b, f"inplace_offload[{j},{i}]", [self.O[x], self.M.get((j, i))])

        if self.offload:
            b.row_block("offload")  # Fe[t,v] <= O[v];  O[v] + S[0,v] <= 1
            for (t, v), fe in self.Fe.items():
                b.row(f"fetch_offloaded[{t},{v}]", [(fe, 1.0), (self.O[v], -1.0)], hi=0.0)
            for v, o in self.O.items():
                b.row(f"offload_leaves[{v}]", [(o, 1.0), (self.S[0, v], 1.0)], hi=1.0)
            b.row_block("useful_fetch")  # Fe[t,v] <= S[t+1,v] + need + sum R users; no duplicate
            for (t, v), fe in self.Fe.items():
                k = g.backward_order[t]
                b.row(f"fetch_not_resident[{t},{v}]", [(fe, 1.0), (self.S[t, v], 1.0)], hi=1.0)
                made = self.R.get((t, values[v].producer))
                if made is not None:
                    b.row(f"fetch_not_made[{t},{v}]", [(fe, 1.0), (made, 1.0)], hi=1.0)
                needers = f.need[t].get(v, ())
                if needers and len(needers) == len(f.impls[k]):
                    continue
                terms = [(fe, 1.0)] + [(self.M[k, i], -1.0) for i in needers]
                if (t + 1, v) in self.S:
                    terms.append((self.S[t + 1, v], -1.0))
                terms += [(self.R[t, u], -1.0) for u in g.users[v] if u in cand_sets[t]]
                b.row(f"useful_fetch[{t},{v}]", terms, hi=0.0)

        if self.support_cuts:
            b.row_block("recompute_support")  # S[t2,v] <= S[t1,v] + sum S[t1,u] + R[t1..t2-1,q]
            for c in sorted(self.support_cuts):
                self._check_cut(c)
                b.row(f"recompute_support[{c.value},{'/'.join(map(str, c.path))},{c.first},"
                      f"{c.last}]", support_terms(self, c), hi=0.0)

        # ---- internals running sums ----
        if var_int:
            b.row_block("internals")
            prev = None
            for j in range(len(ops)):  # IF[j] = IF[j-1] + internals of op j-1 (if it has a stage)
                terms = [(self.IF[j], 1.0)]
                c = 0
                if prev is not None:
                    terms.append((self.IF[prev], -1.0))
                    if prev in var_int:  # the others are constants of the memory rows
                        c, tt = self._choice_terms(prev, lambda im: im.internal_bytes, ms)
                        terms += [(col, -a) for col, a in tt]
                r = b.row(f"internals_forward[{j}]", terms, c / ms, c / ms)
                self._defined.append((self.IF[j], r))
                prev = j
            for t in range(T - 1, -1, -1):  # IB[t] = IB[t+1] + internals of stage t's op
                k = g.backward_order[t]
                c, tt = (self._choice_terms(k, lambda im: im.internal_bytes, ms)
                         if k in var_int else (0, []))
                terms = [(self.IB[t], 1.0)] + [(col, -a) for col, a in tt]
                if t + 1 < T:
                    terms.append((self.IB[t + 1], -1.0))
                r = b.row(f"internals_backward[{t}]", terms, c / ms, c / ms)
                self._defined.append((self.IB[t], r))

        # ---- memory ----
        fixed = g.fixed_bytes
        held_bytes = [0] * (len(ops) + 1)  # bytes of held outputs produced before op j
        for v in values:
            if v.producer is not None and not sched[v.id]:
                held_bytes[v.producer + 1] += v.bytes
        for j in range(len(ops)):
            held_bytes[j + 1] += held_bytes[j]
        all_held = held_bytes[len(ops)]
        # constant internals (ops whose Impls agree on them)
        int_fwd_const = [0] * (len(ops) + 1)
        for j in range(len(ops)):
            add = 0
            if j in stage_ops and j not in var_int:
                add = self._impl(j, f.impls[j][0]).internal_bytes
            int_fwd_const[j + 1] = int_fwd_const[j] + add
        int_bwd_const = [0] * (T + 1)
        for t in range(T - 1, -1, -1):
            k = g.backward_order[t]
            add = 0 if k in var_int else self._impl(k, f.impls[k][0]).internal_bytes
            int_bwd_const[t] = int_bwd_const[t + 1] + add

        b.row_block("mem_forward")
        # live before op j: scheduled v with p(v) < j <= last_use(v), or kept (S[0,v])
        live_const = [0] * (len(ops) + 1)
        for v in values:
            if sched[v.id]:
                live_const[v.producer + 1] += v.bytes
                live_const[f.last_use[v.id] + 1] -= v.bytes
        kept_after = [[] for _ in range(len(ops) + 1)]  # kept-or-freed decided after last use
        for v in values:
            if sched[v.id] and hz[v.id] >= 0:
                kept_after[f.last_use[v.id] + 1].append(v.id)
        running, kept_terms = 0, []
        for j, op in enumerate(ops):
            running += live_const[j]
            kept_terms += [(self.S[0, v], values[v].bytes / ms) for v in kept_after[j]]
            c_ws, t_ws = self._choice_terms(
                j, lambda im: im.internal_bytes + im.fwd_workspace - self._freed(j, im), ms)
            const = (fixed + int_fwd_const[j] + running + held_bytes[j] + f.out_bytes[j] + c_ws)
            terms = kept_terms + t_ws + ([(self.IF[j], 1.0)] if var_int else [])
            self._mem_row(b, f"mem_forward[{j}]", terms, const, f"forward of op {j} {op.name}")

        b.row_block("stage_memory")  # Lm[t,0] = alive at the first point; Lm[t,l] = Lm[t,l-1] + delta
        stage_const: list[list[int]] = []
        stage_terms: list[list[list]] = []
        for t in range(T):
            L = len(cands[t])
            consts = [0] * (L + 2)
            if self.running_sums:
                deltas = [[] for _ in range(L + 2)]
            else:
                rows_terms = [[] for _ in range(L + 1)]
                wanted = [l for l, j in enumerate(cands[t]) if self._has_point(t, j)] + [L]
            for v, us, yexpr, segs in self._alive_plan[t]:
                byt = values[v].bytes
                for (lo, hi, term) in segs:
                    if term is None or lo > hi:
                        continue
                    if term == ("c",):
                        consts[lo] += byt
                        consts[hi + 1] -= byt
                    elif self.running_sums:
                        deltas[lo].append((term[1], byt / ms))
                        deltas[hi + 1].append((term[1], -byt / ms))
                        self.full_sum_nnz += hi + 1 - lo
                    else:
                        for i in range(bisect.bisect_left(wanted, lo),
                                       bisect.bisect_right(wanted, hi)):
                            rows_terms[wanted[i]].append((term[1], byt / ms))
            for l in range(1, L + 1):
                consts[l] += consts[l - 1]
            if self.running_sums:
                rows_terms = []
                for l in range(L + 1):
                    terms = [(self.Lm[t, l], 1.0)] + [(c, -a) for c, a in deltas[l]]
                    if l > 0:
                        terms.append((self.Lm[t, l - 1], -1.0))
                    r = b.row(f"stage_memory[{t},{l}]", terms, 0.0, 0.0)
                    self._defined.append((self.Lm[t, l], r))
                    rows_terms.append([(self.Lm[t, l], 1.0)])
            stage_const.append(consts[:L + 1])
            stage_terms.append(rows_terms)

        b.row_block("mem_recompute")
        for t in range(T):
            base = fixed + g.stage_grad_bytes[t] + int_bwd_const[t] + all_held
            ib = [(self.IB[t], 1.0)] if var_int else []
            for l, j in enumerate(cands[t]):
                if not self._has_point(t, j):
                    continue
                out = f.out_bytes[j]
                if j in self.split_ops:
                    terms = [(self.RI[t, j, i], (out - inplace_freed(g, j, i)
                                                 + self._impl(j, i).recompute_transient) / ms)
                             for i in f.impls[j]]
                else:
                    i0 = f.impls[j][0]
                    terms = [(self.R[t, j], (out - inplace_freed(g, j, i0)
                                             + self._impl(j, i0).recompute_transient) / ms)]
                self._mem_row(b, f"mem_recompute[{t},{j}]", stage_terms[t][l] + terms + ib,
                              base + stage_const[t][l],
                              f"recomputation of op {j} {ops[j].name} before stage {t}")

        b.row_block("mem_backward")
        for t in range(T):
            k = g.backward_order[t]
            L = len(cands[t])
            c_ws, t_ws = self._choice_terms(k, lambda im: im.bwd_workspace, ms)
            base = fixed + g.stage_grad_bytes[t] + int_bwd_const[t] + all_held + c_ws
            ib = [(self.IB[t], 1.0)] if var_int else []
            held_const, held_terms = self._held_past[t]
            self._mem_row(b, f"mem_backward[{t}]", stage_terms[t][L] + t_ws + ib + held_terms,
                          base + stage_const[t][L] + held_const,
                          f"backward of op {k} {ops[k].name}")

        end = fixed + g.final_grad_bytes + all_held
        self._const_point(end, "end of the backward pass")
        return b.finish(offset)

    def _freed(self, j: int, im) -> int:
        """Output bytes Impl `im` of op j does not allocate (in place: analysis.inplace_freed)."""
        return self.facts.out_bytes[j] if im.overwrites is not None else 0

    def _at_most_one(self, b: _Builder, name: str, cols: list) -> None:
        """sum(cols) <= 1, where None stands for an Impl column that does not exist because it
        is the op's only allowed Impl (fixed at 1): the others must then be 0."""
        forced = sum(c is None for c in cols)
        if forced > 1:
            raise ValueError(f"{name}: two ops' only allowed Impls exclude each other (one "
                             f"overwrites a Value the other saves); no schedule exists in mode "
                             f"{self.mode!r}")
        b.row(name, [(c, 1.0) for c in cols if c is not None], hi=1.0 - forced)

    def _check_cut(self, c: SupportCut) -> None:
        """A cut is valid only along an input chain (solver/cuts.py): say so if it is not."""
        g = self.graph
        chain = (c.value,) + c.path
        for a, u in zip(chain, chain[1:]):
            p = g.values[a].producer
            if p is None or u not in g.ops[p].inputs:
                raise ValueError(f"support cut {c}: Value {u} is not an input of the producer "
                                 f"of Value {a}")
        if (0, g.values[c.value].producer) not in self.R or (c.last, c.value) not in self.S \
                or not 0 <= c.first < c.last:
            raise ValueError(f"support cut {c}: Value {c.value} has no recomputation or no "
                             f"residency column at stage {c.last}, or the stages are not "
                             f"first < last")

    def _has_point(self, t: int, j: int) -> bool:
        return self.recompute_points is None or (t, j) in self.recompute_points

    def _made(self, t: int, v: int, coef: float):
        """The columns that make v present at stage t besides residency: R[t,p(v)] when v's
        producer may be recomputed there, Fe[t,v] when v may be fetched from host memory."""
        p = self.graph.values[v].producer
        cols = [self.R.get((t, p)), self.Fe.get((t, v))]
        return [(col, coef) for col in cols if col is not None]

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

    def _mem_row(self, b: _Builder, name: str, terms, const: int, where: str) -> None:
        ms = self.mem_scale
        if self.objective == "peak":
            r = b.row(name, list(terms) + [(self.P, -1.0)], hi=-const / ms)
            self.mem_rows.append(_MemRow(r, const, where))
        elif not terms:
            self._const_point(const, where)
        else:
            r = b.row(name, terms, hi=(self.budget - const) / ms)
            self.mem_rows.append(_MemRow(r, const, where))

    def _const_point(self, const: int, where: str) -> None:
        if const > self.const_peak:
            self.const_peak, self.const_peak_where = const, where
        if self.budget is not None and self.objective == "time" and const > self.budget:
            self.infeasible_points.append((where, const))

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
        import dataclasses
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
        for col, row in self._defined:  # running sums, in definition order
            start, stop = A.indptr[row], A.indptr[row + 1]
            idx, vals = A.indices[start:stop], A.data[start:stop]
            own = vals[idx == col][0]
            rest = sum(a * x[c] for c, a in zip(idx, vals) if c != col)
            x[col] = (self.milp.row_lo[row] - rest) / own
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

