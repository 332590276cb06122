"""One scheduled step's state: what the backward stages need after the forward returns.

`StepState` holds the resident Values, the geometry of the nodes a recomputation reads, the RNG
and autocast state of recomputed Ops, and the progress of the backward stages. Only autograd
references it (through the saved handles and the stage hooks), so it dies with the step's graph.

NOTE [Stage boundaries]
An Op's stage starts when the first of its "roots" (the autograd nodes that give its results a
grad_fn) is about to run: a gradient can only enter the Op through its results. It ends when
another stage starts after all its roots have started, or when the backward finishes (an engine
callback); not at its last root, since nodes behind the roots still unpack saved tensors, and
not at the next stage's start alone, since the engine can interleave a non-contiguous Op's nodes
with another Op's. Only the active stages (`Plan.active_stages`) are hooked; an inactive one ends
late, which matters only for handles whose node did not run or was retained.

NOTE [Storage identity]
A saved tensor is matched to a Value by storage identity, and only against the Values of the Op
running now. An input can die inside its Op and the allocator can hand its address to the next
tensor, so each Value's key is dropped by a weakref callback on its storage the moment the storage
dies (`forget_key`; the callback holds the key dictionary, never the StepState).

NOTE [Recomputed layouts]
A recomputed Value is read through the geometry the forward recorded, so a recomputation must lay
its result out as the forward did. Some kernels choose their layout by whether their inputs
require grad (the CPU's scaled_dot_product_attention with a learned mask), so rebuilt arguments
are flagged requires_grad as the forward's were (`_flagged`), and a result laid out otherwise is
copied into the forward's layout (`_as_forward_layout`) before anything reads it.

NOTE [No reference cycles]
A step's state must die with its autograd graph, also with the garbage collector off. So
StepState never holds an autograd node or a tensor with a grad_fn: `resident` holds detached
aliases. Autograd holds the state (handles and hooks point to it), never the other way round.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any

import torch
import torch.fx as fx

from solver.errors import ScheduleError

from ..core.torch_private import (current_graph_task_id, neg_view, queue_engine_callback, tree_flatten,
                             tree_leaves, tree_unflatten)
from ..core import recompute as rc
from ..core.autograd_hooks import (CREATE_GRAPH_MESSAGE, Saved, missing_value_message,
                                   unreached_message)
from .offload import HostCopies
from .plan import Plan


NOT_STARTED, RUNNING, DONE = 0, 1, 2

# Leaf kinds of a node's recorded result (used to rebuild a recomputation's arguments).
_CONST, _VALUE, _INPUT, _RERUN = 0, 1, 2, 3


_DTYPE_NAMES: dict[torch.dtype, str] = {}


AUTOCAST_CACHE_MESSAGE = (
    "ScheduleWrapper: the backward runs inside the torch.autocast block of the forward, with its "
    "weight-cast cache on: the casts of the parameters stay alive to the end of the block, "
    "memory the schedule did not count (it can peak over its budget). Call backward after the "
    "autocast block, as PyTorch's mixed-precision recipe does, or use "
    "torch.autocast(..., cache_enabled=False)")



def _dtype_name(t: torch.Tensor) -> str:
    # Looked up: str(dtype) costs a microsecond, and every recomputed Op's node asks.
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        name = _DTYPE_NAMES[t.dtype] = str(t.dtype).replace("torch.", "")
    return name


class StepState:
    """One training step's runtime state (see the module docstring)."""

    def __init__(self, plan: Plan, runner: Any, inputs: tuple):
        self.plan = plan
        self.runner = runner
        self.inputs = inputs
        self.input_keys = {}
        for i, x in enumerate(inputs):
            if isinstance(x, torch.Tensor):
                self.input_keys.setdefault(x.untyped_storage()._cdata, i)
        self.resident: dict[int, torch.Tensor] = {}
        self.vkey: dict[int, int] = {}  # Value id -> storage key, while the storage is alive
        self.key_values: dict[int, list[int]] = {}  # and back (an in-place Op's output shares)
        self.vref: dict[int, weakref.ref] = {}
        # Value id -> (size, stride, storage offset, storage bytes) of the forward's result that
        # made it (NOTE [Recomputed layouts]).
        self.vgeom: dict[int, tuple] = {}
        self.node_meta: dict[str, tuple] = {}
        self.op_ctx: dict[int, rc.ForwardContext] = {}
        # Dropout masks a recomputation applies (NOTE [Recomputed from the mask]), by Op: put
        # here by the Impl's forward, taken out by its backward.
        self.stashes: dict[int, Any] = {}
        # A recomputed training BatchNorm's batch statistics from its forward, by fx node name,
        # until the Op's last recomputation (NOTE [BatchNorm from its statistics]).
        self.bn_stats: dict[str, tuple] = {}
        self.current_op: int | None = None
        # Whether the forward ran under autocast with its weight-cast cache on (NOTE [Autocast
        # cache] in recompute.py).
        self.cached_casts = rc.casts_cached()
        self.pending: list[Saved] = []
        # (op, Value id) -> the op's live handles on that Value, for the hand-over in its stage.
        self.handles: dict[tuple[int, int], list[weakref.ref]] = {}
        n_stages = len(plan.graph.backward_order)
        self.stage_status = [NOT_STARTED] * n_stages
        self.stage_hooked = [0] * n_stages
        self.roots_pending = [0] * n_stages  # hooked result nodes of the stage not yet started
        self.running: list[int] = []  # stages started and not ended, usually one
        self.task_id: int | None = None
        # Offload to host (offload.py): the step's pinned host copies, and the forward tensor of
        # each offloaded Value from its creation until its Op's last node ran (copied then).
        self.host = HostCopies(runner.side_streams) if plan.offload else None
        self.to_offload: dict[int, torch.Tensor] = {}

    # -- saved tensors ----------------------------------------------------------------------
    def _match(self, op: int, key: int, dtype: str | None = None) -> int | None:
        """The Value of Op `op` whose storage has this key (of this dtype if given; the first
        in rank), or None."""
        found = self.key_values.get(key)
        if found is None:
            return None
        ranks = self.plan.storage_values[op]
        values = self.plan.graph.values
        best = None
        for v in found:
            if v in ranks and (best is None or ranks[v] < ranks[best]) and (
                    dtype is None or values[v].dtype == dtype):
                best = v
        return best

    def pack(self, t: torch.Tensor) -> Saved:
        op = self.current_op
        h = Saved(t, op)
        if op is None:
            return h.keep()
        if op in self.plan.unreached_ops:
            return h.let_go()
        try:
            key = t.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
            return h.keep()
        v = self._match(op, key) if key in self.key_values else None
        if v is None:
            if t.requires_grad and t.grad_fn is None:
                return h.keep()  # a parameter or input, never the result of the node running
            # Possibly an output of the node running now (relu saves its result): its storage is
            # only known when the node returns; resolved in ScheduledForward.run_node.
            self.pending.append(h)
            return h
        if v in self.plan.scheduled:
            return self._to_value(h, v)
        return h.keep()

    def _to_value(self, h: Saved, v: int) -> Saved:
        self.handles.setdefault((h.op, v), []).append(weakref.ref(h))
        return h.to_value(v)

    def resolve_pending(self, op: int | None) -> None:
        key_values = self.key_values
        for h in self.pending:
            key = h.tensor.untyped_storage()._cdata
            v = self._match(op, key) if op is not None and key in key_values else None
            if v is not None and v in self.plan.scheduled:
                self._to_value(h, v)
            else:
                h.keep()
        self.pending.clear()

    def unpack(self, h: Saved) -> torch.Tensor:
        if h.lost_graph and torch.is_grad_enabled():
            raise RuntimeError(CREATE_GRAPH_MESSAGE)
        if h.vid is None:
            t = h.tensor
            if t is None:
                raise RuntimeError(unreached_message(self.plan.graph, h.op))
            if t._version != h.version:
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by "
                    f"an inplace operation: a {tuple(t.shape)} {_dtype_name(t)} tensor saved by "
                    f"the backward of op {h.op} is at version {t._version}; expected version "
                    f"{h.version} instead (ScheduleWrapper)")
            return t
        base = h.base if h.base is not None else self.resident.get(h.vid)
        if base is None:
            raise RuntimeError(missing_value_message(self, h))
        return _view_of(base, h)

    # -- backward stages (NOTE [Stage boundaries]) ------------------------------------------
    def on_stage(self, t: int, grad_outputs) -> None:
        # This root runs now. The engine runs one node at a time (per device), so it has run
        # when any later prehook fires: counting roots here needs no posthook, which would make
        # the engine keep a second reference to the root's incoming gradient while it runs (and
        # the mask Impls write that gradient in place only when nothing else references it).
        if KEPT_INTERRUPTS:
            raise_kept_interrupt()
        self.roots_pending[t] -= 1
        status = self.stage_status
        if status[t] == RUNNING:
            return
        gid = current_graph_task_id()
        if gid != self.task_id:
            self.task_id = gid
            queue_engine_callback(self._end_task)
            if self.cached_casts and rc.casts_cached():
                warnings.warn(AUTOCAST_CACHE_MESSAGE, RuntimeWarning, stacklevel=2)
        # Another stage starts: the running ones whose roots have all run are over.
        for s in [s for s in self.running if self.roots_pending[s] <= 0]:
            self._end_stage(s)
        if status[t] == DONE:
            # A second backward through the same forward (retain_graph=True): nothing is
            # recomputed or released again; unpacking a released Value raises a clear error.
            return
        status[t] = RUNNING
        self.running.append(t)
        plan = self.plan
        rel = plan.releases[t]
        resident = self.resident
        # Fetched Values come back first: the stage's drops and recomputations may read them
        # (the simulator's order).
        for v in plan.schedule.stages[t].fetch:
            resident[v] = self.host.fetch(v)
        for v in rel.at_start:
            resident.pop(v, None)
        recompute = plan.schedule.stages[t].recompute
        if recompute:
            log = self.runner.recompute_log
            autocast = rc.autocast_state()
            with torch.no_grad():  # once per stage: entering it costs microseconds per Op
                for pos, j in enumerate(recompute):
                    if log is None:
                        self.recompute_op(j, t, autocast)
                    else:
                        self._timed_recompute(j, t, log, autocast)
                    for v in rel.after_recompute[pos]:
                        resident.pop(v, None)
        # NOTE [Early release]: a Value the stage's backward reads last goes to its handles
        # now, so it is freed when autograd releases the last node that saved it, before the
        # stage's peak, as a tensor saved the ordinary way is (Impl.early_release); the profile's
        # workspace was measured that way.
        op = plan.schedule.stages[t].op
        for v in rel.at_end:
            base = resident.pop(v, None)
            if base is not None:
                for ref in self.handles.get((op, v), ()):
                    h = ref()
                    if h is not None:
                        h.base = base

    def _end_stage(self, t: int) -> None:
        op = self.plan.schedule.stages[t].op
        for v in self.plan.releases[t].at_end:
            self.resident.pop(v, None)
            for ref in self.handles.pop((op, v), ()):
                h = ref()
                if h is not None:  # a node of the stage that did not run: let go all the same
                    h.base = None
        self.stage_status[t] = DONE
        self.running.remove(t)

    def _end_task(self) -> None:
        for t in list(self.running):
            self._end_stage(t)
        self.task_id = None
        if all(self.stage_status[t] == DONE for t in self.plan.active_stages):
            # Every stage ran: nothing can need the rest any more. Releasing it here rather than
            # when the graph dies matters when the caller keeps the loss (and so the graph's
            # nodes) alive after backward.
            self.resident.clear()
            self.handles.clear()
            self.node_meta.clear()
            self.op_ctx.clear()
            self.stashes.clear()
            self.bn_stats.clear()
            self.inputs = ()
            self.release_host()

    def release_host(self) -> None:
        """Let go of the step's host copies (end of the backward, or a failed forward)."""
        self.to_offload.clear()
        if self.host is not None:
            self.host.release()

    # -- offload to host (offload.py) -------------------------------------------------------
    def offload_outputs(self, op: int) -> None:
        """Op `op` has run all its nodes: copy its offloaded outputs to host memory."""
        for v in self.plan.offload_after[op]:
            x = self.to_offload.pop(v, None)
            if x is None:
                value = self.plan.graph.values[v]
                raise RuntimeError(f"ScheduleWrapper: op {op} did not produce value {v} "
                                   f"({value.name}), which the schedule offloads; the graph does "
                                   f"not match the model")
            self.host.offload(v, x)

    # -- recomputation ----------------------------------------------------------------------
    def recompute_op(self, j: int, t: int, autocast: tuple) -> None:
        """Op j again, under no_grad (the caller's), before stage t; `autocast`: the state
        now (rc.autocast_state()), so that an Op recorded under the same one and drawing no
        random numbers runs without entering `rc.replay`."""
        plan = self.plan
        op = plan.graph.ops[j]
        local: dict[str, Any] = {}
        new_values: dict[int, torch.Tensor] = {}
        ctx = self.op_ctx.get(j)
        if ctx is None:
            raise RuntimeError(f"ScheduleWrapper: stage {t} recomputes op {j} ({op.name}), whose "
                               f"forward context was not captured; this is a bug")
        if j in self.stashes:
            # Recomputed from a stash, nothing is drawn, so no generator state is set (its 5 KB
            # state tensor would be a transient the profile did not count).
            ctx = rc.without_rng(ctx)
        # NOTE [Generated recomputation]
        call = Recomputation(self, j, local, new_values, t)
        try:
            if rc.replay_needed(ctx, autocast):
                with rc.replay(ctx):
                    self.runner.recompute_code(j)(self.runner.root, call)
            else:
                self.runner.recompute_code(j)(self.runner.root, call)
        except Exception as e:
            raise RuntimeError(f"ScheduleWrapper: recomputing op {j} ({op.name}) before "
                               f"backward stage {t} failed: {type(e).__name__}: {e}") from e
        if self.bn_stats and plan.last_recompute[j] == t:
            for n in plan.op_nodes[j]:
                self.bn_stats.pop(n.name, None)
        resident = self.resident
        for v in op.outputs:
            if v not in resident:
                if v not in new_values:
                    raise RuntimeError(f"ScheduleWrapper: recomputing op {j} ({op.name}) did not "
                                       f"produce value {v}; the graph does not match the model")
                resident[v] = new_values[v]

    def _timed_recompute(self, j: int, t: int, log: tuple, autocast: tuple) -> None:
        times, clock = log
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:  # pragma: no cover - no GPU in CI
            torch.cuda.synchronize()
        start = clock()
        self.recompute_op(j, t, autocast)
        if cuda:  # pragma: no cover
            torch.cuda.synchronize()
        times.setdefault(j, []).append(clock() - start)

    def _materialize_args(self, node: fx.Node, local, new_values, t):
        def get(a):
            return self._materialize(a, local, new_values, t)

        args = fx.node.map_arg(node.args, get)
        kwargs = fx.node.map_arg(node.kwargs, get)
        return args, kwargs

    def _materialize(self, m: fx.Node, local: dict, new_values: dict, t: int) -> Any:
        if m.name in local:
            return local[m.name]
        if m.op == "placeholder":
            return self.inputs[self.plan.placeholder_index[m.name]]
        if m.op == "get_attr":
            return self.runner.fetch_attr(m.target)
        rec = self.node_meta.get(m.name)
        if rec is None:
            raise RuntimeError(f"ScheduleWrapper: no record of node {m.format_node()} needed to "
                               f"recompute before stage {t}; this is a bug")
        spec, leaves, rerun = rec
        if rerun:
            # A view of a parameter or another tensor that is not a Value: cheap to redo.
            args, kwargs = self._materialize_args(m, local, new_values, t)
            out = self.runner.call_for_recompute(m, args, kwargs)
        elif spec is None:  # a tensor (most nodes): no pytree to rebuild
            out = self._leaf(leaves[0], new_values, m, t)
        else:
            out = tree_unflatten([self._leaf(leaf, new_values, m, t) for leaf in leaves], spec)
        local[m.name] = out
        return out

    def _leaf(self, leaf: tuple, new_values: dict, m: fx.Node, t: int) -> Any:
        """One leaf of node m's recorded result (record_meta), rebuilt."""
        kind = leaf[0]
        if kind == _CONST:
            return leaf[1]
        if kind == _INPUT:
            _, i, size, stride, offset, grad = leaf
            return _flagged(torch.as_strided(self.inputs[i], size, stride, offset), grad)
        _, vid, size, stride, offset, grad = leaf
        base = new_values.get(vid)
        if base is None:
            base = self.resident.get(vid)
        if base is None:
            v = self.plan.graph.values[vid]
            raise RuntimeError(
                f"ScheduleWrapper: recomputation before stage {t} reads value {vid} ({v.name}) "
                f"through node {m.name}, which the schedule does not hold at this point. This "
                f"happens on a second backward through the same forward (retain_graph=True) "
                f"after the schedule released it: run the forward again for each backward, or "
                f"use a schedule without recomputation (or `with wrapped.plain():` for that "
                f"step). Otherwise the schedule does not match what the model saves: re-profile "
                f"and solve again.")
        return _flagged(torch.as_strided(base, size, stride, offset), grad)

    # -- forward bookkeeping ----------------------------------------------------------------
    def _register_outputs(self, node: fx.Node, result, store: dict | None, recompute: bool):
        """Give the creator node's new storages their Value ids."""
        # Same indexing as the profiler: position among the pytree leaves of a non-tensor result.
        value_of = self.plan.value_of
        if isinstance(result, torch.Tensor):
            made = ((None, result),)
        else:
            made = enumerate(tree_leaves(result))
        for idx, x in made:
            if not isinstance(x, torch.Tensor):
                continue
            v = value_of.get((node.name, idx))
            if v is None:
                continue
            if recompute:
                geom = self.vgeom.get(v)
                if geom is not None and _geometry(x) != geom:
                    x = _as_forward_layout(x, geom, node, v)
                store[v] = x
            else:
                storage = x.untyped_storage()
                key = storage._cdata
                self.vkey[v] = key
                self.key_values.setdefault(key, []).append(v)
                self.vgeom[v] = _geometry(x)
                # NOTE [Storage identity]: forget the key the moment the storage dies.
                self.vref[v] = weakref.ref(storage, functools.partial(
                    forget_key, self.vkey, self.key_values, v, key))
                if v in self.plan.keep_from_forward:
                    self.resident[v] = x.detach()
                elif self.host is not None and v in self.plan.offload:
                    self.to_offload[v] = x.detach()  # detached: NOTE [No reference cycles]

    def record_meta(self, node: fx.Node, op: int | None, result) -> None:
        """Remember how to rebuild this node's result from Values (geometry, no tensors):
        (pytree spec, or None for a tensor; one record per leaf; whether a leaf is neither a
        constant, a Value nor an input, so the node is run again)."""
        if isinstance(result, torch.Tensor):
            flat, spec = [result], None
        else:
            flat, spec = tree_flatten(result)
        leaves = []
        values = self.plan.graph.values
        candidates = ()
        if op is None:
            candidates = set()
            for a in node.all_input_nodes:
                rec = self.node_meta.get(a.name)
                if rec is not None:
                    candidates.update(leaf[1] for leaf in rec[1]
                                      if leaf[0] == _VALUE and leaf[1] in self.vkey)
        for x in flat:
            if not isinstance(x, torch.Tensor):
                leaves.append((_CONST, x))
                continue
            if x.is_conj() or x.is_neg():
                # A lazy conjugate or negation (c.conj()) is no geometry: run the view again.
                leaves.append((_RERUN,))
                continue
            key = x.untyped_storage()._cdata
            # requires_grad too: some kernels choose by it (NOTE [Recomputed layouts]).
            geom = (tuple(x.size()), tuple(x.stride()), x.storage_offset(), x.requires_grad)
            dtype = _dtype_name(x)
            match = None
            if op is not None:
                match = self._match(op, key, dtype)
            for v in candidates:
                if self.vkey.get(v) == key and values[v].dtype == dtype:
                    match = v
                    break
            if match is not None:
                leaves.append((_VALUE, match) + geom)
            elif key in self.input_keys and \
                    _dtype_name(self.inputs[self.input_keys[key]]) == dtype:
                leaves.append((_INPUT, self.input_keys[key]) + geom)
            else:
                leaves.append((_RERUN,))
        self.node_meta[node.name] = (spec, leaves, any(leaf[0] == _RERUN for leaf in leaves))

    def hook_stage(self, t: int, nodes: list) -> None:
        pre = functools.partial(self.on_stage, t)
        for fn in nodes:
            fn.register_prehook(pre)
        self.stage_hooked[t] += len(nodes)
        self.roots_pending[t] += len(nodes)

    def finish_forward(self) -> None:
        if self.to_offload:
            raise RuntimeError(f"ScheduleWrapper: offloaded values {sorted(self.to_offload)} were "
                               f"made but their ops never finished; this is a bug")
        self.vkey.clear()
        self.key_values.clear()
        self.vref.clear()
        self.pending.clear()
        self.current_op = None
        if self.plan.store_all:
            return
        missing = [t for t in sorted(self.plan.active_stages) if self.stage_hooked[t] == 0]
        if missing:
            graph = self.plan.graph
            names = ", ".join(f"op {graph.backward_order[t]} "
                              f"({graph.ops[graph.backward_order[t]].name})" for t in missing[:3])
            raise ScheduleError(
                f"ScheduleWrapper: {len(missing)} ops have a backward stage in the profiled graph "
                f"but created no autograd node in this run ({names}); the model does not run as "
                f"it was profiled (requires_grad or train/eval changed?): profile and solve again")


class Recomputation:
    """What the generated code of one recomputation calls back into (codegen.generated_recompute):
    the arguments it reads from outside its Op, the nodes run otherwise than in the forward, the
    Values it makes."""

    __slots__ = ("state", "op", "locals", "new_values", "t")

    def __init__(self, state: StepState, op: int, local: dict, new_values: dict, t: int):
        self.state, self.op, self.locals, self.new_values, self.t = state, op, local, new_values, t

    def arg(self, i: int) -> Any:
        """Node i of the traced graph, outside the Op: rebuilt from resident Values."""
        return self.state._materialize(self.state.runner._nodes[i], self.locals,
                                       self.new_values, self.t)

    def run(self, i: int, args: tuple, kwargs: dict) -> Any:
        """Node i as a recomputation runs it: a norm without its running statistics; the node of
        an in-place Impl in place as well, on the copy of the overwritten Value recomputed in
        this stage, which nothing reads afterwards (the simulator counts no new storage for its
        output here)."""
        runner = self.state.runner
        node = runner._nodes[i]
        plan = runner.plan
        if self.op in plan.overwrites:
            sub = plan.impl_calls.get(node.name)
            if sub is not None:
                return sub(runner, node, args, kwargs)
        stashed = plan.stashed_recompute.get(node.name)
        if stashed is not None:
            # Stashed only where the forward's input allowed it (StashedRecompute.applies);
            # recomputed under the forward's autocast state, this input does too. Without a
            # stash, recompute_op kept the generator state and the Op runs again.
            stash = self.state.stashes.get(self.op)
            if stash is not None:
                run, argument = stashed
                return run(args[0] if args else kwargs["input"], stash, argument)
        return runner.call_for_recompute(node, args, kwargs, self.state.bn_stats.get(node.name))

    def made(self, i: int, result: Any) -> None:
        """The Op's node ran: its new storages are the Op's Values."""
        self.state._register_outputs(self.state.runner._nodes[i], result, self.new_values,
                                     recompute=True)

    def local(self, name: str, result: Any) -> None:
        """A result of the Op that a node outside it, rebuilt by `arg`, reads."""
        self.locals[name] = result


def _view_of(base: torch.Tensor, h: Saved) -> torch.Tensor:
    """The tensor a Value handle stands for: its geometry over the Value's storage, read as the
    saved tensor's dtype, with its conjugate and negation bits."""
    if base.dtype != h.dtype:
        base = torch.empty(0, dtype=h.dtype, device=base.device).set_(base.untyped_storage())
    x = torch.as_strided(base, h.size, h.stride, h.offset)
    if x.is_conj() != h.conj:
        x = x.conj()
    if x.is_neg() != h.neg:
        x = neg_view(x) if h.neg else x.resolve_neg()
    return x


def _flagged(x: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A recomputation's argument (made under no_grad) flagged requires_grad as the forward's
    was, so that a kernel that chooses by it chooses as in the forward; nothing is recorded
    under no_grad either way (NOTE [Recomputed layouts])."""
    return x.detach().requires_grad_() if requires_grad and not x.requires_grad else x


def _geometry(x: torch.Tensor) -> tuple:
    return (tuple(x.size()), tuple(x.stride()), x.storage_offset(),
            x.untyped_storage().nbytes())


def _as_forward_layout(x: torch.Tensor, geom: tuple, node: fx.Node, v: int) -> torch.Tensor:
    """NOTE [Recomputed layouts]: `x` copied into the geometry the forward's result had."""
    size, stride, offset, nbytes = geom
    if tuple(x.size()) == size and offset == 0:
        y = torch.empty_strided(size, stride, dtype=x.dtype, device=x.device)
        if y.untyped_storage().nbytes() == nbytes:
            y.copy_(x)
            return y
    raise RuntimeError(
        f"ScheduleWrapper: recomputing node {node.name} gave value {v} another memory layout "
        f"than its forward did (size {tuple(x.size())}, strides {tuple(x.stride())}, offset "
        f"{x.storage_offset()} in {x.untyped_storage().nbytes()} bytes; the forward had size "
        f"{size}, strides {stride}, offset {offset} in {nbytes} bytes), which cannot be copied "
        f"back into the forward's layout; its readers would see other values. Run a schedule "
        f"that keeps this value (solve with a larger budget), and report the model")


def forget_key(vkey: dict, key_values: dict, v: int, key: int, _ref) -> None:
    try:
        if vkey.get(v) == key:
            del vkey[v]
        found = key_values.get(key)
        if found is not None and v in found:
            found.remove(v)
            if not found:
                del key_values[key]
    except KeyboardInterrupt:
        # A weakref callback cannot raise: a Ctrl-C landing here would be printed as "Exception
        # ignored" and lost. Kept, it is raised at the runtime's next node or backward stage.
        KEPT_INTERRUPTS.append(True)


# Ctrl-Cs caught where they could not be raised (forget_key), raised by `raise_kept_interrupt`.
KEPT_INTERRUPTS: list = []


def raise_kept_interrupt() -> None:
    if KEPT_INTERRUPTS:
        KEPT_INTERRUPTS.clear()
        raise KeyboardInterrupt
