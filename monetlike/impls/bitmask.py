"""Bool masks packed 8 to a byte (MONeT's 1-bit ReLU masks), in slices.

`pack(m)` keeps a bool tensor as uint8 bytes, bit i of byte k being element 8k + i in row-major
order (`pack_of(y, mask_of)` makes the mask of y slice by slice); `masked_zero(grad, packed,
in_place)` puts +0 where the mask is set and `grad` elsewhere, as `torch.where(mask, 0, grad)`
does, bit for bit. Both walk the elements in `SLICES` slices (of at least `MIN_SLICE` elements),
so the unpacked bytes exist for one slice at a time: a 32nd of the bool mask's bytes, a 128th of
a float32 gradient's. When the
caller owns the gradient outright (`torch_private.sole_owner`) it is written in place and nothing
of its size is allocated.
"""

from __future__ import annotations

import torch

SLICES = 32
MIN_SLICE = 1 << 20
"""Elements below which a tensor is not sliced further: a slice costs a few kernel launches, and
the transient of a tensor this small does not matter (tests lower it to exercise the slicing)."""


def _weights(device) -> torch.Tensor:
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


def _bounds(n: int):
    step = max(-(-n // SLICES), MIN_SLICE)
    step = max(8, (step + 7) // 8 * 8)  # a multiple of 8: slices start on a byte
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def _flat(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements in memory order, as a view when `t` is contiguous."""
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().view(-1)


def pack(m: torch.Tensor) -> torch.Tensor:
    """The bool tensor `m` packed into ceil(numel / 8) bytes (row-major order)."""
    flat = _flat(m).view(torch.uint8)
    n = flat.numel()
    out = torch.empty((n + 7) // 8, dtype=torch.uint8, device=m.device)
    w = _weights(m.device)
    for a, b in _bounds(n):
        part = flat[a:b]
        if (b - a) % 8:
            part = torch.cat([part, part.new_zeros(8 - (b - a) % 8)])
        torch.sum(part.view(-1, 8) * w, dim=-1, dtype=torch.uint8, out=out[a // 8:(b + 7) // 8])
    return out


def pack_of(y: torch.Tensor, mask_of) -> torch.Tensor:
    """pack(mask_of(y)), with the bool mask made one slice at a time when `y` is contiguous
    (`mask_of` is elementwise): the whole bool mask never exists."""
    if not y.is_contiguous():
        return pack(mask_of(y))
    flat = y.view(-1)
    n = flat.numel()
    out = torch.empty((n + 7) // 8, dtype=torch.uint8, device=y.device)
    for a, b in _bounds(n):
        out[a // 8:(b + 7) // 8] = pack(mask_of(flat[a:b]))
    return out


def _unpack(packed: torch.Tensor, a: int, b: int, w: torch.Tensor) -> torch.Tensor:
    """Elements a..b of the packed mask, as bool (`w`: the bit weights)."""
    bits = packed[a // 8:(b + 7) // 8].unsqueeze(-1).bitwise_and(w)
    return bits.ne_(0).view(torch.bool).view(-1)[a % 8:a % 8 + b - a]


def masked_zero(grad: torch.Tensor, packed: torch.Tensor, in_place: bool,
                stride: tuple[int, ...] | None = None) -> torch.Tensor:
    """+0 where the packed mask is set, `grad` elsewhere (same shape as the mask's tensor, in
    row-major order), with strides `stride` (default: contiguous). In place when `in_place` and
    `grad` is contiguous with those strides."""
    stride = tuple(stride) if stride is not None else torch.empty(grad.shape, device="meta").stride()
    if in_place and grad.is_contiguous() and tuple(grad.stride()) == stride:
        out = grad
    else:
        out = torch.empty_strided(grad.shape, stride, dtype=grad.dtype, device=grad.device)
        out.copy_(grad)
    w = _weights(packed.device)
    n = out.numel()
    if out.is_contiguous():
        flat = out.view(-1)
        for a, b in _bounds(n):
            flat[a:b].masked_fill_(_unpack(packed, a, b, w), 0)
        return out
    # Not row-major: slices of whole rows of the first dimension, each filled through its view.
    rows = out.shape[0]
    row = n // rows if rows else 0
    step = max(1, _bounds(n)[0][1] // row) if row else 1  # rows per slice
    for i in range(0, rows, step):
        j = min(rows, i + step)
        part = out[i:j]
        part.masked_fill_(_unpack(packed, i * row, j * row, w).view(part.shape), 0)
    return out
