"""The LP relaxation as a strategy: a valid bound at once (branch and bound's root can take
minutes), the RINS guide for LNS, and LP rounding (warmstart.lp_rounding) as a schedule."""

from __future__ import annotations

from ..rules.warmstart import lp_rounding
from .context import SearchContext

LP_MIN_LEFT_S = 20.0
"""Solve the LP only with at least this much time left (for it and the search after)."""
LP_TIME_SHARE = 0.3
LP_MAX_S = 120.0


class LpRounding:
    name = "lp_rounding"

    def __init__(self, form_bb):
        self.form_bb = form_bb
        """Branch and bound's first model (full memory sums: its LP solves fastest)."""

    def run(self, ctx: SearchContext) -> None:
        left = ctx.left()
        if left <= LP_MIN_LEFT_S or ctx.should_stop():
            return
        fb = self.form_bb
        rounded = lp_rounding(fb, ctx.new_backend(),
                              time_limit_s=min(LP_MAX_S, LP_TIME_SHARE * left),
                              on_bound=lambda b: ctx.raise_bound("lp", b),
                              on_solution=lambda x: ctx.pool.set_guide(fb, x, False))
        if rounded is not None:
            ctx.offer(ctx.form, ctx.form.encode(rounded[1]), rounded[0])
