"""The scheduled forward: the traced model's generated code, with hooks for the backward stages.

`ScheduledForward` runs the traced model with grad enabled, building one ordinary autograd graph,
the nodes that touch a scheduled Value inside `torch.autograd.graph.saved_tensors_hooks`
(docs/execution-model.md section 5); each step's state is a `StepState` (step_state.py).

NOTE [Where the hooks are]
Saved-tensor hooks are pushed only around the nodes of Ops that read or make a scheduled Value
(NOTE [Value handling] in plan.py) and of Ops no backward reaches. Every other node saves its
tensors the ordinary way, with autograd's version checks and no Python call per tensor. A
store-all schedule runs as plain autograd: fx's generated code bound to the live model.

NOTE [Generated forward]
The forward is the traced graph's own Python code (fx codegen) bound to the live model, in which
only the nodes a schedule needs at run time call back into the runtime (`Plan.runtime_nodes`):
Ops with scheduled Values, recomputed Ops, Ops whose Values the runtime holds or offloads, Ops
of active stages or with a registered Impl. Every other node costs what it costs in the model.

NOTE [Generated recomputation]
A recomputation runs its Op's nodes as generated code too (codegen.generated_recompute, built at
its first recomputation), under no_grad and the Op's recorded RNG and autocast state. What it
reads from outside the Op, and the nodes it runs otherwise than the forward (a norm without its
running statistics, an in-place Impl), call back into `Recomputation`.

NOTE [In place on a view]
An in-place Impl claims the out-of-place op's backward. Written in place, a tensor autograd tracks
as a view makes autograd rebase its history onto the base (CopySlices), which holds a base-sized
gradient buffer longer than the profile saw and leaves the Op's stage hook out of the graph. So
the runtime writes through a plain alias (`_PlainAlias`: same storage and strides, not a view to
autograd) whose backward passes the gradient on itself. The Impl is only offered where no
backward reads that storage, so no version check is lost.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.fx as fx

from solver.errors import ScheduleError

from ..core import recompute as rc
from ..core.autograd_hooks import stage_roots, unreached_message
from ..core.torch_private import tree_flatten
from ..core.modules import MISSING, attr_path
from .codegen import generated_forward, generated_recompute
from .plan import Plan
from .step_state import KEPT_INTERRUPTS, StepState, raise_kept_interrupt
from ..core.modules import has_forward_hooks


class _ForwardLocal(threading.local):
    """What one running forward keeps on its runner, per thread: two threads stepping one
    wrapper each see their own step (a backward, on any thread, sees no forward running)."""

    state: "StepState | None" = None
    capturer: "rc.ContextCapturer | None" = None
    hooks: Any = None

    def __init__(self):
        self.buffer_versions: dict[int, list] = {}
        self.attrs: dict[str, Any] = {}


def _per_thread(name: str) -> property:
    return property(lambda self: getattr(self._local, name),
                    lambda self, value: setattr(self._local, name, value))


class ScheduledForward:
    """Runs the traced forward for one StepState (reused across steps): fx's generated code, with
    the nodes a schedule needs routed through `run_node` (NOTE [Generated forward]). The running
    step's fields are per thread (_ForwardLocal)."""

    state = _per_thread("state")
    _capturer = _per_thread("capturer")
    _hooks = _per_thread("hooks")
    _buffer_versions = _per_thread("buffer_versions")
    _attrs = _per_thread("attrs")

    def __init__(self, plan: Plan, root: torch.nn.Module):
        self.plan = plan
        self.root = root
        self._local = _ForwardLocal()
        self.side_streams: dict = {}  # CUDA side streams for offload copies, per device
        self.recompute_log = None  # (times, clock) inside ScheduleWrapper.timing_recomputations()
        self._nodes = list(plan.gm.graph.nodes)
        self._info = [_node_info(plan, n) for n in self._nodes]
        self._store_all = plan.store_all
        # Per recomputed Op, the targets of its module nodes (their side effects are checked).
        self._op_modules = {j: [n for n in plan.op_nodes[j] if n.op == "call_module"]
                            for j in plan.recomputed_ops}
        self._forward = generated_forward(plan, root)
        self._recompute_code: dict[int, Any] = {}
        self._index: dict[fx.Node, int] | None = None  # built at the first recomputation

    def stash_for(self, node: fx.Node):
        """Where an Impl with a StashedRecompute puts its stash: (dict, key) for a node the
        schedule recomputes from it, else None."""
        if self.state is None or node.name not in self.plan.stashed_recompute:
            return None
        return self.state.stashes, self.plan.node_op[node.name]

    def recompute_code(self, j: int):
        """Op j's recomputation as generated code (NOTE [Generated recomputation])."""
        code = self._recompute_code.get(j)
        if code is None:
            if self._index is None:
                self._index = {n: i for i, n in enumerate(self._nodes)}
            code = self._recompute_code[j] = generated_recompute(self.plan, j, self.root,
                                                                 self._index)
        return code

    # Parameters and submodules are looked up on the live model, not on the traced copy, so
    # `load_state_dict(..., assign=True)` or a replaced submodule is seen by the next step; a
    # constant fx made at trace time exists on the traced copy only.
    def fetch_attr(self, target: str) -> Any:
        found = self._on_model(target)
        if found is MISSING:
            found = attr_path(self.plan.gm, target)
            if found is MISSING:
                raise RuntimeError(f"ScheduleWrapper: the model has no attribute {target!r}, "
                                   f"which the traced graph reads")
            self._attrs[target] = found
        return found

    def _on_model(self, target: str) -> Any:
        """`root.<target>` on the live model, or MISSING; found through its parent, both cached
        for the step (a block's modules share their path)."""
        found = self._attrs.get(target, MISSING)
        if found is MISSING:
            parent, _, atom = target.rpartition(".")
            obj = self._on_model(parent) if parent else self.root
            found = attr_path(obj, atom) if obj is not MISSING else MISSING
            if found is not MISSING:
                self._attrs[target] = found
        return found

    def run_step(self, state: StepState, args: tuple) -> Any:
        self.state = state
        self._buffer_versions = {}
        self._attrs = {}  # looked up once per step (and its recomputations) on the live model
        if not self.plan.store_all:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            self._capturer = rc.ContextCapturer(rc.cuda_devices_of(tensors),
                                                autocast_fixed=not self.plan.autocast_switches)
            self._hooks = torch.autograd.graph.saved_tensors_hooks(state.pack, state.unpack)
        try:
            return self._forward(self, self.root, *args)
        finally:
            self.state = None
            self._capturer = None
            self._hooks = None

    def run_node(self, i: int, args: tuple, kwargs: dict) -> Any:
        """Node i of the traced graph, run by the runtime (called from the generated forward)."""
        if KEPT_INTERRUPTS:
            raise_kept_interrupt()
        try:
            n, op, starts, rng, hooked, makes, meta, stage, ends, offloads, stats, unreached = \
                self._info[i]
            if self._store_all:
                # NOTE [Where the hooks are]: nothing is recomputed, so nothing needs a handle, a
                # stage hook or a recorded context: the step is plain autograd, node by node.
                result = self._call(n, args, kwargs)
                return result if n.users else None
            state = self.state
            if starts:  # the first node of a recomputed Op
                self._before_recomputed_op(op)
                state.op_ctx[op] = self._capturer.capture(rng=rng)
            state.current_op = op
            if hooked:
                self._hooks.__enter__()
            try:
                if unreached is not None and not state.cached_casts:
                    result = self._call_unreached(n, op, unreached, args, kwargs)
                else:
                    result = self._call(n, args, kwargs)
            finally:
                if hooked:
                    self._hooks.__exit__(None, None, None)
                state.current_op = None
            if stats:
                found = rc.batch_stats(result)
                if found is not None:
                    state.bn_stats[n.name] = found
            if makes:
                state._register_outputs(n, result, None, recompute=False)
            if state.pending:
                state.resolve_pending(op)
            if meta:
                state.record_meta(n, op, result)
            if stage is not None:
                # NOTE [Stage boundaries]: the nodes that give this Op's results their grad_fn.
                leaves = (result,) if isinstance(result, torch.Tensor) else tree_flatten(result)[0]
                roots = stage_roots(leaves)
                if roots:
                    state.hook_stage(stage, roots)
            if ends:
                if op in self._buffer_versions:
                    self._after_recomputed_op(op)
                if offloads:
                    # After the Op's in-place nodes too: the host copy holds the final contents.
                    state.offload_outputs(op)
            if not n.users:
                return None  # nobody reads it: free it now, as eager PyTorch and the profiler do
            return result
        except Exception as e:
            if not getattr(e, "_monetlike_node", False):
                e._monetlike_node = True
                e.add_note(f"While executing {self._nodes[i].format_node()} (ScheduleWrapper "
                           f"forward)")
            raise

    def _call_unreached(self, n: fx.Node, op: int, values: tuple, args: tuple,
                        kwargs: dict) -> Any:
        """Node n of an Op no backward reaches, run under no_grad (NOTE [Ops no backward
        reaches] in plan.py); `values`: (result index, requires grad) of the Values it makes."""
        anchor = _requiring_grad((args, kwargs))
        if anchor is None and n.op == "call_module":
            anchor = next((p for p in self.fetch_attr(n.target).parameters()
                           if p.requires_grad), None)
        if anchor is None:  # nothing it reads requires grad: its results do not either
            return self._call(n, args, kwargs)
        with torch.no_grad():
            result = self._call(n, args, kwargs)
        return _unreached_results(result, values, anchor,
                                  lambda: unreached_message(self.plan.graph, op))

    def _call(self, n: fx.Node, args: tuple, kwargs: dict) -> Any:
        if self.plan.impl_calls:
            sub = self.plan.impl_calls.get(n.name)
            if sub is not None:  # the node of an Op run with a registered Impl (monetlike.impls)
                where = self.plan.overwritten_args.get(n.name)
                if where is not None and torch.is_grad_enabled():
                    args, kwargs = _unviewed(args, kwargs, where)
                return sub(self, n, args, kwargs)
        op = n.op
        if op == "call_module":
            return self.fetch_attr(n.target)(*args, **kwargs)
        if op == "call_function":
            return n.target(*args, **kwargs)
        if op == "call_method":
            self_obj, *rest = args
            return getattr(self_obj, n.target)(*rest, **kwargs)
        if op == "get_attr":
            return self.fetch_attr(n.target)
        raise RuntimeError(f"ScheduleWrapper: cannot run node {n.format_node()}")

    # -- side effects of Ops the schedule recomputes ------------------------------------------
    def _before_recomputed_op(self, op: int) -> None:
        graph = self.plan.graph
        versions = []
        for node in self._op_modules[op]:
            mod = self.fetch_attr(node.target)
            if has_forward_hooks(mod, including_global=True):
                raise ScheduleError(
                    f"ScheduleWrapper: the schedule recomputes op {op} ({graph.ops[op].name}), "
                    f"whose module {node.target} has forward hooks; recomputing would call them "
                    f"again. Profile the model with its hooks registered (the profiler marks such "
                    f"ops recompute_unsafe) and solve again")
            allowed = rc.allowed_buffer_writes(mod)
            before = rc.buffer_versions(mod, allowed)
            if before:
                versions.append((node, mod, allowed, before))
        if versions:
            self._buffer_versions[op] = versions

    def _after_recomputed_op(self, op: int) -> None:
        graph = self.plan.graph
        for node, mod, allowed, before in self._buffer_versions.pop(op):
            for (name, ver), (_, now) in zip(before, rc.buffer_versions(mod, allowed)):
                if ver != now:
                    raise ScheduleError(
                        f"ScheduleWrapper: the schedule recomputes op {op} "
                        f"({graph.ops[op].name}), whose module {node.target} writes its buffer "
                        f"{name!r} in the forward; recomputing would write it again. The profiler "
                        f"marks such ops recompute_unsafe: profile again and solve again")

    def call_for_recompute(self, node: fx.Node, args: tuple, kwargs: dict,
                           stats: tuple | None = None) -> Any:
        return rc.call_for_recompute(node.op, node.target, args, kwargs, self.fetch_attr, stats)


def _node_info(plan: Plan, n: fx.Node) -> tuple:
    """What `ScheduledForward.run_node` does around node n, decided once per plan: (node, its Op,
    first node of a recomputed Op, whose RNG is captured, under the saved-tensor hooks, makes the
    Op's Values, geometry recorded, active stage to hook or None, last node of the Op, last node
    of an Op with offloaded outputs, a BatchNorm whose batch statistics are held)."""
    op = plan.node_op.get(n.name)
    if op is None:
        return (n, None, False, False, False, False, n.name in plan.meta_nodes, None, False,
                False, False, None)
    stage = plan.stage_of_op.get(op)
    ends = plan.op_last_node.get(n.name) == op
    unreached = None
    if op in plan.no_grad_ops:
        values = (plan.graph.values[v] for v in plan.graph.ops[op].outputs)
        unreached = tuple((v.index, v.requires_grad) for v in values if v.name == n.name)
    return (n, op, op in plan.recomputed_ops and plan.op_nodes[op][0] is n, op in plan.rng_ops,
            op in plan.hooked_ops, n.name == plan.graph.ops[op].name, n.name in plan.meta_nodes,
            stage if stage in plan.active_stages else None, ends,
            ends and op in plan.offload_after, n.name in plan.stats_nodes, unreached)


def _unviewed(args: tuple, kwargs: dict, where: tuple) -> tuple[tuple, dict]:
    """NOTE [In place on a view]: the arguments with each overwritten tensor in `where` that
    autograd tracks as a view replaced by a plain alias of it (same storage, size and strides)."""
    args, kwargs = list(args), dict(kwargs)
    for i in where:
        box = args if isinstance(i, int) else kwargs
        t = box[i]
        if isinstance(t, torch.Tensor) and t.requires_grad and t._is_view():
            box[i] = _PlainAlias.apply(t)
    return tuple(args), kwargs


class _PlainAlias(torch.autograd.Function):
    """NOTE [In place on a view]: `t`'s storage, size and strides as a tensor autograd does not
    track as a view, whose backward passes the gradient on as it came."""

    @staticmethod
    def forward(ctx, t):
        return torch.ops.aten._unsafe_view(t, t.size())

    @staticmethod
    def backward(ctx, grad):
        return grad


def _requiring_grad(tree) -> torch.Tensor | None:
    return next((t for t in tree_flatten(tree)[0]
                 if isinstance(t, torch.Tensor) and t.requires_grad), None)


def _unreached_results(result: Any, values: tuple, anchor: torch.Tensor, message) -> Any:
    """`result` (made under no_grad) with each tensor that is a Value requiring grad in the
    model given a grad_fn that raises `message()`: it requires grad as in plain PyTorch, and a
    backward that reaches it fails loudly instead of passing it by (NOTE [Ops no backward
    reaches] in plan.py). A fresh tensor keeps its identity (marked dirty); a view, which
    autograd forbids to mark, becomes a plain alias of its storage."""
    single = isinstance(result, torch.Tensor)
    leaves = [result] if single else list(result) if isinstance(result, (tuple, list)) else None
    if leaves is None:
        return result
    changed = False
    for index, requires_grad in values:
        i = 0 if index is None else index
        t = leaves[i] if i < len(leaves) else None
        if requires_grad and isinstance(t, torch.Tensor) and not t.requires_grad and (
                t.is_floating_point() or t.is_complex()):
            leaves[i] = (_UnreachedView if t._is_view() else _Unreached).apply(
                anchor, message, t)
            changed = True
    if single or not changed:
        return leaves[0] if single else result
    kind = type(result)
    if kind in (tuple, list):
        return kind(leaves)
    # a namedtuple takes its fields one by one; torch.return_types (max's values, indices), a
    # sequence
    return kind(*leaves) if hasattr(kind, "_fields") else kind(leaves)


class _Unreached(torch.autograd.Function):
    """The result `t` of an Op no backward reaches, given a grad_fn that saves nothing and
    raises when a backward reaches it; `anchor` (read by the Op, requires grad) makes it
    require grad."""

    @staticmethod
    def forward(ctx, anchor, message, t):
        ctx.message = message
        ctx.mark_dirty(t)
        return t

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(ctx.message())


class _UnreachedView(_Unreached):
    @staticmethod
    def forward(ctx, anchor, message, t):
        ctx.message = message
        return torch.ops.aten._unsafe_view(t, t.size())


__all__ = ["StepState", "ScheduledForward"]
