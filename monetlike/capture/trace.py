"""Model -> torch.fx GraphModule, at module granularity: the graph every other part refers to.

The profiler names Ops after fx nodes and the runtime finds them again by those names, so both
must trace the same way: call `trace(model, leaf_modules)` with the same arguments (the profiler
records them in `OpGraph.meta["leaf_modules"]`, classes as "package.module.Class" strings, which
`trace` accepts back).

Leaves are the `torch.nn` modules (fx's default: conv, bn, relu, linear, ...), any module the
caller names, and any module with forward hooks or forward pre-hooks: tracing through such a module
would run its hooks once on fx proxies at trace time and then never again, so it is kept whole and
its hooks run for real (and its Op is marked recompute-unsafe).

Things a forward can do that symbolic tracing runs but does not record are refused with a
TraceError (so that `capture="auto"` captures with torch.export, which records them), never
traced into a graph that computes something else (NOTE [What fx does not record]); Python
attributes the forward sets are refused by both captures (NOTE [Python state set in forward]):
- ops inside a `torch.no_grad()` / `torch.enable_grad()` / `torch.autocast(...)` block: the
  mode is set while tracing, not in the graph, which would then give them gradients (or dtypes)
  plain PyTorch does not;
- in-place updates of the model's own buffers and parameters outside its leaf modules (a step
  counter, `self.steps += 1`): fx does not proxy buffers, so the update runs once, on the real
  tensor, at trace time, and never again; the buffers are restored to their values before it;
- an augmented assignment (`h += y`) on a tensor another name still refers to (`r = h`, a view
  `half = h[:, :8]`, a list `[h]`, a model input): fx's proxies have no `__iadd__`, so Python
  computes `h + y` out of place and the other name keeps the old contents, where plain
  PyTorch writes into the one tensor they share (NOTE [Augmented assignment]);
- a draw from Python's own generators (`random`, numpy's global one: LayerDrop's `if
  random.random() < p`), refused by both captures (`python_draws`): its outcome would be kept.

When symbolic tracing fails we raise TraceError naming the module being traced, the user code line
and the ways out. `monetlike.capture` falls back to torch.export (non-strict) in that case when
`capture="auto"` (the profiler's default).
"""

from __future__ import annotations

import contextlib
import os
import traceback
from typing import Callable, Iterable

import torch
import torch.fx as fx
from torch.nn.utils.parametrize import is_parametrized

from solver.errors import MonetlikeError

from ..core.torch_private import (BatchNormBase, InstanceNormBase, checkpoint_hook_class,
                            derived_from_parameters, parametrize_cache_on, tree_leaves)
from ..core.modules import has_forward_hooks

__all__ = ["TraceError", "MonetTracer", "trace"]

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class TraceError(MonetlikeError, RuntimeError):
    """The model could not be turned into a torch.fx graph."""


class MonetTracer(fx.Tracer):
    """fx.Tracer with extra leaves: named modules, module types, and modules with forward hooks."""

    def __init__(self, leaf_modules: Iterable = ()):
        super().__init__()
        self.modes = _modes()
        leaf_modules = list(leaf_modules)
        self.leaf_names = {m for m in leaf_modules if isinstance(m, str)}
        self.leaf_types = tuple(m for m in leaf_modules if isinstance(m, type))
        bad = [m for m in leaf_modules if not isinstance(m, (str, type))]
        if bad:
            raise TypeError(f"leaf_modules: expected qualified module names (str) or module "
                            f"classes, got {bad!r}")

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaf_names or (self.leaf_types
                                                        and isinstance(m, self.leaf_types)):
            return True
        # A string may also name a class as "package.module.Class" (how OpGraph.meta records
        # class leaves), so a graph's leaf_modules can be passed back to trace().
        if self.leaf_names and f"{type(m).__module__}.{type(m).__qualname__}" in self.leaf_names:
            return True
        if has_forward_hooks(m):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    # NOTE [Norms under checkpoint]: told of every module call while tracing.
    on_module_call: Callable[[torch.nn.Module], None] | None = None

    def call_module(self, m, forward, args, kwargs):
        if self.on_module_call is not None:
            self.on_module_call(m)
        if parametrize_cache_on() and is_parametrized(m) \
                and self.is_leaf_module(m, self.path_of_module(m)):
            # NOTE [Cached parametrizations]
            self.cached_leaves.append(self.path_of_module(m))
        return super().call_module(m, forward, args, kwargs)

    def trace(self, root, concrete_args=None):
        self.cached_leaves: list[str] = []
        self.augmented: list[tuple[fx.Node, fx.Node, str]] = []  # (new node, target, operator)
        self.modes = _modes()  # the grad and autocast modes the forward starts in
        with functions_applied(self._function_as_op):
            return super().trace(root, concrete_args)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _AugmentedProxy(node, self)

    def _function_as_op(self, cls, args, kwargs):
        """NOTE [Custom autograd Functions]: a Function applied to proxies is one node."""
        if not any(isinstance(a, fx.Proxy) for a in tree_leaves((args, kwargs))):
            return None
        return self.create_proxy("call_function", function_op(cls), args, kwargs)

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        now = _modes()
        if now != self.modes and kind not in ("placeholder", "output", "get_attr"):
            raise _NotRecorded(
                f"an op traced under {_describe_modes(now)} while the forward started under "
                f"{_describe_modes(self.modes)} (a torch.no_grad(), torch.enable_grad(), "
                f"torch.set_grad_enabled or torch.autocast block in forward): torch.fx records "
                f"no grad or autocast mode, so the graph would run that op as if the block were "
                f"not there")
        return super().create_node(kind, target, args, kwargs, name, type_expr)


# NOTE [Augmented assignment]
# `h += y` calls h.__iadd__(y) when h's type has one, else h = h + y. A tensor has one and adds in
# place: every name for the tensor (`r = h`, a view `half = h[:, :8]`, a list `[h]`, the caller's
# input) sees the sum. fx's Proxy has none, so the traced graph adds out of place and those names
# keep the old contents: the graph computes another function than the model (wrong outputs and
# gradients, silently, under every schedule). Where nothing else refers to h (torchvision's
# ResNet: `out += identity`) the two agree, and fx's graph is kept. So the tracer's proxies
# record each augmented assignment (`_AugmentedProxy`), still traced out of place, and `trace`
# refuses the graph when the old tensor, or a view of it or a tensor it is a view of, is read
# after the assignment, or is a model input; capture="auto" then takes torch.export, which
# records the in-place op.
_AUGMENTED = {"iadd": ("add", "+="), "isub": ("sub", "-="), "imul": ("mul", "*="),
              "itruediv": ("truediv", "/="), "ifloordiv": ("floordiv", "//="),
              "imod": ("mod", "%="), "ipow": ("pow", "**="), "imatmul": ("matmul", "@="),
              "iand": ("and", "&="), "ior": ("or", "|="), "ixor": ("xor", "^="),
              "ilshift": ("lshift", "<<="), "irshift": ("rshift", ">>=")}
# Nodes whose result may share the storage of their first argument (views, and methods that
# return the tensor itself when nothing needs to change).
_ALIASING = {"view", "view_as", "reshape", "reshape_as", "transpose", "swapaxes", "swapdims",
             "permute", "t", "narrow", "select", "unsqueeze", "squeeze", "flatten",
             "unflatten", "expand", "expand_as", "as_strided", "chunk", "split",
             "tensor_split", "unbind", "movedim", "moveaxis", "diagonal", "unfold", "real",
             "imag", "contiguous", "to", "type", "type_as", "float", "double", "half",
             "bfloat16", "cpu", "cuda", "detach", "requires_grad_", "view_as_real",
             "view_as_complex", "getitem", "__getitem__", "split_with_sizes", "hsplit",
             "vsplit", "dsplit", "T", "mT", "H", "mH", "align_as", "rename", "refine_names"}


class _AugmentedProxy(fx.Proxy):
    """NOTE [Augmented assignment]: `h op= y` traced as `h op y`, and recorded."""


def _augmented(op: str, method: str):
    def apply(self, other):
        out = getattr(self, f"__{method}__")(other)
        if isinstance(out, fx.Proxy):
            self.tracer.augmented.append((out.node, self.node, op))
        return out
    apply.__name__ = f"__{op}__"
    return apply


for _op, (_method, _) in _AUGMENTED.items():
    setattr(_AugmentedProxy, f"__{_op}__", _augmented(_op, _method))


def _target_name(n: fx.Node) -> str:
    """A call node's method or function name ('view', 'getitem', 'index_add_')."""
    return n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")


def _aliasing(n: fx.Node) -> bool:
    if n.op not in ("call_method", "call_function") or not n.args:
        return False
    return _target_name(n) in _ALIASING


def _aliases(target: fx.Node) -> set[fx.Node]:
    """The nodes that may share `target`'s storage: the tensors it is a view of, and every view
    of those (through _ALIASING nodes)."""
    base = target
    while _aliasing(base) and isinstance(base.args[0], fx.Node):
        base = base.args[0]
    found, stack = {base}, [base]
    while stack:
        for u in stack.pop().users:
            if u not in found and _aliasing(u) and u.args[0] in found:
                found.add(u)
                stack.append(u)
    return found


def _written_constant(graph: fx.Graph) -> str | None:
    """A description of the first tensor fx made a graph constant (made in forward from
    constant sizes: `torch.zeros(4, 32)`) that the graph writes in place, or None. fx runs the
    factory once, at trace time, so every step would write into the same tensor (a segment-sum
    accumulator summing over all the steps); torch.export makes it afresh per call."""
    for n in graph.nodes:
        if n.op != "get_attr" or not str(n.target).startswith("_tensor_constant"):
            continue
        for a in _aliases(n):
            for u in a.users:
                name = _target_name(u)
                writes = (u.op in ("call_method", "call_function") and u.args and u.args[0] is a
                          and (name == "setitem" or (name.endswith("_")
                                                     and not name.endswith("__"))))
                if writes:
                    return f"node {u.name} ({name}) writes into it in place"
    return None


def _aliased_assignment(graph: fx.Graph, augmented: list) -> str | None:
    """A description of the first augmented assignment whose old tensor is read afterwards
    (NOTE [Augmented assignment]), or None."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for new, target, op in augmented:
        what = f"`{target.name} {_AUGMENTED[op][1]} ...` (node {new.name})"
        if target.op == "placeholder":
            return (f"{what} writes into the model input {target.name!r} in plain PyTorch, "
                    f"which the traced graph would leave unchanged")
        for a in _aliases(target):
            late = [u for u in a.users if u is not new and order[u] > order[new]]
            if late:
                via = "it" if a is target else f"{a.name}, which shares its storage,"
                return (f"{what}: {via} is read afterwards by {late[0].name}, which in plain "
                        f"PyTorch sees the updated contents and in the traced graph the old ones")
    return None


# NOTE [What fx does not record]
# Symbolic tracing runs the forward's Python once with proxies; everything that is not an op on
# a proxy happens once, at trace time, and is not in the graph. Two such things change what the
# model computes: the grad and autocast modes (a context manager sets them while tracing: ops in
# a no_grad block would get gradients in the graph), and in-place updates of real tensors the
# model holds (fx proxies parameters, not buffers: `self.steps += 1` adds to the real buffer
# during the trace and never again), and random numbers drawn outside the traced ops
# (`torch.randn(4, 32)` has no proxy argument: fx runs it once and keeps the tensor as a constant,
# the same noise every step). All are detected (MonetTracer.create_node; tensor versions and the
# generators' states around the trace) and refused with a TraceError; torch.export records them.

# NOTE [Custom autograd Functions]
# `MyFunction.apply(x)` runs MyFunction.forward under no_grad and attaches MyFunction.backward to
# its outputs. Traced like any Python, its forward's ops would be recorded and differentiated by
# autograd, not by the Function's own backward (a gradient reversal or a straight-through
# estimator would get the wrong gradients). While fx traces, `torch.autograd.Function.apply` is
# routed to the tracer (functions_applied), which records a call with proxy arguments as one
# call_function node of `function_op(MyFunction)`, so the graph applies the Function itself: one
# Op, whose saved tensors are what its forward saves, recomputed by applying it again.
_FUNCTION_OPS: dict = {}


def function_op(cls) -> Callable:
    """The graph's target for `cls.apply`: a plain function of this module (fx's code generator
    writes a function of torch by its dotted name, which a Function defined by torch, such as
    torch.utils.checkpoint's, does not have)."""
    op = _FUNCTION_OPS.get(cls)
    if op is None:
        def op(*args, **kwargs):
            return cls.apply(*args, **kwargs)

        op.__name__ = op.__qualname__ = f"{cls.__name__}_apply"
        _FUNCTION_OPS[cls] = op
    return op


@contextlib.contextmanager
def functions_applied(hook):
    """Within this block `SomeFunction.apply(*args, **kwargs)` first calls `hook(SomeFunction,
    args, kwargs)`, whose result replaces the call's unless it is None."""
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        out = hook(cls, args, kwargs)
        if out is not None:
            return out
        return original.__get__(None, cls)(*args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = original


class _NotRecorded(Exception):
    """Raised inside the tracer: the forward does something fx would not record."""


def _modes() -> tuple:
    return (torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"),
            torch.is_autocast_enabled("cuda"))


def _describe_modes(modes: tuple) -> str:
    grad, cpu, cuda = modes
    on = [d for d, flag in (("cpu", cpu), ("cuda", cuda)) if flag]
    return (f"grad {'enabled' if grad else 'disabled'}"
            + (f", autocast on {' and '.join(on)}" if on else ""))


def _model_state(model: torch.nn.Module) -> list:
    """(kind, name, tensor, version, copy) of each parameter and buffer; the copy (of buffers
    only) restores a buffer the trace updated."""
    out = []
    for kind, named in (("parameter", model.named_parameters(remove_duplicate=True)),
                        ("buffer", model.named_buffers(remove_duplicate=True))):
        for name, t in named:
            if t is not None:
                out.append((kind, name, t, t._version,
                            t.detach().clone() if kind == "buffer" else None))
    return out


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
               "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
               "_backward_hooks", "_backward_pre_hooks")


def _hook_dicts(m: torch.nn.Module) -> list[dict]:
    return [d for d in (m.__dict__.get(name) for name in _HOOK_DICTS) if isinstance(d, dict)]


_UNSET = object()
_PLAIN = (bool, int, float, str, type(None))


def is_plain_value(value) -> bool:
    """A bool, int, float, str or None, or a tuple of them: a module's Python state that a
    captured graph bakes in (NOTE [Python attributes read in forward] in monetlike/wrapper.py)."""
    return isinstance(value, _PLAIN) or (isinstance(value, tuple)
                                         and all(isinstance(v, _PLAIN) for v in value))


def _same_plain_value(old, new) -> bool:
    """A plain value set again to what it was (Hugging Face Swin clamps its window size on every
    call, to the same numbers): no state the capture leaves out."""
    if not is_plain_value(new) or type(old) is not type(new) or old != new:
        return False
    return not isinstance(new, tuple) or all(type(a) is type(b) for a, b in zip(old, new))


@contextlib.contextmanager
def attributes_set(model: torch.nn.Module, exempt: Callable[[], bool] = lambda: False):
    """NOTE [Python state set in forward]: a capture runs the forward's Python once, so an
    attribute the forward sets (a call counter, `self.last = h.detach()` kept for logging) is set
    once, at capture time (to a tracer's proxy under fx; torch.export puts it back), and never at
    a training step. Yields the (module name, attribute) pairs set on the model's modules while
    capturing (Module.__setattr__, which `self.calls += 1` calls), and puts them back after,
    with the modules' hooks as they were. A set made while `exempt()` holds is put back and not
    yielded: one made by code the graph runs for real at every step (an autograd Function's
    forward, which the capture keeps as one op)."""
    modules = dict(model.named_modules(remove_duplicate=True))
    names = {id(m): prefix for prefix, m in modules.items()}
    before = {(prefix, k): v for prefix, m in modules.items() for k, v in vars(m).items()}
    # Hooks a first call registers (transformers' output-capturing hooks) go with the flag it
    # sets: a failed fx attempt that kept them made the export attempt register them twice.
    hooks = [(d, dict(d)) for m in modules.values() for d in _hook_dicts(m)]
    written: list = []
    restored: list = []  # the exempt sets
    setattr_ = torch.nn.Module.__setattr__

    def recording(self, name, value):
        prefix = names.get(id(self))
        if prefix is not None and exempt():
            restored.append((prefix, name))
            prefix = None
        # Not a registered parameter, buffer or submodule (`self.steps += 1` on a buffer: its
        # in-place update is what _check_state sees), nor a constant fx keeps on the root.
        if prefix is not None and (prefix, name) not in written \
                and name not in self._parameters and name not in self._buffers \
                and name not in self._modules and not name.startswith("_tensor_constant") \
                and name not in derived_from_parameters(self) \
                and not _same_plain_value(before.get((prefix, name), _UNSET), value):
            written.append((prefix, name))
        setattr_(self, name, value)

    torch.nn.Module.__setattr__ = recording
    try:
        yield written
    finally:
        torch.nn.Module.__setattr__ = setattr_
        for d, kept in hooks:
            if d.keys() != kept.keys():
                d.clear()
                d.update(kept)
        for prefix, k in dict.fromkeys(written + restored):
            m = modules[prefix]
            if (prefix, k) in before:
                object.__setattr__(m, k, before[(prefix, k)])
            else:
                m.__dict__.pop(k, None)


# NOTE [Cached parametrizations]
# Inside `torch.nn.utils.parametrize.cached()` a parametrized weight (weight_norm, a custom
# parametrization) is computed once and shared by every use in the block. A parametrized module
# that fx keeps as a leaf (nn.Linear) computes its weight in its own forward at each call, so a
# module called twice gives the weight's gradient as two sums where plain PyTorch has one, apart
# by rounding that training steps grow. fx refuses such a call; torch.export traces the cached
# weight as one computation.

# NOTE [Norms under checkpoint]
# torch.utils.checkpoint (use_reentrant=False) runs the function it checkpoints again in the
# backward, so plain PyTorch updates a BatchNorm's running statistics there twice per step
# (torchvision's DenseNet with memory_efficient=True does). A captured graph runs each module
# once, so the wrapped model's statistics would not be plain PyTorch's, silently. While capturing,
# the checkpoint's saved-tensor hooks are counted as they are entered and left, and every module
# called meanwhile (MonetTracer.call_module under fx, a global forward pre-hook under export) that
# updates running statistics is recorded; the capture is then refused with the way out.
@contextlib.contextmanager
def norms_under_checkpoint(model: torch.nn.Module):
    """Yields (names of modules that update running statistics called inside a non-reentrant
    torch.utils.checkpoint while capturing, the callback that records a module call)."""
    hooks_cls = torch.autograd.graph.saved_tensors_hooks
    checkpoint_cls = checkpoint_hook_class()
    names = {id(m): n for n, m in model.named_modules()}
    depth = [0]
    found: list[str] = []
    enter, leave = hooks_cls.__enter__, hooks_cls.__exit__

    def entering(self):
        if isinstance(self, checkpoint_cls):
            depth[0] += 1
        return enter(self)

    def leaving(self, *exc):
        if isinstance(self, checkpoint_cls):
            depth[0] -= 1
        return leave(self, *exc)

    def called(mod: torch.nn.Module) -> None:
        if depth[0] and isinstance(mod, (BatchNormBase, InstanceNormBase)) and mod.training \
                and mod.track_running_stats and mod.running_mean is not None:
            name = names.get(id(mod), type(mod).__name__)
            if name not in found:
                found.append(name)

    hooks_cls.__enter__, hooks_cls.__exit__ = entering, leaving
    handle = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda mod, args: called(mod))
    try:
        yield found, called
    finally:
        hooks_cls.__enter__, hooks_cls.__exit__ = enter, leave
        handle.remove()


def check_norms_under_checkpoint(model: torch.nn.Module, found: list, how: str) -> None:
    """Refuse a capture that saw running statistics updated inside a checkpoint."""
    if not found:
        return
    what = ", ".join(repr(n) for n in found[:3]) + (" and more" if len(found) > 3 else "")
    raise TraceError(
        f"{how} could not capture {type(model).__name__} faithfully: its forward runs "
        f"{what} (updating running statistics) inside torch.utils.checkpoint, which runs them "
        f"again in the backward, so plain PyTorch updates their statistics twice per step; a "
        f"captured graph runs each module once, so the wrapped model's statistics would differ. "
        f"monetlike's schedule takes the place of the model's own checkpointing: turn it off "
        f"(torchvision's DenseNet: memory_efficient=False; Hugging Face: "
        f"model.gradient_checkpointing_disable()) and profile again")


def check_attributes_set(model: torch.nn.Module, written: list, how: str) -> None:
    """Refuse a capture during which the forward set Python attributes (attributes_set)."""
    if not written:
        return
    what = ", ".join(f"'{k}' of {f'module {p!r}' if p else type(model).__name__}"
                     for p, k in written[:3]) + (" and more" if len(written) > 3 else "")
    raise TraceError(
        f"{how} could not capture {type(model).__name__} faithfully: its forward sets the "
        f"Python attribute{'s' if len(written) > 1 else ''} {what} (a call counter such as "
        f"`self.calls += 1`, a tensor kept for logging such as `self.last = h.detach()`). A "
        f"captured graph runs no Python: the attribute was set once, while capturing (put "
        f"back now), and would never be set at a "
        f"training step. Ways out: keep a counter in a buffer updated in place "
        f"(self.register_buffer('calls', torch.zeros((), dtype=torch.long)); `self.calls += 1`, "
        f"which torch.export records: capture='export'), set the attribute outside forward, or "
        f"move that code into a submodule made a leaf (leaf_modules=[<its name or class>]), which "
        f"runs its forward for real at every step (again when the schedule recomputes it). If "
        f"the forward sets it on its first call only (lazy set-up: transformers installs its "
        f"output-capturing hooks and sets _output_capturing_hooks_installed when hidden states "
        f"are asked for), run the model once before profiling and wrapping it")


def _check_state(model: torch.nn.Module, before: list, refuse: bool = True) -> None:
    """Refuse (restoring the buffers) a trace that updated the model's tensors in place; with
    `refuse=False` (the trace failed anyway) only restore them."""
    changed = [(kind, name) for kind, name, t, version, _ in before if t._version != version]
    if not changed:
        return
    with torch.no_grad():
        for kind, name, t, version, copy in before:
            if copy is not None and t._version != version:
                t.copy_(copy)
    if not refuse:
        return
    what = ", ".join(f"{kind} '{name}'" for kind, name in changed)
    raise TraceError(
        f"torch.fx.symbolic_trace could not trace {type(model).__name__}: its forward updates "
        f"{what} in place outside a leaf module (a step counter such as `self.steps += 1`, a "
        f"running statistic written by hand). torch.fx does not record it: the update ran once, "
        f"at trace time (undone for buffers), and would never run in training. Ways out: "
        f"capture the model with torch.export (monetlike.profile(..., capture='export'), the "
        f"fallback of capture='auto'), which records buffer updates, or move the update into a "
        f"submodule made a leaf (leaf_modules=[<its name or class>] in monetlike.profile)")


@contextlib.contextmanager
def python_draws():
    """The block's draws from Python's own generators (the `random` module, numpy's global
    one): yields a list that holds, after the block, the names of those it drew from, each put
    back as it was (capturing must not move the user's random streams). A capture runs the
    forward's Python once, so a draw there (LayerDrop's `if random.random() < p`) is taken once
    and its outcome kept in the graph: every step would skip the same blocks."""
    import random
    import sys

    np = sys.modules.get("numpy")
    before = random.getstate()
    np_before = np.random.get_state() if np is not None else None
    drawn: list[str] = []
    try:
        yield drawn
    finally:
        if random.getstate() != before:
            drawn.append("random")
            random.setstate(before)
        if np is not None:
            now = np.random.get_state()
            if now[0] != np_before[0] or not np.array_equal(now[1], np_before[1]) \
                    or tuple(now[2:]) != tuple(np_before[2:]):
                drawn.append("numpy.random")
                np.random.set_state(np_before)


def python_draw_error(name: str, how: str, drawn: list[str]) -> TraceError:
    return TraceError(
        f"{how} could not capture {name} faithfully: its forward draws from Python's "
        f"{' and '.join(drawn)} generator (a random decision such as LayerDrop's `if "
        f"random.random() < p`). A capture runs the forward's Python once and keeps the outcome "
        f"of that draw: every step would take the same branch. Ways out: draw with torch on "
        f"tensors and use the result without a Python branch (multiply by "
        f"torch.bernoulli(...) or use torch.where), or make the decision outside the model's "
        f"forward and profile each variant you train")


def save_rng() -> dict:
    """The CPU generator's state, and each initialised CUDA device's."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # pragma: no cover - no GPU
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> bool:
    """Put the generators back as `state` (save_rng) had them; whether they had moved (NOTE
    [What fx does not record])."""
    moved = not torch.equal(torch.get_rng_state(), state["cpu"])
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:  # pragma: no cover - no GPU in CI
        now = torch.cuda.get_rng_state_all()
        moved = moved or any(not torch.equal(a, b) for a, b in zip(now, state["cuda"]))
        torch.cuda.set_rng_state_all(state["cuda"])
    return moved


def _user_frame(tb) -> str | None:
    """The innermost traceback frame outside torch and monetlike: the line of the user's model."""
    return user_frame_in(traceback.extract_tb(tb))


def user_frame_in(frames: Iterable[traceback.FrameSummary]) -> str | None:
    """The innermost of `frames` outside torch and monetlike, as
    "file:line in function: `code`"."""
    best = None
    for fr in frames:
        path = os.path.abspath(fr.filename)
        if not path.startswith(_TORCH_DIR) and not path.startswith(_OWN_DIR):
            best = fr
    if best is None:
        return None
    line = (best.line or "").strip()
    return f"{best.filename}:{best.lineno} in {best.name}" + (f": `{line}`" if line else "")


def user_frame_of(e: BaseException) -> str | None:
    """`_user_frame` of the innermost exception in `e`'s chain that passed through the user's
    code (torch.export raises its own error from the one the model's line met)."""
    found, seen = None, set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        found = _user_frame(e.__traceback__) or found
        e = e.__cause__ or e.__context__
    return found


def trace(model: torch.nn.Module, leaf_modules: Iterable = ()) -> fx.GraphModule:
    """Symbolically trace `model` with `MonetTracer`; raise TraceError with a way out on failure."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
    tracer = MonetTracer(leaf_modules)
    before = _model_state(model)
    rng = save_rng()
    try:
        with attributes_set(model) as written, norms_under_checkpoint(model) as (norms, called), \
                python_draws() as drawn:
            tracer.on_module_call = called
            graph = tracer.trace(model)
    except Exception as e:
        restore_rng(rng)
        _check_state(model, before, refuse=False)
        stack = list(getattr(tracer, "module_stack", {}).items())
        where = ""
        if stack:
            path, info = stack[-1]
            typ = info[1] if isinstance(info, tuple) and len(info) > 1 else info
            tname = getattr(typ, "__name__", str(typ))
            where = f" while tracing module '{path or '<root>'}' ({tname})"
        frame = _user_frame(e.__traceback__)
        at = f" at {frame}" if frame else ""
        name = type(model).__name__
        if stack and stack[-1][0]:
            leaf = (f"make that module a leaf (pass leaf_modules=[{stack[-1][0]!r}] to "
                    f"monetlike.profile, so it becomes one op run as a whole)")
        else:
            leaf = ("move that code into a submodule and make it a leaf (leaf_modules=[<its "
                    "name or class>] in monetlike.profile, so it becomes one op run as a whole)")
        if isinstance(e, _NotRecorded):
            raise TraceError(
                f"torch.fx.symbolic_trace could not trace {name}{at}: {e}. Ways out: capture the "
                f"model with torch.export (monetlike.profile(..., capture='export'), the fallback "
                f"of capture='auto'), which records these modes, or move the block into a "
                f"submodule made a leaf (leaf_modules=[<its name or class>] in "
                f"monetlike.profile, so it runs as one op, modes included), or write it without "
                f"the mode (x.detach() in place of torch.no_grad())") from None
        raise TraceError(
            f"torch.fx.symbolic_trace could not trace {name}{where}{at}: "
            f"{type(e).__name__}: {e}. Ways out: {leaf}, or remove the data-dependent Python "
            f"control flow on tensor values there (torch.where instead of `if`), or capture the "
            f"model with torch.export (monetlike.profile(..., capture='export'), the fallback "
            f"of capture='auto')") from e
    _check_state(model, before)
    moved = restore_rng(rng)  # before any refusal: capturing must not move the user's stream
    if drawn:
        raise python_draw_error(type(model).__name__, "torch.fx.symbolic_trace", drawn)
    constant = _written_constant(graph)
    if constant:
        raise TraceError(
            f"torch.fx.symbolic_trace could not trace {type(model).__name__} faithfully: its "
            f"forward makes a tensor from constant sizes (torch.zeros(4, 32), an accumulator) "
            f"and {constant}. fx runs such a call once, while tracing, and keeps the tensor: every "
            f"step would write into the same one. Ways out: capture the model with torch.export "
            f"(monetlike.profile(..., capture='export'), the fallback of capture='auto'), which "
            f"makes it at each call, or make it from a traced tensor (x.new_zeros(4, 32), "
            f"torch.zeros_like(h)), or use the out-of-place op (index_add in place of "
            f"index_add_)")
    aliased = _aliased_assignment(graph, tracer.augmented)
    if aliased:
        raise TraceError(
            f"torch.fx.symbolic_trace could not trace {type(model).__name__} faithfully: an "
            f"augmented assignment on a tensor another name still refers to: {aliased}. fx "
            f"traces `h += y` as `h = h + y`, where PyTorch adds in place into the tensor both "
            f"names share. Ways out: capture the model with torch.export (monetlike.profile(..., "
            f"capture='export'), the fallback of capture='auto'), which records the in-place "
            f"op, or write the update as the method (`h.add_(y)`), or out of place and use the "
            f"new name everywhere (`h = h + y`)")
    check_attributes_set(model, written, "torch.fx.symbolic_trace")
    check_norms_under_checkpoint(model, norms, "torch.fx.symbolic_trace")
    if tracer.cached_leaves:
        leaves = ", ".join(repr(n) for n in dict.fromkeys(tracer.cached_leaves))
        raise TraceError(
            f"torch.fx.symbolic_trace could not capture {type(model).__name__} faithfully: its "
            f"forward calls the parametrized module{'s' if ',' in leaves else ''} {leaves} inside "
            f"torch.nn.utils.parametrize.cached(), which computes a parametrized weight once for "
            f"all its uses; an fx leaf module computes it at each call, so the gradients would "
            f"be summed in another order than plain PyTorch's. Capture the model with "
            f"torch.export (capture='export', the fallback of capture='auto'), which records the "
            f"weight computed once")
    if moved:
        raise TraceError(
            f"torch.fx.symbolic_trace could not trace {type(model).__name__} faithfully: its "
            f"forward draws random numbers outside the traced ops (a random tensor made from "
            f"constant sizes only, torch.randn(4, 32) or torch.randperm(n), or a random Python "
            f"decision such as `if torch.rand(1) < p`). torch.fx runs such a call once, while "
            f"tracing, and keeps its result: every step would reuse the same draw. Ways out: "
            f"capture the model with torch.export (monetlike.profile(..., capture='export'), "
            f"the fallback of capture='auto'), which records the draw, or take its sizes from a "
            f"traced tensor (torch.randn(x.shape), torch.randn_like(x)), or move it into a "
            f"submodule made a leaf (leaf_modules=[<its name or class>])")
    name = type(model).__name__
    gm = fx.GraphModule(tracer.root, graph, name)
    return gm
