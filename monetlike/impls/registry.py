"""The registry of operator implementations (Impls other than 'default').

An `ImplSpec` says which Op groups it applies to and how it runs: `match(gm, nodes)` looks at the
fx nodes of one Op (creator first, then its in-place nodes) and returns, for the nodes it
replaces, a callable `fn(interp, node, args, kwargs) -> result` to run instead of the node; or
None when the group does not fit. The same `match` is used by the profiler (to measure the Impl)
and by the runtime (to execute `schedule.impl[op]`), so what is measured is what runs.

Each replacement is a `torch.autograd.Function` whose forward result is bitwise the default's and
whose backward gives the same gradients; only what its backward holds (and its costs) differ.
Recomputation runs the default nodes under no_grad: the output is the same bits, and without
grad nothing is saved, so the Impl choice does not matter there; except for in-place Impls
(`overwrites`), whose recomputation runs in place too, because the point's memory depends on it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

Replacement = Callable[[Any, fx.Node, tuple, dict], Any]


@dataclass(frozen=True)
class StashedRecompute:
    """An Impl whose recomputation applies what its forward stashed while its backward holds it,
    instead of running the Op again (dropout_mask: its mask, so nothing is drawn). The runtime
    gives the Impl's `run` a `stash_for(node)` on its interpreter; the forward puts the stash in
    it, its backward takes it out."""

    applies: Callable[[str, bool], bool]
    """(an output Value's dtype name, whether it requires grad) -> whether a recomputation of
    that output can use the stash (elsewhere the Op is recomputed as the default)."""
    argument: Callable[[fx.GraphModule, list], Any]
    """(gm, the Op's nodes) -> what `run` needs besides the stash (dropout's p); None: the Op
    is recomputed as the default."""
    run: Callable[[Any, Any, Any], Any]
    """(the node's input, the stash, the argument) -> the node's output, bitwise the forward's."""
    scratch: Callable[[tuple, str], int]
    """(output shape, dtype name) -> bytes `run` allocates beyond its output (on the CPU)."""


@dataclass(frozen=True)
class ImplSpec:
    name: str
    match: Callable[[fx.GraphModule, list], "dict[str, Replacement] | None"]
    doc: str
    overwrites: "Callable[[fx.GraphModule, fx.Node], fx.Node | None] | None" = None
    """In-place Impls (inplace.py): the argument node whose storage the Op's output takes. The
    profiler decides where that is legal and records the Value (`Impl.overwrites`); such Impls
    are not measured in the substituted profiling steps (run in place, the Op would make no
    Value of its own there) but by `profiling.inplace_alternatives`."""
    devices: "frozenset[str] | None" = None
    """Device types of the profiled target ('cpu', 'cuda'; an analytical profile targets a GPU)
    on which the Impl is offered; None: all. An Impl that only helps where the default's
    kernel differs (dropout_mask: CUDA's dropout already holds a bool mask) would otherwise add
    a column the MILP cannot use, and change the fingerprint of every graph it matches."""
    warm: "Callable[[torch.device], None] | None" = None
    """Makes the Impl's lasting caches on a device (bitmask's tables) ahead of the profile's
    measured steps: made inside one, the first profile of a process counted them (a ReLU mask's
    stage 37 KB over later profiles), so a profile depended on what ran before it. (A wrapped
    model's first step builds its plan and these caches: measure from the second.)"""
    stashed_recompute: "StashedRecompute | None" = None
    """How a recomputation of the Op uses what the Impl's forward stashed; None: the Op is
    recomputed by running its nodes again."""
    needs_internals: bool = False
    """Offered only on Ops whose default holds internal bytes (`Impl.internal_bytes`): an Impl
    that exists to drop them has nothing to gain elsewhere (a matmul of contiguous operands)."""


_REGISTRY: dict[str, ImplSpec] = {}


def register(spec: ImplSpec) -> ImplSpec:
    if spec.name == "default" or spec.name in _REGISTRY:
        raise ValueError(f"Impl name {spec.name!r} is reserved or already registered")
    _REGISTRY[spec.name] = spec
    return spec


def specs() -> list[ImplSpec]:
    """Registered Impls, in registration order (the order extra Impls appear on an Op)."""
    return list(_REGISTRY.values())


def get(name: str) -> ImplSpec:
    return _REGISTRY[name]


@contextlib.contextmanager
def registered(spec: ImplSpec):
    """`spec` registered for the block, in place of the Impl of that name if there is one (its
    position, and so every fingerprint, kept): an Impl tried without editing the registry."""
    old = _REGISTRY.get(spec.name)
    _REGISTRY[spec.name] = spec
    try:
        yield spec
    finally:
        if old is None:
            del _REGISTRY[spec.name]
        else:
            _REGISTRY[spec.name] = old


def stashed_recompute_of(name: str) -> "StashedRecompute | None":
    """The StashedRecompute of the Impl called `name` ('default' and unknown names: None)."""
    spec = _REGISTRY.get(name)
    return spec.stashed_recompute if spec is not None else None


def names() -> frozenset[str]:
    return frozenset(_REGISTRY)


def one_node(gm: fx.GraphModule, nodes: list):
    """(node, its module or None when it calls no module) of a one-node group; (None, None)
    for a group of several nodes, which the one-node Impls do not match."""
    if len(nodes) != 1:
        return None, None
    n = nodes[0]
    return n, (gm.get_submodule(n.target) if n.op == "call_module" else None)


def matches(gm: fx.GraphModule, nodes: list) -> list[tuple[ImplSpec, dict]]:
    """The registered Impls that apply to an Op made of `nodes`, with their replacements."""
    out = []
    for spec in specs():
        subs = spec.match(gm, list(nodes))
        if subs:
            out.append((spec, subs))
    return out


class SubstitutingMixin:
    """For fx.Interpreter subclasses: run `self.impl_subs[node.name]` instead of the node.

    Works under interpreters that call `self.call_module/call_function/call_method` from their
    `run_node` (torch's Interpreter, the profiler's ProfileRun and TimingRun)."""

    impl_subs: dict = {}
    _impl_node: fx.Node | None = None

    def run_node(self, n: fx.Node):
        self._impl_node = n
        try:
            return super().run_node(n)
        finally:
            self._impl_node = None

    def _impl_sub(self, target, args, kwargs, op):
        n = self._impl_node
        fn = self.impl_subs.get(n.name) if n is not None else None
        if fn is None:
            return getattr(super(), op)(target, args, kwargs)
        return fn(self, n, args, kwargs)

    def call_module(self, target, args, kwargs):
        return self._impl_sub(target, args, kwargs, "call_module")

    def call_function(self, target, args, kwargs):
        return self._impl_sub(target, args, kwargs, "call_function")

    def call_method(self, target, args, kwargs):
        return self._impl_sub(target, args, kwargs, "call_method")


_release_observers: list = []


def announce_release(t) -> None:
    """Called by an Impl's backward when it is done with the saved tensor `t` before its stage
    is over (the split Impls, after the weight gradient): the tensor's storage goes when the
    autograd node returns, unless something else holds it. The profiler counts it there as an
    early release even when, in its own step, another Op's saved tensors keep it alive
    (`ProfileRun._on_release`); nothing else listens."""
    for observe in _release_observers:
        observe(t)


@contextlib.contextmanager
def observing_releases(observe):
    """Call `observe(t)` for every `announce_release(t)` inside the block."""
    _release_observers.append(observe)
    try:
        yield
    finally:
        _release_observers.remove(observe)

