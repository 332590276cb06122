"""Named Hugging Face transformers shapes, built from configs (random init, nothing downloaded).

    model = monetlike.models.gpt2()                      # GPT-2 small: 12 layers, d 768
    model = monetlike.models.llama_1b(layers=2)          # a Llama-3.2-1B-style model, 2 layers
    with torch.device("meta"):                           # shapes only: nothing allocated
        model = monetlike.models.llama3_8b()             # Llama-3-8B, to plan for a GPU
    batch = model.example_inputs(batch=8, seq_len=1024)  # input_ids, attention_mask, labels
    graph = monetlike.profile(model, batch, cost="analytical:A100-40GB")   # captured by export

Each factory takes overrides: `layers`, `hidden`, `heads`, `ffn` (MLP width), `vocab`,
`positions`, and any other config field by its own name (`attn_pdrop=0.0`). The model gets an
`example_inputs(batch, seq_len=None, device=None)` method giving a batch in the Hugging Face
calling convention (keyword tensors; `labels`, so the loss is computed inside the model and is part
of the graph; `use_cache=False` for causal LMs), which the profiler and the wrapper accept as is.

The shapes are the published configurations: GPT-2 small and medium (Radford et al., 2019),
Llama 3.2 1B (its config.json: 16 layers, d 2048, 32 heads of which 8 key-value, MLP 8192,
vocabulary 128256, tied embeddings, rope theta 500000), Llama 3 8B and 70B (their config.json:
32 layers, d 4096, 32 heads of which 8 key-value, MLP 14336; 80 layers, d 8192, 64 heads of
which 8 key-value, MLP 28672; both vocabulary 128256, untied, 8192 positions), BERT-base and
ViT-B/16 (the transformers config defaults). `transformers` is an optional dependency
(`pip install -e ".[hf]"`).

The Llama 3 shapes are for planning with analytical costs: build them under
`torch.device("meta")` (`monetlike solve` does for analytical costs), as 8B parameters take
32 GB in float32 and 70B 280 GB.
"""

from __future__ import annotations

import types
from typing import Any

import torch

__all__ = ["gpt2", "gpt2_medium", "llama_1b", "llama3_8b", "llama_70b", "bert_base", "vit_base",
           "hf_model", "SHAPES"]

# name -> (config class, model class, config fields); aliases below map overrides to each
# family's own field names.
SHAPES: dict[str, tuple[str, str, dict]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_layer=12, n_embd=768, n_head=12,
                                                   n_positions=1024, vocab_size=50257)),
    "gpt2_medium": ("GPT2Config", "GPT2LMHeadModel", dict(n_layer=24, n_embd=1024, n_head=16,
                                                          n_positions=1024, vocab_size=50257)),
    "llama_1b": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_hidden_layers=16, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
        rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)),
    "llama3_8b": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
        rope_theta=500000.0, tie_word_embeddings=False, rms_norm_eps=1e-5)),
    "llama_70b": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_hidden_layers=80, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
        rope_theta=500000.0, tie_word_embeddings=False, rms_norm_eps=1e-5)),
    "bert_base": ("BertConfig", "BertForMaskedLM", dict(
        num_hidden_layers=12, hidden_size=768, intermediate_size=3072, num_attention_heads=12,
        vocab_size=30522, max_position_embeddings=512)),
    "vit_base": ("ViTConfig", "ViTForImageClassification", dict(
        num_hidden_layers=12, hidden_size=768, intermediate_size=3072, num_attention_heads=12,
        image_size=224, patch_size=16, num_labels=1000)),
}

_ALIASES = {
    "GPT2Config": dict(layers="n_layer", hidden="n_embd", heads="n_head", ffn="n_inner",
                       vocab="vocab_size", positions="n_positions"),
    "LlamaConfig": dict(layers="num_hidden_layers", hidden="hidden_size",
                        heads="num_attention_heads", ffn="intermediate_size", vocab="vocab_size",
                        positions="max_position_embeddings", kv_heads="num_key_value_heads"),
    "BertConfig": dict(layers="num_hidden_layers", hidden="hidden_size",
                       heads="num_attention_heads", ffn="intermediate_size", vocab="vocab_size",
                       positions="max_position_embeddings"),
    "ViTConfig": dict(layers="num_hidden_layers", hidden="hidden_size",
                      heads="num_attention_heads", ffn="intermediate_size",
                      image="image_size", patch="patch_size", classes="num_labels"),
}


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"the Hugging Face model shapes need the transformers package ({e}); "
                          f"install it with: pip install -e \".[hf]\" (or pip install "
                          f"transformers)") from None
    return transformers


# Overrides that are sizes: positive integers (a config would take 0 or -1 and build a broken
# or empty model without a word).
_SIZES = ("layers", "hidden", "heads", "ffn", "vocab", "positions", "kv_heads", "image", "patch",
          "classes")


def _one_line(e: BaseException) -> str:
    """An exception's text on one line (transformers' validation errors span several)."""
    text = " ".join(str(e).split())
    return (text[:300] + "...") if len(text) > 300 else (text or type(e).__name__)


def _config_errors() -> tuple:
    """What a transformers config raises on a bad field (huggingface_hub's strict dataclass
    validation, transformers 5), besides ValueError and TypeError."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)


def hf_model(name: str, **overrides: Any) -> torch.nn.Module:
    """The named shape (SHAPES) with `overrides`, random init, in training mode.

    A bad override raises ValueError in one line: what was expected, what was given, and how to
    fix it."""
    if name not in SHAPES:
        raise ValueError(f"hf_model: expected one of {', '.join(sorted(SHAPES))}, got {name!r}")
    transformers = _transformers()
    config_cls, model_cls, fields = SHAPES[name]
    aliases = _ALIASES[config_cls]
    default = getattr(transformers, config_cls)()
    # num_labels is a property of every config (from id2label), not a field of to_dict().
    unknown = [k for k in overrides if not hasattr(default, aliases.get(k, k))]
    if unknown:
        raise ValueError(f"hf_model({name!r}): unknown override(s) {unknown}; expected "
                         f"{', '.join(sorted(aliases))} or a field of {config_cls}")
    for key, value in overrides.items():
        if (key in _SIZES or aliases.get(key, key) in (aliases.get(k) for k in _SIZES)) and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"hf_model({name!r}): {key} must be a positive integer, got "
                             f"{value!r}; pass e.g. {key}=2")
    fields = dict(fields)
    for key, value in overrides.items():
        fields[aliases.get(key, key)] = value
    if config_cls == "LlamaConfig" and "head_dim" not in overrides and (
            "hidden" in overrides or "heads" in overrides):
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    if config_cls == "LlamaConfig":
        fields["num_key_value_heads"] = min(fields["num_key_value_heads"],
                                            fields["num_attention_heads"])
    given = ", ".join(f"{k}={v!r}" for k, v in overrides.items()) or "no overrides"
    try:
        config = getattr(transformers, config_cls)(**fields)
        model = getattr(transformers, model_cls)(config).train()
    except (ValueError, TypeError, AssertionError, RuntimeError, *_config_errors()) as e:
        raise ValueError(f"hf_model({name!r}) with {given}: transformers' {config_cls} or "
                         f"{model_cls} refused it ({type(e).__name__}: {_one_line(e)}); change "
                         f"the overrides to values {config_cls} accepts (heads must divide "
                         f"hidden, for one)") from None
    model.example_inputs = types.MethodType(_example_inputs, model)
    return model


def _example_inputs(model, batch: int, seq_len: int | None = None, device=None,
                    seed: int = 0) -> dict:
    """A batch in the Hugging Face calling convention for this model (see module docstring)."""
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"example_inputs: batch must be a positive integer, got {batch!r}")
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    if cfg.model_type == "vit":
        x = torch.randn(batch, cfg.num_channels, cfg.image_size, cfg.image_size, generator=g)
        labels = torch.randint(0, cfg.num_labels, (batch,), generator=g)
        return {"pixel_values": x.to(device), "labels": labels.to(device)}
    limit = getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings")
    seq_len = seq_len or min(limit, 1024)
    if seq_len > limit:
        raise ValueError(f"example_inputs: seq_len {seq_len} is longer than the model's "
                         f"{limit} positions; pass positions=... to the factory")
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=g)
    out = {"input_ids": ids.to(device),
           "attention_mask": torch.ones(batch, seq_len, dtype=torch.long, device=device),
           "labels": ids.clone().to(device)}
    if cfg.model_type in ("gpt2", "llama"):
        out["use_cache"] = False
    return out


def gpt2(**overrides) -> torch.nn.Module:
    """GPT-2 small (124M parameters): 12 layers, d 768, 12 heads, 1024 positions."""
    return hf_model("gpt2", **overrides)


def gpt2_medium(**overrides) -> torch.nn.Module:
    """GPT-2 medium (355M parameters): 24 layers, d 1024, 16 heads."""
    return hf_model("gpt2_medium", **overrides)


def llama_1b(**overrides) -> torch.nn.Module:
    """A Llama-3.2-1B-style causal LM (1.24B parameters)."""
    return hf_model("llama_1b", **overrides)


def llama3_8b(**overrides) -> torch.nn.Module:
    """Llama-3-8B's shape (8.03B parameters); build it on the meta device (module docstring)."""
    return hf_model("llama3_8b", **overrides)


def llama_70b(**overrides) -> torch.nn.Module:
    """Llama-3-70B's shape (70.6B parameters); build it on the meta device (module docstring)."""
    return hf_model("llama_70b", **overrides)


def bert_base(**overrides) -> torch.nn.Module:
    """BERT-base with its masked-LM head: 12 layers, d 768."""
    return hf_model("bert_base", **overrides)


def vit_base(**overrides) -> torch.nn.Module:
    """ViT-B/16 classifier at 224x224."""
    return hf_model("vit_base", **overrides)
