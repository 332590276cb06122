"""The scheduled training step: generated code for the forward, hooks for the backward stages.

`ScheduledForward` runs the traced model with grad enabled, building one ordinary autograd graph,
the nodes that touch a scheduled Value inside `torch.autograd.graph.saved_tensors_hooks`
(docs/execution-model.md section 5). `StepState` is everything one step needs after the forward
returns: the resident Values, the geometry of nodes a recomputation reads, the RNG and autocast
state of recomputed Ops, and the progress of the backward stages. Only autograd references it
(through the saved handles and the stage hooks), so it dies with the step's autograd graph.

NOTE [Stage boundaries]
Each Op's stage starts when the first of its autograd nodes is about to run. The prehooks sit on
the nodes that give the Op's results their grad_fn ("roots"; after an in-place write through a
view, the base's new grad_fn too): a gradient can only enter an Op's part of the graph through its
results, so a root runs first. A stage ends when another stage starts after all its roots have
started (the prehooks count them; the engine runs one node at a time, so a root that started before
another stage's prehook fired has run), or when the backward finishes (an engine callback). Not at its last
root: nodes behind the roots (a module's inner nodes) still unpack saved tensors. Not at the next
stage's start alone: an Op whose fx nodes are not contiguous (`out.add_(identity)` with the
identity branch computed after `out`) has nodes created before and after another Op's, and the
engine, which runs the ready node created last, runs part of it, then the other Op, then the rest.
For contiguous Ops the two rules agree, because when a node runs every node created after it
that will run has run. If the engine prunes a root (torch.autograd.grad with `inputs=`), the
stage ends with the backward: later than the schedule says, never too early. Hooking roots only,
rather than every node an Op created, costs microseconds per Op. Only the active stages are
hooked (`Plan.active_stages`: those that fetch, recompute or release a Value the runtime holds);
the others leave everything to autograd, and a running stage then ends when the next active
stage starts. That is later than the schedule's stage end, which only matters for handles whose
node did not run or was retained (retain_graph=True): their Values are let go at that point.

NOTE [Storage identity]
A saved tensor is matched to a Value by storage identity (`untyped_storage()._cdata`), and only
against the Values of the Op running now, which are alive... almost: an Op's input can die in the
middle of the Op (after the last of its nodes that reads it), and the next allocation can reuse
its StorageImpl address. MobileNetV2's in-place ReLU6 clones its input after BatchNorm released
the convolution output; the clone got the convolution output's address and was taken for it.
So each Value's key is dropped by a weakref callback on its storage the moment the storage dies
(an UntypedStorage's Python object lives exactly as long as the storage, since PyTorch 2.1). The
callback holds the key dictionary only, never the StepState.

NOTE [Where the hooks are]
The saved-tensor hooks are pushed only around the nodes of Ops that read or make a scheduled
Value (NOTE [Value handling] in plan.py): only there can a saved tensor need a handle; and around
those of Ops no backward reaches, which keep nothing (NOTE [Ops no backward reaches]). Every other
node saves its tensors the ordinary way, with autograd's own version checks and without a Python
call per tensor, and a tensor saved that way keeps its history, so double backward through it is
right. A schedule that recomputes nothing (store-all) runs as plain autograd where no Op no
backward reaches saves anything: fx's generated code for the traced graph, bound to the live
model; no hooks, no stage prehooks, no recorded contexts.

NOTE [Generated forward]
The forward is the traced graph's own Python code (fx codegen), bound to the live model, in which
only the nodes a schedule needs at run time call back into the runtime (`Plan.runtime_nodes`): the
nodes of Ops that read or make a scheduled Value (saved-tensor hooks), of recomputed Ops (RNG and
autocast capture, buffer checks), of Ops making a Value the runtime holds or offloads (their
storage is registered), of Ops whose stage is active (stage hooks) or run with a registered Impl,
and the nodes whose geometry a recomputation rebuilds its arguments from. Every other node costs
what it costs in the model's own forward: a schedule recomputing 4 Ops of DenseNet-121's 600 runs
a few dozen nodes through Python bookkeeping, not 1,300 through an interpreter.

NOTE [Generated recomputation]
A recomputation runs its Op's nodes as generated code too (codegen.generated_recompute, built at
the Op's first recomputation and kept with the plan): fx's code for each node, in the forward's
order, under no_grad and the Op's recorded RNG and autocast state. What it reads from outside the
Op (the resident Values through the geometry the forward recorded, inputs, parameters) and the
nodes a recomputation runs otherwise than the forward (a norm without its running statistics,
an in-place Impl) call back into `Recomputation`; nothing else goes through Python bookkeeping
per node. Every result of the Op lives until the Op is done, as the profile measured it.

NOTE [In place on a view]
An in-place Impl (monetlike/impls/inplace.py) runs `x.add_(y)` or `torch.relu_(x)` where the model
wrote `x + y` or `torch.relu(x)`, and claims the out-of-place op's backward: the same saved
tensors, the same gradient memory (the profile measured Impl 0's). That holds when x is an
ordinary tensor, not when autograd tracks x as a view of another tensor, which the result of
an Op often is: a Linear on a 3-d input returns a view of its 2-d addmm, and
`layer(x.transpose(1, 2)).transpose(1, 2)` a transposed view. Written in place, a view makes
autograd rebase the view's history onto its base (CopySlices): the backward then clones the
incoming gradient into a base-sized buffer and hands the Op's inputs two gradient tensors where
the out-of-place add hands them one, so a gradient-sized buffer more stays alive until the
base's backward has run (a GPT's last residual add run in place: +262,144 B at the next stage's
peak, over the schedule's budget; tests/test_peak_fidelity_cases.py).
It also leaves the view's own grad_fn, on which the Op's stage hook sits, out of the graph. So
the runtime writes through a plain alias of x (`_PlainAlias`: aten._unsafe_view to x's own size,
same storage and strides, not a view to autograd), whose backward hands on the incoming
gradient itself: the in-place kernel's backward is then the out-of-place one's, node for node,
plus that pass-through. Not _unsafe_view's own backward, a reshape to the same shape: that is a
second tensor on the gradient's storage, and a later Op summing its gradient into x's then can
no longer do it in place (the storage is shared), so it allocates a gradient-sized buffer the
profile did not see (a fuzzed model: 960 B over an in-place schedule's prediction). Nothing
checks versions on x's storage afterwards, and nothing needs to: the in-place Impl is only
offered where no backward reads that storage. Under no_grad (recomputation) there is no view
tracking and nothing to do.

NOTE [Recomputed layouts]
A recomputed Value is read through the geometry (sizes, strides, offset into its storage) that
the forward recorded: the views between Ops and the saved tensors are rebuilt with as_strided on
the recomputed storage. So a recomputation must lay its result out as the forward did, and some
kernels choose by whether their inputs require grad, which tensors made under no_grad do not:
scaled_dot_product_attention on the CPU with a mask that requires grad (a Swin window's learned
relative-position bias) runs the math path, whose output is laid out like the query (B, L, H, D
in memory), and with one that does not, the fused kernel, whose output is a contiguous
(B, H, L, D). Recomputed from a mask made under no_grad, read with the forward's strides, that
storage gave the next Op a transposed tensor: wrong values and gradients, silently (Hugging Face
Swin). So the arguments a recomputation rebuilds from Values and inputs are flagged
requires_grad as the forward's were (`_flagged`; the profiler measures the recomputation with
the forward's own arguments, so the kernel and its scratch are those it measured), and, for
whatever else makes a kernel choose otherwise, the forward records each Value's geometry
(`vgeom`) and a recomputed result laid out otherwise is copied into the forward's layout
(`_as_forward_layout`: a transient of the Value's size that the profile does not have) before
anything reads it.

NOTE [No reference cycles]
A step's state must die with its autograd graph, also with the garbage collector disabled
(a 50-step test checks this). So StepState never holds an autograd node or a tensor with a
grad_fn: `resident` holds detached aliases, the generated forward's locals die when it returns,
and node lists live only on the stack while the forward runs. Autograd holds the state (handles
and hooks point to it), never the other way round.
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from typing import Any

import torch
import torch.fx as fx

from solver.errors import ScheduleError

from ..impls.dropout import dropout_from_mask
from ..torch_private import (current_graph_task_id, neg_view, queue_engine_callback, tree_flatten,
                             tree_leaves, tree_unflatten)
from . import recompute as rc
from .codegen import MISSING, attr_path, generated_forward, generated_recompute
from .hooks import (CREATE_GRAPH_MESSAGE, Saved, missing_value_message, stage_roots,
                    unreached_message)
from .offload import HostCopies
from .plan import Plan, module_of

NOT_STARTED, RUNNING, DONE = 0, 1, 2

# Leaf kinds of a node's recorded result (used to rebuild a recomputation's arguments).
_CONST, _VALUE, _INPUT, _RERUN = 0, 1, 2, 3


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(t: torch.Tensor) -> str:
    # Looked up: str(dtype) costs a microsecond, and every recomputed Op's node asks.
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        name = _DTYPE_NAMES[t.dtype] = str(t.dtype).replace("torch.", "")
    return name


class StepState:
    """One training step's runtime state (see the module docstring)."""

    def __init__(self, plan: Plan, runner: "ScheduledForward", inputs: tuple):
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
        self.masks: dict[int, torch.Tensor] = {}
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
        if _INTERRUPTED:
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
            self.masks.clear()
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
        if j in self.masks:
            # NOTE [Recomputed from the mask]: nothing is drawn, so no generator state is set
            # (its 5 KB state tensor would be a transient the profile did not count).
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
                    _forget, self.vkey, self.key_values, v, key))
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


AUTOCAST_CACHE_MESSAGE = (
    "ScheduleWrapper: the backward runs inside the torch.autocast block of the forward, with its "
    "weight-cast cache on: the casts of the parameters stay alive to the end of the block, "
    "memory the schedule did not count (it can peak over its budget). Call backward after the "
    "autocast block, as PyTorch's mixed-precision recipe does, or use "
    "torch.autocast(..., cache_enabled=False)")


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
        p = plan.mask_recompute.get(node.name)
        if p is not None:  # NOTE [Recomputed from the mask] in impls/dropout.py
            # Held only when the forward's input was a float32/64 CPU tensor; recomputed under
            # the forward's autocast state, this input is too. Without it, recompute_op kept the
            # generator state and the dropout draws again.
            mask = self.state.masks.get(self.op)
            if mask is not None:
                return dropout_from_mask(args[0] if args else kwargs["input"], mask, p)
        return runner.call_for_recompute(node, args, kwargs, self.state.bn_stats.get(node.name))

    def made(self, i: int, result: Any) -> None:
        """The Op's node ran: its new storages are the Op's Values."""
        self.state._register_outputs(self.state.runner._nodes[i], result, self.new_values,
                                     recompute=True)

    def local(self, name: str, result: Any) -> None:
        """A result of the Op that a node outside it, rebuilt by `arg`, reads."""
        self.locals[name] = result


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

    def mask_stash(self, node: fx.Node):
        """Where a dropout_mask Impl puts its mask (NOTE [Recomputed from the mask]): (dict,
        key) for a dropout the schedule recomputes from it, else None."""
        if self.state is None or node.name not in self.plan.mask_recompute:
            return None
        return self.state.masks, self.plan.node_op[node.name]

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
        if _INTERRUPTED:
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
            if rc.module_has_hooks(mod):
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


def _forget(vkey: dict, key_values: dict, v: int, key: int, _ref) -> None:
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
        _INTERRUPTED.append(True)


# Ctrl-Cs caught where they could not be raised (_forget), raised by `raise_kept_interrupt`.
_INTERRUPTED: list = []


def raise_kept_interrupt() -> None:
    if _INTERRUPTED:
        _INTERRUPTED.clear()
        raise KeyboardInterrupt


__all__ = ["StepState", "ScheduledForward", "module_of"]
