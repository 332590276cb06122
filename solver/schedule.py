"""Schedules and solve results: what the solver hands to the simulator and the runtime.

A Schedule is plain data (JSON, never pickle, so loading one never runs code). It is explicit per
backward stage, in the vocabulary of docs/execution-model.md:
- `impl[op]`: the Impl index each Op uses;
- `forward_keep`: the Values kept resident at the end of the forward pass (all other Values are
  freed at their last forward use, except the model's outputs, which the caller holds);
- `stages[t].recompute`: Ops recomputed (no grad, topological order) just before backward stage t;
- `stages[t].drop`: Values released once stage t no longer needs them;
- `offload` and `stages[t].fetch`: Values copied to host memory during the forward pass (they leave
  the device at their last forward use) and copied back at the start of stage t (GPU only).

`SolveResult` is the one result type of every backend and baseline, built with keyword arguments
through `SolveResult.success(...)` or `SolveResult.failure(...)`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from .errors import FormatError
from .jsonio import (atomic_write_text, get_field, int_field, ints_field, list_field,
                     read_json_file, str_field)

SCHEDULE_FORMAT = "monetlike.schedule"
SCHEDULE_SCHEMA_VERSION = 1

# The status vocabulary: every SolveResult.status is one of these.
OPTIMAL = "optimal"
FEASIBLE_AT_TIME_LIMIT = "feasible-at-time-limit"
INFEASIBLE = "infeasible"
ERROR = "error"
HEURISTIC = "heuristic"  # a baseline: a valid schedule with no optimality claim
STATUSES = (OPTIMAL, FEASIBLE_AT_TIME_LIMIT, INFEASIBLE, ERROR, HEURISTIC)


@dataclass(frozen=True)
class StageSchedule:
    """What happens around one backward stage."""

    op: int
    """The Op whose backward this stage runs (equals graph.backward_order[t])."""
    recompute: tuple[int, ...] = ()
    """Ops recomputed just before the stage, in topological order."""
    drop: tuple[int, ...] = ()
    """Values released once this stage no longer needs them."""
    fetch: tuple[int, ...] = ()
    """Offloaded Values copied back from host memory at the start of this stage."""

    def to_dict(self) -> dict:
        d = {"op": self.op, "recompute": list(self.recompute), "drop": list(self.drop)}
        if self.fetch:
            d["fetch"] = list(self.fetch)
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "StageSchedule":
        return cls(op=int_field(d, "op", where), recompute=ints_field(d, "recompute", where),
                   drop=ints_field(d, "drop", where),
                   fetch=(ints_field(d, "fetch", where)
                          if isinstance(d, dict) and "fetch" in d else ()))


@dataclass(frozen=True)
class Schedule:
    """A complete memory schedule for one OpGraph (identified by its fingerprint)."""

    fingerprint: str
    graph_summary: dict
    """model, batch, input shapes and dtypes of the graph: to say in words what differs."""
    impl: tuple[int, ...]
    forward_keep: tuple[int, ...]
    stages: tuple[StageSchedule, ...]
    budget_bytes: int | None = None
    mode: str = "store_all"
    created_by: str = ""
    """Backend or baseline that made it, e.g. 'highs', 'baseline:chen_sqrt_n'."""
    cost_provenance: str = ""
    predicted_peak_bytes: int | None = None
    predicted_time: float | None = None
    meta: dict = field(default_factory=dict, compare=False)
    offload: tuple[int, ...] = ()
    """Values copied to host memory during the forward pass (never in forward_keep)."""

    def to_dict(self) -> dict:
        d = {
            "format": SCHEDULE_FORMAT,
            "schema_version": SCHEDULE_SCHEMA_VERSION,
            "fingerprint": self.fingerprint,
            "graph_summary": self.graph_summary,
            "budget_bytes": self.budget_bytes,
            "mode": self.mode,
            "created_by": self.created_by,
            "cost_provenance": self.cost_provenance,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_time": self.predicted_time,
            "impl": list(self.impl),
            "forward_keep": list(self.forward_keep),
            "stages": [s.to_dict() for s in self.stages],
            "meta": self.meta,
        }
        if self.offload:
            d["offload"] = list(self.offload)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "Schedule":
        where = "schedule"
        if not isinstance(d, dict):
            raise FormatError(f"{where}: expected a JSON object, got {type(d).__name__}")
        if d.get("format") != SCHEDULE_FORMAT:
            raise FormatError(f"{where}.format: expected {SCHEDULE_FORMAT!r}, got "
                              f"{d.get('format')!r}; is this a schedule written by monetlike?")
        if d.get("schema_version") != SCHEDULE_SCHEMA_VERSION:
            raise FormatError(f"{where}.schema_version: expected {SCHEDULE_SCHEMA_VERSION}, got "
                              f"{d.get('schema_version')!r}; re-solve with this version")
        summary = get_field(d, "graph_summary", where)
        if not isinstance(summary, dict):
            raise FormatError(f"{where}.graph_summary: expected an object, got "
                              f"{type(summary).__name__}")
        meta = d.get("meta", {})
        if not isinstance(meta, dict):
            raise FormatError(f"{where}.meta: expected an object, got {type(meta).__name__}")
        peak = int_field(d, "predicted_peak_bytes", where, optional=True)
        t = d.get("predicted_time")
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                              or not math.isfinite(t) or t < 0):
            raise FormatError(f"{where}.predicted_time: expected a non-negative, finite number "
                              f"or null, got {t!r:.60}")
        return cls(
            fingerprint=str_field(d, "fingerprint", where),
            graph_summary=summary,
            impl=ints_field(d, "impl", where),
            forward_keep=ints_field(d, "forward_keep", where),
            stages=tuple(StageSchedule.from_dict(x, f"{where}.stages[{i}]")
                         for i, x in enumerate(list_field(d, "stages", where))),
            budget_bytes=int_field(d, "budget_bytes", where, optional=True),
            mode=str_field(d, "mode", where),
            created_by=str_field(d, "created_by", where),
            cost_provenance=str_field(d, "cost_provenance", where),
            predicted_peak_bytes=peak,
            predicted_time=None if t is None else float(t),
            meta=meta,
            offload=ints_field(d, "offload", where) if "offload" in d else (),
        )

    def save(self, path: "str | os.PathLike") -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: "str | os.PathLike") -> "Schedule":
        return cls.from_dict(read_json_file(path, "schedule"))


@dataclass(frozen=True)
class SolveResult:
    """The answer of every backend and baseline: one type, one status vocabulary."""

    status: str
    schedule: Schedule | None
    objective: float | None
    """Predicted step time in seconds (forward + recomputation + backward)."""
    predicted_peak_bytes: int | None
    predicted_time: float | None
    mip_gap: float | None
    """(upper - lower) / upper on the objective, against a valid lower bound; None if unknown."""
    solve_time_s: float
    backend: str
    stats: dict = field(default_factory=dict)
    """Model size (variables, constraints, nonzeros), time to first solution, bounds, messages."""
    message: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    @property
    def ok(self) -> bool:
        return self.schedule is not None

    @classmethod
    def failure(cls, *, status: str, backend: str, message: str, solve_time_s: float = 0.0,
                stats: dict | None = None) -> "SolveResult":
        """The one way to build a result without a schedule."""
        if status not in (INFEASIBLE, ERROR):
            raise ValueError(f"failure status must be {INFEASIBLE!r} or {ERROR!r}, got {status!r}")
        return cls(status=status, schedule=None, objective=None, predicted_peak_bytes=None,
                   predicted_time=None, mip_gap=None, solve_time_s=solve_time_s, backend=backend,
                   stats=dict(stats or {}), message=message)
