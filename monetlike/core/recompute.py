"""Faithful recomputation: the same numbers as the original forward, and no repeated side effects.

What the original forward of an Op depended on besides its inputs, and how it is restored:
- the RNG state (dropout and other random ops draw the same numbers): captured on the CPU and on
  every CUDA device in use just before the Op's first node ran, restored around the recomputation
  and put back afterwards, as torch.utils.checkpoint does (see NOTE [RNG capture]);
- the autocast state (dtypes of the results): captured with the RNG state, re-entered;
- BatchNorm and InstanceNorm in training mode: the forward normalised with the batch statistics
  and updated the running statistics. The recomputation normalises with the batch statistics
  again (a BatchNorm with those its forward computed, where that gives the same bits: NOTE
  [BatchNorm from its statistics]) but passes no running statistics, so `running_mean`,
  `running_var` and `num_batches_tracked` are updated exactly once per step (pytorch#96136).
  The output is bitwise identical (checked in tests/test_runtime_bites.py and
  tests/test_batchnorm_from_stats.py).
Side effects that cannot be undone (forward hooks, buffers a module writes) make an Op unsafe to
recompute; `check_side_effects` refuses them at the first step instead of replaying them.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .torch_private import BatchNormBase, InstanceNormBase, batch_norm_saved_stats

# NOTE [RNG capture]
# The executor holds a CPU generator state (5 KB) as a clone of the generator, host bookkeeping
# outside the tensor allocator (as CUDA's states are): the budget counts the step's tensors.
# Restoring from a clone goes through a 5 KB state tensor, which the profiler adds to each random
# Op's recomputation workspace. An Impl that saves the state for its backward asks for a tensor
# (`as_tensor=True`). CUDA states are captured per device of the step's inputs, once CUDA is up.


@dataclass
class ForwardContext:
    """What an Op's original forward ran under, besides its inputs."""

    cpu_rng: "torch.Tensor | torch.Generator | None"
    """None for an Op that draws no random numbers (nothing to replay)."""
    cuda_devices: tuple[int, ...]
    cuda_rng: tuple[torch.Tensor, ...]
    autocast: tuple[tuple[str, bool, Any], ...]
    """(device type, enabled, dtype) for 'cpu' and (when available) 'cuda'."""
    autocast_cache: bool


class ContextCapturer:
    """Captures ForwardContexts during one forward pass, sharing equal RNG states."""

    def __init__(self, cuda_devices: tuple[int, ...], *, as_tensor: bool = False,
                 autocast_fixed: bool = False):
        """autocast_fixed: the autocast state cannot change during the pass (the traced graph
        has no node entering or leaving an autocast context: fx does not record them, and
        torch.export wraps an autocast region into one node), so it is read once."""
        self.cuda_devices = cuda_devices
        self.as_tensor = as_tensor
        self._last_cpu: torch.Tensor | None = None
        self._last_cuda: tuple[torch.Tensor, ...] = ()
        self._cuda = torch.cuda.is_available()
        self._no_rng = self._capture(rng=False) if autocast_fixed else None

    def capture(self, rng: bool = True) -> ForwardContext:
        """The context now. rng=False for Ops known not to draw random numbers (RNG_FREE)."""
        if not rng and self._no_rng is not None:
            return self._no_rng  # shared: nothing in it changes during the pass
        return self._capture(rng)

    def _capture(self, rng: bool) -> ForwardContext:
        cpu: torch.Tensor | torch.Generator | None = None
        cuda: tuple[torch.Tensor, ...] = ()
        if rng and not self.as_tensor:
            cpu = torch.default_generator.clone_state()
        elif rng:
            cpu = torch.get_rng_state()
            if self._last_cpu is not None and torch.equal(cpu, self._last_cpu):
                cpu = self._last_cpu
            self._last_cpu = cpu
        if rng:
            if self.cuda_devices:
                states = []
                for i, d in enumerate(self.cuda_devices):
                    s = torch.cuda.get_rng_state(d)
                    if i < len(self._last_cuda) and torch.equal(s, self._last_cuda[i]):
                        s = self._last_cuda[i]
                    states.append(s)
                cuda = tuple(states)
                self._last_cuda = cuda
        # Autocast can only change between nodes if the traced code entered a context itself.
        return ForwardContext(cpu_rng=cpu, cuda_devices=self.cuda_devices if rng else (),
                              cuda_rng=cuda, autocast=_autocast_state(self._cuda),
                              autocast_cache=torch.is_autocast_cache_enabled())


def rng_states(ctx: ForwardContext) -> tuple[torch.Tensor, ...]:
    """The state tensors of a context captured with as_tensor=True: the CPU generator's (when
    captured), then each CUDA device's (captured only with it)."""
    return tuple(s for s in (ctx.cpu_rng, *ctx.cuda_rng) if s is not None)


def with_rng_states(ctx: ForwardContext, states) -> ForwardContext:
    """`ctx` with the tensors `rng_states` gave (none: `ctx` without its states). An autograd
    Function saves the states as saved tensors and keeps the rest as an attribute: a ctx
    attribute lives as long as its node, which later nodes keep until the whole backward is
    done, where saved tensors are freed once the node's backward has run."""
    return dataclasses.replace(ctx, cpu_rng=states[0] if states else None,
                               cuda_rng=tuple(states[1:]))


def without_rng(ctx: ForwardContext) -> ForwardContext:
    """The context of a recomputation that draws no random numbers: autocast only."""
    return dataclasses.replace(ctx, cpu_rng=None, cuda_devices=(), cuda_rng=())


def _autocast_state(cuda: bool) -> tuple[tuple[str, bool, Any], ...]:
    """(device type, enabled, dtype) for 'cpu', and for 'cuda' if `cuda` (CUDA is available)."""
    out = [("cpu", torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))]
    if cuda:
        out.append(("cuda", torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")))
    return tuple(out)


def cuda_devices_of(tensors) -> tuple[int, ...]:
    """CUDA device indices among `tensors` (empty when CUDA is unavailable or unused)."""
    if not torch.cuda.is_available():
        return ()
    devs = sorted({t.device.index if t.device.index is not None else torch.cuda.current_device()
                   for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
    return tuple(devs)


def autocast_state() -> tuple[tuple[str, bool, Any], ...]:
    """The autocast state now, as a ForwardContext records it."""
    return _autocast_state(torch.cuda.is_available())


def autocast_on() -> bool:
    """Whether autocast is on for some device now."""
    return any(enabled for _, enabled, _ in autocast_state())


def replay_needed(ctx: ForwardContext, autocast: tuple) -> bool:
    """Whether `replay(ctx)` would change anything when the autocast state is `autocast`
    (autocast_state()): an Op that drew random numbers, or whose autocast state differs."""
    return ctx.cpu_rng is not None or not _same_autocast(ctx, autocast)


def _same_autocast(ctx: ForwardContext, autocast: tuple) -> bool:
    return ctx.autocast == autocast and (not any(enabled for _, enabled, _ in autocast)
                                         or ctx.autocast_cache == torch.is_autocast_cache_enabled())


# NOTE [Autocast cache]
# Autocast caches each weight's cast until the outermost autocast block exits, so a cast's life
# depends on where the user's `with` ends. The profile runs with the cache off
# (`uncached_autocast`): each cast lives as its op's backward holds it, which is what PyTorch's
# recipe (backward outside the block) measures, cache or not; the casts no backward saves are
# counted by NOTE [Cached casts]. The wrapped step keeps the user's cache, which changes values too
# (a weight updated inside the block is read through its stale cast); a backward inside the block
# is warned about (executor.AUTOCAST_CACHE_MESSAGE).
def casts_cached() -> bool:
    """Whether autocast is on for some device with its weight-cast cache on."""
    return torch.is_autocast_cache_enabled() and autocast_on()


# Whether the caller's autocast, which `uncached_autocast` turned off, caches casts.
_STEP_CACHES_CASTS: contextvars.ContextVar = contextvars.ContextVar("monetlike_step_caches_casts",
                                                                    default=False)


@contextlib.contextmanager
def uncached_autocast():
    """The current autocast state, with the weight-cast cache off (NOTE [Autocast cache]);
    `step_caches_casts()` tells inside whether the caller's cached them."""
    token = _STEP_CACHES_CASTS.set(casts_cached() or _STEP_CACHES_CASTS.get())
    try:
        with contextlib.ExitStack() as stack:
            if casts_cached():
                for device_type, enabled, dtype in autocast_state():
                    if enabled:
                        stack.enter_context(torch.autocast(device_type, dtype=dtype,
                                                           cache_enabled=False))
            yield
    finally:
        _STEP_CACHES_CASTS.reset(token)


def step_caches_casts() -> bool:
    """Inside `uncached_autocast`: whether the step being profiled caches its casts (NOTE
    [Cached casts] in profile/interpreter.py)."""
    return _STEP_CACHES_CASTS.get()


@contextlib.contextmanager
def replay(ctx: ForwardContext):
    """Run the body under the RNG and autocast state of an Op's original forward.

    The RNG states current before entering are put back on exit, so recomputation in the backward
    pass does not shift the random numbers of the next forward pass. Autocast contexts are only
    entered when the current state differs (usually it is the same: off in both).
    """
    rng = ctx.cpu_rng is not None
    if rng:
        saved_cpu = torch.default_generator.clone_state()
        saved_cuda = [torch.cuda.get_rng_state(d) for d in ctx.cuda_devices]
        _set_cpu_state(ctx.cpu_rng)
        for d, s in zip(ctx.cuda_devices, ctx.cuda_rng):
            torch.cuda.set_rng_state(s, d)
    try:
        if _same_autocast(ctx, _autocast_state(len(ctx.autocast) > 1)):
            yield
        else:
            with contextlib.ExitStack() as stack:
                for device_type, enabled, dtype in ctx.autocast:
                    stack.enter_context(torch.autocast(device_type=device_type, dtype=dtype,
                                                       enabled=enabled,
                                                       cache_enabled=ctx.autocast_cache))
                yield
    finally:
        if rng:
            _set_cpu_state(saved_cpu)
            for d, s in zip(ctx.cuda_devices, saved_cuda):
                torch.cuda.set_rng_state(s, d)


def _set_cpu_state(state: "torch.Tensor | torch.Generator") -> None:
    if isinstance(state, torch.Generator):
        state = state.get_state()  # the 5 KB transient of NOTE [RNG capture]
    torch.default_generator.set_state(state)


# Ops made only of these never draw random numbers, so their RNG state is neither captured nor
# replayed (a CPU state is 5 KB to copy and compare per Op). Anything else (dropout, custom
# modules, unknown functions) gets the full replay: the list only has to be right, not complete.
RNG_FREE_MODULES = frozenset({
    "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
    "Linear", "Bilinear", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "LayerNorm", "GroupNorm",
    "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "LocalResponseNorm", "RMSNorm",
    "ReLU", "ReLU6", "LeakyReLU", "PReLU", "ELU", "SELU", "CELU", "GELU", "SiLU", "Mish",
    "Sigmoid", "Tanh", "Hardtanh", "Hardswish", "Hardsigmoid", "Softplus", "Softmax",
    "LogSoftmax", "MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d",
    "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d", "AdaptiveMaxPool1d",
    "AdaptiveMaxPool2d", "AdaptiveMaxPool3d", "Identity", "Flatten", "Unflatten", "Embedding",
    "Upsample", "UpsamplingNearest2d", "UpsamplingBilinear2d", "ZeroPad2d", "ConstantPad2d",
    "ReflectionPad2d", "ReplicationPad2d", "PixelShuffle",
})
RNG_FREE_FUNCTIONS = frozenset({
    "add", "add_", "iadd", "sub", "isub", "mul", "mul_", "imul", "truediv", "floordiv", "div",
    "matmul", "bmm", "mm", "cat", "stack", "relu", "relu_", "gelu", "silu", "sigmoid", "tanh",
    "softmax", "log_softmax", "layer_norm", "batch_norm", "linear", "conv2d", "flatten", "view",
    "reshape", "permute", "transpose", "contiguous", "getitem", "getattr", "size", "chunk",
    "split", "pad", "interpolate", "adaptive_avg_pool2d", "max_pool2d", "avg_pool2d", "mean",
    "sum", "exp", "sqrt", "rsqrt", "pow", "neg", "clamp", "hardtanh", "hardtanh_", "relu6",
    "expand", "repeat", "squeeze", "unsqueeze", "t", "masked_fill", "where", "float", "to",
    "type_as",
})  # not scaled_dot_product_attention: it draws a dropout mask when dropout_p > 0


def rng_free(kinds: list[str]) -> bool:
    """True when every node of an Op is known not to draw random numbers."""
    return all(k in RNG_FREE_MODULES or k in RNG_FREE_FUNCTIONS for k in kinds)


# ----------------------------------------------------------------------------------------------
# Modules and functions with running statistics
# ----------------------------------------------------------------------------------------------
@functools.cache
def norm_kind(cls: type) -> str | None:
    """'batchnorm' or 'instancenorm' for torch's own classes of those (decided once per class)."""
    # SyncBatchNorm is a collective and must never be recomputed (the profiler marks it unsafe);
    # any other subclass may override forward, so only the library classes are rewritten.
    if cls.__module__ == "torch.nn.modules.batchnorm" and issubclass(cls, BatchNormBase) \
            and cls.__name__ != "SyncBatchNorm":
        return "batchnorm"
    if cls.__module__ == "torch.nn.modules.instancenorm" and issubclass(cls, InstanceNormBase):
        return "instancenorm"
    return None


def _is_plain_batchnorm(mod: torch.nn.Module) -> bool:
    return norm_kind(type(mod)) == "batchnorm"


def _is_plain_instancenorm(mod: torch.nn.Module) -> bool:
    return norm_kind(type(mod)) == "instancenorm"


def call_for_recompute(kind: str, target: Any, args: tuple, kwargs: dict, fetch_attr,
                       stats: tuple | None = None) -> Any:
    """Run an fx node (`kind` its op, `target` its target) as a recomputation does. The runtime
    recomputes with it and the profiler measures a recomputation's transient memory with it:
    a norm run without running statistics takes other kernel paths (other scratch) than the
    forward that updated them. `stats`: the node's batch statistics from its forward
    (`batch_stats`), which a training BatchNorm reuses where it can (NOTE [BatchNorm from its
    statistics])."""
    if kind == "call_module":
        return call_module_for_recompute(fetch_attr(target), args, kwargs, stats)
    if kind == "call_function":
        return call_function_for_recompute(target, args, kwargs, stats)
    if kind == "call_method":
        self_obj, *rest = args
        return getattr(self_obj, target)(*rest, **kwargs)
    if kind == "get_attr":
        return fetch_attr(target)
    raise RuntimeError(f"ScheduleWrapper: cannot recompute an fx node of kind {kind!r} "
                       f"(target {target})")


def writes_left_out(kind: str, target: Any, args: tuple, kwargs: dict, fetch_attr) -> list:
    """The tensors the node's forward writes in place and `call_for_recompute` does not (a
    norm's running statistics): with no other write, running it again under no_grad changes
    nothing."""
    if kind == "call_module":
        mod = fetch_attr(target)
        allowed = allowed_buffer_writes(mod) if not kwargs and len(args) == 1 else ()
        return [b for name, b in mod.named_buffers() if b is not None and name in allowed]
    if kind != "call_function":
        return []
    if target in (F.batch_norm, F.instance_norm):
        names = ("input", "running_mean", "running_var")
        bound = _bind_norm(target, args, kwargs, names)
        return [bound[k] for k in names[1:] if isinstance(bound.get(k), torch.Tensor)]
    if target in _ATEN_NORMS:
        return [t for t in args[3:5] if isinstance(t, torch.Tensor)]
    return []


def call_module_for_recompute(mod: torch.nn.Module, args: tuple, kwargs: dict,
                              stats: tuple | None = None) -> Any:
    """Call `mod` as its original forward did, but without updating running statistics.
    `stats`: a BatchNorm's batch statistics from its forward (`batch_stats`), or None."""
    if _is_plain_batchnorm(mod) and not kwargs and len(args) == 1:
        bn_training = mod.training or (mod.running_mean is None and mod.running_var is None)
        if bn_training:
            out = normalized_with(args[0], mod.weight, mod.bias, stats)
            if out is not None:
                return out
            # Batch statistics, no running-statistics update (torch.nn.BatchNorm forward with
            # running_mean = running_var = None). mod._check_input_dim ran in the forward.
            return F.batch_norm(args[0], None, None, mod.weight, mod.bias, True, 0.0, mod.eps)
        return mod(*args)  # eval-mode BatchNorm inside a training model: reads, never writes
    if _is_plain_instancenorm(mod) and not kwargs and len(args) == 1:
        if mod.training and mod.track_running_stats:
            x = args[0]
            if x.dim() == mod._get_no_batch_dim():
                return F.instance_norm(x.unsqueeze(0), None, None, mod.weight, mod.bias, True,
                                       0.0, mod.eps).squeeze(0)
            return F.instance_norm(x, None, None, mod.weight, mod.bias, True, 0.0, mod.eps)
        return mod(*args)
    return mod(*args, **kwargs)


def recomputes_differently(fn) -> bool:
    """True for the functions `call_function_for_recompute` does not simply call again."""
    return fn is F.batch_norm or fn is F.instance_norm or fn in _ATEN_NORMS


def call_function_for_recompute(fn, args: tuple, kwargs: dict,
                                stats: tuple | None = None) -> Any:
    """Call a traced function, dropping running statistics from functional batch/instance norm
    (`stats`: as for call_module_for_recompute)."""
    if fn is F.batch_norm:
        bound = _bind_norm(fn, args, kwargs, ("input", "running_mean", "running_var", "weight",
                                              "bias", "training", "momentum", "eps"))
        if bound.get("training", False):
            out = normalized_with(bound["input"], bound.get("weight"), bound.get("bias"), stats)
            if out is not None:
                return out
            bound["running_mean"] = bound["running_var"] = None
            bound["momentum"] = 0.0
        return F.batch_norm(**bound)
    if fn is F.instance_norm:
        bound = _bind_norm(fn, args, kwargs, ("input", "running_mean", "running_var", "weight",
                                              "bias", "use_input_stats", "momentum", "eps"))
        if bound.get("use_input_stats", True):
            bound["running_mean"] = bound["running_var"] = None
            bound["momentum"] = 0.0
        return F.instance_norm(**bound)
    if fn in _ATEN_NORMS:
        # The same for the ATen ops of a graph captured with torch.export (monetlike.capture):
        # aten.batch_norm(input, weight, bias, running_mean, running_var, training, momentum,
        # eps, cudnn_enabled), aten.instance_norm(..., use_input_stats, ...): batch statistics
        # are used when argument 5 is true, and then running statistics are only written.
        bound = list(args) + [kwargs.pop(k) for k in _ATEN_NORM_ARGS[len(args):] if k in kwargs]
        if len(bound) > 5 and bound[5]:
            bound[3] = bound[4] = None
            bound[6] = 0.0
        return fn(*bound, **kwargs)
    return fn(*args, **kwargs)


# NOTE [BatchNorm from its statistics]
# Recomputing a training BatchNorm recomputes its batch statistics, about nine tenths of the
# kernel's time on the CPU, while the forward's autograd node already holds them (`save_mean`,
# `save_invstd`) until after every recomputation. ATen's CPU kernel normalises as `x * alpha +
# beta` per channel in both modes, so the eval-mode kernel fed alpha and beta reproduces the
# training kernel's bits. How it rounds beta depends on how it was compiled, so `_beta_rules` probes
# it once per dtype, and the held statistics are used only where a rule reproduced it exactly
# (float32/float64 CPU tensors, channels-first or channels-last).
def batch_stats(result: Any) -> tuple | None:
    """(save_mean, save_invstd) of a training BatchNorm's result, from its autograd node, or
    None (no node: nothing requires grad; another kind of node)."""
    if not isinstance(result, torch.Tensor):
        return None
    return batch_norm_saved_stats(result.grad_fn)


def normalized_with(x: Any, weight, bias, stats: tuple | None) -> "torch.Tensor | None":
    """A training BatchNorm's output from its forward's batch statistics, bit for bit as the
    kernel computes it, or None where that is not known to hold (NOTE [BatchNorm from its
    statistics])."""
    if stats is None or not isinstance(x, torch.Tensor) or x.device.type != "cpu" \
            or x.dim() < 2:
        return None
    rule = _beta_rules().get(x.dtype)
    mean, invstd = stats
    if rule is None or mean.dtype != x.dtype or invstd.dtype != x.dtype \
            or mean.shape != (x.shape[1],) \
            or any(p is not None and (not isinstance(p, torch.Tensor) or p.dtype != x.dtype)
                   for p in (weight, bias)) or not _dense(x):
        return None
    return _normalized(x, weight, bias, mean, invstd, rule)


def _normalized(x, weight, bias, mean, invstd, rule) -> torch.Tensor:
    alpha = invstd * weight if weight is not None else invstd
    beta = rule(bias if bias is not None else torch.zeros_like(mean), mean, alpha)
    return torch.batch_norm(x, alpha, beta, torch.zeros_like(mean), torch.ones_like(mean),
                            False, 0.0, 0.0, False)


def _dense(x: torch.Tensor) -> bool:
    if x.is_contiguous():
        return True
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    return fmt is not None and x.is_contiguous(memory_format=fmt)


def _beta_fused(bias, mean, alpha):
    return torch.addcmul(bias, mean, alpha, value=-1)


def _beta_rounded(bias, mean, alpha):
    return bias - mean * alpha


@functools.cache
def _beta_rules() -> dict:
    """dtype -> the beta rule that reproduces the CPU kernel's output on a probe, for float32 and
    float64 (absent: neither did). Made once per process, before any measured step: the
    profiler and the runtime call it when they start (`warm`)."""
    rules = {}
    with torch.no_grad():
        for dtype in (torch.float32, torch.float64):
            # Deterministic values (no generator draws): 64 channels, 2 x 67 elements each (a
            # vector body and a tail), means and scales far apart so that beta's rounding shows.
            c, n = 64, 2 * 67
            k = torch.arange(c * n, dtype=dtype)
            x = (torch.sin(k * 0.7071) * (1 + k % 7) + torch.cos(k * 0.013) * 5).view(2, c, 67)
            w = torch.cos(torch.arange(c, dtype=dtype) * 1.3) * 2
            b = torch.sin(torch.arange(c, dtype=dtype) * 0.9) * 3
            ref, mean, invstd = torch.native_batch_norm(x, w, b, None, None, True, 0.0, 1e-5)
            for rule in (_beta_fused, _beta_rounded):
                if torch.equal(_normalized(x, w, b, mean, invstd, rule), ref):
                    rules[dtype] = rule
                    break
    return rules


def warm() -> None:
    """Make what `normalized_with` asks the kernel once (before any measured step)."""
    _beta_rules()


_ATEN_NORMS = (torch.ops.aten.batch_norm.default, torch.ops.aten.instance_norm.default)
_ATEN_NORM_ARGS = ("input", "weight", "bias", "running_mean", "running_var", "training",
                   "momentum", "eps", "cudnn_enabled")


def _bind_norm(fn, args, kwargs, names) -> dict:
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


# ----------------------------------------------------------------------------------------------
# Side effects
# ----------------------------------------------------------------------------------------------
def buffer_versions(mod: torch.nn.Module, skip: frozenset[str] = frozenset()) -> list:
    """(name, version) of the module's buffers whose last name part is not in `skip`."""
    if not mod._modules and mod._buffers.keys() <= skip:
        return []  # a plain BatchNorm: every buffer it has may be written
    return [(name, b._version) for name, b in mod.named_buffers()
            if b is not None and name.rsplit(".", 1)[-1] not in skip]


def allowed_buffer_writes(mod: torch.nn.Module) -> frozenset[str]:
    """Buffers a module may write in its forward because recomputation avoids writing them."""
    if _is_plain_batchnorm(mod) or (_is_plain_instancenorm(mod) and mod.track_running_stats):
        return frozenset({"running_mean", "running_var", "num_batches_tracked"})
    return frozenset()
