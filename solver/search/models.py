"""Which equivalent model of the MILP branch and bound gets (formulation.py builds them all)."""

from __future__ import annotations

from ..formulation import Formulation
from ..graph import OpGraph
from ..schedule import Schedule
from ..simulate import simulate

ALL_ROWS_NNZ = 200_000
"""Below this many nonzeros (full memory sums, every recomputation row) branch and bound gets
the whole model rather than lazy rows. UNet (batch 11): 97,532; GoogLeNet (batch 320): 1.25 M.
Lazy rows restart branch and bound, which loses its tree (UNet at 5 GiB restarted 2-6 times)."""
RUNNING_SUMS_NNZ = 2_500_000
"""Above this many nonzeros with every row, branch and bound gets running memory sums."""


def every_row(form: Formulation) -> bool:
    """Small enough (ALL_ROWS_NNZ) for branch and bound to get every recomputation row."""
    return form.full_sum_nnz + form.milp.nnz <= ALL_ROWS_NNZ


def branch_and_bound_form(form: Formulation, points=None, support_cuts=frozenset(),
                          should_stop=None) -> Formulation:
    """The formulation branch and bound runs on: full memory sums (HiGHS solved the root LP of
    the full-sum form up to three times faster than the running-sum form on the profiled
    GoogLeNet) and, for the time objective on a model above ALL_ROWS_NNZ, memory rows only at
    the recomputation points in `points` (lazy rows: on the profiled GoogLeNet and ResNet-50 at
    5 GiB the LP bound is the same without any of them and the LP solves seven times faster; the
    simulator checks every solution and branch and bound restarts with the points a solution
    violates, see branch_and_bound.py), plus the recompute-support cuts `support_cuts`
    (solver/cuts.py). `should_stop` is asked as a new model is built (Formulation): milp.BuildStopped
    when it says yes."""
    nnz = form.full_sum_nnz + form.milp.nnz  # of the full-sum form with every row
    if form.objective != "time":
        points = None
    elif every_row(form):
        points = None  # small enough for every row: no restarts that lose the tree
    elif points is None:
        points = frozenset()
    big = points is None and nnz > RUNNING_SUMS_NNZ
    if big and not support_cuts:
        return form
    return Formulation(form.graph, form.budget, mode=form.mode, objective=form.objective,
                       running_sums=big, recompute_points=points, offload=form.offload,
                       support_cuts=support_cuts, should_stop=should_stop)


def tight_points(graph: OpGraph, schedule: Schedule, budget: int, share: float = 0.9):
    """(stage, op) of the recomputation points of `schedule` within `share` of the budget: the
    lazy rows branch and bound starts with."""
    return frozenset((p.stage, p.op) for p in simulate(graph, schedule).points
                     if p.phase == "recompute" and p.bytes >= share * budget)
