"""`monetlike.profile`: a model and an example batch in, a `solver.OpGraph` out.

The user's model is never touched: the measured profile runs on a `copy.deepcopy`, the analytical
one on a copy whose parameters and buffers live on the meta device (shapes and dtypes only, so a
ResNet-50 at batch 184 profiles in seconds on a laptop). The global RNG state is restored after.
The model is profiled in whatever train/eval mode it is in.

The structure, memory and saved-tensor facts come from one instrumented step (interpreter.py);
measured costs come from `repeat` further plain steps timed per Op (median), analytical ones from
a roofline over the aten ops of the instrumented step (costs.py). Everything but the costs is the
same for both, so both graphs have the same fingerprint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import copy
import sys
import time
import warnings
from typing import Any, Callable, Iterable, Mapping

import torch

from solver.graph import Impl, Op, OpGraph, Value
from solver.search.progress import phase

from ..capture.api import capture as capture_graph
from ..impls.registry import stashed_recompute_of
from ..capture.api import check_capture, split_example
from ..core import recompute as rc
from ..capture.trace import restore_rng, save_rng
from ..core.torch_private import tree_leaves, tree_map_only
from .costs import (CLOCKS, Roofline, Timer, check_clock, check_host_bandwidth,
                    measure_host_bandwidth, median, parse_cost)
from .fsdp import FSDPConfig, cast_for_mixed_precision, per_rank_graph
from .gpu_like import GpuLike
from .impl_timing import (alternatives_from, inplace_alternatives, measure_alternatives,
                          over_defaults, profile_rounds)
from .interpreter import ProfileRun
from .records import ProfileError, forward_interleaving, loss_fn_in_use
from .timing import TimingRun
from .memory import storage_of

__all__ = ["profile", "profile_memory", "OPTIMIZER_STATE_MULTIPLIER"]

# Optimizer state per trainable parameter byte: SGD keeps a momentum buffer, Adam two moments.
OPTIMIZER_STATE_MULTIPLIER = {"none": 0, "sgd": 1, "adam": 2, "adamw": 2}


def _optimizer_multiplier(optimizer: str | None) -> int:
    if optimizer is None:
        return 0
    if not isinstance(optimizer, str) or optimizer.lower() not in OPTIMIZER_STATE_MULTIPLIER:
        raise ValueError(f"optimizer: expected one of None, {', '.join(map(repr, OPTIMIZER_STATE_MULTIPLIER))}"
                         f", got {optimizer!r}")
    return OPTIMIZER_STATE_MULTIPLIER[optimizer.lower()]


def _as_inputs(example_inputs: Any) -> tuple[torch.Tensor, ...]:
    xs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
    if isinstance(xs, (tuple, list)) and xs and not all(isinstance(x, torch.Tensor) for x in xs):
        i, x = next((i, x) for i, x in enumerate(xs) if not isinstance(x, torch.Tensor))
        raise ValueError(f"example_inputs[{i}]: expected a tensor, got {type(x).__name__}; a "
                         f"forward taking a dict, tuple or other non-tensor argument is profiled "
                         f"from a mapping of its arguments by name "
                         f"(example_inputs={{'<argument>': value, ...}}, captured with "
                         f"torch.export), or pass its tensors as separate arguments")
    if not isinstance(xs, (tuple, list)) or not xs:
        raise ValueError(f"example_inputs: expected a tensor or a non-empty tuple of tensors, got "
                         f"{type(example_inputs).__name__}")
    if xs[0].dim() == 0:
        raise ValueError("example_inputs: the first input must have a batch dimension (dim 0), "
                         "got a 0-dim tensor")
    return tuple(xs)


def _unique_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        s = storage_of(t)
        if s is not None:
            seen.setdefault(s._cdata, int(s.nbytes()))
    return sum(seen.values())


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """Deep copy with parameters and buffers on the meta device, without copying their data."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if id(p) not in memo:
            memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"),
                                             requires_grad=p.requires_grad)
    for b in model.buffers():
        if id(b) not in memo:
            memo[id(b)] = torch.empty_like(b, device="meta")
    m = copy.deepcopy(model, memo)
    # Plain tensor attributes (not registered as parameters or buffers) follow to meta too, or
    # the meta run would mix devices.
    for mod in m.modules():
        for k, v in list(vars(mod).items()):
            if isinstance(v, torch.Tensor) and v.device.type != "meta":
                setattr(mod, k, v.to("meta"))
    return m


def _model_device(model: torch.nn.Module, inputs: tuple) -> torch.device:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return inputs[0].device


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"cuda:{dev.index if dev.index is not None else torch.cuda.current_device()}"
    return str(dev)


def progress_bar(total: int):
    """The profile's progress bar over `total` node runs (one per node per pass), or None when
    stderr is not a terminal. Looked up by `profile` at each call, so a caller can count the
    passes a profile makes by putting its own object with `update(n)` and `close()` here."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm(total=total, desc="monetlike profile", unit="node", leave=False)


# Casts are not cached, in the capture and in every step (NOTE [Autocast cache] in
# monetlike/core/recompute.py).
@rc.uncached_autocast()
def profile(model: torch.nn.Module, example_inputs: Any, *, cost: str = "measured",
            optimizer: str | None = None, repeat: int = 5,
            leaf_modules: Iterable = (), impls: bool = True,
            host_bandwidth: float | None = None, clock: str = "wall",
            impl_target: str | None = None, capture: str = "auto",
            loss_fn: Callable[[Any], torch.Tensor] | None = None,
            before_timing: Callable[[OpGraph], None] | None = None,
            fsdp: FSDPConfig | None = None) -> OpGraph:
    """Profile one training step of `model` on `example_inputs` into an OpGraph.

    cost: "measured" (median of `repeat` timings per Op on the model's device) or
        "analytical:<DEVICE>" (roofline on a preset GPU, run on the meta device; see
        monetlike.profile.costs.PRESETS).
    optimizer: None, "sgd" (momentum: 1x trainable parameter bytes of state) or "adam" (2x).
    leaf_modules: extra module names or classes to keep as single ops (see monetlike.capture.trace).
    impls: also measure the registered operator implementations (monetlike.impls) as extra
        Impls of the Ops they apply to. The runtime's structure check profiles with the default
        (True) unless it is given a graph whose Ops offer no Impl: a graph made with
        impls=False must be passed to ScheduleWrapper as `graph=`.
    host_bandwidth: bytes/s of the device<->host link, the cost of offloading a Value to host
        memory (OpGraph.host_bandwidth); None: measured on a CUDA device, the preset's nominal
        figure for analytical costs, and none for a measured CPU profile (so no offload).
    clock: for measured CPU costs, "wall" (the default) or "thread": the calling thread's CPU
        time, which other processes on a shared machine do not inflate; it needs
        torch.set_num_threads(1). Ignored for analytical costs.
    impl_target: the device type ('cpu' or 'cuda') whose Impl set to offer (ImplSpec.devices);
        None: the profile's own target (the measured device; a GPU for analytical costs).
    loss_fn: the training loss as a function of the model's output (a scalar tensor), e.g.
        `lambda out: F.cross_entropy(out, labels)`; None: the sum of the floating outputs.
        The step's memory depends on it: its backward hands the model a real output gradient
        (a sum's is an expanded scalar) and runs its own kernels first; a profile made with
        another loss can predict a peak the step exceeds. `meta["loss"]` records it. It runs
        on the profile's device: for analytical costs the output is on the meta device, so
        tensors it uses (labels) must be made on "meta" too or from the output.
    capture: "auto" (torch.fx symbolic tracing, torch.export when fx fails), "fx" or "export"
        (monetlike.capture); `meta["capture"]` records which one made the graph. A mapping of
        keyword inputs (a Hugging Face batch: input_ids, attention_mask, labels) is accepted as
        `example_inputs`.
    before_timing: called with the step's graph once its memory is profiled and before any
        step is timed (its costs all 0.0, provenance 'memory-only:<device>'), so that what
        depends on memory alone (is a budget feasible?) is answered first; it may raise to stop.
        For analytical costs it is called with the finished graph.
    fsdp: an FSDPConfig: the graph's memory is then one rank's under FSDP2 with those units
        (monetlike.profile.fsdp), and a budget solved on it is a per-rank peak. The model is
        the unsharded one; `meta["fsdp"]` records the config.
    """
    if fsdp is not None and not isinstance(fsdp, FSDPConfig):
        raise TypeError(f"fsdp: expected a monetlike.FSDPConfig, got {type(fsdp).__name__}")
    if fsdp is not None and fsdp.param_dtype is not None:
        return _profile_mixed_precision(
            model, example_inputs, fsdp, before_timing, cost=cost, optimizer=optimizer,
            repeat=repeat, leaf_modules=leaf_modules, impls=impls,
            host_bandwidth=host_bandwidth, clock=clock, impl_target=impl_target,
            capture=capture, loss_fn=loss_fn)
    kind, preset = parse_cost(cost)
    if host_bandwidth is not None:
        host_bandwidth = check_host_bandwidth(host_bandwidth)
    opt_mult = _optimizer_multiplier(optimizer)
    check_capture(capture)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    call_args, call_kwargs, inputs = _call_of(model, example_inputs)
    if kind == "measured" and (not isinstance(repeat, int) or repeat < 1):
        raise ValueError(f"repeat: expected an integer >= 1, got {repeat!r}")
    autocast = rc.autocast_on()
    if kind == "analytical" and autocast:
        # Meta tensors are not autocast: the graph would hold float32 Values where the step
        # runs bfloat16 or float16 ones (a hunted model's step peaked 28% over such a plan).
        raise ProfileError(
            f"cost={cost!r}: an analytical profile runs on the meta device, where "
            f"torch.autocast does not apply, so its graph would not be the autocast step's. "
            f"Profile under autocast with cost='measured' (on the device it trains on), or call "
            f"profile outside the autocast block if the model trains without it")
    leaf_modules = list(leaf_modules)
    t_start = time.perf_counter()
    batch = int(inputs[0].shape[0])
    rng = save_rng()
    try:
        work, to_input, device, note, clock = _working_copy(model, inputs, kind, clock)
        for p in work.parameters():
            p.grad = None  # a step starts from zero_grad(set_to_none=True)
        call_args, call_kwargs = tree_map_only(torch.Tensor, to_input, (call_args, call_kwargs))
        with phase("capture"):
            gm, xs = capture_graph(work, call_args, call_kwargs, mode=capture,
                                   leaf_modules=leaf_modules)
        xs = tuple(xs)
        measured = kind == "measured"
        n_nodes = len(gm.graph.nodes)
        bar = progress_bar(n_nodes * (1 + (repeat + 1 if measured else 0)))
        if host_bandwidth is None:
            host_bandwidth = _host_bandwidth(kind, preset, device)
        meta = {"torch_version": torch.__version__, "optimizer": optimizer,
                "device": _device_name(device) if measured else preset.name, "cost": cost,
                "repeat": repeat if measured else 0, "clock": clock if measured else None,
                "leaf_modules": _leaf_names(leaf_modules), "training": bool(model.training),
                "autocast": autocast, "capture": gm.meta["capture"], "loss": _loss_name(loss_fn),
                # NOTE [Data-dependent branches] (monetlike/capture/export_ops.py)
                **({"value_reads": gm.meta["value_reads"]} if gm.meta.get("value_reads") else {})}

        def assemble(fwd_times, bwd_times, alternatives, provenance) -> OpGraph:
            graph = _assemble(run, gm, work, model, xs, batch=batch, measured=measured,
                             fwd_times=fwd_times, bwd_times=bwd_times, opt_mult=opt_mult,
                             alternatives=alternatives, provenance=provenance,
                             host_bandwidth=host_bandwidth,
                             meta={**meta, "profile_seconds":
                                   round(time.perf_counter() - t_start, 3)})
            # under FSDP2 the memory is one rank's (the memory-only graph's too)
            return graph if fsdp is None else per_rank_graph(graph, model, fsdp,
                                                             optimizer_multiplier=opt_mult)

        try:
            with loss_fn_in_use(loss_fn):  # every run of the step ends with it
                # On meta, dropout and attention run the preset GPU's kernels (gpu_like.py).
                gpu_like = ((lambda: GpuLike(preset.compute_capability)) if kind == "analytical"
                            else contextlib.nullcontext)
                rc.warm()  # what a recomputation asks once, outside the measured steps
                with phase("memory"):
                    with torch.enable_grad(), gpu_like():
                        run = ProfileRun(gm, work, roofline=Roofline(preset) if preset else None,
                                         device_note=note, progress=bar, device=device)
                        run.profile_step(xs)
                    rounds = (profile_rounds(gm, work, xs, run, measured=measured, preset=preset,
                                             device=device, note=note, context=gpu_like,
                                             target=impl_target) if impls else [])
                if measured and before_timing is not None:
                    # Memory alone decides feasibility: answered before any step is timed.
                    memory_only = alternatives_from(run, rounds, None)
                    if impls:
                        _merge(memory_only, inplace_alternatives(gm, xs, run, measured=False,
                                                                 device=device, repeat=repeat))
                    before_timing(assemble({}, {}, memory_only,
                                           f"memory-only:{_device_name(device)}"))
                with phase("timing") if measured else contextlib.nullcontext():
                    fwd_times, bwd_times, alternatives = _timed(
                        gm, work, xs, run, rounds if impls else None, measured=measured,
                        preset=preset, device=device, repeat=repeat, note=note, clock=clock,
                        target=impl_target, context=gpu_like, bar=bar)
        finally:
            if bar is not None:
                bar.close()
        provenance = (f"measured:{_device_name(device)}" if measured
                      else f"analytical:{preset.name}")
        graph = assemble(fwd_times, bwd_times, alternatives, provenance)
        if not measured and before_timing is not None:
            before_timing(graph)  # nothing was timed
    finally:
        restore_rng(rng)
    return graph


class _MemoryKnown(Exception):
    def __init__(self, graph: OpGraph):
        super().__init__()
        self.graph = graph


def profile_memory(model: torch.nn.Module, example_inputs: Any, **kwargs) -> OpGraph:
    """The step's graph with its memory profiled on the model's device and nothing timed (costs
    0.0, provenance 'memory-only:<device>'): what a budget's feasibility and a schedule's peak
    depend on. `kwargs` as for `profile` (cost 'measured')."""
    def stop(graph: OpGraph) -> None:
        raise _MemoryKnown(graph)

    try:
        return profile(model, example_inputs, cost="measured", before_timing=stop, **kwargs)
    except _MemoryKnown as known:
        return known.graph


def _profile_mixed_precision(model, example_inputs, fsdp: FSDPConfig, before_timing,
                             **kwargs) -> OpGraph:
    """FSDP2's mixed precision computes in param_dtype, its forward inputs cast to it: the model
    is profiled so, and the graph made one rank's (the memory-only graph's too)."""
    def per_rank(graph: OpGraph) -> OpGraph:
        return per_rank_graph(graph, model, fsdp,
                              optimizer_multiplier=_optimizer_multiplier(kwargs["optimizer"]))

    low = tree_map_only(torch.Tensor, lambda t: t.to(fsdp.param_dtype)
                        if t.is_floating_point() else t, example_inputs)
    return per_rank(profile(
        cast_for_mixed_precision(model, fsdp.param_dtype), low, **kwargs,
        before_timing=None if before_timing is None else
        (lambda graph: before_timing(per_rank(graph)))))


def _call_of(model, example_inputs) -> tuple[tuple, dict, tuple]:
    """(positional inputs, keyword inputs, the tensors among them) of the example call."""
    if not isinstance(example_inputs, Mapping):
        inputs = _as_inputs(example_inputs)
        return inputs, {}, inputs
    call_args, call_kwargs = split_example(model, example_inputs)
    tensors = tuple(t for t in tree_leaves(call_kwargs) if isinstance(t, torch.Tensor))
    if not tensors:
        raise ValueError(f"example_inputs: the keyword inputs {sorted(call_kwargs)} hold no "
                         f"tensor; expected at least one (input_ids=..., pixel_values=...)")
    return call_args, call_kwargs, _as_inputs(tensors)


def _working_copy(model, inputs: tuple, kind: str, clock: str):
    """(the copy of the model the profile runs, how an input becomes its input, the device, a
    note for errors, the clock): a meta copy for analytical costs, a deep copy otherwise (the
    user's own model is never run)."""
    if kind == "analytical":
        device = torch.device("meta")
        if clock not in CLOCKS:
            check_clock(clock, device)  # raises: not a clock name
        if clock == "thread":
            warnings.warn("profile: clock='thread' is ignored for analytical costs (nothing "
                          "is timed)", UserWarning, stacklevel=3)
        return (meta_copy(model),
                lambda x: torch.empty_like(x, device="meta").requires_grad_(x.requires_grad),
                device, " on the meta device (analytical costs; where the op reads tensor "
                "values, as .item() or nonzero do, which meta tensors have not, use "
                "cost='measured')", clock)
    try:
        work = copy.deepcopy(model)
    except Exception as e:
        raise ProfileError(
            f"could not copy {type(model).__name__} with copy.deepcopy ({type(e).__name__}: "
            f"{e}); the profiler never runs the user's own model. Make the model "
            f"deep-copyable, or use cost='analytical:<DEVICE>'") from e
    device = _model_device(model, inputs)
    return (work, lambda x: x.detach().clone().requires_grad_(x.requires_grad), device, "",
            check_clock(clock, device))


def _loss_name(loss_fn) -> str:
    """The loss the peaks predicted hold for (a step ending with it), as meta["loss"] records it;
    the wrapper trusts a given graph only under the same loss, autocast and capture."""
    return ("sum of the outputs" if loss_fn is None
            else getattr(loss_fn, "__qualname__", repr(loss_fn)))


def _leaf_names(leaf_modules) -> list[str]:
    return [m if isinstance(m, str) else f"{m.__module__}.{m.__qualname__}"
            for m in leaf_modules]


def _timed(gm, work, xs, run: ProfileRun, rounds: list | None, *, measured: bool, preset, device,
           repeat: int, note: str, clock: str, target, context, bar):
    """(forward times, backward times, the Impls' alternatives) of the profiled Ops: timed steps
    when measured, and the registered Impls' own rounds (`rounds`; None: no Impls)."""
    fwd_times: dict[int, list[float]] = {}
    bwd_times: dict[int, list[float]] = {}
    alternatives: dict[int, list[dict]] = {}
    if measured:
        fwd_times, bwd_times = _time_steps(gm, work, xs, run, device, clock, repeat, bar)
    if rounds is not None:
        alternatives = measure_alternatives(
            gm, work, xs, run, measured=measured, preset=preset, device=device, repeat=repeat,
            note=note, clock=clock, target=target, context=context, rounds=rounds)
        _merge(alternatives, inplace_alternatives(gm, xs, run, measured=measured, device=device,
                                                  repeat=repeat, clock=clock))
        if measured:
            over_defaults(alternatives, fwd_times, bwd_times)
    return fwd_times, bwd_times, alternatives


def _merge(alternatives: dict, more: dict) -> None:
    for gid, alts in more.items():
        alternatives.setdefault(gid, []).extend(alts)


def _time_steps(gm, work, xs, run: ProfileRun, device, clock: str, repeat: int, bar
                ) -> tuple[dict[int, list[float]], dict[int, list[float]]]:
    """Per group, the forward and backward times of `repeat` plain timed steps."""
    for t in (*work.parameters(), *xs):
        t.grad = None  # as after the memory rounds' steps: a step from zero_grad
    fwd_times: dict[int, list[float]] = {}
    bwd_times: dict[int, list[float]] = {}
    with torch.enable_grad():
        timing = TimingRun(gm, run.node_gid, Timer(device, clock), progress=bar)
        timing.step(xs)  # warm-up without the instrumentation's overhead
        for _ in range(repeat):
            f, b = timing.step(xs)
            for gid in range(len(run.groups)):
                fwd_times.setdefault(gid, []).append(f.get(gid, 0.0))
                bwd_times.setdefault(gid, []).append(b.get(gid, 0.0))
    return fwd_times, bwd_times


def _assemble(run: ProfileRun, gm, work, model, xs, *, batch: int, measured: bool, fwd_times,
              bwd_times, opt_mult: int, alternatives: dict, provenance: str,
              host_bandwidth, meta: dict) -> OpGraph:
    """The OpGraph of a profiled step: the run's structure and memory, the given costs."""
    param_bytes = _unique_storage_bytes(list(work.parameters()) + list(work.buffers())
                                        + _get_attr_tensors(gm, work))
    trainable = _unique_storage_bytes(p for p in work.parameters() if p.requires_grad)
    graph = _build_graph(run, model_name=type(model).__name__, batch=batch, measured=measured,
                         fwd_times=fwd_times, bwd_times=bwd_times, param_bytes=param_bytes,
                         optimizer_bytes=opt_mult * trainable,
                         input_bytes=_unique_storage_bytes(xs), provenance=provenance,
                         alternatives=alternatives, host_bandwidth=host_bandwidth,
                         params=_param_records(model), meta=meta)
    return dataclasses.replace(graph, meta={**graph.meta, "op_modules": _op_modules(gm, graph)})


def _param_records(model: torch.nn.Module) -> tuple:
    """(name, shape, dtype, requires_grad) of each parameter and buffer: part of the graph's
    fingerprint (OpGraph.params), read from the user's model, which the profile leaves alone."""
    rows = [(name, tuple(t.shape), str(t.dtype).replace("torch.", ""), bool(t.requires_grad))
            for name, t in [*model.named_parameters(), *model.named_buffers()]]
    return tuple(rows)


def _host_bandwidth(kind: str, preset, device: torch.device) -> float | None:
    """The device<->host link when the caller gave none: the preset's figure, the link measured
    on a CUDA device, or None (a CPU has no such link: offload is unavailable)."""
    if kind == "analytical":
        return preset.host_bandwidth
    if device.type == "cuda" and torch.cuda.is_available():  # pragma: no cover - needs a GPU
        return measure_host_bandwidth(device)
    return None


def _get_attr_tensors(gm, work) -> list[torch.Tensor]:
    out = []
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            obj = gm
            try:
                for part in n.target.split("."):
                    obj = getattr(obj, part)
            except AttributeError:
                continue
            if isinstance(obj, torch.Tensor):
                out.append(obj)
    return out


def _inplace_in_order(run: ProfileRun, new_gid: dict, gid: int, alt: dict,
                      interleaved_reads: dict[int, set[int]]) -> bool:
    """An in-place Impl needs every other reader of the Value it overwrites before its Op in op
    order as well (the simulator's and the MILP's order; the fx order is checked when offered),
    an Op that holds it through its forward for an Op run inside it among them."""
    x = alt.get("overwrites")
    if x is None:
        return True
    readers = [r for _, r in run.readers.get(x, ())]
    readers += [r for r, tids in interleaved_reads.items() if x in tids]
    return all(new_gid[r] < new_gid[gid] for r in readers if r != gid)


def _op_modules(gm, graph: OpGraph) -> list[str]:
    """Per Op, the module path its first node runs in ('' at the top level): the block structure
    the solver's per-block checkpointing rule reads (solver/rules/segments.py). Not
    fingerprinted."""
    nodes = {n.name: n for n in gm.graph.nodes}
    out = []
    for op in graph.ops:
        node = nodes.get(op.nodes[0])
        stack = (node.meta.get("nn_module_stack") or {}) if node is not None else {}
        paths = [p for p, _ in stack.values()]
        if node is not None and node.op == "call_module":
            paths.append(str(node.target))
        out.append(paths[-1] if paths else "")
    return out


def _build_graph(run: ProfileRun, *, model_name: str, batch: int, measured: bool,
                 fwd_times: dict, bwd_times: dict, param_bytes: int, optimizer_bytes: int,
                 input_bytes: int, provenance: str, meta: dict,
                 alternatives: dict | None = None,
                 host_bandwidth: float | None = None, params: tuple = ()) -> OpGraph:
    order = run.topological_order()
    new_gid = {gid: i for i, gid in enumerate(order)}
    # Value ids: graph inputs first (placeholder order), then each Op's outputs in Op order.
    tids = [v.tid for v in run.values if v.producer is None]
    for gid in order:
        tids.extend(run.groups[gid].outputs)
    new_tid = {tid: i for i, tid in enumerate(tids)}
    values = []
    for tid in tids:
        v = run.values[tid]
        values.append(Value(id=new_tid[tid], name=v.name, index=v.index, shape=tuple(v.shape),
                            dtype=v.dtype, bytes=v.nbytes,
                            producer=None if v.producer is None else new_gid[v.producer],
                            requires_grad=v.requires_grad))
    interleaved_reads, workspace_floor = forward_interleaving(run.groups, run.values, new_gid)
    ops = []
    for gid in order:
        g = run.groups[gid]
        floor = workspace_floor.get(gid, 0)
        if measured:
            fwd = median(fwd_times.get(gid, []))
            bwd = median(bwd_times.get(gid, [])) if g.ran_backward else 0.0
        else:
            fwd, bwd = g.fwd_cost, (g.bwd_cost if g.ran_backward else 0.0)
        internal_bytes, fwd_workspace = g.forward_figures()
        cached = g.cached_casts_before or 0  # NOTE [Cached casts] in interpreter.py
        impl = Impl(name="default", saved=tuple(sorted(new_tid[t] for t in g.saved)),
                    internal_bytes=int(internal_bytes), fwd_time=float(fwd),
                    bwd_time=float(bwd), fwd_workspace=int(max(0, fwd_workspace, floor)) + cached,
                    bwd_workspace=int(max(0, g.bwd_peak - g.stage_start))
                    if g.ran_backward else 0,
                    recompute_workspace=int(max(0, g.recompute_workspace)),
                    early_release=tuple(sorted(new_tid[t] for t in g.early_release
                                               if t in g.saved)))
        # Registered operator implementations measured in their own steps (monetlike.impls).
        # The runtime recomputes an allocating Impl with the Op's own forward under no_grad
        # (the default's transient), an in-place one with its in-place kernel, which makes
        # nothing but its workspace, and, on the CPU, an Impl with a StashedRecompute from its
        # stash (dropout_mask from its held mask), whose scratch is measured here.
        def rerun_workspace(alt) -> int:
            if alt.get("overwrites") is not None:
                return int(alt["fwd_workspace"])
            outs = [run.values[t] for t in g.outputs]
            stashed = stashed_recompute_of(alt["name"])
            if stashed is not None and meta.get("device") == "cpu" and all(
                    stashed.applies(v.dtype, v.requires_grad) for v in outs):
                return stashed.scratch(tuple(outs[0].shape), outs[0].dtype)
            return impl.recompute_workspace

        extra = tuple(Impl(**{**alt, "fwd_workspace": max(int(alt["fwd_workspace"]), floor)
                              + cached,
                              "saved": tuple(sorted(new_tid[t] for t in alt["saved"])),
                              "early_release": tuple(sorted(
                                  new_tid[t] for t in alt.get("early_release", ()))),
                              **({"overwrites": new_tid[alt["overwrites"]]}
                                 if alt.get("overwrites") is not None else {}),
                              "recompute_workspace": rerun_workspace(alt)})
                      for alt in (alternatives or {}).get(gid, ())
                      if _inplace_in_order(run, new_gid, gid, alt, interleaved_reads))
        ops.append(Op(id=new_gid[gid], name=g.name, kind=g.kind, nodes=tuple(g.nodes),
                      inputs=tuple(new_tid[t] for t in g.inputs) + tuple(sorted(
                          new_tid[t] for t in interleaved_reads.get(gid, ()))),
                      outputs=tuple(new_tid[t] for t in g.outputs), impls=(impl,) + extra,
                      has_backward=bool(g.ran_backward),
                      recompute_unsafe="; ".join(g.unsafe) if g.unsafe else None))
    # Which Ops draw random numbers: the runtime replays the generator state for these alone.
    meta = {**meta, "random_ops": [new_gid[gid] for gid in order if run.groups[gid].random]}
    backward_order = tuple(new_gid[gid] for gid in run.backward_order)
    stage_grad = tuple(int(run.groups[gid].stage_start) for gid in run.backward_order)
    return OpGraph(model=model_name, batch=batch, values=tuple(values), ops=tuple(ops),
                   backward_order=backward_order, stage_grad_bytes=stage_grad,
                   final_grad_bytes=int(run.final_grad_bytes),
                   outputs=tuple(new_tid[t] for t in run.output_tids),
                   param_bytes=int(param_bytes), optimizer_bytes=int(optimizer_bytes),
                   input_bytes=int(input_bytes), cost_provenance=provenance, meta=meta,
                   host_bandwidth=host_bandwidth, params=params)
