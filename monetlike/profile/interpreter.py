"""The profiling run: an fx.Interpreter that groups fx nodes into Ops and measures what each holds.

One training step (forward node by node, then `loss.backward()`) runs under three of torch's own
mechanisms at once:
- a storage-tracking TorchDispatchMode (`memory.StorageTracker`) that sees every aten op, so we
  know which storages each node creates, which it writes in place, the peak during it, and (for
  analytical costs) the FLOPs and bytes of every aten op;
- `torch.autograd.graph.saved_tensors_hooks`, whose pack hook tells us exactly which tensors each
  node's backward will hold;
- hooks on every autograd node of every Op (`register_prehook` / `register_hook`), so that in the
  backward we see where each Op's stage starts, the engine's real order, and the gradient bytes
  live at each stage.

Grouping follows docs/execution-model.md: a node creating new storage starts an Op and its new
storages become Values; a node writing in place into a Value's storage joins the Op that created
it; views, getitem and non-tensor nodes belong to no Op. Everything is decided from storages
observed at run time, never from op names. A few cases cannot be one Op (an in-place write into a
storage that another Op already read, a write into a graph input): that node becomes an Op of its
own with no outputs, and both it and the creator of the storage are marked recompute-unsafe.

Ops are then put in a topological order that stays as close to the fx order as dependencies allow
(an in-place node joining its creator can read a Value made after the creator, e.g. the
downsample branch of a ResNet bottleneck when its add is written in place).
"""

from __future__ import annotations

import contextlib
import heapq
from typing import Any

import torch
import torch.fx as fx

from solver.errors import MonetlikeError

from ..capture.export_ops import RECOMPUTE_UNSAFE
from ..core.allocator import AllocatorLog
from ..impls.registry import observing_releases
from ..core import recompute as rc
from ..core.torch_private import outside_dispatch_modes, tensors_in, tree_leaves
from .costs import Roofline
from .memory import FIXED, INPUT, INTERNAL, OTHER, VALUE, StorageTracker, storage_of
from .safety import aten_unsafe_reason, module_hook_reason, written_tensors
from .records import (LOSS_FN, TO_COPY, Group, NodeRec, ProfileError, TmpValue, autocast_cast,
                      copies_of_written, dtype_name, node_kind, training_loss,
                      walk_new_autograd_nodes)
from .windows import AllocatorWindows

__all__ = ["ProfileRun"]


class ProfileRun(AllocatorWindows, fx.Interpreter):
    """One instrumented training step over a traced model; fills Groups and TmpValues."""

    def __init__(self, gm: fx.GraphModule, model: torch.nn.Module, *,
                 roofline: Roofline | None = None, device_note: str = "", progress=None,
                 device: torch.device | None = None):
        super().__init__(gm)
        # On a GPU, kernels also take scratch memory from the caching allocator that never shows
        # up as a tensor (cuDNN workspaces): read the allocator's peak as well.
        self.cuda = device if (device is not None and device.type == "cuda"
                               and torch.cuda.is_available()) else None
        self._alloc0 = 0
        self._other0 = 0
        self.gm, self.model, self.roofline, self.progress = gm, model, roofline, progress
        self.device_note = device_note
        self.tracker = StorageTracker(window_class=OTHER)
        # On the CPU, kernels take scratch from the allocator that never shows up as a tensor
        # (mm copying a non-contiguous operand): read the allocator's own events afterwards, at
        # marks left around each node and backward interval, and raise the tracker's figures.
        self.alloc = AllocatorLog() if device is not None and device.type == "cpu" else None
        self._marks = 0
        # (gid, marks, persistent, nograd marks, addresses of the storages the node left)
        self._fwd_windows: list[tuple] = []
        # (gid, start mark, Value bytes at start, the stage the simulator is in, first interval
        # of the stage?, what other stages hold then (_held_elsewhere), end mark)
        self._bwd_windows: list[tuple] = []
        # The same without the allocator's count: (gid, the simulator's stage, first?, held
        # elsewhere, the tracker's peak of non-Value bytes)
        self._tracked_windows: list[tuple] = []
        # Started stages that may still hold internals, and Values all of whose savers started:
        # what a stage autograd comes back to later keeps while others run (_held_elsewhere).
        self._holding_groups: set[int] = set()
        self._holding_values: dict[int, tuple[int, ...]] = {}  # tid -> the groups that saved it
        self._savers: dict[int, list[int]] | None = None
        self._window: tuple | None = None  # (the simulator's stage, first?, held elsewhere)
        self._windows_opened = 0
        # (class, tag) of a held thing -> the interval its last byte died in (_held_elsewhere)
        self._gone_at: dict[tuple, int] = {}
        self._bwd_open: tuple | None = None
        self._end: tuple[int, int] | None = None  # (mark, Value bytes) after the backward
        # Values freed inside a backward stage (autograd drops a saved Value once its node ran):
        # mark -> (group, Value tag, bytes). Those whose holding would raise the stage's peak
        # are the Op's `early_release` (`early_releases`): a schedule that holds one longer
        # adds its bytes back.
        self._value_frees: dict[int, tuple[int, int, int]] = {}
        # Values an Impl's backward let go of before its stage ended (`announce_release`), which
        # another Op's saved tensors may keep alive in this step: mark -> (group, tag, bytes) on
        # the CPU, as `_value_frees`; on the meta device, the open one with the stage's peak
        # before it.
        self._declared: dict[int, tuple[int, Any, int]] = {}
        self._meta_release: tuple | None = None
        self.tracker.on_free = self._on_free
        self.tracker.observers.append(self._on_aten)
        self.tracker.on_create = self._on_create
        self.groups: list[Group] = []
        self.values: list[TmpValue] = []
        self.readers: dict[int, list[tuple[int, int]]] = {}  # tid -> [(pos, gid)]
        self.foreign_writes: list[tuple[int, int, int]] = []  # (pos, gid, tid)
        self.taint: dict[str, list[str]] = {}  # non-op node -> unsafe reasons to pass on
        self.node_gid: dict[str, int] = {}
        self.fn_owner: dict[int, int] = {}
        self.fn_keep: list = []
        self.backward_order: list[int] = []
        self.output_tids: list[int] = []
        self.final_grad_bytes = 0
        self.cur: NodeRec | None = None
        self.phase = "setup"
        self.bcur: int | None = None
        self.pos = -1
        self.fixed_names: dict[int, str] = {}
        self.contiguous: dict[str, bool] = {}  # node -> its tensor result is contiguous
        # With a user's loss (loss_fn_in_use): the windows opened before its forward and before
        # its backward (_loss_window_start), whether the tracker watched it, and its forward's
        # peak. The CPU allocator's count is charged after the run (_charge_loss), the
        # tracker's and CUDA's when the first stage starts (_bwd_pre).
        self._loss: tuple | None = None
        # NOTE [Cached casts]: device type -> the dtype its autocast casts to, where cached
        self.cast_cache = {device: dtype for device, enabled, dtype in rc.autocast_state()
                           if enabled} if rc.step_caches_casts() else {}
        self._cast_leaves: set[int] = set()  # leaves whose cast the cache holds already
        self._cast_cache_bytes = 0

    # -- dispatch-level observers -----------------------------------------------------------
    def _on_create(self, key: int, nbytes: int) -> None:
        if self.cur is not None:
            self.cur.created.add(key)

    def _on_aten(self, func, args, kwargs, out) -> None:
        rec = self.cur
        if self.phase == "forward" and rec is not None:
            reason = aten_unsafe_reason(func, args, kwargs)
            if reason:
                rec.unsafe.append(reason)
            if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
                rec.random = True
            for t in written_tensors(func, args, kwargs):
                s = storage_of(t)
                if s is not None and s._cdata not in rec.created and s._cdata not in rec.writes:
                    rec.writes.append(s._cdata)
            if self.cast_cache and func is TO_COPY and autocast_cast(args[0], kwargs,
                                                                       self.cast_cache):
                s = storage_of(out)
                if s is not None:
                    rec.casts.append((id(args[0]), s._cdata, int(s.nbytes())))
            if self.roofline is not None:
                rec.cost += self.roofline.op_time(func, args, kwargs, out)
        elif self.phase == "backward" and self.bcur is not None and self.roofline is not None:
            self.groups[self.bcur].bwd_cost += self.roofline.op_time(func, args, kwargs, out)

    def _pack(self, t: torch.Tensor):
        rec = self.cur
        if rec is not None:
            s = storage_of(t)
            if s is not None:
                key = self.tracker.track(s)  # no-op when tracked; else it is something new
                rec.saved.append((key, int(s.nbytes())))
        return t

    # -- allocator windows (CPU) ------------------------------------------------------------
    def _mark(self) -> int | None:
        if self.alloc is None:
            return None
        self._marks += 1
        self.alloc.mark(self._marks)
        return self._marks

    def _on_free(self, nbytes: int, cls: str, tag) -> None:
        if (self.phase == "backward" and cls in (VALUE, INTERNAL)
                and (cls, tag) not in self.tracker.live_by_tag):
            self._gone_at[(cls, tag)] = self._windows_opened - 1
        if self.phase != "backward" or cls != VALUE or self.bcur is None:
            return
        if self.alloc is not None:
            self._value_frees[self._mark()] = (self.bcur, tag, nbytes)
        elif self.cuda is not None:  # pragma: no cover - no GPU in CI
            # The CUDA allocator's peak has no time: count every Value freed in the stage.
            self.groups[self.bcur].early_release.add(tag)

    def _on_release(self, t: torch.Tensor) -> None:
        """An Impl's backward is done with saved tensor `t` (NOTE in impls/registry.py): when `t`
        is a Value, it counts as freed here, as it is in a schedule that does not hold it past
        the stage; `early_releases` decides whether it is an early release."""
        s = storage_of(t)
        key = None if s is None else s._cdata
        if self.phase != "backward" or self.bcur is None or self.tracker.class_of(key) != VALUE:
            return
        tag, nbytes = self.tracker.tag_of(key), self.tracker.nbytes_of(key)
        if self.alloc is not None:
            self._declared[self._mark()] = (self.bcur, tag, nbytes)
        elif self.cuda is not None:  # pragma: no cover - no GPU in CI
            self.groups[self.bcur].early_release.add(tag)  # as _on_free does there
        else:
            # Meta: the window so far is the stage's first part, with the Value resident.
            if self._meta_release is not None:
                self._close_meta_release()
            self._meta_release = (self.bcur, tag, nbytes, self.tracker.window_class_peak)
            self.tracker.reset_window()

    def _close_meta_release(self) -> int:
        """The meta device's stage peak with a declared release: levels (gradients and other
        non-Value bytes) peaked at `before` with the Value resident and at `after` without it.
        Same rule as `early_releases` on these two levels. Returns the peak charged."""
        gid, tag, nbytes, before = self._meta_release
        self._meta_release = None
        after = self.tracker.window_class_peak
        g = self.groups[gid]
        peak = max(before, after - nbytes)
        g.bwd_peak = max(g.bwd_peak, peak)
        if after > before:  # holding the Value past the release would raise the peak
            g.early_release.add(tag)
        self.tracker.reset_window()
        return peak

    # -- the run ----------------------------------------------------------------------------
    def profile_step(self, inputs: tuple) -> None:
        if self.alloc is None:
            self._profile_step(inputs)
            return self._apply_tracked_windows()
        with self.alloc:
            self._profile_step(inputs)
        self._apply_allocator_windows()

    def _profile_step(self, inputs: tuple) -> None:
        tr = self.tracker
        for name, p in list(self.model.named_parameters()) + list(self.model.named_buffers()):
            s = storage_of(p)
            if s is not None:
                self.fixed_names.setdefault(tr.track(s, FIXED), name)
        for n in self.gm.graph.nodes:
            if n.op == "get_attr":
                obj = self.fetch_attr(n.target)
                if isinstance(obj, torch.Tensor) and storage_of(obj) is not None:
                    self.fixed_names.setdefault(tr.track(storage_of(obj), FIXED), n.target)
        for x in inputs:
            tr.track(storage_of(x), INPUT)
        self.phase = "forward"
        try:
            with tr, torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                out = self.run(*inputs)
            self.phase = "loss"
            leaves = tensors_in(out)
            for t in leaves:
                tid = tr.tag_of(storage_of(t)._cdata) if storage_of(t) is not None else None
                if tid is not None and tid not in self.output_tids and \
                        tr.class_of(storage_of(t)._cdata) in (VALUE, INPUT):
                    self.output_tids.append(tid)
            # With the allocator's count (and no roofline to read the backward's ops), the
            # backward runs outside the dispatch mode: under it autograd accumulates a Value's
            # gradients out of place (its tensors are shared with Python), which a plain step
            # does not. Frees are still seen: the tracker watches storages through weakrefs.
            plain = self.alloc is not None and self.roofline is None
            with contextlib.nullcontext() if plain else tr:
                user_loss = LOSS_FN.get() is not None
                if user_loss:
                    before = self._loss_window_start()
                loss = training_loss(out)
                if user_loss:
                    forward = self._loss_window_peak(before, tracked=not plain)
                    self._loss = (before, self._loss_window_start(), not plain, forward)
                if loss is not None:
                    self._let_go_of_unreached_nodes(loss)
                    self.phase = "backward"
                    with observing_releases(self._on_release):
                        loss.backward()
                    del loss
                self._close_interval()
                self.phase = "done"
            self.final_grad_bytes = tr.live_by_class[OTHER]
            if self.alloc is not None:
                self._end = (self._mark(), tr.live_by_class[VALUE] + tr.live_by_class[INTERNAL])
            del out, leaves
        finally:
            self.phase = "done"
            self.cur = None
            tr.close()
            # Autograd nodes hold our hooks and we held the nodes: a cycle through C++ objects
            # that Python's gc cannot see. Break it, and drop the interpreter's last values.
            self.fn_keep.clear()
            self.fn_owner.clear()
            self.env = {}

    def _let_go_of_unreached_nodes(self, loss: torch.Tensor) -> None:
        """Drop our hold on the autograd nodes the loss's backward cannot reach (a gate's, a
        detached statistic's). In a plain step and at run time (NOTE [Ops no backward reaches]
        in runtime/plan.py) they die with their results, and what they saved with them; held
        by `fn_keep`, they kept it through the backward, where a stage's Value then never
        showed as freed early."""
        seen: dict = {}
        walked: list = []  # keeps each wrapper, and so its id, alive while `seen` is read
        walk_new_autograd_nodes([loss], seen, walked, -1, lambda fn, gid, root: None)
        for fn in self.fn_keep:
            if id(fn) not in seen:
                del self.fn_owner[id(fn)]
        self.fn_keep[:] = [fn for fn in self.fn_keep if id(fn) in seen]

    def run_node(self, n: fx.Node) -> Any:
        self.pos += 1
        rec = NodeRec(n, self.pos)
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            for t in tree_leaves((args, kwargs)):
                s = storage_of(t)
                if s is not None:
                    rec.reads.append(s._cdata)
            self.tracker.reset_window()
            rec.start_live = self.tracker.live
            if self.cuda is not None:  # pragma: no cover - no GPU in CI
                torch.cuda.reset_peak_memory_stats(self.cuda)
                alloc0 = torch.cuda.memory_allocated(self.cuda)
            self.cur = rec
            start_mark = self._mark()
            try:
                result = getattr(self, n.op)(n.target, args, kwargs)
            except MonetlikeError:
                raise
            except Exception as e:
                raise ProfileError(
                    f"node {n.name} ({n.op} {node_kind(self.gm, n)}) failed while profiling"
                    f"{self.device_note}: {type(e).__name__}: {e}") from e
            finally:
                self.cur = None
            rec.peak = self.tracker.window_peak
            if start_mark is not None:
                rec.marks = (start_mark, self._mark())
            if self.cuda is not None:  # pragma: no cover
                rec.peak = max(rec.peak, rec.start_live
                               + torch.cuda.max_memory_allocated(self.cuda) - alloc0)
            if rec.writes:
                # The runtime's own rule (recompute.writes_left_out): the running statistics a
                # recomputed BatchNorm or InstanceNorm does not write again.
                left_out = rc.writes_left_out(n.op, n.target, args, kwargs, self.fetch_attr)
                rec.spared = frozenset(s._cdata for s in map(storage_of, left_out)
                                       if s is not None)
            if (self.phase == "forward" and n.op in ("call_module", "call_function",
                                                     "call_method") and not rec.unsafe):
                # A rerun writes no existing storage but what the recomputation leaves out, or
                # writes only whole tensors it is given (an in-place dropout into its Op's own
                # Value), which it is given copies of.
                copied = copies_of_written(args, kwargs, set(rec.writes) - rec.spared)
                if copied is not None:
                    rec.nograd_transient = self._nograd_transient(
                        rec, n, *copied, rc.batch_stats(result))
        if isinstance(result, torch.Tensor):
            self.contiguous[n.name] = result.is_contiguous()
        # Tensors the node wrote into in place (`x[idx] = y` returns None): their new grad_fn
        # (CopySlices) belongs to this node's Op.
        written = [t for t in tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor) and storage_of(t) is not None
                   and storage_of(t)._cdata in rec.writes]
        del args, kwargs
        self._after(rec, n, result, written)
        if self.progress is not None:
            self.progress.update(1)
        if not n.users and n.op != "output":
            return None  # nobody reads it: free it now, as eager PyTorch would
        return result

    def _nograd_transient(self, rec: NodeRec, n: fx.Node, args, kwargs,
                          stats: tuple | None) -> int:
        """Peak bytes of node `n` run again under no_grad, as the runtime recomputes it, above
        the memory before it and the outputs it leaves. Under no_grad nothing is saved for a
        backward, so an Impl's internals (a ReLU mask, max-pool indices) are not made unless the
        kernel makes them anyway (CPU dropout's noise, BatchNorm's batch statistics; an in-place
        dropout's noise, which its forward saved, is scratch here). Only for nodes whose
        recomputation writes no existing storage but the copies in `args` (run twice, an
        in-place write would apply twice); run by the runtime's own rule
        (rc.call_for_recompute: a BatchNorm without its running statistics takes another kernel
        path, with other scratch; a training one reuses its forward's batch statistics `stats`,
        as the runtime does). The generator state is put back, so later nodes draw what they
        drew before."""
        tr = self.tracker
        tr.reset_window()
        start = tr.live
        if self.cuda is not None:  # pragma: no cover - no GPU in CI
            torch.cuda.reset_peak_memory_stats(self.cuda)
            alloc0 = torch.cuda.memory_allocated(self.cuda)
        devices = [self.cuda] if self.cuda is not None else []
        # NOTE [No-grad runs outside the tracker]: on the CPU the allocator's log measures the
        # rerun, so it runs with the tracker's dispatch mode set aside, as the runtime runs it.
        # Under a Python dispatch mode a composite op's intermediates live longer (a GRU under
        # no_grad held 2,048 B more, the size of its input: the forward of an Op no backward
        # reaches predicted 4.9% over the measured peak, found by the fuzzer).
        aside = outside_dispatch_modes() if self.alloc is not None else contextlib.nullcontext()
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                start_mark = self._mark()  # after fork_rng's own copy of the state
                with aside:
                    again = rc.call_for_recompute(n.op, n.target, args, kwargs,
                                                  self.fetch_attr, stats)
                end_mark = self._mark()
        except Exception as e:
            raise ProfileError(
                f"node {n.name} ({n.op} {node_kind(self.gm, n)}) failed when run again under "
                f"no_grad to measure its recomputation{self.device_note}: "
                f"{type(e).__name__}: {e}") from e
        peak = tr.window_peak
        if self.cuda is not None:  # pragma: no cover
            peak = max(peak, start + torch.cuda.max_memory_allocated(self.cuda) - alloc0)
        left = tr.live  # its outputs (held by `again`)
        if start_mark is not None:
            rec.nograd_marks = (start_mark, end_mark)
        del again
        return max(0, peak - left)

    # -- grouping ---------------------------------------------------------------------------
    def _newly_cached(self, rec: NodeRec) -> int:
        """NOTE [Cached casts]: bytes of the first casts of leaf tensors this node made that died
        with it here, and that the step's cache keeps to the end of its autocast block."""
        n = 0
        for leaf, key, nbytes in rec.casts:
            if leaf not in self._cast_leaves:
                self._cast_leaves.add(leaf)
                if key not in self.tracker.entries:
                    n += nbytes
        return n

    def _new_value(self, name, index, t: torch.Tensor, nbytes, producer) -> int:
        tid = len(self.values)
        self.values.append(TmpValue(tid, name, index, tuple(t.shape), dtype_name(t.dtype),
                                    int(nbytes), producer, bool(t.requires_grad)))
        return tid

    def _after(self, rec: NodeRec, n: fx.Node, result: Any, written=()) -> None:
        tr = self.tracker
        multi = not isinstance(result, torch.Tensor)
        leaves = tree_leaves(result)
        if n.op == "placeholder":
            for i, t in enumerate(leaves):
                s = storage_of(t)
                if s is None:
                    continue
                key = tr.track(s, INPUT)
                if tr.tag_of(key) is None and tr.class_of(key) in (INPUT, OTHER):
                    tid = self._new_value(n.name, i if multi else None, t, s.nbytes(), None)
                    tr.set_class(key, INPUT, tid)
            return
        if n.op in ("output", "get_attr"):
            return

        # Unsafe reasons raised in non-op nodes flow on to the ops that consume them.
        reasons = list(rec.unsafe) + list(n.meta.get(RECOMPUTE_UNSAFE, ()))  # from the capture
        for inp in n.all_input_nodes:
            reasons.extend(self.taint.get(inp.name, ()))
        fixed_writes, value_writes = [], []
        for key in rec.writes:
            cls = tr.class_of(key)
            if cls == FIXED:
                fixed_writes.append(key)
            elif cls in (VALUE, INPUT):
                value_writes.append(tr.tag_of(key))
        for key in fixed_writes:
            if key not in rec.spared:
                name = self.fixed_names.get(key, "?")
                reasons.append(f"writes parameter or buffer '{name}' in place")
        if n.op == "call_module":
            hook = module_hook_reason(self.gm.get_submodule(n.target), n.target)
            if hook:
                reasons.append(hook)

        # New storages among the outputs: this node creates Values and starts an Op.
        new: list[tuple[int, torch.Tensor, Any]] = []
        seen = set()
        for i, t in enumerate(leaves):
            s = storage_of(t)
            if s is None:
                continue
            key = s._cdata
            cls = tr.class_of(key)
            if cls is None:
                tr.track(s, OTHER)
                cls = OTHER
            if cls in (VALUE, INPUT, FIXED) or key in seen:
                continue
            seen.add(key)
            new.append((i, t, s))

        g: Group | None = None
        if new:
            g = self._open_group(n, rec)
            for i, t, s in new:
                tid = self._new_value(n.name, i if multi else None, t, s.nbytes(), g.gid)
                tr.set_class(s._cdata, VALUE, tid)
                g.outputs.append(tid)
        elif value_writes:
            target = value_writes[0]
            producer = self.values[target].producer
            standalone = producer is None or any(
                gid != producer for _, gid in self.readers.get(target, ()))
            if standalone:
                g = self._open_group(n, rec)
                if producer is None:
                    g.add_unsafe(f"overwrites graph input {self.values[target].name} in place")
            else:
                g = self.groups[producer]
                g.nodes.append(n.name)
                g.positions.append(rec.pos)
                self.node_gid[n.name] = g.gid
            for t in leaves:
                s = storage_of(t)
                if s is not None and tr.tag_of(s._cdata) == target and t.requires_grad:
                    v = self.values[target]
                    self.values[target] = TmpValue(**{**v.__dict__, "requires_grad": True})
        if g is not None and g.cached_casts_before is None:
            g.cached_casts_before = self._cast_cache_bytes
        self._cast_cache_bytes += self._newly_cached(rec)
        if g is None:
            if reasons:
                self.taint[n.name] = reasons
            return
        for r in reasons:
            g.add_unsafe(r)

        # Inputs: Values whose storage the node reads (views included), other than its own.
        for key in rec.reads:
            if tr.class_of(key) in (VALUE, INPUT):
                self._add_input(g, tr.tag_of(key), rec.pos)
        # Writes into storages this Op did not create.
        for tid in value_writes:
            if tid in g.outputs:
                continue
            self._add_input(g, tid, rec.pos)
            self.foreign_writes.append((rec.pos, g.gid, tid))
            g.add_unsafe(f"overwrites value {self.values[tid].name} (made by another op) in place")
            p = self.values[tid].producer
            if p is not None and p != g.gid:
                self.groups[p].add_unsafe(
                    f"its output {self.values[tid].name} is later overwritten in place by node "
                    f"{n.name} of another op (recomputing would give the old contents)")
            # An Op that read the old contents would read the new ones when recomputed (every
            # recomputation runs after the forward, so after this write).
            for pos, reader in self.readers.get(tid, ()):
                if pos < rec.pos and reader not in (g.gid, p):
                    self.groups[reader].add_unsafe(
                        f"reads value {self.values[tid].name}, which node {n.name} of another op "
                        f"later overwrites in place (recomputing would read the new contents)")

        # What the backward holds.
        persistent = sum(self.values[tid].nbytes for tid in g.outputs
                         if self.values[tid].name == n.name)
        for key, nbytes in rec.saved:
            cls = tr.class_of(key)
            if cls == VALUE:
                tid = tr.tag_of(key)
                if tid not in g.outputs and tid not in g.inputs:
                    self._add_input(g, tid, rec.pos)
                g.saved.add(tid)
            elif cls == OTHER:
                tr.set_class(key, INTERNAL, g.gid)
                g.internal_bytes += nbytes
                if key in rec.created:
                    persistent += nbytes
            # INPUT and FIXED: always resident, not the schedule's business; INTERNAL: already
            # counted for the Op that created it.
        workspace = rec.peak - rec.start_live - persistent
        g.fwd_workspace = max(g.fwd_workspace, workspace)
        # A node not run again (it writes in place, or the Op is never recomputed) counts its
        # forward workspace.
        g.recompute_workspace = max(g.recompute_workspace, workspace
                                    if rec.nograd_transient is None else rec.nograd_transient)
        g.nograd_exact = g.nograd_exact and rec.nograd_transient is not None and not rec.writes
        g.nograd_workspace = max(g.nograd_workspace, rec.nograd_transient or 0)
        g.random = g.random or rec.random
        if rec.marks is not None:
            left = {s.data_ptr() for s in (*map(tr.storage, rec.created), *map(storage_of, leaves))
                    if s is not None}
            self._fwd_windows.append((g.gid, rec.marks, persistent, rec.nograd_marks, left))
        g.fwd_cost += rec.cost
        walk_new_autograd_nodes(list(leaves) + list(written), self.fn_owner, self.fn_keep,
                                 g.gid, self._hook_fn)

    def _open_group(self, n: fx.Node, rec: NodeRec) -> Group:
        g = Group(gid=len(self.groups), name=n.name, kind=node_kind(self.gm, n), position=rec.pos)
        g.nodes.append(n.name)
        g.positions.append(rec.pos)
        self.groups.append(g)
        self.node_gid[n.name] = g.gid
        return g

    def _add_input(self, g: Group, tid: int, pos: int) -> None:
        if tid in g.outputs:
            return
        if tid not in g.inputs:
            g.inputs.append(tid)
        self.readers.setdefault(tid, []).append((pos, g.gid))

    # -- backward stages --------------------------------------------------------------------
    def _hook_fn(self, fn, gid: int, root: bool) -> None:
        fn.register_prehook(lambda grad_outputs, gid=gid, root=root: self._bwd_pre(gid, root))

    def _close_interval(self) -> None:
        if self._bwd_open is not None:
            self._bwd_windows.append((*self._bwd_open, self._mark()))
            self._bwd_open = None
        if self.bcur is None:
            return
        if self._meta_release is not None:
            peak = self._close_meta_release()
        else:
            peak = self.tracker.window_class_peak
            if self.cuda is not None:  # pragma: no cover - no GPU in CI
                peak = max(peak, self._other0 + torch.cuda.max_memory_allocated(self.cuda)
                           - self._alloc0)
        self._tracked_windows.append((self.bcur, *self._window, peak))

    def _bwd_pre(self, gid: int, root: bool) -> None:
        if gid == self.bcur:
            return None
        if not root and not self.groups[gid].ran_backward:
            # A node the Op claimed that is none of its results' grad_fn, run before any of
            # those: a view between Ops, claimed by the first Op to read it (one whose results
            # may lead nowhere), run for another reader. As at run time, where a stage starts
            # at a result's grad_fn only, it runs in the stage under way.
            return None
        loss_peaks = ()
        if self._loss is not None and not self.backward_order:
            # the first stage: the loss's backward ends where the model's begins
            _, start, tracked, forward = self._loss
            loss_peaks = (forward, self._loss_window_peak(start, tracked))
        self._close_interval()
        self.bcur = gid
        g = self.groups[gid]
        first = not g.ran_backward
        if not g.ran_backward:
            g.ran_backward = True
            self.backward_order.append(gid)
            g.stage_start = self.tracker.live_by_class[OTHER]
            # The first stage is charged the loss's peaks as well (_charge_loss says why).
            g.bwd_peak = max((g.stage_start, *loss_peaks))
            self._start_holding(g)
        owner = self.backward_order[-1]
        self._window = (owner, first, self._held_elsewhere(owner))
        self._windows_opened += 1
        self.tracker.reset_window()
        if self.alloc is not None:
            tr = self.tracker
            self._bwd_open = (gid, self._mark(), tr.live_by_class[VALUE]
                              + tr.live_by_class[INTERNAL], *self._window)
        if self.cuda is not None:  # pragma: no cover - no GPU in CI
            torch.cuda.reset_peak_memory_stats(self.cuda)
            self._alloc0 = torch.cuda.memory_allocated(self.cuda)
            self._other0 = self.tracker.live_by_class[OTHER]
        return None

    # -- the order of Ops -------------------------------------------------------------------
    def topological_order(self) -> list[int]:
        """Group ids in a dependency order, as close to fx order as possible."""
        succ: dict[int, set[int]] = {g.gid: set() for g in self.groups}
        for g in self.groups:
            for tid in g.inputs:
                p = self.values[tid].producer
                if p is not None and p != g.gid:
                    succ[p].add(g.gid)
        for pos, wg, tid in self.foreign_writes:
            for rpos, rg in self.readers.get(tid, ()):
                if rg == wg:
                    continue
                if rpos < pos:
                    succ[rg].add(wg)
                elif rpos > pos:
                    succ[wg].add(rg)
        indeg = {gid: 0 for gid in succ}
        for s in succ.values():
            for b in s:
                indeg[b] += 1
        heap = [(self.groups[gid].position, gid) for gid, d in indeg.items() if d == 0]
        heapq.heapify(heap)
        order = []
        while heap:
            _, gid = heapq.heappop(heap)
            order.append(gid)
            for b in succ[gid]:
                indeg[b] -= 1
                if indeg[b] == 0:
                    heapq.heappush(heap, (self.groups[b].position, b))
        if len(order) != len(self.groups):  # pragma: no cover - the grouping rules prevent it
            stuck = [self.groups[g].name for g, d in indeg.items() if d > 0]
            raise ProfileError(f"op groups form a cycle (in-place aliasing the profiler cannot "
                               f"order): {stuck[:8]}")
        return order
