"""recompute_internals: an Op that holds only its inputs and rebuilds its internals in its backward.

Some Ops' backwards hold large tensors that are neither Values nor parameters
(`Impl.internal_bytes`): `nn.MultiheadAttention` with `need_weights=True` (the default) keeps
the attention probabilities, batch x heads x L x L; an LSTM keeps its gate activations; an
`nn.TransformerEncoderLayer`, which torch.fx keeps whole (a module of torch.nn is a leaf), keeps
everything its sub-layers save. No keep/recompute decision can drop them: they live inside the
Op from its forward to its backward.

This Impl runs the Op's forward as the default does, then lets go of the autograd graph it built
and keeps only the Op's tensor inputs (Values, so the schedule decides where they come from). At
the Op's backward stage it runs the same forward again with grad enabled, under the RNG and
autocast state of the original (monetlike.core.recompute.replay: dropout draws the same
mask), and backpropagates through it: the internals exist only during that stage, as backward
workspace. It is a one-Op checkpoint, with the forward hooks not called again (the module's
`forward` is called, not the module) and nothing else repeated: the modules it applies to have no
buffers, so there are no running statistics to update twice.

Matmuls written by hand belong here too: `q @ k.transpose(-2, -1)` on the permuted heads of a
fused projection reshapes its non-contiguous operands into contiguous copies for one batched
kernel, and its backward holds those copies (three of them per attention), not the Values. It
is offered only where the default holds such internals (`ImplSpec.needs_internals`).

Why the forward runs with grad enabled and not under no_grad: some modules choose another kernel
without grad (nn.MultiheadAttention's and the Transformer layers' "fast path" in eval mode), and
the forward result must be bitwise the default's. The internals that forward saves are hidden
from outer saved-tensor hooks (the profiler's, the runtime's) by an innermost identity pair, and
die with its graph at the end of the Op, so they count as forward workspace.

Parameters are passed to the autograd Function as inputs and their gradients returned through it,
so they reach `.grad` through ordinary AccumulateGrad nodes (DistributedDataParallel's hooks fire
as usual), not through a nested backward call.
"""

from __future__ import annotations

import operator

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core import recompute as rc
from ..core.torch_private import tree_flatten, tree_unflatten
from .registry import ImplSpec, one_node, register
from ..core.modules import has_forward_hooks, module_of

# Module types with large internals and no buffers, kept whole by torch.fx (leaves of torch.nn).
MODULES = (nn.MultiheadAttention, nn.LSTM, nn.GRU, nn.RNN,
           nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
# torch.export keeps these aten overloads (same arguments as the functions): a Hugging Face
# model's attention is one aten.scaled_dot_product_attention node, whose CPU math path with
# dropout holds the attention probabilities and the dropout noise.
_ATEN = torch.ops.aten
FUNCTIONS = (F.scaled_dot_product_attention, torch.matmul, operator.matmul, torch.einsum,
             _ATEN.scaled_dot_product_attention.default, _ATEN.matmul.default,
             _ATEN.einsum.default)
METHODS = ("matmul",)  # x.matmul(y)
RANDOM_FUNCTIONS = (F.scaled_dot_product_attention,
                    _ATEN.scaled_dot_product_attention.default)  # the others draw none


def _pack(t):
    # Detached: a saved output packed as itself would hold its own grad_fn, a reference cycle
    # through C++ that keeps the forward's whole graph (every internal) alive after the Op.
    # Autograd gives the unpacked tensor its grad_fn back, so the backward's rerun is unchanged.
    return t.detach()


def _unpack(t):
    return t


def _hidden_hooks():
    """Saved-tensor hooks that keep every save in memory, and keep outer hooks from seeing it."""
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)


class RecomputeInternals(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call, spec, layout, random, *tensors):
        # tensors: the tensor leaves of the call's (args, kwargs), then the call's parameters.
        # layout: filled here with where the output's tensors sit in its structure (the Function
        # returns the tensors only; `run` rebuilds the structure).
        n_in = len(tensors) - len(call.params)
        inputs = tensors[:n_in]
        ctx.same = first_positions(inputs)
        rng_ctx = rc.ContextCapturer(rc.cuda_devices_of(inputs), as_tensor=True).capture(rng=random)
        with torch.enable_grad(), _hidden_hooks():
            detached = _detach(inputs, [t.requires_grad for t in inputs], ctx.same)
            out = call(_rebuild(spec, detached))
        leaves, layout["spec"] = tree_flatten(out)
        layout["tensor_pos"] = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        layout["other"] = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        ctx.call, ctx.spec, ctx.n_in = call, spec, n_in
        ctx.tensor_pos = layout["tensor_pos"]
        # The RNG states are saved tensors (rc.with_rng_states): the profiler's accounting sees
        # them, as dropout_regen's, and they are freed once this backward has run (held as a
        # ctx attribute, 5 KB outlived the stage: a fuzzed model measured over its prediction).
        ctx.rng_ctx = rc.with_rng_states(rng_ctx, ())
        ctx.save_for_backward(*distinct_inputs(inputs, ctx.same), *rc.rng_states(rng_ctx))
        outs = tuple(leaves[i].detach() for i in ctx.tensor_pos)
        del out, leaves  # the forward's graph, and with it every internal, goes here
        ctx.mark_non_differentiable(*[o for o in outs
                                      if not (o.is_floating_point() or o.is_complex())])
        ctx.set_materialize_grads(False)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        need = ctx.needs_input_grad[4:]
        n_in, same = ctx.n_in, ctx.same
        saved = ctx.saved_tensors
        inputs = inputs_from(saved, same)
        n_distinct = sum(s == i for i, s in enumerate(same))  # the RNG states follow them
        rng_ctx = rc.with_rng_states(ctx.rng_ctx, saved[n_distinct:])
        with torch.enable_grad(), rc.replay(rng_ctx), _hidden_hooks():
            detached = _detach(inputs, need[:n_in], same)
            out = ctx.call(_rebuild(ctx.spec, detached))
        leaves, _ = tree_flatten(out)
        outs, gouts = [], []
        for i, g in zip(ctx.tensor_pos, grads):
            if g is not None and leaves[i].requires_grad:
                outs.append(leaves[i])
                gouts.append(g)
        # A tensor passed several times gets its whole gradient at its first position (autograd
        # adds the gradients of the positions of one tensor).
        pos = [i for i in range(len(need)) if need[i] and (i >= n_in or same[i] == i)]
        wrt = [detached[i] if i < n_in else ctx.call.params[i - n_in] for i in pos]
        got = torch.autograd.grad(outs, wrt, gouts, allow_unused=True) if outs \
            else [None] * len(wrt)
        result = [None] * len(need)
        for i, g in zip(pos, got):
            result[i] = g
        return (None, None, None, None, *result)


def first_positions(tensors) -> list[int]:
    """`same[i]`: the first position holding the tensor at position i (None: i itself).

    A recomputation must see the same tensor passed twice where the forward did
    (nn.MultiheadAttention projects query, key and value in one matmul when they are one tensor;
    autograd sums a shared tensor's gradients in its own order), and a saved tensor comes back
    from unpacking as a new object each time; so each distinct input is saved once."""
    first: dict[int, int] = {}
    return [first.setdefault(id(t), i) if t is not None else i for i, t in enumerate(tensors)]


def distinct_inputs(tensors, same) -> list:
    """The tensors to save: each distinct one once, by `first_positions` (None kept as None)."""
    return [t for i, t in enumerate(tensors) if same[i] == i]


def inputs_from(saved, same) -> list:
    """The inputs back from what `distinct_inputs` saved (more saved tensors may follow)."""
    it = iter(saved)
    inputs = [None] * len(same)
    for i in range(len(same)):
        inputs[i] = next(it) if same[i] == i else inputs[same[i]]
    return inputs


def _detach(tensors, requires_grad, same):
    """Detached aliases of `tensors` with the given requires_grad (None stays None); a position
    holding the same tensor as an earlier one (`same`) gets that one's alias."""
    out = []
    for i, (t, rg) in enumerate(zip(tensors, requires_grad)):
        out.append(out[same[i]] if same[i] != i
                   else None if t is None else t.detach().requires_grad_(bool(rg)))
    return out


_TENSOR = object()  # marks where a tensor sits among a call's arguments


def _rebuild(spec, tensors):
    """(args, kwargs) with the tensor leaves of the template replaced by `tensors`, in order."""
    template, treedef = spec
    it = iter(tensors)
    return tree_unflatten([next(it) if x is _TENSOR else x for x in template], treedef)


class _Call:
    """A module's forward (its hooks are not called again) or a function, taking (args, kwargs),
    with the parameters whose gradients the Function returns."""

    def __init__(self, fn, params):
        self.fn, self.params = fn, params

    def __call__(self, args_kwargs):
        args, kwargs = args_kwargs
        return self.fn(*args, **kwargs)


def _draws_random(mod: nn.Module) -> bool:
    """Whether a module's training forward draws random numbers (dropout somewhere inside)."""
    if not mod.training:
        return False
    for m in mod.modules():
        p = m.p if isinstance(m, nn.Dropout) else getattr(m, "dropout", 0.0)
        if isinstance(p, (int, float)) and p > 0:
            return True
    return False


def _match(gm, nodes):
    n, mod = one_node(gm, nodes)
    if n is None:
        return None
    if mod is not None:
        if type(mod) not in MODULES or any(True for _ in mod.buffers()) \
                or has_forward_hooks(mod, including_global=True):
            return None
    elif not (n.op == "call_function" and n.target in FUNCTIONS
              or n.op == "call_method" and n.target in METHODS):
        return None

    def run(interp, node, args, kwargs):
        if node.op == "call_module":
            mod = module_of(interp, node.target)
            call = _Call(mod.forward, [p for p in mod.parameters()])
            random = _draws_random(mod)
        elif node.op == "call_method":
            call = _Call(getattr(torch.Tensor, node.target), [])
            random = False
        else:
            call = _Call(node.target, [])
            random = False
            if node.target in RANDOM_FUNCTIONS:
                # scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, ...)
                p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
                random = not isinstance(p, (int, float)) or p > 0
        leaves, treedef = tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        template = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
        layout: dict = {}
        outs = RecomputeInternals.apply(call, (template, treedef), layout, random, *tensors,
                                        *call.params)
        out_leaves = list(layout["other"])
        for i, o in zip(layout["tensor_pos"], outs):
            out_leaves[i] = o
        return tree_unflatten(out_leaves, layout["spec"])

    return {n.name: run}


register(ImplSpec("recompute_internals", _match,
                  "An Op with large internal saved tensors (attention probabilities, RNN gates, "
                  "a matmul's contiguous copies of its operands) holds only its inputs; its "
                  "forward runs again at its backward stage", needs_internals=True))
