"""Peers of monetlike, built the way their users build them, one adapter per model family.

`scripts/bench_peers.py` compares monetlike with what a PyTorch user reaches for first:
- `torch.utils.checkpoint.checkpoint` around each natural block (non-reentrant);
- `checkpoint_sequential` over the model flattened to a chain, about sqrt(n) segments;
- selective activation checkpointing (SAC): per block, save matmul/conv outputs, recompute the rest;
- `torch.compile(backend="aot_eager")` with `activation_memory_budget` (the min-cut partitioner
  plus a knapsack over what to save).

The first three need to know the model's blocks, so each family gets an adapter: `forward(model,
x, wrap)` runs exactly the computation of `model(x)` but calls every natural block as
`wrap(fn, *inputs)`, and `chain(model)` lists modules whose composition is `model`. The bench
checks both against the plain model (equal outputs) before it measures anything.

Families: torchvision ResNet (BasicBlock / Bottleneck), DenseNet (dense layers), MobileNetV2
(InvertedResidual), a stack of monetlike.models.TransformerBlock (attention and MLP
sub-layers) and Hugging Face's GPT-2 (its GPT2Blocks; random init from a config; fx cannot
trace it, so ours captures it with torch.export).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, checkpoint_sequential,
                                    create_selective_checkpoint_contexts)

__all__ = ["ModelSpec", "SPECS", "Adapter", "adapter_for", "PEERS", "Peer", "TransformerStack",
           "sac_policy", "SAC_SAVE_OPS"]

Wrap = Callable[..., torch.Tensor]


def _plain(fn, *args):
    return fn(*args)


# ----------------------------------------------------------------------------------------------
# Models and sizes
# ----------------------------------------------------------------------------------------------
class TransformerStack(nn.Sequential):
    """`depth` monetlike.models.TransformerBlock in a row: one block has only two sub-layers, too
    few for checkpoint_sequential to leave anything checkpointed (its last segment never is)."""

    def __init__(self, depth: int = 4, **kw):
        from monetlike.models import transformer_block
        super().__init__(*[transformer_block(**kw) for _ in range(depth)])


@dataclass(frozen=True)
class ModelSpec:
    """One benchmarked model at one size."""

    name: str
    """Name on the command line and in the table."""
    build: Callable[[], nn.Module]
    """Factory of a freshly initialised model (the bench seeds the RNG before calling it)."""
    input_shape: tuple[int, ...]
    """Shape of the input batch, batch dimension first."""
    family: str
    """Key of the Adapter that knows the model's blocks."""
    vocab: int | None = None
    """Token ids below this as the input (a language model), instead of normal floats."""

    def example_input(self, seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        if self.vocab is not None:
            return torch.randint(0, self.vocab, self.input_shape, generator=g)
        return torch.randn(self.input_shape, generator=g)


def labels_for(out: torch.Tensor) -> "torch.Tensor | None":
    """The bench's fixed class labels for a model returning (batch, classes) logits, else None."""
    return (torch.arange(out.shape[0]) % out.shape[1]) if out.dim() == 2 else None


def bench_loss(out: torch.Tensor, labels: "torch.Tensor | None") -> torch.Tensor:
    """The bench's training loss: cross-entropy on logits, else the output's mean square."""
    if labels is not None:
        return F.cross_entropy(out, labels)
    return out.float().pow(2).mean()


class GPT2Logits(nn.Module):
    """transformers' GPT2LMHeadModel called on token ids, returning its logits (the bench's
    steps take a tensor and give one); no cache, as in training."""

    def __init__(self, layers: int, dim: int, heads: int, positions: int, vocab: int):
        super().__init__()
        import transformers
        cfg = transformers.GPT2Config(n_layer=layers, n_embd=dim, n_head=heads,
                                      n_positions=positions, vocab_size=vocab,
                                      bos_token_id=vocab - 1, eos_token_id=vocab - 1)
        self.lm = transformers.GPT2LMHeadModel(cfg)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, use_cache=False).logits


def _gpt2(**kw) -> Callable[[], nn.Module]:
    return lambda: GPT2Logits(**kw)


def _tv(name: str, **kw) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision
        return getattr(torchvision.models, name)(**kw)
    return build


# Sizes: activations must dominate the step's memory (they are what any of these methods can
# save) and a step must take well under a few seconds on 2 cores, because every config is timed
# many times. "quick" sizes exist for the test and a smoke run only.
SPECS: dict[str, dict[str, ModelSpec]] = {
    "full": {
        "resnet18": ModelSpec("resnet18", _tv("resnet18"), (32, 3, 160, 160), "resnet"),
        "resnet50": ModelSpec("resnet50", _tv("resnet50"), (16, 3, 128, 128), "resnet"),
        "densenet121": ModelSpec("densenet121", _tv("densenet121"), (16, 3, 128, 128), "densenet"),
        "mobilenet_v2": ModelSpec("mobilenet_v2", _tv("mobilenet_v2"), (32, 3, 128, 128),
                                  "mobilenet_v2"),
        "transformer": ModelSpec("transformer",
                                 lambda: TransformerStack(depth=4, dim=256, heads=4),
                                 (8, 256, 256), "transformer"),
        # A vocabulary of 2,048 keeps the logits (and their gradient) from outweighing the
        # activations any of these methods can save.
        "gpt2": ModelSpec("gpt2", _gpt2(layers=4, dim=256, heads=4, positions=256, vocab=2048),
                          (8, 256), "gpt2", vocab=2048),
    },
    "quick": {
        "resnet18": ModelSpec("resnet18", _tv("resnet18", num_classes=10), (4, 3, 64, 64),
                              "resnet"),
        "resnet50": ModelSpec("resnet50", _tv("resnet50", num_classes=10), (2, 3, 32, 32),
                              "resnet"),
        "densenet121": ModelSpec("densenet121", _tv("densenet121", num_classes=10),
                                 (2, 3, 32, 32), "densenet"),
        "mobilenet_v2": ModelSpec("mobilenet_v2", _tv("mobilenet_v2", num_classes=10),
                                  (2, 3, 32, 32), "mobilenet_v2"),
        "transformer": ModelSpec("transformer",
                                 lambda: TransformerStack(depth=2, dim=32, heads=2),
                                 (4, 64, 32), "transformer"),
        "gpt2": ModelSpec("gpt2", _gpt2(layers=2, dim=32, heads=2, positions=32, vocab=64),
                          (2, 32), "gpt2", vocab=64),
    },
}


# ----------------------------------------------------------------------------------------------
# Family adapters
# ----------------------------------------------------------------------------------------------
class Adapter:
    """How one model family is cut into blocks. Subclasses mirror the library's forward."""

    def forward(self, model: nn.Module, x: torch.Tensor, wrap: Wrap = _plain) -> torch.Tensor:
        raise NotImplementedError

    def chain(self, model: nn.Module) -> list[nn.Module]:
        raise NotImplementedError

    def n_blocks(self, model: nn.Module) -> int:
        raise NotImplementedError

    def blocks(self, model: nn.Module, x: torch.Tensor) -> list[list[str]]:
        """The natural blocks `forward` wraps, in call order, each as the qualified names of the
        model's modules it runs (found by one no-grad forward with a recording wrap)."""
        seen: list = []

        def record(fn, *args):
            seen.append(fn)
            return fn(*args)
        with torch.no_grad():
            self.forward(model, x, record)
        return [module_names(model, fn) for fn in seen]

    def segments(self, model: nn.Module) -> list[list[str]]:
        """What checkpoint_sequential checkpoints: its first `segments - 1` segments of the chain
        (the last one runs without checkpointing), as qualified module names."""
        chain = self.chain(model)
        n = segments_for(len(chain))
        size = len(chain) // n
        return [[name for mod in chain[a:a + size] for name in module_names(model, mod)]
                for a in range(0, size * (n - 1), size)]


def module_names(model: nn.Module, fn) -> list[str]:
    """Qualified names (in `model`) of the modules `fn` is or contains: adapters wrap model
    modules in helpers (_ListCall, nn.Sequential, _Residual) that are not part of the model."""
    names = {id(m): n for n, m in model.named_modules()}

    def resolve(mod) -> list[str]:
        if id(mod) in names:
            return [names[id(mod)]]
        return [n for c in mod.children() for n in resolve(c)]
    return resolve(fn)


class ResNetAdapter(Adapter):
    """torchvision.models.ResNet: blocks are the BasicBlocks / Bottlenecks of layer1..layer4;
    the stem and the head run unwrapped (as in every per-block recipe)."""

    def _blocks(self, m):
        return [b for layer in (m.layer1, m.layer2, m.layer3, m.layer4) for b in layer]

    def forward(self, m, x, wrap=_plain):
        x = m.maxpool(m.relu(m.bn1(m.conv1(x))))
        for b in self._blocks(m):
            x = wrap(b, x)
        return m.fc(torch.flatten(m.avgpool(x), 1))

    def chain(self, m):
        # The stem's in-place ReLU stays inside one module, so no segment starts with an in-place
        # op on its (checkpointed) input.
        stem = nn.Sequential(m.conv1, m.bn1, m.relu, m.maxpool)
        head = nn.Sequential(m.avgpool, nn.Flatten(1), m.fc)
        return [stem, *self._blocks(m), head]

    def n_blocks(self, m):
        return len(self._blocks(m))


class DenseNetAdapter(Adapter):
    """torchvision.models.DenseNet: blocks are the dense layers (concat, BN-ReLU-1x1 conv,
    BN-ReLU-3x3 conv); a layer's inputs are all earlier feature maps of its dense block."""

    def _is_block(self, mod):
        from torchvision.models.densenet import _DenseBlock
        return isinstance(mod, _DenseBlock)

    def forward(self, m, x, wrap=_plain):
        for mod in m.features:
            if self._is_block(mod):
                feats = [x]
                for layer in mod.values():
                    # _DenseLayer takes the list of earlier maps; checkpoint wants tensors.
                    feats.append(wrap(_ListCall(layer), *feats))
                x = torch.cat(feats, 1)
            else:
                x = mod(x)
        out = F.relu(x, inplace=True)
        out = torch.flatten(F.adaptive_avg_pool2d(out, (1, 1)), 1)
        return m.classifier(out)

    def chain(self, m):
        feats = list(m.features)
        i = next(i for i, mod in enumerate(feats) if self._is_block(mod))
        stem = nn.Sequential(*feats[:i])
        head = nn.Sequential(feats[-1], nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1),
                             nn.Flatten(1), m.classifier)
        return [stem, *feats[i:-1], head]

    def n_blocks(self, m):
        return sum(len(mod) for mod in m.features if self._is_block(mod))


class _ListCall(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, *feats):
        return self.layer(list(feats))


class MobileNetV2Adapter(Adapter):
    """torchvision.models.MobileNetV2: blocks are the InvertedResiduals (features[1:-1]); the
    first and last Conv-BN-ReLU6 and the classifier (with its dropout) run unwrapped."""

    def forward(self, m, x, wrap=_plain):
        f = list(m.features)
        x = f[0](x)
        for b in f[1:-1]:
            x = wrap(b, x)
        x = f[-1](x)
        x = torch.flatten(F.adaptive_avg_pool2d(x, (1, 1)), 1)
        return m.classifier(x)

    def chain(self, m):
        return [*m.features, nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(1), m.classifier)]

    def n_blocks(self, m):
        return len(m.features) - 2


class _Residual(nn.Module):
    """x + body(norm(x)): one pre-norm sub-layer of TransformerBlock."""

    def __init__(self, norm: nn.Module, body: nn.Module):
        super().__init__()
        self.norm, self.body = norm, body

    def forward(self, x):
        return x + self.body(self.norm(x))


class TransformerAdapter(Adapter):
    """TransformerStack: blocks are the sub-layers, attention (ln1 + attn) and MLP (ln2 + mlp);
    the residual adds stay outside (they save nothing for backward)."""

    def forward(self, m, x, wrap=_plain):
        for blk in m:
            x = x + wrap(nn.Sequential(blk.ln1, blk.attn), x)
            x = x + wrap(nn.Sequential(blk.ln2, blk.mlp), x)
        return x

    def chain(self, m):
        out = []
        for blk in m:
            out += [_Residual(blk.ln1, blk.attn), _Residual(blk.ln2, blk.mlp)]
        return out

    def n_blocks(self, m):
        return 2 * len(m)


class _GPT2Embed(nn.Module):
    """GPT2Model's input embedding: tokens plus positions, then dropout."""

    def __init__(self, t: nn.Module):
        super().__init__()
        self.wte, self.wpe, self.drop = t.wte, t.wpe, t.drop

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        return self.drop(self.wte(ids) + self.wpe(pos))


class GPT2Adapter(Adapter):
    """GPT2Logits: blocks are the GPT2Blocks (causal attention with no mask given: the model's
    own mask is None for an unpadded batch under SDPA attention); the embedding, the final
    LayerNorm and the head run unwrapped, as transformers' gradient_checkpointing_enable()
    leaves them."""

    def forward(self, m, x, wrap=_plain):
        t = m.lm.transformer
        h = _GPT2Embed(t)(x)
        for blk in t.h:
            h = wrap(blk, h)
        return m.lm.lm_head(t.ln_f(h))

    def chain(self, m):
        t = m.lm.transformer
        return [_GPT2Embed(t), *t.h, nn.Sequential(t.ln_f, m.lm.lm_head)]

    def n_blocks(self, m):
        return len(m.lm.transformer.h)


ADAPTERS: dict[str, Adapter] = {
    "resnet": ResNetAdapter(),
    "densenet": DenseNetAdapter(),
    "mobilenet_v2": MobileNetV2Adapter(),
    "transformer": TransformerAdapter(),
    "gpt2": GPT2Adapter(),
}


def adapter_for(spec: ModelSpec) -> Adapter:
    try:
        return ADAPTERS[spec.family]
    except KeyError:
        raise ValueError(f"no adapter for family {spec.family!r}; known: "
                         f"{', '.join(sorted(ADAPTERS))}") from None


# ----------------------------------------------------------------------------------------------
# Selective activation checkpointing policy
# ----------------------------------------------------------------------------------------------
def _sac_save_ops() -> frozenset:
    aten = torch.ops.aten
    names = ["convolution", "mm", "addmm", "bmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention"]
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


SAC_SAVE_OPS = _sac_save_ops()


def sac_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Save the outputs of convolutions, matmuls and attention (expensive to recompute); recompute
    everything else (norms, activations, adds: cheap per byte)."""
    return CheckpointPolicy.MUST_SAVE if op in SAC_SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _sac_context():
    return create_selective_checkpoint_contexts(sac_policy)


# ----------------------------------------------------------------------------------------------
# Peers: each turns (model, adapter) into a forward callable
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Peer:
    name: str
    """Row name in the table."""
    describe: str
    """One line for the report."""
    build: Callable[[nn.Module, Adapter], Callable[[torch.Tensor], torch.Tensor]]
    """(model, adapter) -> forward function x -> output."""


def _per_block(model, ad):
    def wrap(fn, *args):
        return checkpoint(fn, *args, use_reentrant=False)
    return lambda x: ad.forward(model, x, wrap)


def segments_for(n: int) -> int:
    """About sqrt(n) segments (Chen et al. 2016), at least 2 so something is checkpointed."""
    return max(2, min(n, round(math.sqrt(n))))


def _sequential(model, ad):
    chain = nn.Sequential(*ad.chain(model))
    seg = segments_for(len(chain))
    return lambda x: checkpoint_sequential(chain, seg, x, use_reentrant=False)


def _sac(model, ad):
    def wrap(fn, *args):
        return checkpoint(fn, *args, use_reentrant=False, context_fn=_sac_context)
    return lambda x: ad.forward(model, x, wrap)


PEERS: tuple[Peer, ...] = (
    Peer("ckpt-block", "torch.utils.checkpoint per natural block (use_reentrant=False)",
         _per_block),
    Peer("ckpt-seq", "checkpoint_sequential, about sqrt(n) segments (use_reentrant=False)",
         _sequential),
    Peer("sac", "selective AC per block: save conv/mm/addmm/bmm/sdpa, recompute the rest",
         _sac),
)

COMPILE_BUDGETS: tuple[float, ...] = (0.25, 0.5, 0.75)
