"""The CUDA paths, checked on one GPU in a few minutes (issue 54); run by scripts/cuda_check.sh.

    .venv/bin/python scripts/cuda_check.py            # exits 1 where torch.cuda is unavailable

Nothing here has run on CUDA yet (the development machine has no GPU). Each check prints one
line, PASS or FAIL with its numbers; the exit status is the number of FAILs (capped at 100).
1. eager runtime: a small CNN profiled on the GPU (measured costs), solved at the midpoint of its
   least feasible and store-all peaks, run through ScheduleWrapper: the step's peak above its
   start (torch.cuda.max_memory_allocated) against the simulator's above the fixed bytes,
   gradients against plain PyTorch.
2. compiled runtime (monetlike.backend, aot_eager): gradients bitwise equal to eager, the peak
   against the model's prediction (kernel scratch is measured only on the CPU, so a CUDA
   prediction can read low: the gap is printed, and checked only to be under 10%).
3. offload: tests/test_offload_runtime.py's CUDA test (pytest).
4. costs: the analytical H100 profile's step time against the measured one (printed, and
   checked only to be within a factor of 10: a roofline is a bound, not a forecast).
The caching allocator rounds blocks to 512 bytes and keeps its own pools, so CUDA peaks are
checked within 5% (the CPU bar is 1-2%).
"""

from __future__ import annotations

import copy
import subprocess
import sys

import torch
import torch.nn as nn

FAILS: list[str] = []


def report(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILS.append(name)


def cnn() -> nn.Module:
    torch.manual_seed(0)

    def block(i, o):
        return nn.Sequential(nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o),
                             nn.ReLU(inplace=True))
    return nn.Sequential(block(3, 32), block(32, 64), nn.MaxPool2d(2), block(64, 64),
                         nn.Dropout(0.2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(64, 10))


def cuda_peak(fn) -> int:
    """The step's peak above what was allocated when it started (other model copies, reference
    gradients and the step's own parameters and input are resident then)."""
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


def grads_of(model) -> list[torch.Tensor]:
    out = [p.grad.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return out


def seeded_step_peak(run, x, model) -> int:
    """cuda_peak of one step through `run` (seed 1, the loss the outputs' sum); `model`'s
    gradients are dropped after it."""
    def step():
        torch.manual_seed(1)
        out = run(x)
        out.sum().backward()
        del out
    measured = cuda_peak(step)
    grads_of(model)
    return measured


def report_same(name: str, got, want, reference: str) -> None:
    same = all(torch.equal(a, b) for a, b in zip(got, want))
    report(name, same, f"bitwise equal to {reference}" if same else f"differ from {reference}")


def check_eager(x) -> None:
    import monetlike
    import solver
    model = cnn().cuda()
    graph = monetlike.profile(model, x)
    store = solver.simulate(graph, solver.store_all_schedule(graph)).peak_bytes
    least = solver.min_budget(graph, time_limit_s=60)
    budget = (least + store) // 2
    schedule = solver.solve(graph, budget, time_limit_s=60).schedule
    predicted = solver.simulate(graph, schedule).peak_bytes - graph.fixed_bytes  # above fixed
    plain, tst = copy.deepcopy(model), copy.deepcopy(model)
    wrapped = monetlike.ScheduleWrapper(tst, schedule, graph=graph)
    torch.manual_seed(1)
    plain(x).sum().backward()
    want = grads_of(plain)
    torch.manual_seed(1)
    wrapped(x).sum().backward()  # warm-up: builds the runtime's plan
    got = grads_of(tst)
    measured = seeded_step_peak(wrapped, x, tst)
    report_same("eager runtime gradients", got, want, "plain PyTorch")
    gap = (measured - predicted) / predicted
    report("eager runtime peak", abs(gap) <= 0.05,
           f"budget {budget}, simulated {predicted}, measured {measured} ({gap:+.2%})")


def check_compiled(x) -> None:
    import monetlike
    from solver.compiled import least_peak
    model = cnn().cuda()
    torch.manual_seed(1)
    model(x).sum().backward()
    want = grads_of(model)
    probe = monetlike.backend(budget="1TiB")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=probe)
    compiled(x).sum().backward()
    grads_of(model)
    least = least_peak(probe.record.graph).peak_bytes
    be = monetlike.backend(budget=least)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=be)
    torch.manual_seed(1)
    compiled(x).sum().backward()
    got = grads_of(model)
    report_same("compiled gradients (aot_eager)", got, want, "eager")
    measured = seeded_step_peak(compiled, x, model)
    predicted = be.record.plan.prediction.transient_peak_bytes  # above parameters and input
    gap = (measured - predicted) / predicted
    report("compiled peak", abs(gap) <= 0.10,
           f"budget {least}, predicted {predicted}, measured {measured} ({gap:+.2%}; "
           f"{len(be.record.plan.prediction.recomputed)} ops recomputed)")


def check_offload() -> None:
    r = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-q",
                        "tests/test_offload_runtime.py", "-k", "on_cuda"],
                       capture_output=True, text=True, timeout=300)
    tail = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
    report("offload on CUDA (pytest)", r.returncode == 0 and "passed" in tail, tail)


def check_costs(x) -> None:
    import monetlike
    import solver
    model = cnn().cuda()
    measured = monetlike.profile(model, x)
    analytical = monetlike.profile(cnn(), x.cpu(), cost="analytical:H100-80GB")
    tm = solver.simulate(measured, solver.store_all_schedule(measured)).total_time
    ta = solver.simulate(analytical, solver.store_all_schedule(analytical)).total_time
    ratio = ta / tm
    report("analytical vs measured step time", 0.1 <= ratio <= 10,
           f"measured {tm * 1e3:.3f} ms on {torch.cuda.get_device_name()}, analytical H100 "
           f"{ta * 1e3:.3f} ms (ratio {ratio:.2f})")


def main() -> int:
    if not torch.cuda.is_available():
        print("cuda_check: torch.cuda.is_available() is False: no GPU here, nothing checked. "
              "Run it on a machine with a CUDA GPU.", file=sys.stderr)
        return 1
    print(f"cuda_check on {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    x = torch.randn(16, 3, 64, 64, device="cuda")
    for check in (lambda: check_eager(x), lambda: check_compiled(x), check_offload,
                  lambda: check_costs(x)):
        try:
            check()
        except Exception as e:  # one broken path must not hide the others' results
            report(getattr(check, "__name__", "check"), False, f"{type(e).__name__}: {e}")
    print(f"cuda_check: {len(FAILS)} failed" + (f": {', '.join(FAILS)}" if FAILS else ""))
    return min(len(FAILS), 100)


if __name__ == "__main__":
    sys.exit(main())
