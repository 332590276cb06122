"""What the profiling run records: Ops being grouped (`Group`), Values (`TmpValue`), a node's
record, and the small rules the run and the timing run share (the loss, autograd node walks,
what a stage still holds of an interleaved Op, casts autocast caches)."""

from __future__ import annotations

import bisect
import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from solver.errors import MonetlikeError

from ..core.autograd_hooks import stage_roots
from ..core.torch_private import tensors_in, tree_leaves, tree_map
from .memory import storage_of


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


def forward_interleaving(groups: list[Group], values: list[TmpValue], rank: dict[int, int]
                          ) -> tuple[dict[int, set[int]], dict[int, int]]:
    """What the Ops run between the nodes of another must read in the simulator's forward.

    An Op whose nodes are not contiguous in the trace (`h = act_(a(x)); h += b(x)`: a, act_ and
    add_, with b between) runs whole in the simulator, before or after the Ops between its nodes
    (`rank`: group -> position in the Op order); at run time those run inside it, while it holds
    what it has made and what its later nodes read. So the one of each pair that runs later
    reads what the earlier one read (and, where the outer Op runs first, what it made; graph
    inputs are resident throughout), and an outer Op that runs later keeps at least the
    workspace of the Ops inside it: the simulator's point for it then holds all the run holds
    there. Returns (group -> extra Values it reads, group -> its least forward workspace)."""
    nodes = sorted((p, g.gid) for g in groups for p in g.positions)
    extra: dict[int, set[int]] = {}
    floor: dict[int, int] = {}
    for outer in groups:
        if len(outer.positions) < 2:
            continue
        first, last = min(outer.positions), max(outer.positions)
        inside = {gid for _, gid in nodes[bisect.bisect_right(nodes, (first, len(groups))):
                                          bisect.bisect_left(nodes, (last, -1))]}
        for inner in (groups[gid] for gid in sorted(inside - {outer.gid})):
            if rank[inner.gid] < rank[outer.gid]:
                extra.setdefault(outer.gid, set()).update(inner.inputs)
                floor[outer.gid] = max(floor.get(outer.gid, 0), inner.forward_figures()[1])
            else:
                extra.setdefault(inner.gid, set()).update(outer.inputs, outer.outputs)
    for gid, tids in extra.items():
        tids.difference_update(groups[gid].outputs, groups[gid].inputs,
                               [t for t in tids if values[t].producer is None])
    return extra, floor


def last_windows(windows: list[tuple]) -> dict[int, int]:
    """group -> the index of its last backward interval among `windows` (group first)."""
    return {w[0]: k for k, w in enumerate(windows)}


def still_held(held: tuple, last: dict[int, int], gone_at: dict[tuple, int]) -> int:
    """Bytes of `held` (_held_elsewhere at the start of an interval) that die by the last
    interval of a group holding them: kept for a later interval of that group (NOTE [Interleaved
    stages]). What outlives its groups' backward is held for another reason, not this one."""
    return sum(n for key, groups, n in held
               if key in gone_at and gone_at[key] <= max(last[g] for g in groups))


def early_releases(levels: list[int], frees: list[tuple[int, int, int]]) -> list[int]:
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


class NodeRec:
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
# With autocast's cache on, a leaf's cast lives until the block exits. The profile runs with it
# off (NOTE [Autocast cache] in monetlike/core/recompute.py), where a cast no backward saves (a
# Linear's bias) dies with its op. So, when the caller's autocast caches, each leaf's first such
# cast is counted held to the end of the forward: every later Op's `fwd_workspace` carries the
# bytes held so far (`Group.cached_casts_before`). The backward runs after the block, cache empty.
TO_COPY = torch.ops.aten._to_copy.default


def autocast_cast(x: Any, kwargs: dict, cast_to: dict) -> bool:
    """Whether `_to_copy(x, **kwargs)` is a cast autocast caches: a float32 leaf that requires
    grad, not a view, to the dtype autocast casts to on its device (`cast_to`; read outside
    the dispatch, where autocast shows as off)."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or not x.is_leaf \
            or not x.requires_grad or x._is_view():
        return False
    return kwargs.get("dtype") == cast_to.get(x.device.type)


# The user's loss, while `profile(..., loss_fn=...)` runs: every run of the profile (the
# instrumented step, the timing steps, the Impls' rounds) ends with it.
LOSS_FN: contextvars.ContextVar = contextvars.ContextVar("monetlike_loss_fn", default=None)


@contextlib.contextmanager
def loss_fn_in_use(loss_fn):
    """Within this block, training_loss is `loss_fn(model output)` (None: the default sum)."""
    token = LOSS_FN.set(loss_fn)
    try:
        yield
    finally:
        LOSS_FN.reset(token)


def training_loss(out) -> "torch.Tensor | None":
    """The loss of every profiled (and calibrated) step: the loss_fn in use (loss_fn_in_use) of
    the model's output, else the sum of each floating output that requires grad, in fp32; None
    when no output needs a gradient.

    The loss matters to the peak: its backward hands the model a real output gradient (a sum's
    is an expanded scalar) and runs its own kernels before the model's first stage."""
    loss_fn = LOSS_FN.get()
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


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def node_kind(gm: fx.GraphModule, n: fx.Node) -> str:
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


def walk_new_autograd_nodes(tensors, owner: dict, keep: list, gid: int, on_new) -> None:
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


def copies_of_written(args, kwargs, written: set) -> "tuple[tuple, dict] | None":
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
