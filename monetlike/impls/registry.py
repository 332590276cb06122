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
    needs_internals: bool = False
    """Offered only on Ops whose default holds internal bytes (`Impl.internal_bytes`): an Impl
    that exists to drop them has nothing to gain elsewhere (a matmul of contiguous operands)."""


_REGISTRY: dict[str, ImplSpec] = {}


def register(spec: ImplSpec) -> ImplSpec:
    if spec.name == "default" or spec.name in _REGISTRY:
        raise ValueError(f"Impl name {spec.name!r} is reserved or already registered")
    _REGISTRY[spec.name] = spec
    return spec


@contextlib.contextmanager
def registered(spec: ImplSpec):
    """`spec` registered, after every built-in Impl, for the block only (tests, experiments)."""
    _load()
    register(spec)
    try:
        yield spec
    finally:
        del _REGISTRY[spec.name]


def specs() -> list[ImplSpec]:
    """Registered Impls, in registration order (the order extra Impls appear on an Op)."""
    _load()
    return list(_REGISTRY.values())


def get(name: str) -> ImplSpec:
    _load()
    return _REGISTRY[name]


def names() -> frozenset[str]:
    _load()
    return frozenset(_REGISTRY)


def matches(gm: fx.GraphModule, nodes: list) -> list[tuple[ImplSpec, dict]]:
    """The registered Impls that apply to an Op made of `nodes`, with their replacements."""
    out = []
    for spec in specs():
        subs = spec.match(gm, list(nodes))
        if subs:
            out.append((spec, subs))
    return out


def _load() -> None:
    # The families register themselves on import; imported lazily so that importing the
    # registry (from the runtime's plan) stays cheap and free of cycles. The import order is the
    # registration order, i.e. the order of an Op's extra Impls (part of its fingerprint).
    from . import dropout, pool, relu, hardtanh, internals, inplace, split, attention  # noqa: F401


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


def module_of(interp_or_gm, target: str):
    """The submodule `target` as the interpreter sees it (the runtime reads the live model)."""
    fetch = getattr(interp_or_gm, "fetch_attr", None)
    if fetch is not None:
        return fetch(target)
    return interp_or_gm.get_submodule(target)
