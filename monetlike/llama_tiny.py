"""A small Llama-style decoder (RMSNorm, causal attention, SwiGLU MLP, untied head) written in
plain torch.nn, for the FSDP2 per-rank memory test and examples/fsdp_llama.py.

Its blocks are `layers.<i>` (the unit each fully_shard call wraps, as torchtitan shards a Llama)
and it traces with torch.fx at module granularity. Sizes are arguments so a test stays small;
rotary embeddings are left out (they change no memory the per-rank model counts).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["LlamaTiny", "llama_tiny"]


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.heads
        q = self.wq(x).view(b, t, h, c // h).transpose(1, 2)
        k = self.wk(x).view(b, t, h, c // h).transpose(1, 2)
        v = self.wv(x).view(b, t, h, c // h).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, c))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class LlamaTiny(nn.Module):
    """Token ids (batch, tokens) in, logits (batch, tokens, vocab) out."""

    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 3, heads: int = 4,
                 hidden: int = 172):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim: expected a multiple of heads ({heads}), got {dim}")
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def llama_tiny(**kw) -> LlamaTiny:
    return LlamaTiny(**kw)
