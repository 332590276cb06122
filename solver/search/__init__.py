"""The search for the fastest schedule within a budget: a pipeline (validate, first incumbent,
portfolio, certify; pipeline.py) over strategies that share one pool of incumbents and bounds
(pool.py) and follow one small protocol (context.py): branch and bound (branch_and_bound.py),
the LP relaxation and its rounding (relaxation.py), large-neighbourhood search (local.py) and
bound probes (probes.py)."""

from .pipeline import min_budget, min_budget_details, solve

__all__ = ["min_budget", "min_budget_details", "solve"]
