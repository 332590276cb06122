"""Small example and test models that exercise what torchvision's classifiers do not.

- `UNet`: the encoder-decoder with skip concatenations that MONeT's model zoo includes
  (double 3x3 conv + BatchNorm + in-place ReLU blocks, max-pool down, transposed-conv up, crop-free
  padding to the skip's size, concatenation). Long-lived skip activations make it the classic case
  where recomputation pays.
- `TransformerBlock`: pre-norm block with LayerNorm, softmax multi-head attention written out
  (so the attention matrix and its dropout mask are visible), GELU MLP and dropout.
- `TwoInOut`: two inputs (an image and a vector) and two outputs (logits and an embedding), to
  check that inputs and outputs are handled as sets, not as "the" input and output.

All are torch.fx-traceable at module granularity. Factories take sizes so tests can stay small.

Named Hugging Face transformers shapes (`gpt2`, `gpt2_medium`, `llama_1b`, `llama3_8b`,
`llama_70b`, `bert_base`, `vit_base`; captured with torch.export) live in hf_models.py and are
re-exported here, so a MODEL argument can name them like the models above.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .hf_models import (bert_base, gpt2, gpt2_medium, llama3_8b, llama_1b,  # noqa: F401
                        llama_70b, vit_base)
from .llama_tiny import llama_tiny  # noqa: F401  (a small Llama-style model: FSDP2 examples)

__all__ = ["UNet", "TransformerBlock", "TwoInOut", "unet", "transformer_block", "two_in_out",
           "gpt2", "gpt2_medium", "llama_1b", "llama3_8b", "llama_70b", "bert_base", "vit_base",
           "llama_tiny"]


class DoubleConv(nn.Sequential):
    def __init__(self, cin: int, cout: int):
        super().__init__(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True))


class Down(nn.Sequential):
    def __init__(self, cin: int, cout: int):
        super().__init__(nn.MaxPool2d(2), DoubleConv(cin, cout))


class Up(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cin // 2, kernel_size=2, stride=2)
        self.conv = DoubleConv(cin, cout)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = self.up(x)
        # Pad to the skip's size (odd input sizes); sizes are traced symbolically by fx.
        dy = skip.size(2) - x.size(2)
        dx = skip.size(3) - x.size(3)
        x = F.pad(x, [dx // 2, dx - dx // 2, dy // 2, dy - dy // 2])
        return self.conv(torch.cat([skip, x], dim=1))


class UNet(nn.Module):
    def __init__(self, in_channels: int = 3, num_classes: int = 2, width: int = 64,
                 depth: int = 4):
        super().__init__()
        chans = [width * 2 ** i for i in range(depth + 1)]
        self.inc = DoubleConv(in_channels, chans[0])
        self.downs = nn.ModuleList(Down(chans[i], chans[i + 1]) for i in range(depth))
        self.ups = nn.ModuleList(Up(chans[i + 1], chans[i]) for i in reversed(range(depth)))
        self.outc = nn.Conv2d(chans[0], num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = [self.inc(x)]
        for down in self.downs:
            skips.append(down(skips[-1]))
        x = skips.pop()
        for up in self.ups:
            x = up(x, skips.pop())
        return self.outc(x)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        assert dim % heads == 0, "dim must be a multiple of heads"
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(dropout)
        self.proj_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.heads
        qkv = self.qkv(x).reshape(b, t, 3, h, c // h).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // h))
        att = self.attn_drop(att.softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj_drop(self.proj(y))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int = 256, heads: int = 4, mlp_ratio: int = 4, dropout: float = 0.1):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(),
                                 nn.Linear(mlp_ratio * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TwoInOut(nn.Module):
    """An image branch and a vector branch, fused; returns (logits, embedding)."""

    def __init__(self, in_channels: int = 3, vec_dim: int = 32, width: int = 32,
                 num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.vec = nn.Sequential(nn.Linear(vec_dim, 2 * width), nn.Tanh())
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, image: torch.Tensor, vec: torch.Tensor):
        f = self.pool(self.features(image)).flatten(1)
        emb = torch.cat([f, self.vec(vec)], dim=1)
        return self.head(emb), emb


def unet(**kw) -> UNet:
    return UNet(**kw)


def transformer_block(**kw) -> TransformerBlock:
    return TransformerBlock(**kw)


def two_in_out(**kw) -> TwoInOut:
    return TwoInOut(**kw)


class TransformerStack(nn.Module):
    """A GPT-style stack of TransformerBlocks on (batch, tokens, dim) embeddings, for the zoo."""

    def __init__(self, depth: int = 12, dim: int = 768, heads: int = 12, mlp_ratio: int = 4,
                 dropout: float = 0.1):
        super().__init__()
        self.blocks = nn.Sequential(*(TransformerBlock(dim, heads, mlp_ratio, dropout)
                                      for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.blocks(x))


def transformer(**kw) -> TransformerStack:
    return TransformerStack(**kw)
