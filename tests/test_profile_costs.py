"""Costs: measured timings are positive where work happens; the analytical roofline is exact on a
hand-computed linear layer and follows the preset and dtype rules."""

import pytest
import torch
import torch.nn as nn

import monetlike
from monetlike.profile import PRESETS
from monetlike.profile.costs import Roofline, get_preset, parse_cost


def test_presets_exist_with_cited_numbers():
    for name in ("P100-16GB", "V100-16GB", "A100-40GB", "A100-80GB", "H100-80GB"):
        p = get_preset(name)
        assert p.flops["fp32"] > 1e12 and p.bandwidth > 5e11 and p.source
    assert get_preset("a100-40gb") is PRESETS["A100-40GB"]  # case-insensitive
    assert parse_cost("measured") == ("measured", None)
    assert parse_cost("analytical:H100-80GB")[1].name == "H100-80GB"


def test_linear_roofline_is_exact():
    b, n_in, n_out = 1024, 1024, 512
    m = nn.Sequential(nn.Linear(n_in, n_out))
    g = monetlike.profile(m, torch.randn(b, n_in), cost="analytical:A100-40GB")
    (op,) = g.ops
    a100 = PRESETS["A100-40GB"]
    flops = 2 * b * n_in * n_out                           # aten.addmm
    moved = 4 * (n_out + b * n_in + n_in * n_out + b * n_out)  # bias, x, W^T, out (t() is a view)
    expected = max(flops / a100.flops["fp32"], moved / a100.bandwidth)  # matmul TF32 is off
    assert op.impls[0].fwd_time == pytest.approx(expected, rel=1e-9)
    # Backward: grad wrt weight is one more matmul of the same size (x does not need a grad),
    # plus the bias reduction; so at least the matmul time.
    assert op.impls[0].bwd_time >= flops / a100.flops["fp32"]
    assert op.has_backward


def test_bf16_and_tf32_rates():
    r = Roofline(PRESETS["A100-40GB"])
    x = torch.empty(256, 256, device="meta", dtype=torch.bfloat16)
    t = r.op_time(torch.ops.aten.mm.default, (x, x), {}, torch.empty_like(x))
    assert t == pytest.approx(max(2 * 256 ** 3 / 312e12, 3 * 256 * 256 * 2 / 1555e9))
    # V100 has no bf16 rate: falls back to fp32.
    v = Roofline(PRESETS["V100-16GB"])
    t = v.op_time(torch.ops.aten.mm.default, (x, x), {}, torch.empty_like(x))
    assert t == pytest.approx(max(2 * 256 ** 3 / 15.7e12, 3 * 256 * 256 * 2 / 900e9))
    # Views and allocations are free.
    assert r.op_time(torch.ops.aten.view.default, (x, [65536]), {}, x.view(65536)) == 0.0


def test_measured_costs_are_positive_and_labelled():
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 4))
    g = monetlike.profile(m, torch.randn(2, 3, 16, 16), repeat=3)
    assert g.cost_provenance == "measured:cpu" and g.meta["repeat"] == 3
    for op in g.ops:
        assert op.impls[0].fwd_time > 0
        assert (op.impls[0].bwd_time > 0) == op.has_backward
    assert g.meta["device"] == "cpu" and g.meta["profile_seconds"] > 0
    assert g.meta["torch_version"] == torch.__version__


def test_progress_bar_only_on_a_terminal(monkeypatch):
    import sys

    from monetlike.profile import api

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert api.progress_bar(10) is None
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    bar = api.progress_bar(10)
    assert bar is not None and bar.total == 10
    bar.close()


# -- the device<->host link (OpGraph.host_bandwidth, the cost of offload to host) ------------
def _tiny():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), torch.randn(4, 8)


def test_host_bandwidth_of_presets_measured_cpu_and_override():
    m, x = _tiny()
    for name, preset in PRESETS.items():
        # Nominal figures (80% of the PCIe link's rate per direction): plausible pinned copies.
        assert 5e9 < preset.host_bandwidth < 100e9, name
    g = monetlike.profile(m, x, cost="analytical:A100-40GB")
    assert g.host_bandwidth == PRESETS["A100-40GB"].host_bandwidth == 25.2e9  # PCIe 4.0 x16
    assert monetlike.profile(m, x, cost="analytical:H100-80GB").host_bandwidth == 50.4e9
    cpu = monetlike.profile(m, x, repeat=1)
    assert cpu.cost_provenance == "measured:cpu" and cpu.host_bandwidth is None  # no link
    # An explicit figure overrides both, and the fingerprint ignores it (a cost).
    over = monetlike.profile(m, x, repeat=1, host_bandwidth=16e9)
    assert over.host_bandwidth == 16e9 and over.fingerprint == cpu.fingerprint == g.fingerprint
    assert monetlike.profile(m, x, cost="analytical:A100-40GB",
                             host_bandwidth=int(8e9)).host_bandwidth == 8e9
    from solver.graph import OpGraph

    assert OpGraph.from_dict(over.to_dict()).host_bandwidth == 16e9


@pytest.mark.parametrize("bad", [0, -1e9, float("nan"), float("inf"), "25GB/s", True])
def test_bad_host_bandwidth_is_refused(bad):
    m, x = _tiny()
    with pytest.raises(ValueError, match="host_bandwidth: expected a positive, finite number of "
                                         "bytes per second"):
        monetlike.profile(m, x, cost="analytical:A100-40GB", host_bandwidth=bad)


def test_thread_clock_counts_work_not_waiting():
    """clock='thread' reads the calling thread's CPU time, which leaves out sleeping and other
    processes' time slices (Python's time.thread_time); 'wall' reads perf_counter. Checked on the
    clock each reads, not on durations (which the machine's load decides)."""
    import time

    from monetlike.profile.costs import Timer

    wall, thread = Timer(torch.device("cpu")), Timer(torch.device("cpu"), "thread")
    assert thread.now is time.thread_time and wall.now is time.perf_counter
    ticks = iter([2.0, 2.75])
    thread.now = lambda: next(ticks)
    a = thread.mark()
    assert thread.seconds(a, thread.mark()) == 0.75


def test_profile_with_thread_clock():
    n = torch.get_num_threads()
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    x = torch.randn(32, 64)
    try:
        torch.set_num_threads(2)
        with pytest.raises(ValueError, match=r"torch\.set_num_threads\(1\)"):
            monetlike.profile(m, x, cost="measured", clock="thread", repeat=1)
        torch.set_num_threads(1)
        with pytest.raises(ValueError, match="clock: expected one of 'wall', 'thread', got 'cpu'"):
            monetlike.profile(m, x, cost="measured", clock="cpu", repeat=1)
        g = monetlike.profile(m, x, cost="measured", clock="thread", repeat=2)
        assert g.meta["clock"] == "thread"
        assert all(op.impls[0].fwd_time > 0 for op in g.ops)
        with pytest.warns(UserWarning, match="ignored for analytical costs"):
            ga = monetlike.profile(m, x, cost="analytical:A100-40GB", clock="thread")
        assert ga.meta["clock"] is None
    finally:
        torch.set_num_threads(n)
