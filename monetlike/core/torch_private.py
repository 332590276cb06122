"""The only module of monetlike that touches private torch APIs.

Private torch names (`torch._C...`, `torch.utils._pytree`, underscore-named classes, the autograd
engine, the profiler's event tree) can change or vanish in any torch release without notice.
Every use of one is here, one small function or constant per need, each saying which public API
is missing, so that a torch upgrade has one place to check and to fix.
tests/test_torch_private.py fails if another module of monetlike reaches for a private torch name.

Checked against torch 2.14.1.

Not covered: underscore-named attributes read from torch objects the caller already holds (a
tensor's `_version`, `_base` and `_is_view()`, a storage's `_cdata`, an nn.Module's hook and
parameter dictionaries, an fx.Graph's `_codegen`); they are read where the object is.

Imports stay as cheap as before: everything imported at the top here is already imported by
`import torch`; the profiler's event types are imported when a recording is replayed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator

import torch
import torch.fx
from torch.nn.modules import module as _module
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_map_only, tree_unflatten

__all__ = [
    "BatchNormBase", "HARDTANH", "InstanceNormBase", "PyTreeCodeGen", "PyTreeInfo",
    "RELU6_INPLACE", "RELU6_OUT", "TorchDispatchMode", "batch_norm_saved_stats",
    "checkpoint_hook_class", "custom_op_autograd_class", "exporting_with_real_values",
    "neg_view", "parametrize_cache_on",
    "current_graph_task_id", "sole_owner",
    "fsdp_unit_settings", "global_module_hooks", "profiler_events", "queue_engine_callback",
    "sdp_priority_order", "tensors_in", "aot_backend", "default_partition",
    "joint_placeholder_kind", "joint_forward_tagged",
    "inductor_backend", "tree_flatten", "tree_leaves", "tree_map", "tree_map_only", "tree_unflatten",
]

# -- pytree and dispatch modes -------------------------------------------------------------------
# tree_flatten, tree_leaves, tree_map, tree_map_only, tree_unflatten (imported above): torch's
# nested-container <-> leaves + spec utilities, the ones torch.export's specs are made of; torch
# has no public pytree module (torch.utils.pytree does not exist in 2.14).
# TorchDispatchMode (imported above): the base class of a mode that sees every aten call; torch
# exports it only from the private torch.utils._python_dispatch.


def tensors_in(obj) -> list:
    """The tensors in a model's output or inputs: the pytree's tensor leaves, and those of the
    fields of a dataclass instance, which the pytree keeps whole unless it is registered (a
    Hugging Face ModelOutput is)."""
    found = []
    for leaf in tree_leaves(obj):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found.extend(tensors_in([getattr(leaf, f.name) for f in dataclasses.fields(leaf)]))
    return found


# -- classes of torch.nn and torch.fx ------------------------------------------------------------
BatchNormBase = _BatchNorm
"""The common base of BatchNorm1d/2d/3d (and SyncBatchNorm); torch.nn has no public name for it."""

InstanceNormBase = _InstanceNorm
"""The common base of InstanceNorm1d/2d/3d; torch.nn has no public name for it."""

PyTreeCodeGen = torch.fx.graph._PyTreeCodeGen
"""The fx codegen of an exported graph (flattens inputs, rebuilds outputs); no public name."""

PyTreeInfo = torch.fx.graph._PyTreeInfo
"""The (arg names, in_spec, out_spec) record PyTreeCodeGen takes; no public name."""


def global_module_hooks() -> bool:
    """Whether a global nn.Module forward (pre-)hook is registered; torch has no public query."""
    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks)


# -- ReLU6 / hardtanh: the C bindings torch.nn.functional calls -----------------------------------
RELU6_INPLACE = {torch._C._nn.relu6_} if hasattr(torch._C._nn, "relu6_") else set()
"""The in-place ReLU6 binding F.relu6(inplace=True) calls, as a graph may record it; not public."""

RELU6_OUT = {torch._C._nn.relu6} if hasattr(torch._C._nn, "relu6") else set()
"""The out-of-place ReLU6 binding F.relu6 calls, as a graph may record it; not public."""

HARDTANH = torch._C._nn.hardtanh
"""The out-of-place hardtanh binding F.hardtanh calls, as a graph may record it; not public."""


# -- the CPU math path of scaled_dot_product_attention -------------------------------------------
SAFE_SOFTMAX = torch.ops.aten._safe_softmax.default
"""The softmax the math path applies (0 on wholly masked rows); there is no public binding."""

SOFTMAX_BACKWARD_DATA = torch.ops.aten._softmax_backward_data.default
"""The backward autograd applies to _safe_softmax (derivatives.yaml); not public."""


# -- autograd engine -----------------------------------------------------------------------------
def current_graph_task_id() -> int:
    """The id of the running backward (graph task), -1 outside one; no public API gives it."""
    return torch._C._current_graph_task_id()


def sole_owner(grad: torch.Tensor) -> bool:
    """Whether the gradient a custom Function's backward was handed is referenced by nothing
    else: one reference to the tensor (the engine moved its buffer into the call), its storage
    shared with no other tensor (no view, no alias kept by another node or by `.grad`). Then
    writing it in place changes no tensor anyone else reads. No public API counts references
    (`_use_count`, `_storage_Use_Count` are private); the storage count includes the temporary
    storage object made to ask."""
    return (grad._base is None and grad._use_count() == 1
            and torch._C._storage_Use_Count(grad.untyped_storage()._cdata) == 2)


def batch_norm_saved_stats(fn) -> "tuple[torch.Tensor, torch.Tensor] | None":
    """(save_mean, save_invstd) held by a training BatchNorm's autograd node `fn`, detached, or
    None for another node. No public API reads a node's saved tensors: the generated node class
    (NativeBatchNormBackward0) names them `_saved_result1` and `_saved_result2` (the forward's
    outputs 1 and 2, unpacked through any saved-tensor hooks)."""
    if fn is None or type(fn).__name__ != "NativeBatchNormBackward0" or not fn._saved_training:
        return None
    return fn._saved_result1.detach(), fn._saved_result2.detach()


def checkpoint_hook_class() -> type:
    """The saved-tensor hooks torch.utils.checkpoint (use_reentrant=False) enters around the
    function it checkpoints; not public."""
    import torch.utils.checkpoint

    return torch.utils.checkpoint._checkpoint_hook


def derived_from_parameters(module: torch.nn.Module) -> frozenset[str]:
    """Attributes a torch module's forward sets from its own parameters, a cache that follows
    them: an RNN's forward rebuilds `_flat_weights` (and their weak references) when its
    parameters are other tensors than last time, as they are while torch.export traces it. Not
    public."""
    if isinstance(module, torch.nn.RNNBase):
        return frozenset({"_flat_weights", "_flat_weight_refs"})
    return frozenset()


def custom_op_autograd_class(cls: type) -> bool:
    """Whether `cls` is the autograd Function torch.library makes for a custom op's registered
    backward (`register_autograd`: GeneratedBackwardFor_<op>), applied by the op's autograd
    kernel; not public."""
    return cls.__module__ == "torch._library.autograd"


@contextlib.contextmanager
def exporting_with_real_values():
    """torch.export's fake tensors carry the real values of the example they were made from: a
    guard on a data-dependent value (`if y.sum() > 0`, `int(n)`) takes the example's value and
    becomes a run-time assertion in the graph (`aten._assert_scalar`), as torch.export's
    draft_export does; no public switch. Its log line per guard is silenced."""
    import logging

    import torch._functorch.config as functorch_config

    log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with functorch_config.patch(fake_tensor_propagate_real_tensors=True):
            yield
    finally:
        log.setLevel(level)


def parametrize_cache_on() -> bool:
    """Whether a `torch.nn.utils.parametrize.cached()` block is running; no public getter."""
    import torch.nn.utils.parametrize

    return bool(torch.nn.utils.parametrize._cache_enabled)


def neg_view(x: torch.Tensor) -> torch.Tensor:
    """`x` as a lazily negated view (its neg bit set), as `z.conj().imag` is; not public."""
    return torch._neg_view(x)


def queue_engine_callback(fn: Callable[[], None]) -> None:
    """Run `fn` when the running backward finishes; no public API (autograd engine's queue)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


# -- attention -----------------------------------------------------------------------------------
def sdp_priority_order() -> list:
    """SDPA's backends (torch.nn.attention.SDPBackend) in the order torch tries them; no getter."""
    b = torch._C._SDPBackend
    return [b(code) for code in torch._C._get_sdp_priority_order()]


# -- profiler ------------------------------------------------------------------------------------
# No public API gives the allocation events with their times: prof.events() and key_averages()
# fold them into the operators' totals.
def outside_dispatch_modes():
    """A context with the active TorchDispatchModes (the profiler's storage tracker) set aside:
    for bookkeeping kernels that are no part of the step (an Impl asking a kernel which layout
    it gives, on tiny tensors) and must not be counted as its memory or cost."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def profiler_events(prof) -> Iterator[tuple[int, str, tuple[str, int, int] | None]]:
    """A finished profile's events: (start ns, name, (device, bytes, address) of an allocation
    (bytes < 0 for a free) or None)."""
    from torch._C._profiler import _EventType

    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.typed[0] == _EventType.Allocation:
            f = node.extra_fields
            yield node.start_time_ns, node.name, (f.device.type, int(f.alloc_size), int(f.ptr))
        else:
            yield node.start_time_ns, node.name, None


# -- AOTAutograd's partition (the compiled runtime) ----------------------------------------------
# torch.compile has no public API for choosing which joint-graph values the forward saves: a
# backend built with torch._dynamo's aot_autograd takes a partition function, and torch's own
# partitioners live in torch._functorch.partitioners.
def aot_backend(partition_fn: Callable, compiler: Callable | None = None) -> Callable:
    """A torch.compile backend: AOTAutograd tracing the joint graph, `partition_fn` cutting it,
    and `compiler` (default: aot_eager's boxed no-op, running the graphs' aten ops eagerly, their
    inputs freed at last use) compiling the forward and the backward."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    return aot_autograd(fw_compiler=compiler or boxed_nop, bw_compiler=compiler or boxed_nop,
                        partition_fn=partition_fn, keep_inference_input_mutations=True)


def default_partition(joint, joint_inputs, **kwargs):
    """torch's default partition: saves every forward value the backward reads, except those
    tagged node.meta["recompute"] = MUST_RECOMPUTE, which the backward recomputes (random ops
    replaying the forward's RNG state)."""
    from torch._functorch.partitioners import default_partition as partition

    return partition(joint, joint_inputs, **kwargs)


def min_cut_partition(joint, joint_inputs, **kwargs):
    """torch's min-cut partition (Inductor's own; it reads the activation_memory_budget knob)
    of a copy of `joint`: the forward saves what it cuts at, the backward recomputes the rest."""
    import copy

    from torch._functorch.partitioners import min_cut_rematerialization_partition as partition

    return partition(copy.deepcopy(joint), joint_inputs, **kwargs)


def joint_placeholder_kind(node: torch.fx.Node) -> str:
    """'primal', 'tangent' or 'other' for a placeholder of AOTAutograd's joint graph."""
    from torch._functorch import partitioners as p

    if p._is_primal(node):
        return "primal"
    return "tangent" if p._is_tangent(node) else "other"


def joint_forward_tagged(node: torch.fx.Node) -> bool:
    """Whether AOTAutograd traced `node` in the forward (default_partition's rule for where the
    forward ends: at the last node so tagged)."""
    from torch._functorch import partitioners as p

    return p._has_tag_is_forward(node)


def inductor_backend(partition_fn: Callable,
                     on_code: "Callable[[bool, str], None] | None" = None) -> Callable:
    """A torch.compile backend: Inductor with `partition_fn` as its partitioner (Inductor's
    joint-graph passes run first), through `torch._inductor.config.custom_partitioner_fn`.
    `on_code(is_backward, source)` gets the Python wrapper Inductor generated for each graph;
    the backward is compiled with the forward (not at its first run), so both are known before
    the step runs."""
    import torch._functorch.config as functorch_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class _Partitioner(CustomPartitionerFn):
        def __call__(self, gm, joint_inputs, **kwargs):
            return partition_fn(gm, joint_inputs, **kwargs)

        def uuid(self):
            return None  # no caching: the plan depends on the budget and the graph

    def inner(gm, example_inputs, **kwargs):
        out = compile_fx_inner(gm, example_inputs, **kwargs)
        if on_code is not None:
            on_code(bool(kwargs.get("is_backward")), getattr(out, "source_code", None))
        return out

    def backend(gm, example_inputs):
        # the FX graph cache would pickle the partitioner (it cannot) and reuse a graph
        # partitioned for another budget
        with functorch_config.patch(force_non_lazy_backward_lowering=True):
            return compile_fx(gm, example_inputs, inner_compile=inner,
                              config_patches={"custom_partitioner_fn": _Partitioner(),
                                              "fx_graph_cache": False})
    return backend


def fsdp_unit_settings(module: torch.nn.Module) -> tuple:
    """(reshard_after_forward, the mixed-precision param_dtype, its reduce_dtype) of a module
    FSDP2's fully_shard made a unit of. FSDP2 has setters for these
    (FSDPModule.set_reshard_after_forward) but no getters: they are read from the unit's
    parameter group. A root unit that has run a forward reads False (FSDP2 clears its
    post-forward mesh then)."""
    from torch.distributed.fsdp import fully_shard  # imported where a sharded model exists

    group = fully_shard.state(module)._fsdp_param_group
    if group is None:  # a unit without parameters
        return True, None, None
    policy = group.mp_policy
    return group.post_forward_mesh_info is not None, policy.param_dtype, policy.reduce_dtype


def ddp_splits_graphs() -> bool:
    """Whether Dynamo is compiling inside a DistributedDataParallel forward with its
    DDPOptimizer on, which splits the graph at each gradient bucket (one graph per bucket, so
    that each bucket's all-reduce can start while the backward goes on)."""
    import torch._dynamo.config as dynamo_config  # torch.compile's, loaded once it runs

    active = torch.nn.parallel.DistributedDataParallel._get_active_ddp_module()
    return active is not None and bool(dynamo_config.optimize_ddp)
