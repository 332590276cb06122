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
import contextvars
import heapq
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from solver.errors import MonetlikeError

from ..allocator import AllocatorLog
from ..export_ops import RECOMPUTE_UNSAFE
from ..impls.registry import observing_releases
from ..runtime import recompute as rc
from ..runtime.hooks import stage_roots
from ..torch_private import outside_dispatch_modes, tensors_in, tree_leaves, tree_map
from .costs import Roofline, Timer
from .memory import FIXED, INPUT, INTERNAL, OTHER, VALUE, StorageTracker, storage_of
from .safety import aten_unsafe_reason, module_hook_reason, written_tensors

__all__ = ["ProfileError", "ProfileRun", "TimingRun", "Group", "TmpValue"]


class ProfileError(MonetlikeError, RuntimeError):
    """The model could not be run while profiling (a node failed)."""


@dataclass
class TmpValue:
    tid: int
    name: str
    index: int | None
    shape: tuple
    dtype: str
    nbytes: int
    producer: int | None  # group id
    requires_grad: bool


@dataclass
class Group:
    gid: int
    name: str
    kind: str
    position: int  # fx position of the first node: the ordering priority
    nodes: list = field(default_factory=list)
    positions: list = field(default_factory=list)
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    saved: set = field(default_factory=set)
    internal_bytes: int = 0  # saved tensors the saved-tensor hooks saw that are not Values
    # Bytes its autograd nodes keep outside those hooks until its backward ran (autograd saves a
    # Python number wrapped as a 0-dim tensor, `x * 1.5`'s 1.5, without calling them): found
    # from the CPU allocator's blocks (_apply_allocator_windows).
    unhooked_bytes: int = 0
    fwd_workspace: int = 0
    recompute_workspace: int = 0  # the forward's transient under no_grad (how it is recomputed)
    # The same as measured, before the RNG replay's state is added, and whether every node was
    # rerun so, writing nothing (the forward's own kernels): the forward of an Op no backward
    # reaches, whose saved tensors the runtime lets go (forward_figures).
    nograd_workspace: int = 0
    nograd_exact: bool = True
    random: bool = False  # draws random numbers (an aten op tagged nondeterministic_seeded)
    unsafe: list = field(default_factory=list)
    fwd_cost: float = 0.0
    bwd_cost: float = 0.0
    ran_backward: bool = False
    stage_start: int = 0
    bwd_peak: int = 0
    early_release: set = field(default_factory=set)  # Value tags autograd freed before the peak
    # Bytes the step's autocast cache holds when the Op starts (NOTE [Cached casts]).
    cached_casts_before: int | None = None

    def forward_figures(self) -> tuple[int, int]:
        """(internal_bytes, fwd_workspace) of the Op's default Impl. An Op no backward reaches
        keeps nothing at run time (NOTE [Ops no backward reaches] in monetlike/runtime/plan.py):
        its forward is then its no_grad run, where every node was rerun exactly; otherwise its
        internals count at its forward point, an upper bound."""
        if not self.ran_backward and self.nograd_exact:
            return 0, self.nograd_workspace
        return self.held_bytes, self.fwd_workspace

    @property
    def held_bytes(self) -> int:
        """What the Op holds from its forward to its backward besides Values: its Impl's
        `internal_bytes`."""
        return self.internal_bytes + self.unhooked_bytes

    def add_unsafe(self, reason: str) -> None:
        if reason and reason not in self.unsafe:
            self.unsafe.append(reason)


def _last_windows(windows: list[tuple]) -> dict[int, int]:
    """group -> the index of its last backward interval among `windows` (group first)."""
    return {w[0]: k for k, w in enumerate(windows)}


def _still_held(held: tuple, last: dict[int, int], gone_at: dict[tuple, int]) -> int:
    """Bytes of `held` (_held_elsewhere at the start of an interval) that die by the last
    interval of a group holding them: kept for a later interval of that group (NOTE [Interleaved
    stages]). What outlives its groups' backward is held for another reason, not this one."""
    return sum(n for key, groups, n in held
               if key in gone_at and gone_at[key] <= max(last[g] for g in groups))


def _early_releases(levels: list[int], frees: list[tuple[int, int, int]]) -> list[int]:
    """The Values among `frees` ((position in `levels`, tag, bytes), in time order) that a stage
    must count as early releases, given the allocator's `levels` over the stage.

    The model charges the stage its natural peak max(levels) plus the bytes of each early
    release a schedule holds past the stage. Every Value freed before the peak is one (holding it
    raises the peak by its bytes, exactly). A Value freed after the peak is left out only if
    holding it, together with those already left out, keeps every later level at or under the
    peak: then no schedule, whatever it holds, peaks above the prediction (a later allocation,
    e.g. an out-of-place gradient sum, can make a second peak that a held Value would raise)."""
    if not frees:
        return []
    peak = max(levels)
    first_peak = levels.index(peak)
    raised = list(levels)  # the levels with the left-out Values held
    early = []
    for pos, tag, nbytes in sorted(frees):
        if pos <= first_peak or max(raised[pos + 1:], default=0) + nbytes > peak:
            early.append(tag)
            continue
        for q in range(pos + 1, len(raised)):
            raised[q] += nbytes
    return early


class _NodeRec:
    __slots__ = ("node", "pos", "created", "writes", "spared", "reads", "saved", "unsafe", "cost",
                 "start_live", "peak", "nograd_transient", "marks", "nograd_marks", "random",
                 "casts")

    def __init__(self, node: fx.Node, pos: int):
        self.node, self.pos = node, pos
        self.created: set[int] = set()
        self.writes: list[int] = []
        self.spared: frozenset[int] = frozenset()  # writes a recomputation leaves out
        self.reads: list[int] = []
        self.saved: list[tuple[int, int]] = []
        self.unsafe: list[str] = []
        self.cost = 0.0
        self.start_live = 0
        self.peak = 0
        self.nograd_transient: int | None = None
        self.marks: tuple | None = None  # allocator marks around the node (CPU runs)
        self.nograd_marks: tuple | None = None  # and around its no_grad rerun
        self.random = False
        # Autocast's casts of leaf tensors: (id of the leaf, storage key of the cast, bytes)
        self.casts: list[tuple[int, int, int]] = []


# NOTE [Cached casts]
# Autocast casts a float32 leaf that requires grad (a parameter) to its lower precision once per
# autocast block when its cache is on (the default), and keeps the cast until the block exits.
# The profile runs with the cache off (NOTE [Autocast cache] in runtime/recompute.py): a cast
# the backward saves (a Linear's weight) lives as long either way, but one it does not save (a
# Linear's bias) dies with its op there, while a cached step keeps it to the end of the forward
# (a two-layer ViT under bfloat16: 960 B over the predicted forward peak, and a schedule over its
# budget). So, when the caller's autocast caches, each leaf's first cast that died with its node
# is counted held from then to the end of the forward: every later Op's `fwd_workspace` carries
# the bytes held so far (`Group.cached_casts_before`; the forward is the same for every schedule
# and Impl). The backward and its recomputations run after the block, with the cache empty.
_TO_COPY = torch.ops.aten._to_copy.default


def _autocast_cast(x: Any, kwargs: dict, cast_to: dict) -> bool:
    """Whether `_to_copy(x, **kwargs)` is a cast autocast caches: a float32 leaf that requires
    grad, not a view, to the dtype autocast casts to on its device (`cast_to`; read outside
    the dispatch, where autocast shows as off)."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or not x.is_leaf \
            or not x.requires_grad or x._is_view():
        return False
    return kwargs.get("dtype") == cast_to.get(x.device.type)


# The user's loss, while `profile(..., loss_fn=...)` runs: every run of the profile (the
# instrumented step, the timing steps, the Impls' rounds) ends with it.
_LOSS_FN: contextvars.ContextVar = contextvars.ContextVar("monetlike_loss_fn", default=None)


@contextlib.contextmanager
def loss_fn_in_use(loss_fn):
    """Within this block, training_loss is `loss_fn(model output)` (None: the default sum)."""
    token = _LOSS_FN.set(loss_fn)
    try:
        yield
    finally:
        _LOSS_FN.reset(token)


def training_loss(out) -> "torch.Tensor | None":
    """The loss of every profiled (and calibrated) step: the loss_fn in use (loss_fn_in_use) of
    the model's output, else the sum of each floating output that requires grad, in fp32; None
    when no output needs a gradient.

    The loss matters to the peak: its backward hands the model a real output gradient (a sum's
    is an expanded scalar) and runs its own kernels before the model's first stage."""
    loss_fn = _LOSS_FN.get()
    if loss_fn is not None:
        try:
            loss = loss_fn(out)
        except MonetlikeError:
            raise
        except Exception as e:
            devices = sorted({str(t.device) for t in tensors_in(out)})
            raise ProfileError(
                f"loss_fn failed on the model's output (on {', '.join(devices)}): "
                f"{type(e).__name__}: {e}. It runs on the device of the profile; for analytical "
                f"costs that is 'meta', so make the tensors it uses (labels) there or from the "
                f"output") from e
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad):
            got = (f"a tensor of shape {tuple(loss.shape)}, requires_grad={loss.requires_grad}"
                   if isinstance(loss, torch.Tensor) else type(loss).__name__)
            raise ProfileError(f"loss_fn must return a scalar tensor that requires grad (the "
                               f"loss of the model's output); it returned {got}")
        return loss
    grads = [t for t in tensors_in(out) if t.requires_grad and t.is_floating_point()]
    return sum(t.float().sum() for t in grads) if grads else None


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _node_kind(gm: fx.GraphModule, n: fx.Node) -> str:
    if n.op == "call_module":
        return type(gm.get_submodule(n.target)).__name__
    if n.op == "call_function":
        return getattr(n.target, "__name__", str(n.target))
    return str(n.target)


def _is_accumulate_grad(fn) -> bool:
    try:
        return fn.name().endswith("AccumulateGrad")
    except Exception:
        return False


def _walk_new_autograd_nodes(tensors, owner: dict, keep: list, gid: int, on_new) -> None:
    """Claim for `gid` every autograd node reachable from `tensors` not claimed by an earlier Op.

    The walk stops at nodes of earlier Ops and at AccumulateGrad (parameters, leaf inputs): what
    remains was created by this Op's nodes (or by the views between it and earlier Ops).
    `on_new(fn, gid, root)`: root says whether fn is the grad_fn of one of `tensors`, where the
    runtime starts the Op's stage (NOTE [Stage boundaries] in runtime/executor.py)."""
    roots = stage_roots(tensors)
    root_ids = {id(fn) for fn in roots}
    stack = list(roots)
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in owner or _is_accumulate_grad(fn):
            continue
        owner[id(fn)] = gid
        keep.append(fn)  # keeps the Python wrapper (and so id(fn)) stable
        on_new(fn, gid, id(fn) in root_ids)
        stack.extend(f for f, _ in fn.next_functions)


class ProfileRun(fx.Interpreter):
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
        # are the Op's `early_release` (`_early_releases`): a schedule that holds one longer
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
        self.cur: _NodeRec | None = None
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
            if self.cast_cache and func is _TO_COPY and _autocast_cast(args[0], kwargs,
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
        the stage; `_early_releases` decides whether it is an early release."""
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
        Same rule as `_early_releases` on these two levels. Returns the peak charged."""
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

    def _apply_allocator_windows(self) -> None:
        """Each Op's workspaces and each stage's gradient memory from what the allocator saw
        between the marks (the tracker's figures miss kernel scratch)."""
        a = self.alloc
        spans: dict[int, list[tuple[int, int]]] = {}  # group -> its backward intervals
        for gid, s, *_, e in self._bwd_windows:
            spans.setdefault(gid, []).append((a.position(s), a.position(e)))
        # Blocks a node allocated that outlive it, are none of the storages it left (Values,
        # hooked internals) and die in its Op's backward: autograd keeps them for it without the
        # hooks (Group.unhooked_bytes). (position allocated, position freed, bytes, group)
        unhooked: list[tuple[int, int, int, int]] = []
        for gid, (s, e), persistent, nograd, left in self._fwd_windows:
            g = self.groups[gid]
            held = [b for b in a.blocks_left(s, e) if b[0] not in left and b[3] is not None
                    and any(bs < b[3] < be for bs, be in spans.get(gid, ()))]
            g.unhooked_bytes += sum(b[1] for b in held)
            persistent += sum(b[1] for b in held)
            unhooked.extend((b[2], b[3], b[1], gid) for b in held)
            workspace = a.peak_between(s, e) - a.level(s) - persistent
            g.fwd_workspace = max(g.fwd_workspace, workspace)
            if nograd is None:
                g.recompute_workspace = max(g.recompute_workspace, workspace)
            else:
                ns, ne = nograd
                nograd_workspace = a.peak_between(ns, ne) - a.level(ne)
                g.recompute_workspace = max(g.recompute_workspace, nograd_workspace)
                g.nograd_workspace = max(g.nograd_workspace, nograd_workspace)
        # The runtime replays a random Op's generator state through a state tensor (NOTE [RNG
        # capture] in runtime/recompute.py): a transient of its size around the recomputation.
        state = torch.get_rng_state().numel()
        for g in self.groups:
            if g.random:
                g.recompute_workspace = max(g.recompute_workspace, state)
        # Everything the run allocated that is not a Value (or an Op's internal) counts as a
        # stage's gradient memory: gradients, but also what autograd and the loss allocate
        # outside the dispatcher (wrapped Python scalars), which the tracker misses. Levels are
        # relative to the recording's start, so only their differences within one stage are
        # compared with the tracker's (an Impl's run accumulates into gradients made earlier).
        # The workspace is the allocator's own: saved Values and internals that autograd frees
        # before the stage's peak are not in it (the tracker's figure, which holds them to the
        # stage's end, is not used); those Values are the Op's early releases.
        # A group's later interval (autograd came back to one of its nodes after other stages
        # ran) happens while the simulator is in the latest stage started: it counts there, and
        # so does what the group still holds for it meanwhile (NOTE [Interleaved stages]).
        def by_group(marked):  # mark -> (group, tag, bytes) as group -> [(position, tag, bytes)]
            out: dict[int, list[tuple[int, int, int]]] = {}
            for m, (fg, tag, nbytes) in marked.items():
                out.setdefault(fg, []).append((a.position(m), tag, nbytes))
            return out
        frees, declared = by_group(self._value_frees), by_group(self._declared)
        # Each stage's span: from its first interval to the end of the last one counting in it
        # (later intervals of earlier stages run in it: NOTE [Interleaved stages]).
        stages: dict[int, list] = {}  # group -> [start mark, end mark, Value bytes, held]
        for gid, s, values0, owner, first, held, e in self._bwd_windows:
            if first:
                stages[gid] = [s, e, values0, held]
            else:
                stages[owner][1] = e
        last = _last_windows(self._bwd_windows)
        started: set[int] = set()
        for gid, (s, e, values0, held) in stages.items():
            # "other" bytes at the stage's start; the unhooked blocks of a stage already passed
            # are not the simulator's either
            other0 = (a.level(s) - values0 + _still_held(held, last, self._gone_at)
                      - self._unhooked_at(unhooked, s, lambda fg: fg == gid or fg not in started))
            started.add(gid)
            start, end = a.position(s), a.position(e)
            levels = [a.level_at(i) for i in range(start, end + 1)]
            freed = [(i - start, tag, n) for i, tag, n in frees.get(gid, ()) if start <= i <= end]
            # A declared release whose Value stayed alive in this step (another Op saved it
            # too): the levels after it, as in a schedule where it goes there.
            really = {tag for _, tag, _ in freed}
            for i, tag, n in declared.get(gid, ()):
                if start <= i <= end and tag not in really:
                    freed.append((i - start, tag, n))
                    for q in range(i - start + 1, len(levels)):
                        levels[q] -= n
            # Levels are read against the stage's start: what autograd freed since (the
            # stage's own saved Values, which the stage's point still holds) cancels out.
            g = self.groups[gid]
            g.early_release.update(_early_releases(levels, freed))
            g.stage_start = max(g.stage_start, other0)
            g.bwd_peak = g.stage_start + max(0, max(levels) - a.level(s))
        self._charge_loss(unhooked)
        if self._end is not None:
            end, values = self._end
            self.final_grad_bytes = max(self.final_grad_bytes, a.level(end) - values)

    def _unhooked_at(self, unhooked: list[tuple[int, int, int, int]], mark,
                     counted=lambda gid: True) -> int:
        """Bytes of `unhooked` blocks ((allocated, freed, bytes, group) positions) alive at
        `mark` whose group is `counted`: held like internals, so not part of the "other" bytes
        there."""
        i = self.alloc.position(mark)
        return sum(n for s, e, n, gid in unhooked if s < i < e and counted(gid))

    def _charge_loss(self, unhooked: list[tuple[int, int, int, int]]) -> None:
        """A user's loss runs its own kernels between the model's forward and its first stage:
        their peak, forward and backward, is charged to the first stage, whose backward point
        holds at least what the step held then (every Value kept or output at the end of the
        forward, the first stage's recomputations on top; its gradients, the output's among
        them, on top of the loss's forward), so the charge errs on the safe side. Not to the
        last Op's forward point: an in-place Impl there frees its input, which the loss's
        moment does not. The default sum allocates only scalars there and is left out."""
        if self._loss is None or not self._bwd_windows:
            return
        a = self.alloc
        (before, values_before, _), (start, values_start, _) = self._loss[:2]
        g = self.groups[self._bwd_windows[0][0]]
        first_mark = self._bwd_windows[0][1]
        # the peak of gradients and other non-Value bytes over each part, as stages count them
        forward = (a.peak_between(before, start) - values_before
                   - self._unhooked_at(unhooked, before))
        backward = (a.peak_between(start, first_mark) - values_start
                    - self._unhooked_at(unhooked, start))
        g.bwd_peak = max(g.bwd_peak, forward, backward)

    def _loss_window_start(self) -> tuple:
        """Open a window over the loss's own memory: (allocator mark, Value bytes live, the CUDA
        allocator's bytes and the non-Value bytes then)."""
        tr = self.tracker
        tr.reset_window()
        values = tr.live_by_class[VALUE] + tr.live_by_class[INTERNAL]
        cuda = None
        if self.cuda is not None:  # pragma: no cover - no GPU in CI
            torch.cuda.reset_peak_memory_stats(self.cuda)
            cuda = (torch.cuda.memory_allocated(self.cuda), tr.live_by_class[OTHER])
        return self._mark(), values, cuda

    def _loss_window_peak(self, window: tuple, tracked: bool) -> int:
        """The highest non-Value bytes since `window` opened, as a stage counts them: by the
        tracker (when it watched the loss: meta, CUDA) and the CUDA allocator. The CPU
        allocator's count is read after the run (_charge_loss)."""
        peak = self.tracker.window_class_peak if tracked else 0
        if window[2] is not None:  # pragma: no cover - no GPU in CI
            alloc0, other0 = window[2]
            peak = max(peak, other0 + torch.cuda.max_memory_allocated(self.cuda) - alloc0)
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
                user_loss = _LOSS_FN.get() is not None
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
        _walk_new_autograd_nodes([loss], seen, walked, -1, lambda fn, gid, root: None)
        for fn in self.fn_keep:
            if id(fn) not in seen:
                del self.fn_owner[id(fn)]
        self.fn_keep[:] = [fn for fn in self.fn_keep if id(fn) in seen]

    def run_node(self, n: fx.Node) -> Any:
        self.pos += 1
        rec = _NodeRec(n, self.pos)
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
                    f"node {n.name} ({n.op} {_node_kind(self.gm, n)}) failed while profiling"
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
                copied = _copies_of_written(args, kwargs, set(rec.writes) - rec.spared)
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

    def _nograd_transient(self, rec: _NodeRec, n: fx.Node, args, kwargs,
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
                f"node {n.name} ({n.op} {_node_kind(self.gm, n)}) failed when run again under "
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
    def _newly_cached(self, rec: _NodeRec) -> int:
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
        self.values.append(TmpValue(tid, name, index, tuple(t.shape), _dtype_name(t.dtype),
                                    int(nbytes), producer, bool(t.requires_grad)))
        return tid

    def _after(self, rec: _NodeRec, n: fx.Node, result: Any, written=()) -> None:
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
        _walk_new_autograd_nodes(list(leaves) + list(written), self.fn_owner, self.fn_keep,
                                 g.gid, self._hook_fn)

    def _open_group(self, n: fx.Node, rec: _NodeRec) -> Group:
        g = Group(gid=len(self.groups), name=n.name, kind=_node_kind(self.gm, n), position=rec.pos)
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

    # NOTE [Interleaved stages]: autograd may leave an Op's backward after some of its nodes, run
    # another Op's nodes, and come back (an Op whose nodes are not contiguous in the forward:
    # `h = act_(a(x)); h += b(x)` under export is one Op, a, act_ and add_, with b's node between
    # them). The simulator runs each stage whole, in the order the stages started, and the later
    # interval counts in the stage under way then. So what such an Op still holds for its later
    # nodes while another stage runs (its internals, the Values only started stages saved, when
    # they die in that later interval) is not among the simulator's resident bytes: it counts as
    # the running stage's own bytes, as its gradients do. And the stage's levels run on through
    # the later interval, read against the level at the stage's start: the stage's point still
    # holds the saved Values autograd has freed since, and a release the stage declared holds
    # there too (_apply_allocator_windows).
    def _start_holding(self, g: Group) -> None:
        """Stage `g` starts: its internals, and the Values whose savers have all started, may
        now be held for a stage the simulator has left."""
        if self._savers is None:
            self._savers = {}
            for other in self.groups:
                for tid in other.saved:
                    self._savers.setdefault(tid, []).append(other.gid)
        self._holding_groups.add(g.gid)
        for tid in g.saved:
            savers = self._savers[tid]
            if all(self.groups[s].ran_backward for s in savers):
                self._holding_values[tid] = tuple(savers)

    def _held_elsewhere(self, owner: int) -> tuple[tuple[tuple, tuple[int, ...], int], ...]:
        """What started stages other than `owner` hold now, as ((class, tag), the groups
        holding it, bytes): it counts for `owner` if it dies in a later interval of one of those
        groups (_still_held)."""
        live = self.tracker.live_by_tag
        held = []
        for gid in list(self._holding_groups):
            n = live.get((INTERNAL, gid), 0)
            if not n:  # freed: internals are made in the forward only
                self._holding_groups.discard(gid)
            elif gid != owner:
                held.append(((INTERNAL, gid), (gid,), n))
        for tid, savers in list(self._holding_values.items()):
            n = live.get((VALUE, tid), 0)
            if not n:
                del self._holding_values[tid]
            elif owner not in savers:
                held.append(((VALUE, tid), savers, n))
        return tuple(held)

    def _apply_tracked_windows(self) -> None:
        """Each stage's peak of non-Value bytes from the tracker's windows (no allocator's
        count): a later interval and what is held for one counts in the stage under way."""
        last = _last_windows(self._tracked_windows)
        for _, owner, first, held, peak in self._tracked_windows:
            g = self.groups[owner]
            extra = _still_held(held, last, self._gone_at)
            if first:
                g.stage_start += extra
            g.bwd_peak = max(g.bwd_peak, peak + extra)

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


class TimingRun(fx.Interpreter):
    """A plain training step that times each Op's forward nodes and backward autograd nodes."""

    def __init__(self, gm: fx.GraphModule, node_gid: dict[str, int], timer: Timer,
                 progress=None):
        super().__init__(gm)
        self.node_gid, self.timer, self.progress = node_gid, timer, progress

    def step(self, inputs: tuple) -> tuple[dict[int, float], dict[int, float]]:
        self.fwd_marks: list[tuple[int, Any, Any]] = []
        self.bwd_marks: list[tuple[int, Any, Any]] = []
        self.fn_owner: dict[int, int] = {}
        self.fn_keep: list = []
        out = self.run(*inputs)
        loss = training_loss(out)
        if loss is not None:
            loss.backward()
        del out, loss
        self.timer.sync()
        self.env = {}
        fwd: dict[int, float] = {}
        bwd: dict[int, float] = {}
        for gid, a, b in self.fwd_marks:
            fwd[gid] = fwd.get(gid, 0.0) + self.timer.seconds(a, b)
        for gid, a, b in self.bwd_marks:
            bwd[gid] = bwd.get(gid, 0.0) + self.timer.seconds(a, b)
        self.fn_keep.clear()
        self.fn_owner.clear()
        return fwd, bwd

    def run_node(self, n: fx.Node) -> Any:
        gid = self.node_gid.get(n.name)
        if gid is None:
            result = super().run_node(n)
        else:
            a = self.timer.mark()
            result = super().run_node(n)
            b = self.timer.mark()
            self.fwd_marks.append((gid, a, b))
            _walk_new_autograd_nodes(tree_leaves(result), self.fn_owner, self.fn_keep, gid,
                                     self._hook_fn)
        if self.progress is not None:
            self.progress.update(1)
        if not n.users and n.op != "output":
            return None
        return result

    def _hook_fn(self, fn, gid: int, root: bool) -> None:
        # The closures own their state (this step's list, a cell per node): an autograd node can
        # outlive a step (autocast caches weight casts with their grad_fn) and fire again later,
        # with this step's hooks still on it; it then writes into this step's dead list.
        marks, timer, cell = self.bwd_marks, self.timer, []

        def pre(grad_outputs):
            cell.append(timer.mark())

        def post(grad_inputs, grad_outputs):
            if cell:
                marks.append((gid, cell.pop(), timer.mark()))

        fn.register_prehook(pre)
        fn.register_hook(post)


def _copies_of_written(args, kwargs, written: set) -> "tuple[tuple, dict] | None":
    """(args, kwargs) with each tensor whose storage is in `written` replaced by a copy, so that
    running the node again writes the copies; None where a written storage is not one whole
    tensor argument (a view into it, or a storage the node reaches otherwise)."""
    if not written:
        return args, kwargs
    targets = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
               and storage_of(t) is not None and storage_of(t)._cdata in written]
    if {storage_of(t)._cdata for t in targets} != written or any(
            t.storage_offset() != 0 or t.numel() * t.element_size() != storage_of(t).nbytes()
            for t in targets):
        return None
    copies = {id(t): t.detach().clone(memory_format=torch.preserve_format) for t in targets}
    return tree_map(lambda t: copies.get(id(t), t), (args, kwargs))
