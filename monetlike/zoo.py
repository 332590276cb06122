"""The schedule zoo: prebuilt JSON schedules for MONeT's models, picked by model, batch and budget.

The schedules live in the repository's `schedules/` folder and ship inside the wheel as the
package `monetlike.schedules` (`$MONETLIKE_ZOO` names another folder of the same layout). `schedules/index.json` lists one entry per schedule with what is
needed to choose one without opening it. `load(name, model)` checks the schedule's fingerprint
against the user's model before returning it, so a zoo schedule never runs on the wrong model.

Models that make their own keyword batch (the named transformers shapes of monetlike.hf_models,
`monetlike.models.gpt2`, `llama_1b`: input_ids, attention_mask, labels) are entries too: their
`input_shape` is the shape after the batch dimension of the batch's first input, (seq_len,), as
`--input-shape` is for them on the command line, and the batch is the model's
`example_inputs(batch, seq_len)`.
"""

from __future__ import annotations

import difflib

import json
import os
import pathlib
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any

import torch

from solver.errors import FormatError, MonetlikeError, ScheduleMismatchError
from solver.jsonio import get_field, int_field, ints_field, str_field
from solver.schedule import Schedule
from solver.units import format_bytes, parse_bytes
from solver.verify import verified, with_recorded_optimizer_state

from .maxbatch import model_batch_maker
from .modelspec import load_loss
from .profile import FSDPConfig, profile

INDEX = "index.json"


class ZooError(MonetlikeError, ValueError):
    """No such zoo entry, or no entry fits the request."""


@dataclass(frozen=True)
class ZooEntry:
    name: str
    """File stem, e.g. 'resnet50_184_8GiB'."""
    model: str
    """Factory as given to the CLI, e.g. 'torchvision.models.resnet50'."""
    batch: int
    input_shape: tuple[int, ...]
    """After the batch dimension: (3, H, W) for an image model, (seq_len,) for a model that makes
    its own keyword batch (module docstring)."""
    budget_bytes: int
    predicted_peak_bytes: int
    predicted_time: float
    store_all_time: float
    store_all_peak_bytes: int
    mode: str
    status: str
    mip_gap: float | None
    cost_provenance: str
    fingerprint: str
    fsdp: dict | None = None
    """One rank of FSDP2 (issue 53): {"world_size": N, "param_dtype": "bfloat16" or None},
    every block of the model's block list a unit (`FSDPConfig.per_block`); the budget is a
    per-rank peak. None: one device."""
    optimizer: str | None = None
    """The optimizer whose state the budget holds (profile's `optimizer`); None: none."""
    loss: str | None = None
    """The loss of the step, a name of monetlike.modelspec.LOSSES; None: the profiler's sum."""

    @property
    def overhead(self) -> float:
        """Predicted step time over the store-all (plain PyTorch) step time, minus one."""
        return self.predicted_time / self.store_all_time - 1.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["input_shape"] = list(self.input_shape)
        for key in ("fsdp", "optimizer", "loss"):  # the index names them only where set
            if d[key] is None:
                del d[key]
        return d

    def profile_settings(self, model) -> dict:
        """The keyword arguments of `profile` (besides the cost) that made this entry's graph."""
        return profile_settings(model, fsdp=self.fsdp, optimizer=self.optimizer, loss=self.loss)

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "ZooEntry":
        gap = d.get("mip_gap") if isinstance(d, dict) else None
        return cls(name=str_field(d, "name", where), model=str_field(d, "model", where),
                   batch=int_field(d, "batch", where, minimum=1),
                   input_shape=ints_field(d, "input_shape", where),
                   budget_bytes=int_field(d, "budget_bytes", where),
                   predicted_peak_bytes=int_field(d, "predicted_peak_bytes", where),
                   predicted_time=float(get_field(d, "predicted_time", where)),
                   store_all_time=float(get_field(d, "store_all_time", where)),
                   store_all_peak_bytes=int_field(d, "store_all_peak_bytes", where),
                   mode=str_field(d, "mode", where), status=str_field(d, "status", where),
                   mip_gap=None if gap is None else float(gap),
                   cost_provenance=str_field(d, "cost_provenance", where),
                   fingerprint=str_field(d, "fingerprint", where), fsdp=_fsdp(d, where),
                   optimizer=str_field(d, "optimizer", where, optional=True),
                   loss=str_field(d, "loss", where, optional=True))


def profile_settings(model, *, fsdp: dict | None = None, optimizer: str | None = None,
                     loss: str | None = None) -> dict:
    """`profile`'s keyword arguments for an entry's `fsdp`, `optimizer` and `loss` (ZooEntry)."""
    settings: dict = {"optimizer": optimizer, "loss_fn": load_loss(loss)}
    if fsdp is not None:
        dtype = fsdp.get("param_dtype")
        settings["fsdp"] = FSDPConfig.per_block(
            model, int(fsdp["world_size"]),
            param_dtype=None if dtype is None else getattr(torch, dtype))
    return settings


def _fsdp(d: Any, where: str) -> dict | None:
    f = d.get("fsdp") if isinstance(d, dict) else None
    if f is None:
        return None
    int_field(f, "world_size", f"{where}.fsdp", minimum=1)
    dtype = str_field(f, "param_dtype", f"{where}.fsdp", optional=True)
    if dtype not in (None, "bfloat16", "float16"):
        raise FormatError(f"{where}.fsdp.param_dtype: expected 'bfloat16', 'float16' or null, "
                          f"got {dtype!r}")
    return {"world_size": f["world_size"], "param_dtype": dtype}


def _folder():
    """The zoo's folder: `$MONETLIKE_ZOO` (a team's own zoo, in the same layout) or the one
    shipped in the package. Either way its files are claims: `load` verifies before use."""
    own = os.environ.get("MONETLIKE_ZOO")
    return pathlib.Path(own) if own else resources.files("monetlike.schedules")


def entries() -> list[ZooEntry]:
    """All zoo entries, from the index."""
    index = _folder() / INDEX
    if not index.is_file():
        return []
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise FormatError(f"zoo index {INDEX} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise FormatError(f"zoo index {INDEX}: expected an object with a list 'entries'")
    return [ZooEntry.from_dict(e, f"index.entries[{i}]") for i, e in enumerate(data["entries"])]


def _short(model: str) -> str:
    """'torchvision.models.resnet50' and 'resnet50' both match 'resnet50'; 'llama-1b' matches
    'monetlike.models.llama_1b'."""
    return model.replace(":", ".").rsplit(".", 1)[-1].lower().replace("-", "_")


def get(name: str) -> ZooEntry:
    for e in entries():
        if e.name == name:
            return e
    close = difflib.get_close_matches(name, [e.name for e in entries()], n=NEAREST, cutoff=0.5)
    have = (f"the nearest names: {', '.join(close)}" if close else
            f"its models: {', '.join(sorted({_short(e.model) for e in entries()}))}"
            if entries() else "the zoo is empty")
    raise ZooError(f"no zoo schedule named {name!r}; {have} (all of them: zoo list)")


def pick(model: str, batch: int, budget: "int | str") -> ZooEntry:
    """The entry for this model and batch with the lowest predicted time whose peak fits."""
    budget = parse_bytes(budget)
    same = [e for e in entries() if _short(e.model) == _short(model) and e.batch == batch]
    fits = [e for e in same if e.predicted_peak_bytes <= budget]
    if not fits:
        what = "for this model and batch" if same else "at all for this model and batch"
        raise ZooError(f"no zoo schedule for {model} batch {batch} fits {format_bytes(budget)} "
                       f"({'none fits' if same else 'none exists'} {what}); "
                       f"{_nearest(model, batch, budget)}; solve one for this model, batch "
                       f"and budget (solver.solve, or monetlike solve on the command line)")
    return min(fits, key=lambda e: (e.predicted_time, e.predicted_peak_bytes))


NEAREST = 5
"""How many entries a miss lists."""


def _nearest(model: str, batch: int, budget: int) -> str:
    """The few entries nearest a miss, in words: the same model and batch by peak nearest the
    budget; else the same model by nearest batch; else the models of similar name."""
    short = _short(model)
    same_model = [e for e in entries() if _short(e.model) == short]
    if same_model:
        near = sorted(same_model, key=lambda e: (abs(e.batch - batch),
                                                 abs(e.predicted_peak_bytes - budget)))[:NEAREST]
        return "the nearest entries: " + ", ".join(
            f"{e.name} (batch {e.batch}, peak {format_bytes(e.predicted_peak_bytes)})"
            for e in near)
    models = sorted({_short(e.model) for e in entries()})
    close = difflib.get_close_matches(short, models, n=NEAREST, cutoff=0.5)
    if close:
        return f"models of similar name in the zoo: {', '.join(close)}"
    return (f"the zoo has no {short}; its models: {', '.join(models)}" if models
            else "the zoo is empty")


def dominated(items: list[ZooEntry] | None = None) -> list[tuple[ZooEntry, ZooEntry]]:
    """(entry, the fastest entry of a smaller budget for the same graph, mode and costs that is
    faster than it): a plan that fits a smaller budget fits every larger one, so such an entry
    is not the best known for its budget, whatever its status says. The zoo build replaces it
    (scripts/build_zoo.py, take_smaller_plans); the shipped zoo has none (tests/test_zoo.py)."""
    items = entries() if items is None else items
    out = []
    for e in items:
        better = [s for s in items if (s.fingerprint, s.mode, s.cost_provenance)
                  == (e.fingerprint, e.mode, e.cost_provenance)
                  and s.budget_bytes < e.budget_bytes and s.predicted_time < e.predicted_time]
        if better:
            out.append((e, min(better, key=lambda s: (s.predicted_time, s.budget_bytes))))
    return out


def schedule(name: str) -> Schedule:
    """The schedule of a zoo entry, unchecked (use `load` to check it against a model)."""
    get(name)
    path = _folder() / f"{name}.json"
    try:
        return Schedule.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except json.JSONDecodeError as e:
        raise FormatError(f"zoo schedule {name}.json is not valid JSON: {e}") from None


def example_batch(entry: ZooEntry, model, device="meta"):
    """The batch `entry` was solved for, on `device`: the model's own keyword batch
    (`example_inputs(batch, seq_len)`) when it makes one, else one float tensor."""
    import torch

    if callable(getattr(model, "example_inputs", None)):

        try:
            return model_batch_maker(model, entry.input_shape, device)(entry.batch)
        except ValueError as e:
            raise ScheduleMismatchError(
                f"zoo schedule {entry.name!r} was made for {entry.model} batch {entry.batch} "
                f"input {list(entry.input_shape)}; the given {type(model).__name__} cannot make "
                f"that batch: {e}") from None
    return torch.empty(entry.batch, *entry.input_shape, device=device)


def load(name: str, model) -> Schedule:
    """The schedule of a zoo entry, after checking it was made for `model` (by fingerprint) and
    that its decisions, replayed on the model's graph, peak within its budget (solver.verify:
    an entry edited in place is refused); its figures are then the simulator's. The check
    profiles on the meta device: `model` may itself live there (build it under
    `torch.device("meta")`; a 1B-parameter model then allocates nothing)."""

    entry = get(name)
    sched = schedule(name)
    # The entry's own costs: the preset decides the attention kernels, so the memory.
    graph = profile(model, example_batch(entry, model), cost=entry.cost_provenance,
                    **entry.profile_settings(model))
    if graph.fingerprint != sched.fingerprint:
        raise ScheduleMismatchError(
            f"zoo schedule {name!r} was made for {entry.model} batch {entry.batch} input "
            f"{list(entry.input_shape)} (fingerprint {sched.fingerprint}); the given model has "
            f"fingerprint {graph.fingerprint} at that batch and shape: it is another model or "
            f"configuration")
    graph = with_recorded_optimizer_state(graph, sched) or graph
    # The index's budget is the one the entry was picked by: the tighter of the two holds.
    budget = min(b for b in (entry.budget_bytes, sched.budget_bytes) if b is not None)
    return verified(graph, sched, budget=budget, source=f"zoo schedule {name!r}")


def table(items: list[ZooEntry] | None = None):
    """A pandas table of entries: model, batch, budget, peak, overhead, cost model."""
    import pandas as pd

    rows = [{"name": e.name, "model": _short(e.model), "batch": e.batch,
             "budget": format_bytes(e.budget_bytes), "peak": format_bytes(e.predicted_peak_bytes),
             "overhead": f"{100 * e.overhead:.2f}%", "status": e.status,
             "costs": e.cost_provenance} for e in (entries() if items is None else items)]
    return pd.DataFrame(rows, columns=["name", "model", "batch", "budget", "peak", "overhead",
                                       "status", "costs"])
