"""`ScheduleWrapper`: an nn.Module that trains a model under a memory Schedule, inside autograd.

    wrapped = monetlike.ScheduleWrapper(model, solver.Schedule.load("r50_184_8GiB.json"))
    wrapped(x).sum().backward()      # same gradients as model(x).sum().backward()

In training mode with grad enabled the forward runs the schedule (executor.py); in eval mode,
under torch.no_grad(), or inside `with wrapped.plain():` it calls the model as it is. A schedule
solved for a model in eval mode (trained with frozen BatchNorm statistics, dropout off) runs in
eval mode as well, whenever grad is enabled. The wrapper
owns nothing: its parameters, buffers, submodules and state_dict keys are the model's own (it
shares the model's dictionaries), so an optimizer built on either works, checkpoints load both
ways, and DistributedDataParallel can wrap it.

NOTE [Which graph a schedule runs on]
A Schedule carries only the fingerprint and a summary of the graph it was solved for. On the first
call with a new input signature (shapes, dtypes, devices, requires_grad of inputs and parameters,
train/eval flags, autocast state) the wrapper profiles the structure of (model, inputs) cheaply
(the profiler's analytical mode on the meta device; a one-repeat measured profile when that
cannot run, e.g. under autocast) and compares fingerprints. A difference raises
ScheduleMismatchError naming what differs; a wrong schedule never runs. A schedule that matches
then passes the gate (solver/verify.py): its decisions, replayed by the simulator on that graph,
must peak within its budget, whatever figures it records. The verdict is cached per signature
(which includes the modules' and parameters' identities: NOTE [The model checked every step]), so
later steps pay a dictionary lookup.

NOTE [Smaller shapes]
A training loop meets shapes smaller than the one solved for: the last batch of an epoch without
drop_last, shorter sequences. When the structure profile of such a call differs from the
schedule's graph only in the batch and the Values' sizes (equal `OpGraph.shape_free_fingerprint`,
which the schedule's graph summary records) and no input dimension is larger than the one solved
for, the same decisions (Impls, kept Values, recomputations, drops: all named by Op and Value id,
which correspond one to one) are rebound to the new graph, and the simulator replays them on it:
the call runs only if the replayed peak is within the schedule's budget (or, with no budget, its
predicted peak). So each new shape is proven with the simulator, once, and cached with the
signature; nothing is solved again. A larger shape, or a proof that fails, raises
ScheduleMismatchError suggesting `monetlike.optimize` (which solves per shape) or `monetlike
maxbatch`. A smaller shape at which the traced structure itself changes (a sequence of length
one, where a reduction over it needs no kernel) is another graph and refused as such.

A schedule that offloads Values to host memory (`schedule.offload`) runs on CUDA only
(offload.py). It is refused when the wrapper is built if CUDA is not available, and when the plan
for an input signature is made if the model's tensors or the inputs are not on a CUDA device:
before a step runs, never half-way through one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import time
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from solver.errors import FormatError, ScheduleError, ScheduleMismatchError
from solver.graph import OpGraph, cost_device, cost_kind
from solver.schedule import Schedule
from solver.verify import budget_limit, verified, with_recorded_optimizer_state

from .capture.api import (FlatInputs, bind_inputs, call_spec, check_capture, example_of,
                          export_graph, placeholder_names, resolve)
from .core import recompute as rc
from .capture.identity import module_flags, python_attributes, shared_capture
from .capture.trace import is_plain_value
from .runtime.executor import ScheduledForward, StepState
from .runtime.offload import check_cuda_available, check_offload_devices
from .runtime.plan import Plan, build_plan
from .capture.trace import MonetTracer, trace
from .profile import profile, profile_memory
from .core.modules import fsdp_units_inside, has_forward_hooks

__all__ = ["ScheduleWrapper"]

_SHARED = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")

DATAPARALLEL_MESSAGE = (
    "ScheduleWrapper does not run under torch.nn.DataParallel: its replicas would share one "
    "schedule state across threads and devices. Use DistributedDataParallel (one process per "
    "device; see examples/dist_training.py): DistributedDataParallel(ScheduleWrapper(model, "
    "schedule), ...).")


_OBJECT_CLASS = object.__dict__["__class__"]


def _new_wrapper(cls):
    """An empty wrapper of class `cls` for pickle and copy to fill with __setstate__."""
    return cls.__new__(cls)


class _ModelSignature:
    """`wrapper.forward`: the scheduled forward, under the wrapped model's own signature
    (inspect.signature), so that code that reads the model's arguments from its forward, as
    Hugging Face Trainer's column filter does, sees the model's and not (*args, **kwargs)."""

    def __get__(self, obj, cls=None):
        if obj is None:
            return cls._forward
        bound = obj._forward
        model = obj.__dict__.get("_model")
        if model is None:
            return bound

        def forward(*args, **kwargs):
            return bound(*args, **kwargs)

        try:
            forward.__signature__ = inspect.signature(model.forward)
        except (TypeError, ValueError):  # a builtin forward without one: the wrapper's own
            pass
        return forward


@dataclass
class _Entry:
    plan: Plan
    runner: ScheduledForward


class ScheduleWrapper(torch.nn.Module):
    """Run `model`'s training steps under `schedule` (a Schedule or a path to its JSON file).

    graph: the OpGraph the schedule was solved for, when the caller has it (monetlike.optimize
        does); it saves the structure profile of the first call.
    leaf_modules: as passed to monetlike.profile when the graph was made (default: the names the
        schedule's metadata records); the runtime must trace the model the same way.
    capture: "auto", "fx" or "export" (monetlike.capture), as the graph was captured (default:
        the graph's `meta["capture"]`, else "auto"). An exported graph is specialised to its
        input shapes and constants, so it is captured again for each new input signature.
    """

    def __init__(self, model: torch.nn.Module, schedule: "Schedule | str | os.PathLike", *,
                 graph: OpGraph | None = None, leaf_modules: Iterable | None = None,
                 capture: str | None = None):
        super().__init__()
        _disable_compile_of_the_step()
        if isinstance(model, ScheduleWrapper):
            raise TypeError("ScheduleWrapper: the model is already wrapped")
        if isinstance(model, (torch.nn.DataParallel,
                              torch.nn.parallel.DistributedDataParallel)):
            raise TypeError("ScheduleWrapper: wrap the model first, then DistributedDataParallel: "
                            "DistributedDataParallel(ScheduleWrapper(model, schedule))")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ScheduleWrapper: expected a torch.nn.Module, got "
                            f"{type(model).__name__}")
        source = "the schedule"
        if isinstance(schedule, (str, os.PathLike)):
            source = f"the schedule file {os.fspath(schedule)!r}"
            schedule = Schedule.load(schedule)
        if not isinstance(schedule, Schedule):
            raise TypeError(f"ScheduleWrapper: expected a solver.Schedule or a path to one, got "
                            f"{type(schedule).__name__}")
        if graph is not None and graph.fingerprint != schedule.fingerprint:
            raise ScheduleMismatchError(
                f"ScheduleWrapper: the schedule was not solved for the given graph: "
                f"{graph.describe_difference(schedule.graph_summary)} (fingerprints "
                f"{schedule.fingerprint} and {graph.fingerprint})")
        check_cuda_available(schedule, graph)  # offload runs on CUDA only (offload.py)
        rc.warm()  # before any step measures what the step allocates
        if leaf_modules is None:
            leaf_modules = (graph.meta.get("leaf_modules") if graph is not None else None) \
                or schedule.meta.get("leaf_modules") or []
            if not isinstance(leaf_modules, list) or not all(isinstance(m, str)
                                                             for m in leaf_modules):
                raise FormatError(f"schedule.meta.leaf_modules: expected a list of module names "
                                  f"or 'package.module.Class' strings, got {leaf_modules!r:.80}")
        # The model lives in __dict__, not in _modules: registering it would prefix every
        # state_dict key with "model.". Its dictionaries are shared instead (module docstring).
        object.__setattr__(self, "_model", model)
        for name in _SHARED:
            object.__setattr__(self, name, getattr(model, name))
        self.training = model.training
        self._schedule = schedule
        self._source = source  # how messages name it
        # An eval-mode call is an evaluation (the plain model runs) unless the schedule was
        # solved in eval mode: training with frozen BatchNorm statistics or dropout off.
        solved = schedule.graph_summary.get("training")
        if solved is None and graph is not None:
            solved = graph.meta.get("training")
        self._solved_in_eval = solved is False
        self._leaf_modules = _resolve_leaf_modules(leaf_modules, model)
        self._capture = check_capture(capture or (graph.meta.get("capture") if graph is not None
                                                  else None)
                                      or schedule.meta.get("capture") or "auto")
        self._given_graph = graph
        # the arguments the schedule's graph takes, by name (a keyword outside them is refused)
        self._input_names = None if graph is None else frozenset(
            v.name for v in graph.values if v.producer is None)
        # The train/eval flags the given graph was taken with (trusted only while they hold).
        self._given_training = None if graph is None else _training_flags(model)
        # The solved graph's optimizer state, for schedules whose summary does not record it
        # (NOTE [Smaller shapes]).
        self._optimizer_bytes = None if graph is None else graph.optimizer_bytes
        # A given graph that offers no Op an Impl may have been profiled with impls=False: the
        # structure profiles at other shapes then leave the Impls out too, to match it (where
        # the model has nothing to offer, both give the same structure).
        self._structure_impls = graph is None or any(len(op.impls) > 1 for op in graph.ops)
        self._entries: dict[Any, "_Entry | Exception"] = {}
        self._gm = None
        self._gm_key = None  # what `_gm` was traced with (identity.shared_capture's key)
        self._watched = None  # NOTE [Python attributes read in forward]
        self._placeholders = None
        self._plain = 0
        self._recompute_log = None  # (times, clock) inside timing_recomputations()

    # -- the model's own identity ---------------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        return self._model

    @property
    def schedule(self) -> Schedule:
        return self._schedule

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_model")
            if model is None:
                raise
            return getattr(model, name)

    # NOTE [The class trainers see]
    # Hugging Face Trainer decides by isinstance(model, PreTrainedModel) whether to save with
    # save_pretrained (which drops tied weights' duplicates; its other branch writes the raw
    # state_dict with safetensors, which refuses GPT-2's tied embedding) and reads the label
    # names off the class's forward. For such a model (duck-typed: its class has
    # save_pretrained and config_class) the wrapper reports the model's class as `__class__`,
    # as proxies such as wrapt's do; type(wrapper) stays ScheduleWrapper, and its methods and
    # the model's (by __getattr__) are what run. Pickling names the real class
    # (`__reduce_ex__`): pickle compares __class__ with the class it records.
    @property
    def __class__(self):
        model = self.__dict__.get("_model")
        cls = type(model)
        if model is not None and hasattr(cls, "save_pretrained") and hasattr(cls, "config_class"):
            return cls
        return type(self)

    @__class__.setter
    def __class__(self, cls):
        _OBJECT_CLASS.__set__(self, cls)

    def __reduce_ex__(self, protocol):
        return _new_wrapper, (type(self),), self.__getstate__()

    def _get_name(self) -> str:
        return type(self).__name__

    def train(self, mode: bool = True) -> "ScheduleWrapper":
        self._model.train(mode)
        self.training = mode
        return self

    def state_dict(self, *args, **kwargs):
        return self._model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self._model.load_state_dict(state_dict, strict=strict, assign=assign)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self._model._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, *args, **kwargs):
        self._model._load_from_state_dict(*args, **kwargs)

    def extra_repr(self) -> str:
        s = self._schedule
        budget = f", budget {s.budget_bytes} B" if s.budget_bytes is not None else ""
        return f"model={type(self._model).__name__}, schedule {s.fingerprint} ({s.mode}{budget})"

    # Plans hold the traced module, fx nodes and generated code: rebuilt on the first call after a
    # copy or an unpickle rather than copied.
    _CACHES = ("_entries", "_gm", "_placeholders")

    def __getstate__(self):
        state = self.__dict__.copy()
        for k in self._CACHES:
            state.pop(k, None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._entries, self._gm, self._placeholders = {}, None, None

    @contextlib.contextmanager
    def plain(self):
        """Within this block the wrapper runs the model without the schedule."""
        self._plain += 1
        try:
            yield self
        finally:
            self._plain -= 1

    @contextlib.contextmanager
    def timing_recomputations(self, clock=time.perf_counter):
        """Within this block each recomputation is timed as it runs, inside the backward, by
        `clock` (seconds; time.thread_time for a thread-clock profile): yields {op id: [seconds,
        ...]} (monetlike.calibrate reads it). On CUDA the device is synchronized around each
        recomputation, so the steps run slower than they would."""
        log: dict[int, list[float]] = {}
        self._recompute_log = (log, clock)
        try:
            yield log
        finally:
            self._recompute_log = None

    @property
    def plans(self) -> tuple[Plan, ...]:
        """The plans built so far, one per input signature this wrapper has run (or been asked
        about with graph_for/schedule_for)."""
        return tuple(e.plan for e in self._entries.values() if isinstance(e, _Entry))

    def graph_for(self, *args, **kwargs) -> OpGraph:
        """The OpGraph this wrapper runs the schedule on for inputs like these (profiling the
        structure if this input signature is new); raises ScheduleMismatchError like a call."""
        inputs = self._positional(args, kwargs)
        return self._entry_for(inputs).plan.graph

    def schedule_for(self, *args, **kwargs) -> Schedule:
        """The schedule this wrapper runs for inputs like these: its own, or its decisions
        rebound to a smaller shape with the simulator's peak and time (NOTE [Smaller shapes])."""
        inputs = self._positional(args, kwargs)
        return self._entry_for(inputs).plan.schedule

    # -- the step ---------------------------------------------------------------------------
    def _forward(self, *args, **kwargs):
        if getattr(self, "_is_replica", False):
            raise RuntimeError(DATAPARALLEL_MESSAGE)
        model = self._model
        if self._plain or not torch.is_grad_enabled() or \
                (not model.training and not self._solved_in_eval):
            return model(*args, **kwargs)
        if has_forward_hooks(model):
            raise RuntimeError(
                "ScheduleWrapper: the wrapped model has forward hooks on itself, which the "
                "scheduled forward would not call; register them on the wrapper instead "
                "(hooks on its submodules are fine)")
        return self._scheduled_step(args, kwargs)

    forward = _ModelSignature()

    # torch.compile does not trace into the scheduled step: compiled, its forward's random ops
    # (dropout) draw inductor's random numbers while the recomputations in the backward run
    # eagerly and draw others (other masks: wrong gradients, silently), and its per-node
    # dispatch recompiles at every node. Under torch.compile(wrapper) the step runs eagerly,
    # exactly; eval and no_grad calls (the plain model) still compile. `_scheduled_step` is
    # this method under torch.compiler.disable (_disable_compile_of_the_step).
    def _eager_scheduled_step(self, args: tuple, kwargs: dict):
        inputs = self._positional(args, kwargs)
        entry = self._entry_for(inputs)
        entry.runner.recompute_log = self._recompute_log
        state = StepState(entry.plan, entry.runner, inputs)
        try:
            out = entry.runner.run_step(state, inputs)
            state.finish_forward()
        except BaseException as e:
            state.release_host()  # a failed step's pinned host copies go now, not with the graph
            if isinstance(e, ScheduleError):
                # A schedule found unsafe while running (side effects it would replay) is
                # refused for good for this signature.
                self._entries[self._signature(inputs)] = e
            raise
        return out

    def _graph_inputs(self) -> set[str]:
        """Names of the arguments the schedule's graph takes (empty when not known: an
        exported graph's, without the graph the schedule was solved for)."""
        if self._input_names is not None:
            return set(self._input_names)
        if self._capture == "fx" or self._placeholders is not None:
            return set(self._placeholders or placeholder_names(self._traced()))
        return set()

    def _keywords(self, kwargs: dict) -> dict:
        """The keywords that can change the call: one equal to its default in the model's
        signature is left out (the same call), and one the graph did not take, such as a
        trainer's num_items_in_batch, is refused in words (it could change what forward
        computes, which the schedule's graph does not)."""
        if not kwargs:
            return kwargs
        try:
            params = inspect.signature(self._model.forward).parameters
        except (TypeError, ValueError):
            return kwargs
        kept = {k: v for k, v in kwargs.items() if not (
            k in params and params[k].default is not inspect.Parameter.empty
            and is_plain_value(v) and type(v) is type(params[k].default)
            and v == params[k].default)}
        taken = self._graph_inputs()
        foreign = sorted(k for k in kept if k not in params and taken and k not in taken)
        if foreign:
            raise ScheduleMismatchError(
                f"ScheduleWrapper: forward was called with {', '.join(foreign)}, which the "
                f"example the schedule was made for did not pass; it can change what the "
                f"forward computes (a loss normalised by it), so this schedule does not "
                f"describe the call. Pass it in the example given to monetlike.optimize or "
                f"monetlike.profile as the caller will (Hugging Face Trainer passes "
                f"num_items_in_batch as a 0-dim float tensor), or call without it")
        return kept

    def _positional(self, args: tuple, kwargs: dict) -> tuple:
        kwargs = self._keywords(kwargs)
        if self._exported(args, kwargs):
            return call_spec(self._model, args, kwargs)  # FlatInputs (monetlike.capture)
        if self._placeholders is None:
            self._placeholders = placeholder_names(self._traced())
        return bind_inputs(self._model, self._placeholders, args, kwargs)

    def _signature(self, inputs: tuple):
        parts = []
        for x in inputs:
            if isinstance(x, torch.Tensor):
                parts.append((tuple(x.shape), x.dtype, x.device, x.requires_grad))
            else:
                parts.append(("const", repr(x)))
        if isinstance(inputs, FlatInputs):  # an exported graph bakes in the call's constants
            parts.append(("call", inputs.spec.key))
        autocast = [torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")]
        if torch.cuda.is_available():
            autocast += [torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")]
        training: list = []
        grads: list = []
        module_flags(self._model, training, grads)
        structure = tuple(grads)
        if structure != self.__dict__.get("_structure"):
            described = _described(self._model)
            if self.__dict__.get("_structure") is not None:
                # NOTE [The model checked every step]: a module or parameter replaced since
                # the last step: trace the model as it is now and list its attributes again.
                # (On the first step, the trace this call's binding made is of the model now.)
                object.__setattr__(self, "_gm", None)
                self._watched = self._placeholders = None
                self._changed = _first_change(self.__dict__.get("_described", []), described)
            self._structure, self._described = structure, described
        return (tuple(parts), tuple(autocast), structure, tuple(training),
                self._python_state())

    def _python_state(self) -> tuple:
        """NOTE [Python attributes read in forward]: the values of the modules' plain Python
        attributes."""
        watched = self._watched
        if watched is None or watched[0] != self._capture:
            run_whole = None
            if self._capture != "export":  # an fx leaf runs its own forward, reading them live

                run_whole = MonetTracer(self._leaf_modules).is_leaf_module
            watched = self._watched = (self._capture,
                                       python_attributes(self._model, run_whole))
        return tuple(getattr(m, name, None) for m, name in watched[1])

    def _entry_for(self, inputs: tuple) -> _Entry:
        sig = self._signature(inputs)
        entry = self._entries.get(sig)
        if entry is None:
            try:
                entry = self._build_entry(inputs)
            except (ScheduleMismatchError, ScheduleError) as e:
                reads = self._schedule.graph_summary.get("value_reads")
                if reads:  # this batch's branch: another batch of this signature may fit
                    raise type(e)(
                        f"{e}. The schedule's graph was captured for the branch its example "
                        f"took where the forward reads a tensor's value, at "
                        f"{'; '.join(reads)}: a batch that takes another branch there is "
                        f"another graph. Call the wrapped model with batches that take the "
                        f"example's branch, or profile and wrap one model per branch") from None
                entry = e
            self._entries[sig] = entry
        if isinstance(entry, Exception):
            raise type(entry)(str(entry))
        return entry

    def _build_entry(self, inputs: tuple) -> _Entry:
        schedule = self._schedule
        # Before profiling or planning: offload runs only with everything on CUDA.
        model = self._model
        units = fsdp_units_inside(model)
        if units:
            raise NotImplementedError(
                f"ScheduleWrapper: the wrapped model has FSDP2 units inside it ({units[:3]}"
                f"{' ...' if len(units) > 3 else ''}); the scheduled forward does not call their "
                f"all-gather and reshard hooks, so it runs only as FSDP2's root unit: "
                f"fully_shard(ScheduleWrapper(model, schedule)) with no fully_shard inside. "
                f"Per-block units are predicted by profile(..., fsdp=FSDPConfig(units=...)) for "
                f"plain FSDP2 only")
        check_offload_devices(schedule, self._given_graph,
                              [*model.parameters(), *model.buffers(),
                               *(x for x in inputs if isinstance(x, torch.Tensor))])
        graph = self._given_graph
        structure = graph is None or not _graph_fits(graph, inputs, model,
                                                     getattr(self, "_given_training", None))
        if structure:
            graph = self._profile_structure(inputs)
        self._given_graph = None  # only trusted for the call it was made for
        matched = self._match(graph, schedule, structure)
        if matched is None and cost_kind(graph.cost_provenance) == "analytical" \
                and cost_kind(schedule.cost_provenance) == "measured":
            # The meta device can capture another graph than the device the schedule was
            # measured on (the meta run imitates a GPU preset's kernel choices, and a fused
            # kernel's output layout or autocast's casts may differ): ask that device first.
            graph = self._profile_structure(inputs, measured=True)
            matched = self._match(graph, schedule, True)
        if matched is None:
            raise ScheduleMismatchError(
                f"ScheduleWrapper: the schedule was solved for another graph: "
                f"{graph.describe_difference(schedule.graph_summary)} (schedule fingerprint "
                f"{schedule.fingerprint}, this model and input {graph.fingerprint}; besides the "
                f"model, batch and shapes, the structure depends on which inputs and parameters "
                f"require grad, train/eval mode, autocast, leaf_modules and the values of the "
                f"Python attributes the forward reads, such as a flag or a dropout rate)"
                f"{_smaller_note(graph, schedule)}{self.__dict__.get('_changed', '')}; solve a "
                f"schedule for this model, batch and "
                f"input shape (monetlike.optimize does it in one call)")
        graph, schedule, source = matched
        # The gate (solver/verify.py): whatever the schedule records, it runs only if its
        # decisions, replayed on this call's graph, peak within the budget it was made for.
        schedule = verified(graph, schedule, budget=budget_limit(self._schedule), source=source)
        plan = build_plan(graph, schedule, self._traced(inputs))
        return _Entry(plan, ScheduledForward(plan, self._model))

    def _match(self, graph: OpGraph, schedule: Schedule, structure: bool):
        """(graph, schedule, what to call it) to verify and run when the schedule fits this
        call's graph as it is or rebound to a smaller shape (NOTE [Smaller shapes]); None when
        it is for another graph. A `structure` profile counts no optimizer state: the solved
        graph's is added, so the proof covers the step the budget did."""
        optimizer_bytes = getattr(self, "_optimizer_bytes", None)
        if graph.fingerprint == schedule.fingerprint:
            if structure:
                graph = _with_optimizer_state(graph, schedule, optimizer_bytes, required=False)
            return graph, schedule, f"ScheduleWrapper: {getattr(self, '_source', 'the schedule')}"
        if _same_but_smaller(graph, schedule):
            if budget_limit(schedule) is None:
                raise ScheduleMismatchError(
                    f"ScheduleWrapper: {getattr(self, '_source', 'the schedule')} was made for "
                    f"batch {schedule.graph_summary.get('batch')} input shapes "
                    f"{schedule.graph_summary.get('input_shapes')} and records no budget or "
                    f"peak, so it cannot be proven within one at the smaller batch "
                    f"{graph.batch} input shapes {graph.summary()['input_shapes']}; solve for "
                    f"this shape with monetlike.optimize(model, x, budget=...)")
            graph = _with_optimizer_state(graph, schedule, optimizer_bytes, required=True)
            return (graph, _rebind(graph, schedule),
                    f"ScheduleWrapper: {getattr(self, '_source', 'the schedule')} at input shapes "
                    f"{graph.summary()['input_shapes']}")
        return None

    def _exported(self, args: tuple = (), kwargs: dict | None = None) -> bool:
        """Whether this model runs through torch.export (capture "export", or "auto" where fx
        symbolic tracing fails or the call hands forward a container of tensors, as
        monetlike.capture decides for the profile)."""
        self._capture = resolve(self._model, args, kwargs, self._capture, self._traced)
        return self._capture == "export"

    def _traced(self, inputs: tuple | None = None):
        model = self._model
        if isinstance(inputs, FlatInputs):
            # Specialised to these shapes and constants: captured per input signature (the
            # plan built on it is cached with the signature).
            return shared_capture(model, ("export", self._signature(inputs)),
                                   lambda: export_graph(model, inputs))
        training: list = []
        structure: list = []
        module_flags(model, training, structure)
        # train/eval flags too: fx bakes a forward's own `self.training` in
        key = ("fx", tuple(map(repr, self._leaf_modules)), tuple(structure), tuple(training),
               self._python_state())
        if self._gm is None or key != self._gm_key:
            # object.__setattr__: a Module attribute would be registered in _modules, which is
            # the model's own dictionary.
            object.__setattr__(self, "_gm", shared_capture(
                model, key, lambda: trace(model, self._leaf_modules)))
            self._gm_key = key
        return self._gm

    def _profile_structure(self, inputs: tuple, *, measured: bool = False) -> OpGraph:
        """This call's graph, for the schedule's fingerprint and the gate's replay. A schedule
        measured on a device is replayed on the memory profiled there (nothing timed): the meta
        device imitates a GPU preset's kernels and holds other bytes (CPU dropout's float
        noise); an analytical schedule on the meta device's, which touches no real data."""
        tensors = example_of(inputs)
        # The Impls on offer depend on the device the schedule was profiled for (ImplSpec.devices).
        target = _impl_target(self._schedule.cost_provenance)
        options = dict(leaf_modules=self._leaf_modules, impl_target=target,
                       capture=self._capture, impls=self._structure_impls)
        autocast = torch.is_autocast_enabled("cpu") or (torch.cuda.is_available()
                                                        and torch.is_autocast_enabled("cuda"))
        on_meta = cost_kind(self._schedule.cost_provenance) != "measured"
        if not autocast and not measured and on_meta:
            try:
                return profile(self._model, tensors, cost="analytical:A100-40GB", **options)
            except Exception:  # data-dependent ops cannot run on meta; try for real below
                pass
        # Autocast does not apply to meta tensors: under autocast (or when the meta run failed)
        # the memory is profiled for real too (with the weight-cast cache off, as every profile:
        # NOTE [Autocast cache]).
        return profile_memory(self._model, tensors, **options)


# NOTE [The model checked every step]
# A model changed after the first step (a wider head, a swapped activation) would run the old
# plan: over budget, or wrong gradients. So each module's identity and type and each parameter's
# identity, shape, dtype and requires_grad are in the call's signature (a few attribute reads):
# a change is profiled again and runs or is refused naming what differs, as a new wrapper would.


# NOTE [Python attributes read in forward]
# A capture bakes a plain attribute the forward reads (`h * self.scale`, `if self.use_extra:`)
# into the graph. A loop that changes one between steps would run the old value, silently, so
# the modules' plain immutable attributes are in the call's signature: a change is captured and
# matched again (another branch is another structure: a clear ScheduleMismatchError).


def _resolve_leaf_modules(leaf_modules, model: torch.nn.Module) -> list:
    """Module names stay names; a 'package.module.Class' string (how the profiler records classes
    in OpGraph.meta) becomes that class when one of the model's own modules is an instance of a
    class of that qualified name, so subclasses are leaves too, as they were when profiled.
    Nothing is imported: a file's leaf_modules never chooses code to run (the caller's own
    classes may be passed as classes)."""
    own = {}
    for mod in model.modules():
        for cls in type(mod).__mro__:
            if issubclass(cls, torch.nn.Module):
                own.setdefault(f"{cls.__module__}.{cls.__qualname__}", cls)
    return [own.get(m, m) if isinstance(m, str) else m for m in leaf_modules]


def _same_but_smaller(graph: OpGraph, schedule: Schedule) -> bool:
    """The call's graph is the schedule's at a smaller batch or sequence length (NOTE [Smaller
    shapes]); raises ScheduleMismatchError when it is the same structure at a larger shape."""
    summary = schedule.graph_summary
    if summary.get("shape_free_fingerprint") != graph.shape_free_fingerprint:
        return False
    solved, now = summary.get("input_shapes"), graph.summary()["input_shapes"]
    if not isinstance(solved, list) or len(solved) != len(now) or any(
            not isinstance(a, list) or len(a) != len(b) for a, b in zip(solved, now)):
        return False
    larger = [(a, b) for a, b in zip(solved, now) if any(y > x for x, y in zip(a, b))]
    if larger:
        a, b = larger[0]
        raise ScheduleMismatchError(
            f"ScheduleWrapper: input shape {b} is larger than the {a} this schedule was solved "
            f"for (it runs any shape up to that one); solve for the larger shape with "
            f"monetlike.optimize(model, x, budget=...), or find the largest batch that fits the "
            f"budget with `monetlike maxbatch`")
    return True


def _smaller_note(graph: OpGraph, schedule: Schedule) -> str:
    """For a call smaller than the schedule's shape whose graph is not the same structure: why
    it is not run as smaller shapes are (NOTE [Smaller shapes]), and the loop's way out."""
    solved, now = schedule.graph_summary.get("input_shapes"), graph.summary()["input_shapes"]
    if not isinstance(solved, list) or len(solved) != len(now) or solved == now or any(
            not isinstance(a, list) or len(a) != len(b) or any(y > x for x, y in zip(a, b))
            for a, b in zip(solved, now)):
        return ""
    return ("; a smaller shape runs the schedule when the model's graph keeps its structure, and "
            "at this shape it does not (an op saves other tensors or becomes a view: a batch or "
            "sequence of one is the usual case); for the last partial batch of an epoch, "
            "DataLoader(drop_last=True) avoids it")


def _with_optimizer_state(graph: OpGraph, schedule: Schedule, optimizer_bytes: int | None, *,
                          required: bool) -> OpGraph:
    """solver.verify.with_recorded_optimizer_state; `required`: refuse a schedule that records
    none (a rebind must prove the whole step at the smaller shape)."""
    out = with_recorded_optimizer_state(graph, schedule, optimizer_bytes)
    if out is not None or not required:
        return graph if out is None else out
    raise ScheduleMismatchError(
        "ScheduleWrapper: this schedule does not record its optimizer state "
        "(graph_summary.optimizer_bytes; made by an older monetlike), so it cannot be proven "
        "within budget at a smaller shape; solve it again, or solve for this shape with "
        "monetlike.optimize(model, x, budget=...)")


def _rebind(graph: OpGraph, schedule: Schedule) -> Schedule:
    """The schedule's decisions on the smaller graph (ids correspond one to one), to be proven
    within the schedule's budget by the gate. Its recorded peak and time are left out: they
    were the larger shape's."""
    return dataclasses.replace(schedule, fingerprint=graph.fingerprint,
                               graph_summary=graph.summary(), predicted_peak_bytes=None,
                               predicted_time=None)


def _graph_fits(graph: OpGraph, inputs: tuple, model: torch.nn.Module,
                given_training: list | None) -> bool:
    """Whether the graph given to the wrapper is this call's: the same input shapes, dtypes and
    requires_grad, the same parameters requiring grad, autocast on or off as when it was
    profiled, and the train/eval flags the model had when it was wrapped (a parameter frozen, an
    input requiring grad or a submodule put in eval mode in between change the structure:
    profiled again, then matched or refused)."""
    summary = graph.summary()
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    if summary["input_shapes"] != [list(x.shape) for x in tensors] \
            or summary["input_dtypes"] != [str(x.dtype).replace("torch.", "") for x in tensors] \
            or summary.get("input_requires_grad", [x.requires_grad for x in tensors]) \
            != [x.requires_grad for x in tensors]:
        return False
    requires_grad = {n: p.requires_grad for n, p in model.named_parameters()}
    if any(n in requires_grad and requires_grad[n] != bool(rg) for n, _, _, rg in graph.params):
        return False
    # Autocast changes the Values' dtypes (a graph profiled without it, given to a call under
    # it, made a recomputation look for nodes the traced step does not have).
    if bool(graph.meta.get("autocast", False)) != rc.autocast_on():
        return False
    return given_training is None or given_training == _training_flags(model)


def _described(model: torch.nn.Module) -> list:
    """(qualified name, what it is) of every module and parameter: compared only when the
    per-step check saw a change, to name it (NOTE [The model checked every step])."""
    out = []
    for path, mod in model.named_modules(remove_duplicate=False):
        out.append((path or "(the model)", f"a {type(mod).__name__} (object {id(mod):#x})"))
        for name, p in mod._parameters.items():
            if p is not None:
                out.append((f"{path}.{name}" if path else name,
                            f"{'x'.join(map(str, p.shape)) or 'scalar'} {p.dtype} "
                            f"{'requires_grad' if p.requires_grad else 'frozen'} "
                            f"(object {id(p):#x})"))
    return out


def _first_change(old: list, new: list) -> str:
    """'; since an earlier step, module 5 was a GELU ..., now a Dropout ...' (or '')."""
    before, after = dict(old), dict(new)
    for name, what in new:
        if before.get(name) != what:
            was = before.get(name)
            return (f"; since an earlier step {name} " + (f"was {was}, now {what}" if was else
                                                          f"is new: {what}"))
    gone = [name for name, _ in old if name not in after]
    return f"; since an earlier step {gone[0]} is gone" if gone else ""


def _training_flags(model: torch.nn.Module) -> list:
    training: list = []
    module_flags(model, training, [])
    return training


def _impl_target(cost_provenance: str) -> str:
    """The device type a schedule's graph was profiled for: 'measured:cpu' -> 'cpu',
    'measured:cuda:0' -> 'cuda', 'analytical:<GPU preset>' (or unknown) -> 'cuda'."""
    device = cost_device(cost_provenance)
    return device.split(":")[0] if cost_kind(cost_provenance) == "measured" and device else "cuda"


def _disable_compile_of_the_step() -> None:
    """Give ScheduleWrapper its `_scheduled_step`: `_eager_scheduled_step` under
    torch.compiler.disable. Done when the first wrapper is made, not at import: the decorator
    imports torch._dynamo, 3 s that every `monetlike` command would pay (--help included)."""
    if "_scheduled_step" not in ScheduleWrapper.__dict__:
        ScheduleWrapper._scheduled_step = torch.compiler.disable(
            ScheduleWrapper._eager_scheduled_step)
