"""Hardtanh / ReLU6 families: hardtanh_mask and bn_hardtanh_lean (MobileNetV2's activation).

What the default holds (measured with the profiler on Conv-BN-ReLU6, docs/impls.md): hardtanh's
backward is hardtanh_backward(grad, self, min_val, max_val), which reads the activation's *input*.
Run in place (`nn.ReLU6(inplace=True)`, i.e. hardtanh_), that input is about to be overwritten,
so autograd saves a clone of it taken just before the write: a fresh storage that belongs to no
Value (the profiler reports it as `internal_bytes`, 4 bytes per element in float32) and that no
schedule can drop or recompute. After BatchNorm the default thus holds the BN input, the
statistics and that clone. Out of place it holds the input Value instead.

hardtanh_mask holds `(out <= min_val) | (out >= max_val)`, where the gradient is zeroed, packed
to 1 bit per element (bitmask.py): since out = clamp(in, min_val, max_val), out <= min_val iff
in <= min_val and out >= max_val iff in >= max_val, so it is hardtanh_backward's condition
`in <= min || in >= max` exactly, NaN included (a NaN passes the gradient in both;
`!((min < out) & (out < max))` would zero it).
bn_hardtanh_lean holds the BN input only and calls hardtanh_backward itself on the recomputed
pre-activation. Both are the shared Functions of relu.py with `Hardtanh` as the activation.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.torch_private import HARDTANH, RELU6_INPLACE, RELU6_OUT
from . import bitmask
from .registry import ImplSpec, register
from .relu import Activation, bn_lean_matcher, mask_matcher


class Hardtanh(Activation):
    def __init__(self, min_val: float, max_val: float):
        self.min_val, self.max_val = min_val, max_val

    def __repr__(self):
        return f"Hardtanh({self.min_val}, {self.max_val})"

    def run(self, x, inplace):
        # F.relu6 is hardtanh(0, 6) in ATen (relu6 is a composite of hardtanh): same kernel.
        return F.hardtanh(x, self.min_val, self.max_val, inplace)

    def mask(self, y):
        # Where hardtanh_backward zeroes the gradient: at or beyond a bound (a NaN passes).
        lo, hi = self.min_val, self.max_val
        if y.device.type != "cpu" or not (math.isfinite(lo) and math.isfinite(hi)):
            m = torch.le(y, lo)
            return m.logical_or_(torch.ge(y, hi))
        # y is clamped into [lo, hi] (or NaN): at a bound iff min(hi - y, y - lo) is 0, since
        # a - b is 0 only when a == b in IEEE arithmetic; a NaN stays NaN, which casts to True.
        # Float kernels and the cast to bool are vectorised on the CPU, its comparisons to bool
        # are not (2.5x the time); elsewhere the comparisons move fewer bytes. The transient: a
        # float and a bool per element.
        d = torch.rsub(y, hi)
        torch.minimum(d, y if lo == 0 else torch.sub(y, lo), out=d)
        return d.to(torch.bool).logical_not_()

    def grad_from_pre(self, grad, z):
        return torch.ops.aten.hardtanh_backward(grad, z, self.min_val, self.max_val)

    def default_backward(self, grad, saved):
        return self.grad_from_pre(grad, saved)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _arg(n, i: int, name: str, default):
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def hardtanh_call(gm, n) -> "tuple[bool, Hardtanh] | None":
    """(inplace, Hardtanh(min, max)) when node `n` is a hardtanh / ReLU6 with constant bounds."""
    inplace, lo, hi = None, None, None
    if n.op == "call_module":
        mod = gm.get_submodule(n.target)
        # Exact classes only: a subclass may override forward.
        if type(mod) not in (nn.ReLU6, nn.Hardtanh):
            return None
        inplace, lo, hi = mod.inplace, mod.min_val, mod.max_val
    elif n.op == "call_function":
        if n.target is F.relu6:
            inplace, lo, hi = _arg(n, 1, "inplace", False), 0.0, 6.0
        elif n.target in RELU6_INPLACE or n.target in RELU6_OUT:
            inplace, lo, hi = n.target in RELU6_INPLACE, 0.0, 6.0
        elif n.target is F.hardtanh:
            inplace = _arg(n, 3, "inplace", False)
            lo, hi = _arg(n, 1, "min_val", -1.0), _arg(n, 2, "max_val", 1.0)
        elif n.target is F.hardtanh_ or n.target is HARDTANH:
            inplace = n.target is F.hardtanh_
            lo, hi = _arg(n, 1, "min_val", -1.0), _arg(n, 2, "max_val", 1.0)
        else:
            return None
    else:
        return None
    # Bounds or the inplace flag computed in the graph (fx nodes) are not known when matching.
    if not isinstance(inplace, bool) or not _number(lo) or not _number(hi):
        return None
    return inplace, Hardtanh(lo, hi)


register(ImplSpec("hardtanh_mask", mask_matcher(hardtanh_call),
                  "hardtanh / ReLU6 holding a mask packed to 1 bit per element instead of its "
                  "input (or, in place, autograd's clone of it)", warm=bitmask.warm))
register(ImplSpec("bn_hardtanh_lean", bn_lean_matcher(hardtanh_call),
                  "BatchNorm(train) + in-place hardtanh / ReLU6 holding only the BN input; the "
                  "backward recomputes the pre-activation"))
