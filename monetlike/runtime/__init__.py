"""The runtime: execute a Schedule inside ordinary autograd (docs/execution-model.md section 5).

- plan.py       the static join of graph, schedule and traced module, built once per signature.
- executor.py   the scheduled forward: generated code, the nodes a schedule needs routed through it.
- step_state.py one step's state: resident Values, recomputations, the backward stages' hooks.
- codegen.py    the generated forward and recomputation code.
- offload.py    offload to host memory: CUDA side-stream copies, and the refusal elsewhere.

`ScheduleWrapper` (monetlike/wrapper.py), the nn.Module users hold, sits a floor above: it joins
the capture, the profiler (a smaller batch is profiled again) and this runtime.
"""
