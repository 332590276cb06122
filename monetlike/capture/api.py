"""Capture front ends: model and example inputs -> the GraphModule every other part refers to.

Two ways to turn a model into an fx graph, chosen by `capture=`:
- "fx": torch.fx symbolic tracing (monetlike.trace), module-level ops, no inputs needed;
- "export": torch.export.export(..., strict=False), then `ep.module()`: ATen-level ops (matmuls,
  softmax, dropout, layer norms, rotary embedding, scaled_dot_product_attention each their own
  node), which is what models written for today's libraries (Hugging Face transformers) need: fx
  cannot trace them (data-dependent Python, iteration over proxies);
- "auto" (the default): fx first, export when fx fails. `gm.meta["capture"]` says which was used;
  the profiler records it in `OpGraph.meta["capture"]` so the runtime captures the same way.

Under export, a custom autograd Function is one op with its own backward, a torch.library custom
op with a registered backward one op, and a branch on a tensor's value is captured for the real
example's branch with a check at every step (monetlike/capture/export_ops.py).

Both give the same contract: a GraphModule whose placeholders are the call's tensor inputs in a
fixed order (`CallSpec.flat`), whose get_attr targets are the model's own parameter and buffer
names (so the runtime fetches the user's live parameters: tied weights stay one parameter, an
optimizer built before wrapping keeps working), and whose outputs come back in the model's own
structure (a Hugging Face `ModelOutput` with `.loss` and `.logits`).

NOTE [Export inputs]
An exported graph is specialised to its example call: shapes are static and non-tensor inputs
(`use_cache=False`) are baked in. So the inputs are put in one canonical form first (every
argument by keyword, in the order of `forward`'s signature; extra `**kwargs` sorted by name):
the same call written positionally or with keywords in another order gives the same graph. The
non-tensor leaves are constants of the graph; `CallSpec.key` holds them, so a call with other
constants is another graph, never a silent reuse. Tensors given twice (`labels=input_ids`) are
captured as distinct inputs (export would fold them into one placeholder, and a later call with
distinct tensors would then read the wrong one).

NOTE [Contiguous is always recorded]
`Tensor.contiguous()` returns the tensor itself, before any dispatch, when it is already contiguous,
so a trace records the call only when it copies: whether a `contiguous` node exists depends on the
strides the example run produced, which depend on the device. scaled_dot_product_attention is the
case met: on the CPU (and CUDA) its fused kernels return the output in the query's memory layout,
so HF's `attn_output.transpose(1, 2).contiguous()` is a no-op there and is not traced, while the
meta device (analytical profiles) runs the math path, whose output is plain contiguous, so the
transpose is not and the call is traced. The profiler's graph (meta) then names a node the
runtime's trace (CPU) lacks. During export every `.contiguous()` call is routed to the ATen op
(`_RecordContiguous`), which is always recorded: the graph is the program as written on every
device, and the op still returns its input unchanged where that is already contiguous (the
profiler sees no new storage there, so it is no Op).
"""

from __future__ import annotations

import contextlib
import inspect
import re
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode

from ..core.torch_private import (PyTreeCodeGen, PyTreeInfo, exporting_with_real_values,
                                 tree_flatten, tree_unflatten)
from .export_ops import (FunctionsAsOps, ValueReads, inside_function, is_data_dependent,
                         name_guards)
from .trace import (TraceError, attributes_set, check_attributes_set,
                    check_norms_under_checkpoint, functions_applied, norms_under_checkpoint,
                    python_draw_error, python_draws, trace, user_frame_of)

__all__ = ["CAPTURES", "CallSpec", "FlatInputs", "call_spec", "capture", "check_capture",
           "example_of", "export_graph", "split_example"]

CAPTURES = ("auto", "fx", "export")


def check_capture(capture: str) -> str:
    if capture not in CAPTURES:
        raise ValueError(f"capture: expected one of {', '.join(map(repr, CAPTURES))}, got "
                         f"{capture!r}")
    return capture


@dataclass(frozen=True)
class CallSpec:
    """How a call's (args, kwargs) map to the graph's flat tensor inputs and back."""

    treespec: Any
    """pytree spec of the canonical (args, kwargs)."""
    consts: tuple
    """(leaf position, value) of each non-tensor leaf: constants of the exported graph."""
    n_leaves: int

    @property
    def key(self) -> tuple:
        """Hashable: equal for calls that give the same graph up to tensor shapes."""
        return (str(self.treespec), tuple((i, repr(v)) for i, v in self.consts))

    def rebuild(self, tensors: Iterable) -> tuple[tuple, dict]:
        """(args, kwargs) from the flat tensors (in `flat` order) and the constants."""
        it = iter(tensors)
        consts = dict(self.consts)
        leaves = [consts[i] if i in consts else next(it) for i in range(self.n_leaves)]
        return tree_unflatten(leaves, self.treespec)


class FlatInputs(tuple):
    """The graph's tensor inputs in placeholder order, with the CallSpec they came from."""

    spec: CallSpec

    def __new__(cls, tensors: Iterable, spec: CallSpec):
        self = super().__new__(cls, tuple(tensors))
        self.spec = spec
        return self


def _canonical(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """NOTE [Export inputs]: every argument by keyword, in the signature's order."""
    try:
        sig = inspect.signature(model.forward)
        bound = sig.bind(*args, **kwargs)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{type(model).__name__}.forward does not accept these inputs: {e}") \
            from None
    pos: tuple = ()
    out: dict = {}
    for name, p in sig.parameters.items():
        if name not in bound.arguments:
            continue
        v = bound.arguments[name]
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            # Keywords cannot follow *args' values: keep the call positional as written.
            return tuple(args), dict(kwargs)
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            for k in sorted(v):
                out[k] = v[k]
        elif p.kind is inspect.Parameter.POSITIONAL_ONLY:
            pos += (v,)
        else:
            out[name] = v
    return pos, out


def call_spec(model: torch.nn.Module, args: tuple, kwargs: dict) -> FlatInputs:
    """The call's tensor leaves in graph order (canonical form, NOTE [Export inputs])."""
    cargs, ckwargs = _canonical(model, tuple(args), dict(kwargs))
    leaves, treespec = tree_flatten((cargs, ckwargs))
    tensors, consts = [], []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
        else:
            consts.append((i, leaf))
    if not tensors:
        raise ValueError(f"{type(model).__name__}: the call has no tensor inputs; expected at "
                         f"least one (input_ids, pixel_values, x, ...)")
    return FlatInputs(tensors, CallSpec(treespec, tuple(consts), len(leaves)))


def example_of(inputs: tuple) -> Any:
    """The example `monetlike.profile` takes for a call given as the runtime's inputs: the flat
    tuple itself (fx), or the keyword mapping it came from (export)."""
    if not isinstance(inputs, FlatInputs):
        return tuple(inputs)
    args, kwargs = inputs.spec.rebuild(inputs)
    if not args:
        return kwargs
    if not kwargs:
        return tuple(args)
    raise NotImplementedError(
        f"monetlike.capture: the wrapper profiles the model's structure again for a call with "
        f"new shapes or constants, from the call's own inputs; this call passes some by "
        f"position ({len(args)}, e.g. *args) and some by name ({', '.join(sorted(kwargs))}), "
        f"which monetlike.profile cannot take together yet. Call the model with its inputs all "
        f"by position or all by name")


def split_example(model: torch.nn.Module, example_inputs: Any) -> tuple[tuple, dict]:
    """A tensor, a tuple or list of positional inputs, or a mapping of keyword inputs (a Hugging
    Face batch: input_ids, attention_mask, labels) -> (args, kwargs)."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, Mapping):
        bad = [k for k in example_inputs if not isinstance(k, str)]
        if bad:
            raise ValueError(f"example_inputs: keyword inputs need str keys, got {bad[:3]!r}")
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)) and example_inputs:
        return tuple(example_inputs), {}
    raise ValueError(f"example_inputs: expected a tensor, a non-empty tuple of positional inputs "
                     f"or a mapping of keyword inputs (input_ids=..., labels=...), got "
                     f"{type(example_inputs).__name__}")


def _distinct(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """NOTE [Export inputs]: a tensor given twice becomes two tensors for the capture."""
    seen: set = set()
    out = []
    for t in tensors:
        key = id(t)
        try:
            key = t.untyped_storage()._cdata if t.device.type != "meta" else id(t)
        except (RuntimeError, NotImplementedError):
            pass
        out.append(t.clone() if key in seen else t)
        seen.add(key)
    return out


def export_error(model: torch.nn.Module, e: Exception) -> TraceError:
    """What cannot be exported, named, with the ways out."""
    name = type(model).__name__
    text = f"{type(e).__name__}: {e}".strip()
    first = text.splitlines()[0][:400]
    low = text.lower()
    if "dynamicoutputshape" in low:
        op = re.search(r"DynamicOutputShapeException: (\S+)", text)
        what = (f"an op whose output's shape depends on its inputs' values "
                f"({op.group(1) if op else 'named above'}), which torch.export cannot trace, "
                f"even from the real example")
        fix = ("leave out the input that leads there (labels: compute the loss outside the "
               "model from its outputs), or capture the model with torch.fx (capture='fx') "
               "with the module that calls it made a leaf (leaf_modules=[...])")
    elif is_data_dependent(e):
        what = ("Python control flow or a shape that depends on tensor values (an `if` on a "
                "tensor, .item(), .nonzero(), boolean-mask indexing)")
        fix = ("profile with measured costs on the real example (cost='measured': the graph "
               "then holds for the branch the example takes, and a batch that takes another is "
               "refused at that line), or "
               "write it without the branch (torch.where, masks of fixed shape), or mark the "
               "value with torch._check, or profile with capture='fx' if fx can trace the "
               "model; where that line is a library's (a model's own loss), leave out the input "
               "that leads there (labels) and compute that part outside the model")
    elif "use_cache" in low or "cache_utils" in low or "cache" in name.lower():
        what = "a key-value cache object in the outputs"
        fix = "call the model with use_cache=False (training does not need the cache)"
    else:
        what = "a construct torch.export cannot capture"
        fix = ("see the torch.export message above; models of torch.nn modules may trace with "
               "capture='fx' (make the offending module a leaf with leaf_modules=[...])")
    where = user_frame_of(e)
    at = f" At {where}." if where else ""
    return TraceError(f"torch.export.export(strict=False) could not capture {name}: {first}."
                      f"{at} The construct: {what}. Way out: {fix}")


# NOTE [Custom autograd Functions under export] and NOTE [Data-dependent branches]: in
# monetlike/capture/export_ops.py.
# NOTE [Gradient hooks under export]
# A hook registered on a tensor in forward (`h.register_hook(lambda g: 3 * g)`) changes the
# gradient autograd computes; torch.export records ops, not hooks, so the exported graph would
# run without it (tested on torch 2.14: every gradient upstream of the hook wrong, silently).
# fx refuses such a model (the hook is registered on a proxy). Calls are recorded while exporting
# and a graph that had one is refused.
_GRADIENT_HOOKS = (torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook)


class _RecordContiguous(TorchFunctionMode):
    """NOTE [Contiguous is always recorded]: `x.contiguous()` as the ATen op, traced whatever
    the strides; and the gradient hooks registered, in `hooks` (NOTE [Gradient hooks under
    export])."""

    def __init__(self):
        super().__init__()
        self.hooks: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.contiguous:
            return torch.ops.aten.contiguous.default(*args, **(kwargs or {}))
        if func in _GRADIENT_HOOKS:
            self.hooks.append(func.__name__)
        return func(*args, **(kwargs or {}))


_READS_VALUES: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def export_graph(model: torch.nn.Module, flat: FlatInputs) -> fx.GraphModule:
    """`model` captured with torch.export (non-strict) on the call `flat` describes."""
    args, kwargs = flat.spec.rebuild(_distinct(flat))
    reads = ValueReads()  # NOTE [Data-dependent branches]
    real = all(t.device.type != "meta" for t in flat)
    gm = None
    try:
        gm = _export(model, args, kwargs, reads, real_values=real and model in _READS_VALUES)
    except TraceError as e:
        if not (real and is_data_dependent(e)) or model in _READS_VALUES:
            raise
    if gm is None:  # real tensors hold the values export asked for (outside the `except`: an
        # error here is its own, not chained to the first's line)
        reads.lines.clear()
        gm = _export(model, args, kwargs, reads, real_values=True)
        _READS_VALUES.add(model)  # its next capture (a wrapper's per input signature) goes here
    gm.meta["value_reads"] = name_guards(gm, type(model).__name__, reads.lines)
    _flatten_signature(gm, flat.spec)
    gm.meta["capture"] = "export"
    return gm


def _export(model: torch.nn.Module, args: tuple, kwargs: dict, reads: ValueReads, *,
            real_values: bool) -> fx.GraphModule:
    rng = torch.get_rng_state()
    functions = FunctionsAsOps()  # NOTE [Custom autograd Functions under export]
    recorder = _RecordContiguous()
    values = exporting_with_real_values() if real_values else contextlib.nullcontext()
    try:
        with recorder, reads, functions_applied(functions.hook), values, \
                attributes_set(model, inside_function) as written, \
                norms_under_checkpoint(model) as (norms, _), \
                python_draws() as drawn:
            ep = torch.export.export(model, args, kwargs, strict=False)
        gm = ep.module()
        functions.finish(gm)
    except TraceError:
        raise
    except Exception as e:
        raise export_error(model, e) from e
    finally:
        functions.close()
        torch.set_rng_state(rng)  # capturing must not move the user's random stream
    if drawn:
        raise python_draw_error(type(model).__name__, "torch.export.export(strict=False)", drawn)
    check_attributes_set(model, written, "torch.export.export(strict=False)")
    check_norms_under_checkpoint(model, norms, "torch.export.export(strict=False)")
    if recorder.hooks:
        raise TraceError(
            f"torch.export.export(strict=False) could not capture {type(model).__name__} "
            f"faithfully: its forward registers a gradient hook on a tensor "
            f"(Tensor.{recorder.hooks[0]}), which changes the gradients; an exported graph runs "
            f"without it, so they would not be plain PyTorch's. Way out: capture the model with "
            f"torch.fx (capture='fx') with the module that registers the hook made a leaf "
            f"(leaf_modules=[<its name or class>]), so that it runs as one op, hook included")
    return gm


def _flatten_signature(gm: fx.GraphModule, spec: CallSpec) -> None:
    """Placeholders: the tensor inputs only, in `FlatInputs` order; outputs keep their structure.

    ep.module() checks its inputs with a `_guards_fn` module (static shapes, constants): the
    runtime checks the whole graph's fingerprint per input signature instead, and the CallSpec's
    key covers the constants. Non-tensor placeholders become the constants they were captured
    with."""
    graph = gm.graph
    for n in list(graph.nodes):
        if n.op == "call_module" and n.target == "_guards_fn":
            graph.erase_node(n)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    # ep.module() also checks its inputs against the export's input spec in a forward pre-hook;
    # the spec changes below, and the fingerprint check replaces it.
    for k, hook in list(gm._forward_pre_hooks.items()):
        if "input_constraints" in getattr(hook, "__name__", ""):
            del gm._forward_pre_hooks[k]
            gm._forward_pre_hooks_with_kwargs.pop(k, None)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != spec.n_leaves:
        raise TraceError(f"torch.export gave {len(placeholders)} inputs for a call of "
                         f"{spec.n_leaves} leaves; this is a bug in monetlike.capture")
    consts = dict(spec.consts)
    names = []
    for i, n in enumerate(placeholders):
        if i in consts:
            c = consts[i]
            for user in list(n.users):
                user.args = fx.node.map_arg(user.args, lambda a, n=n, c=c: c if a is n else a)
                user.kwargs = fx.node.map_arg(user.kwargs, lambda a, n=n, c=c: c if a is n else a)
            graph.erase_node(n)
        else:
            names.append(n.name)
    old = graph._codegen
    out_spec = old.pytree_info.out_spec if isinstance(old, PyTreeCodeGen) else None
    in_spec = tree_flatten(tuple(range(len(names))))[1]
    graph._codegen = PyTreeCodeGen(PyTreeInfo(names, in_spec, out_spec))
    gm._in_spec = in_spec
    gm.recompile()


def capture(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *,
            mode: str = "auto", leaf_modules: Iterable = ()) -> tuple[fx.GraphModule, tuple]:
    """(GraphModule, its inputs in placeholder order) for `model(*args, **kwargs)`.

    The inputs returned are the caller's own objects (no copies). `gm.meta["capture"]` is "fx" or
    "export"."""
    check_capture(mode)
    kwargs = dict(kwargs or {})
    fx_error = None
    if mode in ("auto", "fx"):
        try:
            gm, inputs = fx_attempt(model, args, kwargs, lambda: trace(model, leaf_modules))
        except TraceError as e:
            if mode == "fx":
                raise
            fx_error = e
        else:
            gm.meta["capture"] = "fx"
            return gm, inputs
    leaf_modules = list(leaf_modules)
    if leaf_modules:
        raise ValueError(f"leaf_modules={leaf_modules!r}: leaves are a torch.fx notion; "
                         f"torch.export captures every module at ATen level (capture='export'"
                         f"{' was chosen because fx failed: ' + str(fx_error) if fx_error else ''})")
    flat = call_spec(model, args, kwargs)
    try:
        gm = export_graph(model, flat)
    except TraceError as e:
        if fx_error is not None:
            raise TraceError(f"{e} (torch.fx before it: {fx_error})") from e
        raise
    return gm, flat


def resolve(model, args: tuple, kwargs: dict | None, mode: str,
            traced: Callable[[], fx.GraphModule]) -> str:
    """The capture that runs this call, "fx" or "export": `mode` itself, or for "auto" fx where
    torch.fx traces the model (`traced()`) and the call hands forward only tensors, export
    otherwise. A call forward does not accept resolves to fx, whose binding reports it."""
    check_capture(mode)
    if mode != "auto":
        return mode
    try:
        fx_attempt(model, args, kwargs or {}, traced)
    except TraceError:
        return "export"
    except TypeError:
        return "fx"
    return "fx"


def fx_attempt(model, args: tuple, kwargs: dict,
               traced: Callable[[], fx.GraphModule]) -> tuple[fx.GraphModule, tuple]:
    """(fx graph, its inputs) for the call; TraceError where fx cannot capture it: the trace
    fails, or an input is a container holding tensors or a non-tensor (the rule "auto" follows,
    for the profile and the runtime alike)."""
    gm = traced()
    return gm, flat_fx_inputs(model, gm, args, kwargs)


def placeholder_names(gm: fx.GraphModule) -> list[str]:
    return [n.target for n in gm.graph.nodes if n.op == "placeholder"]


def flat_fx_inputs(model, gm: fx.GraphModule, args: tuple, kwargs: dict) -> tuple:
    """bind_inputs, where none is a container holding tensors or a non-tensor; TraceError
    otherwise."""
    names = placeholder_names(gm)
    inputs = bind_inputs(model, names, args, kwargs)
    nested = [f"'{name}' (a {type(x).__name__})" for name, x in zip(names, inputs)
              if not isinstance(x, torch.Tensor)
              and any(isinstance(t, torch.Tensor) for t in tree_flatten(x)[0])]
    if nested:
        # fx takes a dict or tuple of tensors as one placeholder, which the profiler and the
        # runtime cannot follow (their placeholders are tensors); export flattens it.
        raise TraceError(
            f"could not capture {type(model).__name__} with torch.fx: its input"
            f"{'s' if len(nested) > 1 else ''} {', '.join(nested)} hold tensors inside a "
            f"container, and an fx graph takes a container as one input, not its tensors; "
            f"capture it with torch.export (capture='export' or 'auto', which flatten the "
            f"container), or pass the tensors as separate arguments of forward")
    plain = [f"'{name}' ({x!r})" for name, x in zip(names, inputs)
             if not isinstance(x, torch.Tensor)]
    if plain:
        # fx traced every argument of forward as a tensor Proxy: code that tests one
        # (`if mask is not None`) took the tensor's branch. Export specializes the graph to the
        # call's values instead (and the runtime checks that a call passes the same).
        raise TraceError(
            f"could not capture {type(model).__name__} with torch.fx: the call passes "
            f"{', '.join(plain)}, not a tensor, for an argument of forward that torch.fx traced "
            f"as a tensor input (Python code testing it, such as `if mask is not None`, took "
            f"the tensor's branch); capture it with torch.export (capture='export' or 'auto'), "
            f"which builds the graph for these values, or pass tensors only")
    return inputs


def bind_inputs(model, names: list[str], args: tuple, kwargs: dict) -> tuple:
    """The fx graph's placeholders (`names`) filled from a call (keywords bound by the
    signature)."""
    if not kwargs and len(args) == len(names):
        return tuple(args)
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{type(model).__name__}.forward does not accept these inputs: {e}") \
            from None
    bound.apply_defaults()
    return tuple(bound.arguments[n] for n in names)
