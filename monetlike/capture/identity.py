"""What a capture of a model depends on besides its call (its structure and the plain Python
attributes its forward may read), and captures shared by every wrapper of the model under
those keys (monetlike/wrapper.py keys and checks them every step)."""

from __future__ import annotations

import weakref

import torch

from .trace import is_plain_value

# Captures of a model as a wrapper keys them (the structure, the Python attributes read, and for
# export the call's signature), shared by every wrapper of that model: a loop or a test that
# wraps one model in several schedules traced it again for each (a sixth of the fuzzer's time).
# Nothing mutates a captured module: plans read it.
_HELD: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
_PER_MODEL = 8


def shared_capture(model: torch.nn.Module, key: tuple, capture):
    held = _HELD.setdefault(model, {})
    gm = held.get(key)
    if gm is None:
        if len(held) >= _PER_MODEL:
            held.pop(next(iter(held)))
        gm = held[key] = capture()
    return gm


def python_attributes(model: torch.nn.Module, run_whole=None) -> list:
    """(module, name) of every plain attribute (bool, int, float, str, None, or a tuple of
    them) of the model's modules, `training` and private names left out; not those of the
    modules `run_whole(module, qualified name)` says run as a whole (fx leaves), nor inside
    them."""
    out = []
    stack = [("", model)]
    while stack:
        path, mod = stack.pop()
        if run_whole is not None and path and run_whole(mod, path):
            continue
        stack.extend((f"{path}.{n}" if path else n, child)
                     for n, child in mod._modules.items() if child is not None)
        for name, value in vars(mod).items():
            if name.startswith("_") or name == "training":
                continue
            if is_plain_value(value):
                out.append((mod, name))
    return out


def module_flags(mod: torch.nn.Module, training: list, grads: list) -> None:
    """train/eval flags of every module, and of every parameter its identity, shape, dtype and
    requires_grad, with each module's identity, in module order: NOTE [The model checked every
    step] in monetlike/wrapper.py. A plain walk over the module dictionaries (named_modules()
    costs a millisecond per step on a MobileNet, a tenth of the scheduled forward's whole
    overhead)."""
    training.append(mod.training)
    grads.append((id(mod), type(mod)))
    for p in mod._parameters.values():
        if p is not None:
            grads.append((id(p), p.shape, p.dtype, p.requires_grad))
    for child in mod._modules.values():
        if child is not None:
            module_flags(child, training, grads)
