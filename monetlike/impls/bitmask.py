"""Bool masks packed 8 to a byte (MONeT's 1-bit ReLU masks), in slices.

`pack(m)` keeps a bool tensor as uint8 bytes, bit i of byte k being element 8k + i in row-major
order (`pack_of(y, mask_of)` makes the mask of y slice by slice); `masked_zero(grad, packed,
in_place)` puts +0 where the mask is set and `grad` elsewhere, as `torch.where(mask, 0, grad)`
does, bit for bit. Both walk the elements in `SLICES` slices (of at least `MIN_SLICE` elements),
so the bool mask (packing) and the unpacked keep words (one gradient element each) exist for one
slice at a time: a 32nd of the bool mask's, of the gradient's bytes. When the caller owns the
gradient outright (`torch_private.sole_owner`) it is written in place and nothing of its size is
allocated.

Two ways to each, the same bits: on the CPU, integer kernels over bytes read as wider integers
(little-endian, checked), because the CPU does not vectorise the plain ones (a reduction over
groups of 8, `masked_fill_`); elsewhere (CUDA, and the meta device an analytical profile runs
on, which plans for a GPU) the plain kernels.
"""

from __future__ import annotations

import sys

import torch

SLICES = 32
MIN_SLICE = 1 << 20
"""Elements below which a tensor is not sliced further: a slice costs a few kernel launches, and
the transient of a tensor this small does not matter (tests lower it to exercise the slicing)."""


_WEIGHTS: dict[str, torch.Tensor] = {}


def _weights(device) -> torch.Tensor:
    """The bit weights 1, 2, ..., 128 on `device` (made once: a copy to a GPU per slice is not
    free)."""
    key = str(device)
    if key not in _WEIGHTS:
        _WEIGHTS[key] = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8,
                                     device=device)
    return _WEIGHTS[key]


INTEGER_KERNELS: bool | None = None
"""None: the integer kernels on the CPU, the plain ones elsewhere (module docstring); True or
False forces one way everywhere (tests run both on the CPU)."""


def _integer_kernels(device) -> bool:
    return device.type == "cpu" if INTEGER_KERNELS is None else INTEGER_KERNELS


_GATHER = sum(1 << (56 - 7 * i) for i in range(8))  # 0x0102040810204080
_CONSTANTS: dict[str, tuple[torch.Tensor, ...]] = {}


def _pack_constants(device) -> tuple[torch.Tensor, ...]:
    """_GATHER, 56 and 0xFF as int64 tensors on `device`: a Python number would be wrapped
    into a fresh 8-byte tensor at each call, at the moment the step peaks (and twice under the
    profiler's dispatch mode, which then counts 8 B the run does not have)."""
    key = str(device)
    if key not in _CONSTANTS:
        _CONSTANTS[key] = tuple(torch.tensor(v, dtype=torch.int64, device=device)
                                for v in (_GATHER, 56, 0xFF))
    return _CONSTANTS[key]


def _pack_into(out: torch.Tensor, part: torch.Tensor) -> None:
    """Pack `part` (bytes 0 or 1, a multiple of 8 of them, starting on an 8-byte boundary) into
    `out`, one byte per 8. Each group of 8 bytes is read as one little-endian int64 whose bit 8i
    is element i; multiplied by `_GATHER` (bits 56 - 7j), bit 8i lands on bit 56 + 8i - 7j,
    which is in the top byte only for j = i (on bit 56 + i), and no two (i, j) share a bit, so
    nothing carries: the top byte is the packed byte, bits past 63 wrap away. Elementwise
    kernels on an eighth of the elements: a multiply-and-sum over groups of 8, the obvious way,
    costs a reduction per byte, slower than making the mask."""
    if not _integer_kernels(part.device):
        torch.sum(part.view(-1, 8) * _weights(part.device), dim=-1, dtype=torch.uint8, out=out)
        return
    if sys.byteorder != "little":
        raise NotImplementedError("monetlike's packed masks read bytes as little-endian integers; "
                                  "this host is big-endian: use the default Impls")
    gather, shift, low = _pack_constants(part.device)
    x = part.view(torch.int64).mul(gather)
    out.copy_(x.bitwise_right_shift_(shift).bitwise_and_(low))  # copy_ narrows to uint8


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
    for a, b in _bounds(n):
        part = flat[a:b]
        if (b - a) % 8 or part.storage_offset() % 8:
            part = torch.cat([part, part.new_zeros(-(b - a) % 8)])
        _pack_into(out[a // 8:(b + 7) // 8], part)
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


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_KEEP: dict[str, torch.Tensor] = {}


def _keep_bytes(device) -> torch.Tensor:
    """256 int64s: byte i (little-endian) of number k is 0 where bit i of k is set and 0xFF
    where it is clear. One gather per packed byte gives a keep byte per element, which
    sign-extends to a keep word of the gradient's width (0 or all ones). ANDed into a gradient's
    bits, it gives +0 (all bits clear) where the mask is set and the gradient's own bits
    elsewhere: `torch.where(mask, 0, grad)` bit for bit, NaNs included, in vectorised integer
    kernels (masked_fill_ and where with a broadcast zero are not vectorised on the CPU:
    several times the default backward's time; gathering a row of 8 words per byte, 2.3x the
    time of this)."""
    key = str(device)
    if key not in _KEEP:
        bits = torch.arange(256).unsqueeze(-1).bitwise_right_shift(torch.arange(8)) & 1
        rows = (bits - 1).to(torch.int8)  # set: 0, clear: -1
        _KEEP[key] = rows.view(torch.int64).reshape(256).to(device)
    return _KEEP[key]


def forget_tables() -> None:
    """Drop the tables made so far, as in a fresh process (each is made again when used)."""
    for tables in (_WEIGHTS, _CONSTANTS, _KEEP):
        tables.clear()


def tables_made() -> set[tuple[str, str]]:
    """(table, device) of each table made so far: 'weights', 'constants' or 'keep'."""
    return {(name, device) for name, tables in (("weights", _WEIGHTS), ("constants", _CONSTANTS),
                                                ("keep", _KEEP)) for device in tables}


def warm(device: torch.device) -> None:
    """Make the tables the kernels on `device` use now (ImplSpec.warm)."""
    if _integer_kernels(device):
        _keep_bytes(device)
        _pack_constants(device)
    else:
        _weights(device)


def _zero_where_set(out: torch.Tensor, packed: torch.Tensor, a: int, b: int) -> None:
    """Elements a..b of the mask (row-major) applied to `out` (of b - a elements, any layout:
    matched by logical position), in place."""
    if not _integer_kernels(out.device):
        bits = packed[a // 8:(b + 7) // 8].unsqueeze(-1).bitwise_and(_weights(packed.device))
        out.masked_fill_(bits.ne_(0).view(torch.bool).view(-1)[a % 8:a % 8 + b - a]
                         .view(out.shape), 0)
        return
    word = _INT_OF_SIZE[out.element_size()]
    keep = torch.index_select(_keep_bytes(out.device), 0, packed[a // 8:(b + 7) // 8].int())
    keep = keep.view(torch.int8)[a % 8:a % 8 + b - a].to(word)  # sign-extended: 0 or all ones
    out.view(word).bitwise_and_(keep.view(out.shape))


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
    n = out.numel()
    if out.is_contiguous():
        flat = out.view(-1)
        for a, b in _bounds(n):
            _zero_where_set(flat[a:b], packed, a, b)
        return out
    # Not row-major: slices of whole rows of the first dimension, each filled through its view.
    rows = out.shape[0]
    row = n // rows if rows else 0
    step = max(1, _bounds(n)[0][1] // row) if row else 1  # rows per slice
    for i in range(0, rows, step):
        j = min(rows, i + step)
        _zero_where_set(out[i:j], packed, i * row, j * row)
    return out
