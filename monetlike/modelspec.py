"""Turn a MODEL argument into a model, never through eval.

MODEL is an importable factory (`torchvision.models.resnet50`, `mypkg.models:build`) or a file
(`path/to/model.py:factory`). Short names of the built-in test models (`unet`, `transformer_block`)
and bare torchvision names (`resnet50`) are accepted as a convenience.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Callable

from solver.errors import MonetlikeError
from .core.torch_private import tensors_in


class ModelSpecError(MonetlikeError, ValueError):
    """A MODEL argument that names nothing importable."""


_HELP = ("expected an importable factory like 'torchvision.models.resnet50' or "
         "'mypkg.models:build', or a file like 'path/to/model.py:factory'")


def load_factory(spec: str) -> Callable:
    """Return the callable named by `spec` (see the module docstring)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ModelSpecError(f"empty model name; {_HELP}")
    spec = spec.strip()
    if ":" in spec:
        where, _, attr = spec.rpartition(":")
        if where.endswith(".py") or os.sep in where:
            module = _load_file(where)
        else:
            module = _import(where, spec)
    elif "." in spec:
        where, _, attr = spec.rpartition(".")
        module = _import(where, spec)
    else:
        attr = spec
        module = None
        for candidate in ("monetlike.models", "torchvision.models"):
            m = importlib.import_module(candidate)
            if hasattr(m, attr):
                module = m
                break
        if module is None:
            raise ModelSpecError(f"unknown model {spec!r}: not in monetlike.models or "
                                 f"torchvision.models; {_HELP}")
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise ModelSpecError(f"{spec!r}: module {module.__name__!r} has no callable {attr!r}; "
                             f"{_HELP}")
    return factory


def _import(module_name: str, spec: str):
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise ModelSpecError(f"cannot import {module_name!r} for model {spec!r} ({e}); "
                             f"{_HELP}") from None


def _load_file(path: str):
    if not os.path.isfile(path):
        raise ModelSpecError(f"model file {path!r} does not exist; {_HELP}")
    name = "monetlike_user_model_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the user's own file, named explicitly by the user
    return module


def cross_entropy_loss(out):
    """Cross-entropy of the model's logits (a mapping's "logits", else its first floating
    tensor; (..., classes), flattened to rows) against class 0: the memory of a classifier's or
    a language model's loss, whatever the labels."""
    import torch
    import torch.nn.functional as F


    logits = out.get("logits") if isinstance(out, dict) else None
    if logits is None:
        logits = next((t for t in tensors_in(out) if t.is_floating_point()), None)
    if logits is None or logits.dim() < 2:
        raise ModelSpecError(f"--loss cross_entropy needs logits of shape (..., classes) among "
                             f"the model's outputs; got {_outputs(out)}")
    logits = logits.flatten(0, -2)
    labels = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    return F.cross_entropy(logits, labels)


def mean_square_loss(out):
    """The mean of the squares of every floating output that requires grad, summed."""

    leaves = [t for t in tensors_in(out) if t.is_floating_point() and t.requires_grad]
    if not leaves:
        raise ModelSpecError(f"--loss mean_square needs a floating output that requires grad; "
                             f"got {_outputs(out)}")
    return sum(t.pow(2).mean() for t in leaves)


def model_loss(out):
    """The loss the model computes itself: a Hugging Face output's `loss` (given `labels`, as a
    causal LM trains), or an output mapping's "loss"."""
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if loss is None or getattr(loss, "dim", lambda: -1)() != 0:
        raise ModelSpecError(f"--loss model needs a scalar 'loss' among the model's outputs (a "
                             f"Hugging Face model given labels); got {_outputs(out)}")
    return loss


def _outputs(out) -> str:

    shapes = [tuple(t.shape) for t in tensors_in(out)]
    return f"outputs of shapes {shapes}" if shapes else f"an output of type {type(out).__name__}"


LOSSES = {"sum": None, "cross_entropy": cross_entropy_loss, "mean_square": mean_square_loss,
          "model": model_loss}
"""The losses a LOSS argument names; "sum" is the profiler's default (the sum of the outputs)."""


def load_loss(spec: "str | None") -> "Callable | None":
    """The loss a LOSS argument names: one of LOSSES, or an importable function of the model's
    output (`mypkg.losses:loss`, `path/to/loss.py:loss`) returning a scalar. None for the
    default sum."""
    if spec is None:
        return None
    name = spec.strip()
    if name in LOSSES:
        return LOSSES[name]
    if ":" not in name and "." not in name:
        raise ModelSpecError(f"unknown loss {spec!r}: expected one of {', '.join(LOSSES)}, or a "
                             f"function of the model's output like 'mypkg.losses:loss' or "
                             f"'path/to/loss.py:loss'")
    return load_factory(name)


def build_model(spec: str, **kwargs):
    """Call the factory; torchvision's googlenet/inception get their training-friendly defaults."""
    factory = load_factory(spec)
    name = getattr(factory, "__name__", "")
    if name in ("googlenet", "inception_v3"):
        kwargs.setdefault("aux_logits", False)
        kwargs.setdefault("init_weights", False)
    try:
        model = factory(**kwargs)
    except SystemExit as e:  # 'sys:exit' would end the command silently with rc 0, read as a pass
        raise ModelSpecError(f"{spec!r} exited (SystemExit {e.code!r}) instead of returning a "
                             f"model; {_HELP}") from None
    except (ValueError, TypeError, ImportError, AttributeError, KeyError, AssertionError,
            RuntimeError) as e:
        # The factory refused what it was asked to build (a bad override of a named
        # transformers shape, a missing optional package): one line, not a traceback.
        text = " ".join(str(e).split()) or "no message"
        raise ModelSpecError(f"model {spec!r}: its factory {name or 'callable'}() failed with "
                             f"{type(e).__name__}: {text[:400]}; fix the factory or the arguments "
                             f"it passes (--debug shows the traceback)") from e
    import torch

    if not isinstance(model, torch.nn.Module):
        raise ModelSpecError(f"{spec!r} returned {type(model).__name__}, expected a "
                             f"torch.nn.Module; name the factory that builds the model ({_HELP})")
    return model
