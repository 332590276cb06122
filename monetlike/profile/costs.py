"""Op costs: measured on the local device, or analytical (a roofline over a named GPU's peaks).

Analytical costs let a CPU box plan for a GPU it does not have. For every aten op the profiler sees
(forward, and the backward through the autograd engine) we take
    time = max(flops / peak_flops(dtype, op), bytes_moved / memory_bandwidth)
with FLOPs from `torch.utils.flop_counter`'s registry (the formulas FlopCounterMode uses: matmuls,
convolutions, attention; every other op is counted as memory-bound) and bytes moved = bytes of
the op's tensor inputs plus outputs. View and allocation ops move nothing. This is a lower bound
on a real GPU's time (no launch latency, no efficiency factor); it ranks ops sensibly, which is
what the scheduler needs, and it is always labelled `analytical:<device>` so nobody mistakes it
for a measurement.

Peak rates are datasheet numbers (dense, no sparsity), each cited beside the preset.

The host link (for offload to host memory) is a preset figure too. NOTE [Host link figures]:
a PCIe x16 link's nominal rate per direction is 15.75 GB/s for PCIe 3.0, 31.5 GB/s for 4.0 and
63 GB/s for 5.0 (after 128b/130b encoding); pinned-memory copies reach about 80% of that once
packet headers and flow control are paid (commonly reported results of CUDA's bandwidthTest with
pinned memory: 12-13 GB/s on PCIe 3.0 hosts, 24-26 GB/s on PCIe 4.0 hosts). Each preset takes 80%
of its link's nominal rate: an estimate from the specification, not measured on that part.
`measure_host_bandwidth` measures a real GPU's link (used by measured CUDA profiles).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch.utils.flop_counter import flop_registry

from solver.errors import MonetlikeError

from ..core.torch_private import tree_leaves

__all__ = ["CostSpecError", "DevicePreset", "PRESETS", "UnknownDeviceError", "parse_cost",
           "get_preset",
           "Roofline", "Timer", "CLOCKS", "check_clock", "measure_host_bandwidth",
           "check_host_bandwidth"]

TFLOPS = 1e12
GBPS = 1e9


class CostSpecError(MonetlikeError, ValueError):
    """`cost=` is not 'measured' or 'analytical:<DEVICE>'."""


class UnknownDeviceError(CostSpecError):
    """`cost="analytical:<DEVICE>"` names a device without a preset."""


@dataclass(frozen=True)
class DevicePreset:
    name: str
    flops: dict = field(compare=False)
    """Peak FLOP/s by rate class: 'fp64', 'fp32', 'tf32', 'fp16', 'bf16' (tensor cores where the
    part has them, dense). A missing class falls back to 'fp32'."""
    bandwidth: float
    """Peak memory bandwidth in bytes/s."""
    memory_bytes: int
    source: str
    host_bandwidth: float
    """Bytes/s of one direction of the device<->host link with pinned host memory: the cost of
    offloading a Value to host memory and fetching it back (OpGraph.host_bandwidth). A nominal
    figure derived from the link's specification (see each preset's comment), not a measurement:
    `profile(..., cost="measured")` on the GPU itself measures the real link."""
    compute_capability: tuple = (8, 0)
    """CUDA (major, minor): which attention kernels the part runs, so what they save
    (NOTE [Attention on the meta device] in gpu_like.py)."""


def _preset(name: str, tflops: dict, gbps: float, gib: int, source: str, host_gbps: float,
            compute_capability: tuple) -> DevicePreset:
    """A preset in its datasheet's units: TFLOPS by rate class, memory GB/s and GiB, host GB/s."""
    return DevicePreset(name, {k: v * TFLOPS for k, v in tflops.items()}, gbps * GBPS,
                        gib * 2**30, source, host_bandwidth=host_gbps * GBPS,
                        compute_capability=compute_capability)


PRESETS: dict[str, DevicePreset] = {p.name: p for p in (
    # NVIDIA Tesla P100 (SXM2, 16 GB HBM2) datasheet: 5.3 TFLOPS FP64, 10.6 FP32, 21.2 FP16;
    # 732 GB/s. No tensor cores, no TF32/BF16 (BF16 runs at FP32 rate via upcast).
    # Host link: PCIe 3.0 x16 on x86 hosts, 15.75 GB/s nominal per direction; 80% of it,
    # 12.6 GB/s (NOTE [Host link figures]).
    _preset("P100-16GB", {"fp64": 5.3, "fp32": 10.6, "fp16": 21.2}, 732, 16,
            "NVIDIA Tesla P100 datasheet (SXM2)", 12.6, (6, 0)),
    # NVIDIA Tesla V100 (SXM2, 16 GB HBM2) datasheet: 7.8 TFLOPS FP64, 15.7 FP32,
    # 125 tensor (FP16); 900 GB/s. No TF32/BF16.
    # Host link: PCIe 3.0 x16 on x86 hosts (DGX-1), 15.75 GB/s nominal per direction; 80% of it,
    # 12.6 GB/s (NOTE [Host link figures]).
    _preset("V100-16GB", {"fp64": 7.8, "fp32": 15.7, "fp16": 125}, 900, 16,
            "NVIDIA Tesla V100 datasheet (SXM2)", 12.6, (7, 0)),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4, 40 GB HBM2): 9.7 TFLOPS FP64, 19.5 FP32,
    # 156 TF32, 312 BF16/FP16 (dense); 1,555 GB/s.
    # Host link: PCIe 4.0 x16 (the datasheet's "64 GB/s" is both directions), 31.5 GB/s nominal
    # per direction; 80% of it, 25.2 GB/s.
    _preset("A100-40GB", {"fp64": 9.7, "fp32": 19.5, "tf32": 156, "fp16": 312, "bf16": 312},
            1555, 40, "NVIDIA A100 datasheet (SXM4 40GB)", 25.2, (8, 0)),
    # Same datasheet, SXM4 80 GB HBM2e: same compute, 2,039 GB/s.
    # Host link: PCIe 4.0 x16, as the 40 GB part.
    _preset("A100-80GB", {"fp64": 9.7, "fp32": 19.5, "tf32": 156, "fp16": 312, "bf16": 312},
            2039, 80, "NVIDIA A100 datasheet (SXM4 80GB)", 25.2, (8, 0)),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5, 80 GB HBM3): 34 TFLOPS FP64, 67 FP32,
    # 494.7 TF32, 989.4 BF16/FP16 (dense; the datasheet's headline figures are with sparsity,
    # twice these); 3.35 TB/s.
    # Host link: PCIe 5.0 x16 (the datasheet's "128 GB/s" is both directions), 63 GB/s nominal
    # per direction; 80% of it, 50.4 GB/s.
    _preset("H100-80GB", {"fp64": 34, "fp32": 67, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4},
            3350, 80, "NVIDIA H100 datasheet (SXM5)", 50.4, (9, 0)),
)}


def get_preset(name: str) -> DevicePreset:
    for key, preset in PRESETS.items():
        if key.lower() == name.strip().lower():
            return preset
    raise UnknownDeviceError(
        f"unknown device {name!r} for analytical costs; presets are: {', '.join(PRESETS)} "
        f"(use cost='analytical:A100-40GB', for example, or cost='measured' to time this machine)")


def parse_cost(cost: str) -> tuple[str, DevicePreset | None]:
    """'measured' -> ('measured', None); 'analytical:NAME' -> ('analytical', preset)."""
    if not isinstance(cost, str):
        raise CostSpecError(f"cost: expected 'measured' or 'analytical:<DEVICE>', got {cost!r}")
    if cost.strip().lower() == "measured":
        return "measured", None
    kind, _, dev = cost.partition(":")
    if kind.strip().lower() == "analytical":
        if not dev.strip():
            raise UnknownDeviceError(f"cost={cost!r} names no device; presets are: "
                                     f"{', '.join(PRESETS)}")
        return "analytical", get_preset(dev)
    raise CostSpecError(f"cost: expected 'measured' or 'analytical:<DEVICE>' (devices: "
                     f"{', '.join(PRESETS)}), got {cost!r}")


# Ops that only reinterpret or allocate memory: no bytes moved, no time.
_FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
         "alias", "lift_fresh", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel",
         "sym_storage_offset", "size", "stride", "numel", "dim", "is_contiguous", "set_"}
_CONV = {"convolution", "_convolution", "cudnn_convolution", "convolution_overrideable",
         "_slow_conv2d_forward", "convolution_backward"}
_MATMUL = {"mm", "addmm", "bmm", "baddbmm"}


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel moves for `t`: a zero-stride (expanded) dimension repeats the same
    elements, read once (the stand-in inputs of torch.nn.grad.conv2d_input-style calls are
    one element broadcast to a shape, and the kernel reads only their sizes)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


class Roofline:
    """Per aten op: max(flops / peak, bytes / bandwidth) on a preset device."""

    def __init__(self, preset: DevicePreset):
        self.preset = preset
        # PyTorch's defaults decide which rate a float32 conv or matmul gets on Ampere and later:
        # cuDNN convolutions use TF32 unless disabled; cuBLAS matmuls do not unless enabled.
        self.conv_tf32 = bool(torch.backends.cudnn.allow_tf32)
        self.matmul_tf32 = bool(torch.backends.cuda.matmul.allow_tf32)

    def _peak(self, name: str, dtype: torch.dtype | None) -> float:
        f = self.preset.flops
        if dtype == torch.float16:
            key = "fp16"
        elif dtype == torch.bfloat16:
            key = "bf16"
        elif dtype == torch.float64:
            key = "fp64"
        elif dtype == torch.float32 and ((name in _CONV and self.conv_tf32)
                                         or (name in _MATMUL and self.matmul_tf32)):
            key = "tf32"
        else:
            key = "fp32"
        return f.get(key, f["fp32"])

    def op_time(self, func, args, kwargs, out) -> float:
        packet = getattr(func, "_overloadpacket", None)
        name = getattr(packet, "__name__", str(func)).split(".")[-1]
        if name in _FREE or getattr(func, "is_view", False):
            return 0.0
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        nbytes = sum(_tensor_bytes(t) for t in ins) + sum(_tensor_bytes(t) for t in outs)
        t_mem = nbytes / self.preset.bandwidth
        flops = 0
        if packet is not None and packet in flop_registry:
            try:
                flops = flop_registry[packet](*args, **kwargs, out_val=out)
            except Exception:  # a formula that does not fit an exotic overload: memory-bound
                flops = 0
        if not flops:
            return t_mem
        dtype = next((t.dtype for t in ins if t.is_floating_point()), None)
        return max(flops / self._peak(name, dtype), t_mem)


CLOCKS = ("wall", "thread")


def check_clock(clock, device: torch.device) -> str:
    """`clock` for a measured profile on `device`, or ValueError saying why it cannot be used."""
    if clock not in CLOCKS:
        raise ValueError(f"clock: expected one of {', '.join(map(repr, CLOCKS))}, got {clock!r}")
    if clock == "thread":
        if device.type != "cpu":
            raise ValueError(f"clock='thread' times CPU work on the calling thread; the model is "
                             f"on {device}: use clock='wall' (CUDA events time GPU work)")
        if torch.get_num_threads() != 1:
            raise ValueError(f"clock='thread' sees only the calling thread's CPU time, but torch "
                             f"uses {torch.get_num_threads()} intra-op threads: call "
                             f"torch.set_num_threads(1) first, or use clock='wall'")
    return clock


class Timer:
    """Wall-clock marks on the CPU (or, with clock='thread', the calling thread's CPU time);
    CUDA events on a GPU (elapsed time read after a sync).

    Why a thread clock: on a machine shared with other processes the wall clock counts their time
    slices too, so every Op looks slower by however busy the machine was while it ran (measured:
    a ResNet-18 step timed by wall clock at 1.4-2x its thread CPU time with both cores busy). With
    one intra-op thread, the thread's CPU time is the work itself; a benchmark that times steps
    by thread CPU time must profile by it too, or its predicted and measured overheads are on
    different scales."""

    def __init__(self, device: torch.device, clock: str = "wall"):
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.device = device
        # the CPU clock read by mark()
        self.now = time.thread_time if clock == "thread" and not self.cuda else time.perf_counter

    def mark(self):
        if self.cuda:  # pragma: no cover - no GPU in CI
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return self.now()

    def sync(self) -> None:
        if self.cuda:  # pragma: no cover
            torch.cuda.synchronize(self.device)

    def seconds(self, a, b) -> float:
        if self.cuda:  # pragma: no cover
            return a.elapsed_time(b) / 1000.0
        return b - a


def check_host_bandwidth(value) -> float:
    """A host link bandwidth given by the caller, as a float of bytes per second; ValueError
    otherwise (a bool, a string, zero, negative, NaN or infinite)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        value = float(value)
        ok = math.isfinite(value) and value > 0
    if not ok:
        raise ValueError(f"host_bandwidth: expected a positive, finite number of bytes per second "
                         f"of the device<->host link (e.g. 25e9), got {value!r}")
    return value


# 64 MiB: large enough that the copy runs at the link's streaming rate (per-copy latency of
# microseconds is under 0.1% of it), small enough to allocate next to any model.
HOST_PROBE_BYTES = 64 * 2**20


def measure_host_bandwidth(device: torch.device, nbytes: int = HOST_PROBE_BYTES,
                           repeat: int = 3) -> float:  # pragma: no cover - needs a GPU
    """Bytes/s of the slower direction of pinned-host <-> `device` copies, timed with CUDA
    events after a warm-up copy each way (the median of `repeat` copies per direction).

    The slower direction: an offloaded Value crosses the link once each way, and the solver
    charges both copies at one rate (OpGraph.host_bandwidth)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"measure_host_bandwidth: needs a CUDA device, got {device}")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = []
    with torch.cuda.device(device):
        for dst, src in ((dev, host), (host, dev)):  # host->device, then device->host
            dst.copy_(src, non_blocking=True)  # warm-up
            times = []
            for _ in range(repeat):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1000.0)
            rates.append(nbytes / median(times))
    del host, dev
    return min(rates)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def credited_difference(diffs: list[float]) -> float:
    """What an alternative (an Impl) is charged over the reference it was timed beside, from
    paired differences (alternative - reference, each pair timed side by side): their median
    when that is a cost; a saving only when every pair showed one, and then the least of them;
    otherwise 0.0. A solver takes the alternatives whose timings came out lowest, so a saving
    that noise could have made, credited, predicts schedules faster than they run (issue 54:
    ResNet-18's conv_split, 9 of 20 Ops timed faster than the default conv, predicted the step
    6.7% faster than plain where it measured 6.7% slower)."""
    if not diffs:
        return 0.0
    m = statistics.median(diffs)
    if m >= 0:
        return m
    least = max(diffs)
    return least if least < 0 else 0.0


def in_context_difference(predicted: float, diffs: list[float]) -> float:
    """What an alternative costs over its reference in the whole step, from the per-Op
    `predicted` difference and paired whole-step `diffs`: the prediction where it lies within
    their middle half (on a shared machine one step's noise is several % of it: a single-Op
    Impl measured at +12 and +25 ms in two runs of MobileNetV2's 170 ms step), else the nearer
    quartile; and no saving beyond `credited_difference`."""
    if not diffs:
        return max(predicted, 0.0)
    q1, _, q3 = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else (diffs[0],) * 3
    fitted = min(max(predicted, q1), q3)
    return max(fitted, credited_difference(diffs)) if fitted < 0 else fitted
