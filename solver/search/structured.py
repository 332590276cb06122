"""Block copy: one plan for a group of identical blocks, solved with the copies in the MILP.

On graphs made of repeated blocks (blocks.find_blocks: a transformer's layers) the monolithic
search stalls (docs/BENCHMARKS.md, Solver-scale). This strategy frees the 0/1 columns of a group
of twin blocks and ties them together: every twin column is set equal to its partner in one
representative member (substituted by it), every other 0/1 column is fixed to the incumbent. The
sub-MILP then chooses one block plan, copied to the whole group, and sees the copies' effect on
memory at every stage at once, so any answer it returns is a feasible schedule of the full MILP.

Partners. For members src and dst of a class, `BlockChain.mapping` renames ops and Values; a
column of dst's op or Value (Impl, residency, recomputation, offload, fetch) has as partner the
column of the renamed op or Value at the renamed stage. Stages are renamed by the shift between
the two members' backward stages (`stage_renaming`: the stage of op j in src and of its twin in
dst differ by the same d for every op of a transformer layer; where they do not, only the
members' own stages are renamed). The representative is the member whose backward comes last,
so every twin stage has a partner stage. A member's stages are "near" (its own, and the
NEAR_BLOCKS block lengths of stages before them: the next block's backward, which reads its
output) or "far" (from stage 1 to the first near stage). Near columns are tied by the shift;
far residency is substituted by the member's residency at its first near stage (held from the
start of the backward until then, or not); far recomputations and fetches stay fixed to the
incumbent; stage-0 columns (kept from the forward, recomputed at the start of the backward, as
the rules do for the residual stream) are tied to the representative's stage-0 columns. A
column with no partner (past a horizon) is left free, untied.

Sweeps: pairs of consecutive members, then runs of 4, 8, ..., then the whole class, each group
starting from the incumbent of the moment; before each sub-MILP each member's incumbent plan is
copied to the rest of the group and replayed in the simulator (cheap candidates; the fastest
that fits is offered and is the sub-MILP's warm start). The strategy takes at most
TIME_SHARE of the time left when it starts, and LNS goes on from what it found.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from ..errors import ScheduleError
from ..formulation import Formulation
from ..milp import MILP
from ..rules.blocks import BlockChain, BlockClass, find_blocks
from ..simulate import simulate
from .context import SearchContext

MIN_COVER_SHARE = 0.2
"""A class is worked on only when its members hold at least this share of the ops: smaller
ones (two equal `arange`/`add` pairs in a prologue) free too little of the step to pay for a
sub-MILP of the whole model."""
TIME_SHARE = 0.5
"""Share of the time left (when the strategy starts) it may take; the rest is LNS's."""
SUB_TIME_S = 30.0
"""Time limit of one tied sub-MILP."""
NEAR_BLOCKS = 1
"""Stages free per member: its own and those of this many block lengths before them (the next
block's backward, which reads its output). Further stages are tied to the first near one: with
every stage free, the group of GPT-24's 23 layers left 13,218 free columns and HiGHS spent 37 s
of a 30 s limit in presolve of the 2.65 M-nonzero model."""
FIRST_INCUMBENT_POLL_S = 0.2


# ----------------------------------------------------------------------------------------------
# Partners and ties (pure functions of a Formulation and a BlockChain)
# ----------------------------------------------------------------------------------------------
def repeated_classes(chain: BlockChain, n_ops: int) -> list[BlockClass]:
    """The classes worth a sub-MILP (MIN_COVER_SHARE), largest coverage first."""
    out = [c for c in chain.classes
           if len(c.members) >= 2 and len(c.members) * c.length >= MIN_COVER_SHARE * n_ops]
    return sorted(out, key=lambda c: -len(c.members) * c.length)


class ColumnIndex:
    """The 0/1 columns of a Formulation by the op that owns them (as lns.column_ops: a Value's
    columns belong to its producer), with their family and key."""

    def __init__(self, form: Formulation):
        self.form = form
        values = form.graph.values
        by_op: dict[int, list[tuple[str, object, int]]] = {}
        for (t, v), c in form.S.items():
            by_op.setdefault(values[v].producer, []).append(("S", (t, v), c))
        for (t, j), c in form.R.items():
            by_op.setdefault(j, []).append(("R", (t, j), c))
        for (j, i), c in form.M.items():
            by_op.setdefault(j, []).append(("M", (j, i), c))
        for v, c in form.O.items():
            by_op.setdefault(values[v].producer, []).append(("O", v, c))
        for (t, v), c in form.Fe.items():
            by_op.setdefault(values[v].producer, []).append(("Fe", (t, v), c))
        self.by_op = by_op

    def columns(self, ops) -> np.ndarray:
        return np.array(sorted(c for j in ops for _, _, c in self.by_op.get(j, ())),
                        dtype=np.int64)


def first_stage(chain: BlockChain, seg: int) -> int:
    """The first backward stage of a segment's ops (-1 when none has a backward)."""
    stage = chain.graph.stage_of_op
    return min((stage[j] for j in chain.segments[seg].ops if j in stage), default=-1)


def stage_renaming(chain: BlockChain, src: int, dst: int):
    """Stage of segment src -> stage of segment dst, as a function (None: no partner stage):
    the constant shift between the two members' backward stages, or, should the shift not be
    constant, the stages of their own ops only."""
    stage = chain.graph.stage_of_op
    m = chain.mapping(src, dst)
    pairs = {stage[j]: stage[k] for j, k in m.ops.items() if j in stage and k in stage}
    shifts = {b - a for a, b in pairs.items()}
    if len(shifts) == 1:
        d = shifts.pop()
        return lambda t: t + d
    return pairs.get


def renamed_column(form: Formulation, m, fam: str, key, t: int | None) -> int | None:
    """The column of family `fam` at `key` renamed by the BlockMapping m, at stage t (for the
    staged families); None when there is none (no partner stage, or past a horizon)."""
    if fam == "M":
        theirs = (m.ops[key[0]], key[1])
    elif fam == "O":
        theirs = m.values[key]
    elif t is None:
        return None
    else:
        theirs = (t, m.ops[key[1]] if fam == "R" else m.values[key[1]])
    return getattr(form, fam).get(theirs)


@dataclass(frozen=True)
class Ties:
    """A group of members of one class made to share one plan."""
    rep: int
    """The representative member (segment index): its backward comes last."""
    members: tuple[int, ...]
    free: np.ndarray
    """The 0/1 columns owned by the members' ops, freed in the sub-MILP (far recomputations
    left out: tie_group)."""
    pairs: np.ndarray
    """(column, column that takes its value) rows: a twin's column and its partner, or a far
    residency column and the member's first near one."""


def tie_group(index: ColumnIndex, chain: BlockChain, members, *,
              near_blocks: int | None = NEAR_BLOCKS, rep: int | None = None) -> Ties:
    """The group's free columns and ties (module docstring). With `near_blocks`, a member's
    stages from 1 to more than that many block lengths before its own first stage are "far"
    (other blocks' backward): its residency there is substituted by its residency at the first
    near stage (held from stage 0 until then, or not), its recomputation and fetches there stay
    fixed to the incumbent, and its stage-0 columns (kept from the forward, recomputed at the
    start of the backward) are tied to the representative's stage-0 columns. None: every stage
    free, all tied by the shift. `rep`: the representative, by default the member whose backward
    comes last (then every twin stage has a partner stage)."""
    members = tuple(members)
    form = index.form
    stage = chain.graph.stage_of_op
    if rep is None:
        rep = max(members, key=lambda i: (first_stage(chain, i), i))
    subst: dict[int, int] = {}  # column -> the column whose value it takes
    fixed: set[int] = set()
    for b in members:
        seg = chain.segments[b]
        first = first_stage(chain, b)
        near = 0
        if near_blocks is not None and first >= 0:
            near = max(1, first - near_blocks * sum(1 for j in seg.ops if j in stage))
        if b != rep:
            m, st = chain.mapping(b, rep), stage_renaming(chain, b, rep)
        for j in seg.ops:
            for fam, key, col in index.by_op.get(j, ()):
                t = key[0] if fam in ("S", "R", "Fe") else None
                if t is not None and 0 < t < near:  # far
                    boundary = form.S.get((near, key[1])) if fam == "S" else None
                    if boundary is not None:
                        subst[col] = boundary
                    else:
                        fixed.add(col)
                    continue
                if b == rep:
                    continue
                tt = None if t is None else (0 if t == 0 and near > 0 else st(t))
                partner = renamed_column(form, m, fam, key, tt)
                if partner is not None:
                    subst[col] = partner

    def root(c: int) -> int:
        while c in subst:
            c = subst[c]
        return c

    free = index.columns(j for i in members for j in chain.segments[i].ops)
    free = free[~np.isin(free, np.fromiter(fixed, dtype=np.int64, count=len(fixed)))]
    pairs = np.array([(root(c), c) for c in subst], dtype=np.int64).reshape(-1, 2)
    return Ties(rep, members, free, pairs)


def copy_plan(x: np.ndarray, ties: Ties) -> np.ndarray:
    """x with every twin column set to its partner's value (untied columns as they were)."""
    y = np.array(x, dtype=float)
    if len(ties.pairs):
        y[ties.pairs[:, 1]] = y[ties.pairs[:, 0]]
    return y


def tied_milp(milp: MILP, x: np.ndarray, ties: Ties) -> MILP:
    """The sub-MILP: 0/1 columns outside `ties.free` fixed to x, and every twin column
    substituted by its partner (its coefficients added to the partner's, itself fixed at 0):
    the same rows, no more nonzeros, and `copy_plan` of a solution is a solution of `milp`
    (x = P x' with P the substitution, so A x = (A P) x'). Its objective equals the expanded
    solution's."""
    cols = np.nonzero(milp.integrality)[0]
    fixed = np.setdiff1d(cols, ties.free, assume_unique=True)
    lb, ub = milp.lb.copy(), milp.ub.copy()
    vals = np.round(x[fixed])
    lb[fixed] = vals
    ub[fixed] = vals
    if len(ties.pairs) == 0:
        return dataclasses.replace(milp, lb=lb, ub=ub)
    n = milp.num_vars
    target = np.arange(n)
    target[ties.pairs[:, 1]] = ties.pairs[:, 0]
    P = sp.csr_matrix((np.ones(n), (np.arange(n), target)), shape=(n, n))
    twins = ties.pairs[:, 1]
    lb[twins] = 0.0
    ub[twins] = 0.0
    return dataclasses.replace(milp, lb=lb, ub=ub, A=(milp.A @ P).tocsr(), c=P.T @ milp.c)


def checked(form: Formulation, y: np.ndarray):
    """(schedule, simulated peak, simulated seconds) if the schedule y describes is valid and
    fits the budget in the simulator; None otherwise (a copied plan need not be either)."""
    try:
        schedule = form.decode(y)
        tl = simulate(form.graph, schedule)
    except ScheduleError:
        return None
    if form.budget is not None and form.objective == "time" and tl.peak_bytes > form.budget:
        return None
    return schedule, tl.peak_bytes, tl.total_time


def best_copy(index: ColumnIndex, chain: BlockChain, x: np.ndarray, group, stop=None):
    """The fastest schedule that fits among those copying one member's plan in x to the rest
    of the group (each member in turn the source): (checked(...), copies tried, copies that
    fit); None in first place when none fits. `stop()` cuts the loop short."""
    form, best, tried, fit = index.form, None, 0, 0
    for src in group:
        if stop is not None and stop():
            break
        tried += 1
        ok = checked(form, copy_plan(x, tie_group(index, chain, group, rep=src)))
        if ok is not None:
            fit += 1
            if best is None or ok[2] < best[2]:
                best = ok
    return best, tried, fit


def group_sweeps(members: tuple[int, ...]):
    """The groups of each sweep: pairs of consecutive members, then runs of 4, 8, ... and the
    whole class last. Small groups first: on GPT-24 at 50% a pair's sub-MILP was solved in
    17 s and beat the rule (+9.71% to +9.33%), while the whole class's (23 layers) found nothing
    but its warm start in 90 s."""
    k, size = len(members), 2
    while True:
        yield [members[a:a + size] for a in range(0, k, size) if len(members[a:a + size]) >= 2]
        if size >= k:
            break
        size = min(k, 2 * size)


# ----------------------------------------------------------------------------------------------
# The strategy
# ----------------------------------------------------------------------------------------------
@dataclass
class StructuredTally:
    """What the block-copy strategy did (SolveResult.stats['structured'])."""
    classes: int = 0
    """Classes worked on (members x length >= MIN_COVER_SHARE of the ops)."""
    copies: int = 0
    """Member plans copied to their group and replayed in the simulator (best_copy)."""
    copies_fit: int = 0
    """... of which were valid and fit the budget (the fastest per group is offered)."""
    copies_improved: int = 0
    sub_milps: int = 0
    improved: int = 0
    """Tied sub-MILPs that beat the incumbent."""
    timed_out: int = 0
    infeasible: int = 0
    """Tied sub-MILPs proven to hold no plan that fits and beats the incumbent (the cutoff)."""
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class BlockCopy:
    """Tied sub-MILPs over groups of identical blocks (module docstring)."""
    name = "structured"

    def __init__(self, chain: BlockChain | None = None, time_share: float = TIME_SHARE,
                 sub_time_s: float = SUB_TIME_S):
        self.chain, self.time_share, self.sub_time_s = chain, time_share, sub_time_s

    def run(self, ctx: SearchContext) -> None:
        form, pool = ctx.form, ctx.pool
        while not pool.has and not ctx.finished.wait(FIRST_INCUMBENT_POLL_S):
            if ctx.left() < 0:
                return
        if not pool.has or ctx.should_stop():
            return
        started = time.perf_counter()
        chain = self.chain if self.chain is not None else find_blocks(form.graph)
        classes = repeated_classes(chain, len(form.graph.ops))
        if not classes:
            return
        tally = ctx.structured = StructuredTally(classes=len(classes))
        stop_at = started + self.time_share * ctx.left()
        index = ColumnIndex(form)
        milp = form.milp

        def stopping() -> bool:
            return ctx.should_stop() or time.perf_counter() > stop_at - 0.5

        try:
            for cls in classes:
                for groups in group_sweeps(cls.members):
                    for group in groups:
                        if stopping():
                            return
                        ties = tie_group(index, chain, group)
                        x, obj, _ = pool.get(form)
                        # cheap candidates first: one member's plan copied to the group
                        ok, tried, fit = best_copy(index, chain, x, group, stopping)
                        tally.copies += tried
                        tally.copies_fit += fit
                        warm = x
                        if ok is not None:
                            xc = form.encode(ok[0])
                            tally.copies_improved += ctx.offer(form, xc, "structured:copy",
                                                               peak=ok[1])
                            # the same plan under the sub-MILP's ties, its warm start
                            again = checked(form, copy_plan(xc, ties))
                            if again is not None:
                                warm = form.encode(again[0])
                        limit = min(self.sub_time_s, stop_at - time.perf_counter())
                        if limit <= 0.2 or stopping():
                            return
                        x, obj, _ = pool.get(form)
                        warm = np.array(warm, dtype=float)
                        warm[ties.pairs[:, 1]] = 0.0  # substituted columns
                        be = ctx.new_backend()
                        # the cutoff: only a plan better than the incumbent is worth the time
                        r = be.solve(tied_milp(milp, x, ties), time_limit_s=limit, mip_gap=1e-6,
                                     warm_start=warm,
                                     cutoff=obj if be.OBJECTIVE_CUTOFF else None)
                        tally.sub_milps += 1
                        tally.timed_out += r.status == "time_limit"
                        tally.infeasible += r.status == "infeasible"
                        if r.x is None:
                            continue
                        y = copy_plan(r.x, ties)  # the twins' columns back
                        if not milp.objective(y) < pool.obj - 1e-9 * max(1.0, abs(pool.obj)):
                            continue
                        # re-encode as LNS does: exact 0/1 values, helpers at their least
                        y = form.encode(form.decode(y))
                        tally.improved += ctx.offer(form, y, "structured")
        finally:
            tally.seconds = round(time.perf_counter() - started, 1)
