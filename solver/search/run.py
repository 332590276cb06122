"""One call of `solve` or `min_budget` as the pipeline's steps see it (pipeline.py): what was
asked (the graph, the budget, the mode, the backend, the limits) and the stats it gathers. Each
step takes the run as one argument, beside what that step adds (the model, the pool)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property

from ..analysis import GraphFacts
from ..backends.base import Backend
from ..graph import OpGraph


@dataclass
class Run:
    """One solve (or min-peak search) of one graph."""
    graph: OpGraph
    mode: str
    """'full' or 'checkpoint' (analysis.MODES)."""
    backend: Backend
    """The MILP backend, an instance (backends.get_backend)."""
    started: float
    """time.perf_counter() when the call began; every reported time counts from here."""
    time_limit_s: float
    """The seconds the caller gave the whole call."""
    deadline: float
    """When the search stops (perf_counter seconds): started + time_limit_s, or earlier for a
    phase of it (`phase`)."""
    budget: int | None = None
    """The bytes the step's peak must fit; None for a min-peak search with no target."""
    mip_gap: float = 0.01
    """The relative gap at which a schedule counts as proven."""
    verbose: bool = False
    """Print the search's progress."""
    offload: bool = False
    """The MILP may copy Values to host memory and back."""
    stats: dict = field(default_factory=dict)
    """What the run did (SolveResult.stats once certified)."""

    @cached_property
    def facts(self) -> GraphFacts:
        return GraphFacts(self.graph, self.mode)

    def phase(self, **changes) -> Run:
        """The same run with some fields changed (a phase with its own deadline and gap), with
        stats of its own."""
        return dataclasses.replace(self, stats={}, **changes)
