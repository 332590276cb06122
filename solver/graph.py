"""The operator graph: the one IR shared by the profiler, the solver, the simulator and the runtime.

Torch-free on purpose: a graph profiled on a GPU box is solved on any CPU box. Everything here is a
frozen dataclass with `to_dict`/`from_dict`; files are JSON (never pickle), written atomically.

Vocabulary (see docs/execution-model.md for the semantics every part must agree on):
- A **Value** is one storage: a tensor that owns its memory. Views and in-place results are not
  new Values; they are names for an existing storage, and the runtime rebuilds them from it.
- An **Op** is a group of fx nodes: one node that creates new storage(s), followed by the in-place
  nodes that overwrite that storage. Pure views, getitem and non-tensor nodes belong to no Op.
- An **Impl** is one implementation of an Op: what its backward holds, its costs, its workspace.
- The **backward order** lists the Ops that have a backward stage, in the order the autograd engine
  ran them while profiling.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from .errors import FormatError
from .jsonio import (atomic_write_text, bool_field, float_field, int_field, ints_field, list_field,
                     read_json_file, str_field, strs_field)

SCHEMA_VERSION = 1
GRAPH_FORMAT = "monetlike.graph"


def cost_kind(provenance: str) -> str:
    """The kind of a cost provenance ("measured:cpu", "analytical:A100-40GB", "memory-only:cpu"
    for a measured profile's memory alone): the part before the first colon."""
    return provenance.partition(":")[0]


def cost_device(provenance: str) -> str:
    """The device a cost provenance names: "cpu", "cuda:0", a GPU preset ("A100-40GB")."""
    return provenance.partition(":")[2]


def fingerprint_of(structure: dict) -> str:
    """The 16-hex-digit hash of a fingerprint structure (`OpGraph.fingerprint_structure`)."""
    blob = json.dumps(structure, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _params(d: dict, where: str) -> tuple:
    """`graph.params`: [name, shape, dtype, requires_grad] rows; absent in older graphs."""
    if "params" not in d:
        return ()
    out = []
    for i, row in enumerate(list_field(d, "params", where)):
        w = f"{where}.params[{i}]"
        if (not isinstance(row, list) or len(row) != 4 or not isinstance(row[0], str)
                or not isinstance(row[2], str) or not isinstance(row[3], bool)):
            raise FormatError(f"{w}: expected [name, shape, dtype, requires_grad], got "
                              f"{row!r:.80}")
        out.append((row[0], ints_field({"shape": row[1]}, "shape", w), row[2], row[3]))
    return tuple(out)


# ----------------------------------------------------------------------------------------------
# The IR
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Value:
    """One storage: the memory a tensor owns, produced by one Op (or a graph input)."""

    id: int
    """Index in `OpGraph.values`."""
    name: str
    """The fx node that created it (placeholder name for graph inputs)."""
    index: int | None
    """Position in that node's tuple output, or None when the node returns a single tensor."""
    shape: tuple[int, ...]
    dtype: str
    """torch dtype name without the prefix, e.g. 'float32', 'bfloat16', 'int64', 'bool'."""
    bytes: int
    """Bytes of the storage (dtype-aware; a view's storage may be larger than its shape)."""
    producer: int | None
    """Op id that creates it; None for graph inputs (always resident: the caller holds them)."""
    requires_grad: bool

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str = "value") -> "Value":
        return cls(
            id=int_field(d, "id", where),
            name=str_field(d, "name", where),
            index=int_field(d, "index", where, optional=True),
            shape=ints_field(d, "shape", where),
            dtype=str_field(d, "dtype", where),
            bytes=int_field(d, "bytes", where),
            producer=int_field(d, "producer", where, optional=True),
            requires_grad=bool_field(d, "requires_grad", where),
        )


@dataclass(frozen=True)
class Impl:
    """One implementation of an Op: what its backward holds, its costs and its workspace."""

    name: str
    """'default' is plain PyTorch; others are registered alternatives (see monetlike.profile)."""
    saved: tuple[int, ...]
    """Value ids (inputs or outputs of the Op) its backward reads; they must be resident then."""
    internal_bytes: int
    """Bytes its backward holds that are neither Values nor parameters (BN statistics, max-pool
    indices, dropout masks, attention internals), allocated in the forward and held until the
    Op's backward stage ends."""
    fwd_time: float
    """Seconds for the forward (and for each recomputation, unless `recompute_time` is set)."""
    bwd_time: float
    """Seconds for its backward stage."""
    fwd_workspace: int
    """Peak transient bytes during the forward above the Op's inputs, outputs and internals."""
    bwd_workspace: int
    """Peak bytes during its backward stage above the memory at the stage's start, not counting
    Values or internals (gradients it creates, parameter gradients, temporaries)."""
    overwrites: int | None = None
    """An in-place Impl: the input Value whose storage its (single) output takes, wherever the Op
    runs (forward and recomputation). That input is destroyed there, so nothing may read or hold
    it afterwards (docs/execution-model.md section 1); None for an Impl that allocates its
    output."""

    recompute_workspace: int | None = None
    """Peak transient bytes of a recomputation of the Op under this Impl, above its inputs and
    its new outputs. The runtime recomputes under no_grad, so nothing is saved for a backward:
    an Impl's internals (a ReLU mask, max-pool indices, BatchNorm statistics) are not made there
    unless the forward kernel makes them anyway (CPU dropout's noise). Measured by the profiler
    (the Op's forward run again under no_grad); None in graphs profiled before it was, read as
    internal_bytes + fwd_workspace (an upper bound). See `recompute_transient`."""

    recompute_time: float | None = None
    """Seconds for a recomputation of the Op under this Impl (no_grad, inside the backward), when
    it was timed there (monetlike.profile.calibrate: costs in context); None reads as
    `fwd_time`. See `rerun_time`."""

    early_release: tuple[int, ...] = ()
    """Saved Values (a subset of `saved`) that autograd frees inside the backward stage, before
    its peak: `bwd_workspace` was measured with them gone. A schedule that still holds one after
    the stage (a later stage or recomputation reads it) adds its bytes to the stage's peak
    (docs/formulation.md section 4). Empty when the profiler could not time the frees (meta
    device) or in graphs profiled before it could; the workspace then holds every saved Value to
    the stage's end."""

    @property
    def rerun_time(self) -> float:
        """Seconds one recomputation of the Op under this Impl costs."""
        return self.fwd_time if self.recompute_time is None else self.recompute_time

    @property
    def recompute_transient(self) -> int:
        """The bytes a recomputation under this Impl needs above its inputs and new outputs."""
        if self.recompute_workspace is None:
            return self.internal_bytes + self.fwd_workspace
        return self.recompute_workspace

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["saved"] = list(self.saved)
        if self.overwrites is None:
            del d["overwrites"]  # graphs without in-place Impls read as before
        if self.recompute_workspace is None:
            del d["recompute_workspace"]  # nor graphs profiled before it was measured
        if self.recompute_time is None:
            del d["recompute_time"]  # nor graphs whose costs were not calibrated
        if self.early_release:
            d["early_release"] = list(self.early_release)
        else:
            del d["early_release"]
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str = "impl") -> "Impl":
        return cls(
            name=str_field(d, "name", where),
            saved=ints_field(d, "saved", where),
            internal_bytes=int_field(d, "internal_bytes", where),
            fwd_time=float_field(d, "fwd_time", where),
            bwd_time=float_field(d, "bwd_time", where),
            fwd_workspace=int_field(d, "fwd_workspace", where),
            bwd_workspace=int_field(d, "bwd_workspace", where),
            overwrites=int_field(d, "overwrites", where, optional=True),
            recompute_workspace=int_field(d, "recompute_workspace", where, optional=True),
            recompute_time=float_field(d, "recompute_time", where, optional=True),
            early_release=(ints_field(d, "early_release", where)
                           if isinstance(d, dict) and "early_release" in d else ()),
        )


@dataclass(frozen=True)
class Op:
    """A group of fx nodes that creates one or more Values (and may overwrite them in place)."""

    id: int
    """Index in `OpGraph.ops`; ops are in topological (forward execution) order."""
    name: str
    """Name of the fx node that creates the storage(s)."""
    kind: str
    """Readable kind: module class ('Conv2d'), function or method name ('add', 'relu_')."""
    nodes: tuple[str, ...]
    """fx node names in the group, in execution order (the creator first)."""
    inputs: tuple[int, ...]
    """Value ids the group reads (no duplicates), graph inputs included."""
    outputs: tuple[int, ...]
    """Value ids the group creates."""
    impls: tuple[Impl, ...]
    has_backward: bool
    """True when autograd created nodes for it, so it has a backward stage."""
    recompute_unsafe: str | None = None
    """Why it must never be recomputed (random op without replayable RNG, data-dependent or
    nondeterministic op, collective, side effects), or None when recomputation is safe."""

    def to_dict(self) -> dict:
        return {
            "id": self.id, "name": self.name, "kind": self.kind, "nodes": list(self.nodes),
            "inputs": list(self.inputs), "outputs": list(self.outputs),
            "impls": [i.to_dict() for i in self.impls], "has_backward": self.has_backward,
            "recompute_unsafe": self.recompute_unsafe,
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = "op") -> "Op":
        impls = tuple(Impl.from_dict(x, f"{where}.impls[{i}]")
                      for i, x in enumerate(list_field(d, "impls", where)))
        if not impls:
            raise FormatError(f"{where}.impls: expected at least one Impl, got none")
        return cls(
            id=int_field(d, "id", where),
            name=str_field(d, "name", where),
            kind=str_field(d, "kind", where),
            nodes=strs_field(d, "nodes", where),
            inputs=ints_field(d, "inputs", where),
            outputs=ints_field(d, "outputs", where),
            impls=impls,
            has_backward=bool_field(d, "has_backward", where),
            recompute_unsafe=str_field(d, "recompute_unsafe", where, optional=True),
        )


@dataclass(frozen=True)
class OpGraph:
    """A model's training step as seen by the scheduler: Values, Ops, backward order, fixed memory."""

    model: str
    """A readable model name (class name or factory path)."""
    batch: int
    values: tuple[Value, ...]
    ops: tuple[Op, ...]
    backward_order: tuple[int, ...]
    """Op ids with a backward stage, in the order the autograd engine ran them."""
    stage_grad_bytes: tuple[int, ...]
    """Per backward stage (aligned with `backward_order`): gradient bytes live at the stage's start
    (activation gradients in flight plus parameter gradients so far), measured while profiling."""
    final_grad_bytes: int
    """Gradient bytes live after the last stage (parameter and input gradients)."""
    outputs: tuple[int, ...]
    """Value ids the model returns; the caller holds them for the whole step."""
    param_bytes: int
    """Parameters and buffers."""
    optimizer_bytes: int
    """Optimizer state (SGD momentum: 1x trainable params; Adam: 2x; none: 0)."""
    input_bytes: int
    """Graph inputs (the caller holds them)."""
    cost_provenance: str
    """'measured:<device>' or 'analytical:<device>'."""
    meta: dict = field(default_factory=dict, compare=False)
    """Free-form provenance (torch version, profile time, optimizer name); not fingerprinted."""
    schema_version: int = SCHEMA_VERSION
    host_bandwidth: float | None = None
    """Bytes per second of the device<->host link (pinned memory), measured or configured; the
    cost of offloading a Value to host memory (docs/execution-model.md section 3). None: no link
    known (a CPU profile), so offload is not available. A cost: not fingerprinted."""
    params: tuple[tuple[str, tuple[int, ...], str, bool], ...] = ()
    """(name, shape, dtype, requires_grad) of every parameter and buffer, in the model's
    named_parameters() then named_buffers() order. Fingerprinted: a layer's weight shape changes
    its workspace and gradient memory even where every activation keeps its shape. Empty in
    graphs profiled before it was recorded."""

    # -- derived views ----------------------------------------------------------------------
    @property
    def fixed_bytes(self) -> int:
        """Memory resident for the whole step whatever the schedule."""
        return self.param_bytes + self.optimizer_bytes + self.input_bytes

    @cached_property
    def users(self) -> tuple[tuple[int, ...], ...]:
        """For each Value, the Op ids that read it in the forward pass, in order."""
        users: list[list[int]] = [[] for _ in self.values]
        for op in self.ops:
            for v in op.inputs:
                users[v].append(op.id)
        return tuple(tuple(u) for u in users)

    @cached_property
    def stage_of_op(self) -> dict[int, int]:
        """Op id -> index of its backward stage."""
        return {op: t for t, op in enumerate(self.backward_order)}

    @cached_property
    def fingerprint(self) -> str:
        """Hash of ops, shapes, dtypes, batch, requires_grad, Impl set, and the shapes and dtypes
        of parameters and buffers (not of costs), so a schedule solved from one device's costs
        runs on any device with the same structure."""
        return fingerprint_of(self.fingerprint_structure())

    @cached_property
    def memory_digest(self) -> str:
        """A digest of every byte count the simulator reads: what a least budget, a schedule's
        peak and a cached answer depend on besides the fingerprint (measured times are left out:
        they differ from run to run, the allocator's counts do not)."""
        figures = [self.stage_grad_bytes, self.final_grad_bytes, self.param_bytes,
                   self.optimizer_bytes, self.input_bytes, [v.bytes for v in self.values],
                   [[(i.saved, i.internal_bytes, i.fwd_workspace, i.bwd_workspace,
                      i.recompute_workspace, i.overwrites, i.early_release) for i in op.impls]
                    for op in self.ops]]
        return hashlib.sha256(json.dumps(figures).encode()).hexdigest()[:16]

    @cached_property
    def shape_free_fingerprint(self) -> str:
        """The fingerprint without the batch and the Values' shapes and bytes: equal for the same
        model run at another batch or sequence length, where each Op, Value and backward stage
        corresponds one to one (the runtime runs a schedule at such smaller shapes; see NOTE
        [Smaller shapes] in monetlike/wrapper.py)."""
        structure = self.fingerprint_structure()
        del structure["batch"]
        structure["values"] = [[v.name, v.index, v.dtype, v.producer, v.requires_grad]
                               for v in self.values]
        return fingerprint_of(structure)

    def fingerprint_structure(self) -> dict:
        """What the fingerprint hashes (scripts/restamp_zoo.py compares its parts)."""
        structure = {
            "schema": self.schema_version,
            "batch": self.batch,
            "values": [[v.name, v.index, list(v.shape), v.dtype, v.bytes, v.producer,
                        v.requires_grad] for v in self.values],
            "ops": [[o.name, o.kind, list(o.nodes), list(o.inputs), list(o.outputs),
                     o.has_backward, o.recompute_unsafe,
                     [[i.name, list(i.saved)] + ([] if i.overwrites is None else [i.overwrites])
                      for i in o.impls]] for o in self.ops],
            "backward_order": list(self.backward_order),
            "outputs": list(self.outputs),
        }
        if self.params:  # graphs without the record keep the fingerprint they were solved with
            structure["params"] = [[n, list(shape), dtype, rg]
                                   for n, shape, dtype, rg in self.params]
        return structure

    def describe_difference(self, other_fingerprint_summary: dict) -> str:
        """Say what differs between this graph and a schedule's recorded graph summary: each
        differing fact, and for lists (inputs, parameters) the first entry that differs."""
        mine = self.summary()
        theirs = other_fingerprint_summary
        diffs = []
        for k in mine:
            a, b = theirs.get(k), mine[k]
            # A hash says nothing in words; optimizer state is not part of the structure.
            if a == b or k in ("shape_free_fingerprint", "optimizer_bytes") \
                    or (k == "training" and a is None):  # not recorded by older monetlikes
                continue
            if k == "params" and a is None:
                diffs.append("the schedule records no parameter shapes (made by an older "
                             "monetlike); solve it again")
                continue
            if isinstance(a, list) and isinstance(b, list):
                i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                if i < min(len(a), len(b)):
                    diffs.append(f"{k}[{i}]: schedule has {a[i]!r}, model has {b[i]!r}")
                else:
                    diffs.append(f"{k}: schedule has {len(a)} entries, model has {len(b)}")
                continue
            diffs.append(f"{k}: schedule has {a!r}, model has {b!r}")
        return "; ".join(diffs) if diffs else "same model, batch and sizes, but different op structure"

    def summary(self) -> dict:
        """The few facts a schedule records about its graph, to explain a mismatch in words."""
        inputs = [v for v in self.values if v.producer is None]
        return {
            "model": self.model,
            "batch": self.batch,
            "input_shapes": [list(v.shape) for v in inputs],
            "input_dtypes": [v.dtype for v in inputs],
            "input_requires_grad": [v.requires_grad for v in inputs],
            "num_ops": len(self.ops),
            "shape_free_fingerprint": self.shape_free_fingerprint,
            # Not fingerprinted (the optimizer is not part of the structure): the runtime adds it
            # to the fixed memory of a smaller shape's graph (NOTE [Smaller shapes]).
            "optimizer_bytes": self.optimizer_bytes,
            # One short string per parameter or buffer: readable in a mismatch message and one
            # line each in a schedule file.
            "params": [f"{n} {'x'.join(map(str, shape)) or 'scalar'} {dtype}"
                       f"{' requires_grad' if rg else ''}" for n, shape, dtype, rg in self.params],
            # The model's own train/eval mode when profiled: a schedule solved in eval mode (a
            # model trained with frozen statistics) runs in eval mode too.
            **({"training": self.meta["training"]} if "training" in self.meta else {}),
            # The lines where the capture read a tensor's value (a branch taken for the
            # example's): a batch taking another branch there is another graph.
            **({"value_reads": self.meta["value_reads"]} if "value_reads" in self.meta else {}),
        }

    def without_impl(self, name: str) -> "OpGraph":
        """The same graph with every Impl called `name` left out (what a model would be without
        that Impl: benchmarks compare the two). The Impls after it on an Op move down one index,
        so a schedule of this graph does not carry over to the original unless it was the last."""
        ops = tuple(dataclasses.replace(o, impls=tuple(i for i in o.impls if i.name != name))
                    for o in self.ops)
        return dataclasses.replace(self, ops=ops)

    # -- checks and (de)serialisation -------------------------------------------------------
    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        nv, no = len(self.values), len(self.ops)
        for i, v in enumerate(self.values):
            if v.id != i:
                raise FormatError(f"values[{i}].id: expected {i}, got {v.id}")
            if v.producer is not None and v.producer >= no:
                raise FormatError(f"values[{i}].producer: op {v.producer} does not exist ({no} ops)")
        for j, op in enumerate(self.ops):
            if op.id != j:
                raise FormatError(f"ops[{j}].id: expected {j}, got {op.id}")
            for key in ("inputs", "outputs"):
                for v in getattr(op, key):
                    if v >= nv:
                        raise FormatError(f"ops[{j}].{key}: value {v} does not exist ({nv} values)")
            for v in op.inputs:
                p = self.values[v].producer
                if p is not None and p >= j:
                    raise FormatError(
                        f"ops[{j}].inputs: value {v} is produced by op {p}, not before op {j}; "
                        f"ops must be in topological order")
            for v in op.outputs:
                if self.values[v].producer != j:
                    raise FormatError(f"ops[{j}].outputs: value {v} names producer "
                                      f"{self.values[v].producer}, expected {j}")
            allowed = set(op.inputs) | set(op.outputs)
            for k, impl in enumerate(op.impls):
                bad = [v for v in impl.saved if v not in allowed]
                if bad:
                    raise FormatError(f"ops[{j}].impls[{k}].saved: values {bad} are neither inputs "
                                      f"nor outputs of op {j}")
                early = [v for v in impl.early_release if v not in impl.saved]
                if early:
                    raise FormatError(f"ops[{j}].impls[{k}].early_release: values {early} are not "
                                      f"in its saved list {list(impl.saved)}")
                if impl.overwrites is not None:
                    self._validate_overwrite(op, k, impl)
        seen = set()
        for t, o in enumerate(self.backward_order):
            if o >= no or not self.ops[o].has_backward or o in seen:
                raise FormatError(f"backward_order[{t}]: op {o} is unknown, repeated or has no "
                                  f"backward")
            seen.add(o)
        missing = [op.id for op in self.ops if op.has_backward and op.id not in seen]
        if missing:
            raise FormatError(f"backward_order: ops {missing[:5]} have a backward but no stage")
        if len(self.stage_grad_bytes) != len(self.backward_order):
            raise FormatError(f"stage_grad_bytes: expected {len(self.backward_order)} entries (one "
                              f"per backward stage), got {len(self.stage_grad_bytes)}")
        for v in self.outputs:
            if v >= nv:
                raise FormatError(f"outputs: value {v} does not exist ({nv} values)")

    def _validate_overwrite(self, op: "Op", k: int, impl: Impl) -> None:
        """The structural conditions of an in-place Impl (docs/execution-model.md section 1):
        what is left to the schedule (nobody holds or saves the overwritten Value) is checked
        by the simulator and encoded by the MILP."""
        x, where = impl.overwrites, f"ops[{op.id}].impls[{k}].overwrites"
        if x not in op.inputs:
            raise FormatError(f"{where}: value {x} is not an input of op {op.id}")
        v = self.values[x]
        if v.producer is None or x in self.outputs:
            raise FormatError(f"{where}: value {x} ({v.name}) is a graph input or a model output; "
                              f"an Impl may only overwrite a Value the schedule decides")
        if x in impl.saved:
            raise FormatError(f"{where}: its backward saves value {x}, which it overwrites")
        # Impl 0 is the fallback where the in-place one cannot run (a schedule built by a rule
        # that holds x): it must not need a Value the in-place Impl does not.
        extra = sorted(set(op.impls[0].saved) - set(impl.saved))
        if extra:
            raise FormatError(f"{where}: Impl 0 of op {op.id} saves values {extra} that this "
                              f"in-place Impl does not; an in-place Impl saves what Impl 0 saves")
        if len(op.outputs) != 1 or self.values[op.outputs[0]].bytes != v.bytes:
            raise FormatError(f"{where}: op {op.id} must have exactly one output of the bytes of "
                              f"value {x} ({v.bytes}) to write it into that storage")
        later = [u for u in range(op.id + 1, len(self.ops)) if x in self.ops[u].inputs]
        if later:
            raise FormatError(f"{where}: ops {later[:5]} read value {x} ({v.name}) after op "
                              f"{op.id} overwrites it")

    def to_dict(self) -> dict:
        return {
            "format": GRAPH_FORMAT,
            "schema_version": self.schema_version,
            "model": self.model,
            "batch": self.batch,
            "cost_provenance": self.cost_provenance,
            "param_bytes": self.param_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "input_bytes": self.input_bytes,
            "outputs": list(self.outputs),
            "backward_order": list(self.backward_order),
            "stage_grad_bytes": list(self.stage_grad_bytes),
            "final_grad_bytes": self.final_grad_bytes,
            "host_bandwidth": self.host_bandwidth,
            "meta": self.meta,
            "values": [v.to_dict() for v in self.values],
            "ops": [o.to_dict() for o in self.ops],
            "params": [[n, list(shape), dtype, rg] for n, shape, dtype, rg in self.params],
        }

    @classmethod
    def from_dict(cls, d: Any) -> "OpGraph":
        where = "graph"
        if not isinstance(d, dict):
            raise FormatError(f"{where}: expected a JSON object, got {type(d).__name__}")
        fmt = d.get("format")
        if fmt != GRAPH_FORMAT:
            raise FormatError(f"{where}.format: expected {GRAPH_FORMAT!r}, got {fmt!r}; "
                              f"is this an operator graph written by `monetlike profile`?")
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise FormatError(f"{where}.schema_version: expected {SCHEMA_VERSION}, got {version!r}; "
                              f"re-profile the model with this version of monetlike")
        meta = d.get("meta", {})
        if not isinstance(meta, dict):
            raise FormatError(f"{where}.meta: expected an object, got {type(meta).__name__}")
        bw = d.get("host_bandwidth")
        if bw is not None and (isinstance(bw, bool) or not isinstance(bw, (int, float))
                               or not bw > 0 or bw == float("inf")):
            raise FormatError(f"{where}.host_bandwidth: expected a positive number of bytes per "
                              f"second or null, got {bw!r:.60}")
        return cls(
            host_bandwidth=None if bw is None else float(bw),
            model=str_field(d, "model", where),
            batch=int_field(d, "batch", where, minimum=1),
            values=tuple(Value.from_dict(x, f"values[{i}]")
                         for i, x in enumerate(list_field(d, "values", where))),
            ops=tuple(Op.from_dict(x, f"ops[{i}]")
                      for i, x in enumerate(list_field(d, "ops", where))),
            backward_order=ints_field(d, "backward_order", where),
            stage_grad_bytes=ints_field(d, "stage_grad_bytes", where),
            final_grad_bytes=int_field(d, "final_grad_bytes", where),
            outputs=ints_field(d, "outputs", where),
            param_bytes=int_field(d, "param_bytes", where),
            optimizer_bytes=int_field(d, "optimizer_bytes", where),
            input_bytes=int_field(d, "input_bytes", where),
            cost_provenance=str_field(d, "cost_provenance", where),
            meta=meta,
            params=_params(d, where),
        )

    def save(self, path: "str | os.PathLike") -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: "str | os.PathLike") -> "OpGraph":
        return cls.from_dict(read_json_file(path, "graph"))
