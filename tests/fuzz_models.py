"""Random small models from a grammar of ops, for the memory and gradient fuzzer (issue 18).

A model is a program: a list of `Step`s over a pool of activations that all have the shape
(B, T, D). Each step reads one to three pool entries (by index, modulo the pool size), applies one
construct of the grammar and appends its (B, T, D) result, so any later step may reuse it:
residuals, a Value read by several Ops and several outputs come for free. The first entry is an
embedding of integer tokens plus a learned position Parameter added by broadcast; the model
returns the last `n_outputs` entries and every entry no later step reads, so that every result
reaches the loss (an Op whose results never do keeps what autograd saved for it until those
results die, which the memory model does not describe: docs/profiler.md, Limits).

The constructs cover what a memory model must account per storage: matmuls and convolutions on
transposed views, split/chunk/slice, view/reshape/permute, contiguous copies, cat/stack,
softmax, dropout, three norms, in-place and out-of-place activations, broadcasting adds and muls,
a Linear whose weight is used by two steps, complex views of float Values, an in-place add
into an activation written in place with another Op computed in between, recurrent layers, and
what torch.export alone refuses: a custom autograd Function, a torch.library custom op with a
registered backward and a Python branch on a tensor's value (captured for the example's branch).

`FUZZ_PROGRAMS` is a hypothesis strategy for programs; `build(program)` makes the module and its
example batch.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

B, T, D, VOCAB = 4, 8, 16, 32

CONSTRUCTS = (
    "linear", "linear_on_transpose", "conv1d_on_transpose", "attention_matmul", "attention_bmm",
    "attention_einsum", "attention_sdpa", "split_cat", "chunk_cat", "slice_cat",
    "reshape_permute", "contiguous",
    "stack_mean", "softmax", "dropout", "layer_norm", "batch_norm", "group_norm", "relu_inplace",
    "gelu", "tanh", "sigmoid_inplace", "add", "mul", "add_param", "mul_param", "shared_linear",
    # what Llama-style blocks and loss heads write: Python numbers autograd keeps, bool masks,
    # integer Values, reductions broadcast back
    "rms_norm", "swiglu", "where_scalar", "masked_fill", "clamp", "scale_pow", "amax_broadcast",
    "argmax_gather",
    # detached statistics, gates no gradient flows through, in-place writes on fresh results and
    # their views, scans
    "detach_stat", "sigmoid_gate", "mul_inplace_scalar", "view_add_inplace", "cumsum",
    "log_softmax", "slice_broadcast", "read_then_inplace",
    # complex numbers: views of float Values as another dtype, lazy conjugates (rotary embeddings)
    "complex_mul",
    # an in-place add into an Op's result with another Op computed in between: one Op whose
    # backward autograd leaves and comes back to (NOTE [Interleaved stages] in the profiler)
    "act_then_add_",
    # recurrent layers: one fx leaf each (oneDNN's kernel on the CPU, its workspace saved), an
    # ATen op each under torch.export
    "gru", "lstm_bi",
    # what torch.export alone refuses (issue 55): a custom autograd Function, a torch.library
    # custom op with a registered backward, a Python branch on a tensor's value
    "custom_function", "custom_op", "value_branch",
)

# How many of a step's three reads each construct uses (the others are not read at all).
ARITY = {k: 1 for k in CONSTRUCTS}
ARITY.update({"attention_matmul": 3, "attention_bmm": 3, "attention_einsum": 3,
              "attention_sdpa": 3, "chunk_cat": 2,
              "slice_cat": 2, "reshape_permute": 2, "stack_mean": 3, "relu_inplace": 2,
              "sigmoid_inplace": 2, "add": 2, "mul": 2, "swiglu": 2, "masked_fill": 2,
              "argmax_gather": 2, "sigmoid_gate": 2, "view_add_inplace": 2,
              "slice_broadcast": 2, "complex_mul": 2, "act_then_add_": 2})


class SquarePlus(torch.autograd.Function):
    """A smooth activation with its own backward; saves its input."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return 0.5 * (x + torch.sqrt(x * x + 4.0))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 0.5 * (1.0 + x * torch.rsqrt(x * x + 4.0))


@torch.library.custom_op("monetlike_fuzz::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.tanh(x) * scale


@scaled_tanh.register_fake
def _(x, scale):
    return torch.empty_like(x)


def _scaled_tanh_context(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.scale = inputs[1]


def _scaled_tanh_backward(ctx, g):
    (y,) = ctx.saved_tensors
    return g * (ctx.scale - y * y / ctx.scale), None


scaled_tanh.register_autograd(_scaled_tanh_backward, setup_context=_scaled_tanh_context)


@dataclass(frozen=True)
class Step:
    construct: str
    reads: tuple[int, int, int]
    p: float = 0.25  # dropout probability


class FuzzNet(nn.Module):
    def __init__(self, program: tuple[Step, ...], n_outputs: int):
        super().__init__()
        self.program, self.n_outputs = program, n_outputs
        self.embed = nn.Embedding(VOCAB, D)
        self.position = nn.Parameter(torch.randn(1, T, D) * 0.1)
        self.shared = nn.Linear(D, D)  # the weight used twice (by every "shared_linear" step)
        layers = []
        for step in program:
            layers.append(self._layer(step.construct))
        self.layers = nn.ModuleList(layers)
        self.scale = nn.Parameter(torch.ones(1, 1, D))
        self.bias = nn.Parameter(torch.zeros(1, T, 1))

    @staticmethod
    def _layer(construct: str) -> nn.Module:
        if construct == "linear":
            return nn.Linear(D, D)
        if construct == "linear_on_transpose":
            return nn.Linear(T, T, bias=False)
        if construct == "conv1d_on_transpose":
            return nn.Conv1d(D, D, 3, padding=1)
        if construct == "layer_norm":
            return nn.LayerNorm(D)
        if construct == "batch_norm":
            return nn.BatchNorm1d(D)
        if construct == "group_norm":
            return nn.GroupNorm(4, D)
        if construct == "gru":
            return nn.GRU(D, D, batch_first=True)
        if construct == "lstm_bi":
            return nn.LSTM(D, D // 2, batch_first=True, bidirectional=True)
        return nn.Identity()

    def forward(self, tokens: torch.Tensor):
        pool = [self.embed(tokens) + self.position]
        for k, (step, layer) in enumerate(zip(self.program, self.layers)):
            a, b, c = (pool[i % len(pool)] for i in step.reads)
            pool.append(_apply(step, layer, self, a, b, c))
            del a, b, c
            # Drop what no later step or output reads, as code without a pool would: an eager
            # list keeps dead tensors alive that the traced graph (and the runtime) frees.
            for i in self._dead_after[k]:
                pool[i] = None
        return tuple(pool[i] for i in self._outputs)

    def _last_reads(self) -> dict[int, int]:
        """Pool entry -> the last step reading it (the step making it when none reads it)."""
        last = {i: i - 1 for i in range(len(self.program) + 1)}  # entry i > 0: made by step i-1
        for k, step in enumerate(self.program):
            for i in step.reads[:ARITY[step.construct]]:
                last[i % (k + 1)] = k
        return last

    @property
    def _outputs(self) -> list[int]:
        n = len(self.program) + 1
        unread = [i for i, k in self._last_reads().items() if k == i - 1]
        return sorted(set(unread) | set(range(max(0, n - self.n_outputs), n)))

    @property
    def _dead_after(self) -> list[list[int]]:
        last = self._last_reads()
        for i in self._outputs:
            last[i] = len(self.program)  # an output: never dropped
        return [[i for i in range(k + 2) if last[i] == k] for k in range(len(self.program))]


def _apply(step: Step, layer: nn.Module, net: FuzzNet, a, b, c) -> torch.Tensor:
    k = step.construct
    if k == "linear":
        return layer(a)
    if k == "linear_on_transpose":
        return layer(a.transpose(1, 2)).transpose(1, 2)
    if k == "conv1d_on_transpose":
        return layer(a.transpose(1, 2)).transpose(1, 2)
    if k == "attention_matmul":
        scores = (a @ b.transpose(-2, -1)) * D ** -0.5
        return scores.softmax(dim=-1) @ c
    if k == "attention_bmm":
        return torch.bmm(torch.bmm(a, b.transpose(1, 2)).sigmoid(), c)
    if k == "attention_einsum":
        s = torch.einsum("btd,bsd->bts", a, b).tanh()
        return torch.einsum("bts,bsd->btd", s, c)
    if k == "attention_sdpa":  # two heads; dropout inside while training
        q, k_, v = (t.unflatten(-1, (2, D // 2)).transpose(1, 2) for t in (a, b, c))
        y = F.scaled_dot_product_attention(q, k_, v, dropout_p=step.p if net.training else 0.0,
                                           is_causal=step.p < 0.2)
        return y.transpose(1, 2).flatten(2)
    if k == "split_cat":
        lo, hi = a.split(D // 2, dim=-1)
        return torch.cat([hi * 2.0, lo.relu()], dim=-1)
    if k == "chunk_cat":
        first, second = a.chunk(2, dim=1)
        return torch.cat([second, first * b[:, : T // 2]], dim=1)
    if k == "slice_cat":
        return torch.cat([a[:, :, : D // 4].tanh(), a[:, :, D // 4:] - b[:, :, D // 4:]], dim=-1)
    if k == "reshape_permute":
        return a.view(B, T, 2, D // 2).permute(0, 1, 3, 2).reshape(B, T, D) + b
    if k == "contiguous":
        return a.transpose(1, 2).contiguous().transpose(1, 2) * 0.5
    if k == "stack_mean":
        return torch.stack([a, b, c], dim=0).mean(dim=0)
    if k == "softmax":
        return F.softmax(a, dim=-1)
    if k == "dropout":
        return F.dropout(a, p=step.p, training=net.training)
    if k in ("layer_norm",):
        return layer(a)
    if k in ("batch_norm", "group_norm"):
        return layer(a.transpose(1, 2)).transpose(1, 2)
    if k == "relu_inplace":
        return F.relu(a * 1.5 - b, inplace=True)  # in place on a fresh result only
    if k == "gelu":
        return F.gelu(a)
    if k == "tanh":
        return torch.tanh(a)
    if k == "sigmoid_inplace":
        return (a + b).sigmoid_()
    if k == "add":
        return a + b
    if k == "mul":
        return a * b
    if k == "add_param":
        return a + net.bias  # broadcasts over batch and features
    if k == "mul_param":
        return a * net.scale  # broadcasts over batch and time
    if k == "shared_linear":
        return net.shared(a)
    if k == "rms_norm":
        return a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6) * net.scale
    if k == "swiglu":
        return F.silu(a) * b
    if k == "where_scalar":
        return torch.where(a > 0, a, 0.1 * a)
    if k == "masked_fill":
        return a.masked_fill(b > 0.5, 0.0)
    if k == "clamp":
        return a.clamp(min=-0.5, max=0.5)
    if k == "scale_pow":
        return (a / 3.0) ** 2 + 1.0
    if k == "amax_broadcast":
        return a - a.amax(dim=1, keepdim=True)
    if k == "argmax_gather":
        return b * torch.gather(a, -1, a.argmax(-1, keepdim=True))
    if k == "detach_stat":
        return a - a.mean(dim=1, keepdim=True).detach()
    if k == "sigmoid_gate":
        return a * (b.sigmoid() > 0.5)  # the sigmoid leads to no gradient
    if k == "mul_inplace_scalar":
        return F.gelu(a).mul_(2.0)
    if k == "read_then_inplace":  # a statistic read from x before x is divided by it in place
        x = a * 1.0
        return x.div_(x.detach().abs().amax(dim=-1, keepdim=True) + 1)
    if k == "complex_mul":  # a fresh float Value and a tanh read as complex pairs, one conjugated
        # (contiguous first: an elementwise result keeps its input's strides, and a complex view
        # needs the pairs adjacent)
        za = torch.view_as_complex((a.contiguous() * 1.0).unflatten(-1, (-1, 2)))
        zb = torch.view_as_complex(torch.tanh(b.contiguous()).unflatten(-1, (-1, 2)))
        return torch.view_as_real(za * zb.conj()).flatten(-2)
    if k == "view_add_inplace":
        x = a * 1.0
        x[:, 0] += b[:, 0]
        return x
    if k == "act_then_add_":  # SiLU in place saves a copy of its input until its backward
        h = F.silu(a * 1.5, inplace=True)
        return h.add_(torch.tanh(b))
    if k == "cumsum":
        return a.cumsum(dim=1)
    if k == "log_softmax":
        return F.log_softmax(a, dim=-1)
    if k == "slice_broadcast":
        return a[:, :1] * b
    if k in ("gru", "lstm_bi"):
        return layer(a)[0]
    if k == "custom_function":
        return SquarePlus.apply(a)
    if k == "custom_op":
        return scaled_tanh(a, 1.5)
    if k == "value_branch":  # a guard on a value, as T5's `if torch.isinf(h).any()`: captured
        # for the example's branch (torch.export); one that training can flip (`a.mean() > 0`)
        # is refused at its next step, as it should be, which is no model to fuzz
        return a.clamp(-1e4, 1e4) if torch.isinf(a).any() else torch.tanh(a)
    raise ValueError(f"unknown construct {k!r}")


def settle_heap() -> None:
    """Move what the process holds before a model is built (torch, transformers, modules that
    the previous model imported lazily) out of the garbage collector's way: measure_step collects
    garbage and lists live tensors once per measurement, 65-120 ms each over that heap. Every
    tensor of the model built after this is still seen; frozen ones neither die in a step nor
    count in the difference measured_peak takes."""
    gc.collect()
    gc.freeze()


def build(program: tuple[Step, ...], n_outputs: int, seed: int) -> tuple[FuzzNet, torch.Tensor]:
    torch.manual_seed(seed)
    model = FuzzNet(program, n_outputs)
    tokens = torch.randint(0, VOCAB, (B, T))
    return model, tokens


STEPS = st.builds(Step, st.sampled_from(CONSTRUCTS),
                  st.tuples(*(st.integers(0, 63),) * 3),
                  st.sampled_from((0.1, 0.25, 0.5)))
FUZZ_PROGRAMS = st.tuples(st.lists(STEPS, min_size=2, max_size=9).map(tuple),
                          st.integers(1, 3), st.integers(0, 2 ** 16))
