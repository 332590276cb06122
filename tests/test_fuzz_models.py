"""The memory model and the runtime on models nobody wrote by hand (issue 18).

Hypothesis draws small models from the grammar of tests/fuzz_models.py. For each, by the CPU
allocator's own count (measure_step):
- the wrapped store-all step's peak equals the predicted peak within 1%;
- for two schedules drawn at random, the wrapped step peaks at or under the prediction (a
  schedule predicted at its budget must not go over it);
- with every in-place Impl on store-all, the wrapped step's peak equals the prediction within 1%;
- for the solver's schedules at two budgets between the least feasible peak and store-all, the
  wrapped step peaks at or under the budget and at most 1% above the prediction (check_model
  says why not equal);
- outputs, input and parameter gradients and BatchNorm statistics equal plain PyTorch's over two
  SGD steps, and dropout draws the same masks (the outputs would differ otherwise).

The wrapper runs the traced graph, which frees each tensor after its last use; plain eager code
can hold some longer in Python locals (the operands of a construct until it returns), so plain
PyTorch is not the yardstick here.

Every counterexample found so far is kept below as an explicit `@example`.
"""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, example, given, settings

import monetlike
import solver
from fuzz_models import FUZZ_PROGRAMS, Step, build, settle_heap
from runtime_support import PEAK_TOLERANCE, compare_step, measured_peak, peak_of, three_schedules
from solver_cases import random_schedules
from solver.rules.simple import schedule_from_keep
from solver.simulate import simulate, store_all_schedule

# 100 generated models in the default run (about 2 minutes of one of the suite's two workers
# with the kept examples); derandomized, so the same 100 each run. FUZZ_EXAMPLES raises it for a
# longer hunt (another count draws other models: 70 drew INTERLEAVED_OP_HOLDS_ITS_INNER_OPS_INPUTS).
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "100"))


# CPU kernels split their scratch between intra-op threads, so with several threads a peak
# depends on scheduling (seen: +2048 bytes in one run of a fuzzed model, not in the next). One
# thread makes the allocator's count repeatable, for the profile and the measurement alike.
pytestmark = pytest.mark.usefixtures("one_thread")


def _profiled(program: tuple[Step, ...], n_outputs: int, seed: int, capture: str = "auto"):
    """The fuzzed model and its tokens, built on a frozen heap, and their profile (measured, one
    repeat)."""
    settle_heap()
    model, tokens = build(program, n_outputs, seed)
    return model, tokens, monetlike.profile(model, tokens, repeat=1, capture=capture)


def _assert_measured_as_predicted(graph, model, tokens, schedule) -> None:
    measured = measured_peak(graph, model, monetlike.ScheduleWrapper(model, schedule, graph=graph),
                             (tokens,))
    assert measured == peak_of(graph, schedule), (measured, peak_of(graph, schedule))


def _close(measured: int, predicted: int) -> bool:
    return abs(measured - predicted) <= predicted * PEAK_TOLERANCE


def check_model(program: tuple[Step, ...], n_outputs: int, seed: int,
                capture: str = "auto") -> None:
    model, tokens, graph = _profiled(program, n_outputs, seed, capture)
    assert capture == "auto" or graph.meta["capture"] == capture
    store_all = store_all_schedule(graph)
    predicted = peak_of(graph, store_all)
    wrapped = monetlike.ScheduleWrapper(model, store_all, graph=graph)
    measured = measured_peak(graph, model, wrapped, (tokens,))
    assert _close(measured, predicted), ("store-all", measured, predicted)

    # Two schedules drawn at random (kept sets, Impls): the solver's choices depend on its time
    # limit, these do not. Never above the prediction: a solver may return any of them at a
    # budget equal to its peak (BATCHNORM_RECOMPUTED below went 128 B over, within 1%).
    rng = random.Random(seed)
    drawn = (random_schedules(graph, rng)[2], random_schedules(graph, rng, random_impls=True)[1])
    for schedule in drawn:
        expected = peak_of(graph, schedule)
        measured = measured_peak(graph, model,
                                 monetlike.ScheduleWrapper(model, schedule, graph=graph),
                                 (tokens,))
        assert measured <= expected, ("random", measured, expected)
    # Gradients under the schedule that recomputes most (nothing kept, each stage recomputes
    # from the inputs): it recomputes what no solver at these budgets would (a reader of a Value
    # overwritten in place later, recomputed from the new contents, went unseen while only
    # solved schedules were compared).
    tight = three_schedules(graph)["tight"]
    compare_step(model, lambda m: monetlike.ScheduleWrapper(m, tight, graph=graph),
                 (tokens,), seed=seed)

    # Every in-place Impl the profiler offers, at once, on store-all: each kernel then runs in
    # place with grad, whose backward must be the out-of-place one's that the Impl's figures
    # are. Written into a Value autograd tracks as a view (a Linear's 3-d output, a transposed
    # result), it made autograd clone a gradient (NOTE [In place on a view] in
    # monetlike/runtime/executor.py).
    inplace = tuple(next((i for i, im in enumerate(op.impls) if im.overwrites is not None), 0)
                    for op in graph.ops)
    if any(inplace):
        schedule = store_all_schedule(graph, inplace)
        expected = peak_of(graph, schedule)
        measured = measured_peak(graph, model,
                                 monetlike.ScheduleWrapper(model, schedule, graph=graph),
                                 (tokens,))
        assert _close(measured, expected), ("in place", measured, expected)

    least = solver.min_budget(graph, time_limit_s=10)
    budgets = sorted({least + (predicted - least) * f // 4 for f in (1, 3)})
    for budget in budgets:
        schedule = solver.solve(graph, budget, time_limit_s=10).schedule
        expected = peak_of(graph, schedule)
        measured = measured_peak(graph, model,
                                 monetlike.ScheduleWrapper(model, schedule, graph=graph),
                                 (tokens,))
        assert measured <= budget, ("over budget", budget, measured, expected)
        # At most 1% above the prediction, not equal: a Value freed inside a stage's backward
        # changes when later gradients are summed in ways the per-Op model does not follow, and
        # the profiler then counts it as an early release on the safe side (early_releases;
        # seen up to 2,048 B, 6% of these tiny models' peaks, over).
        assert measured <= expected * (1 + PEAK_TOLERANCE), ("schedule", budget, measured,
                                                             expected)
        compare_step(model, lambda m: monetlike.ScheduleWrapper(m, schedule, graph=graph),
                     (tokens,), seed=seed, steps=2)


# Drawn with FUZZ_EXAMPLES=70: a random kept set measured 500 B over the simulator's peak. The
# act_then_add_ Op (mul, silu_, add_) runs tanh between its nodes, so the value tanh reads lives
# through the Op's first nodes, which the simulator, running tanh whole before it, had freed
# (records.forward_interleaving).
INTERLEAVED_OP_HOLDS_ITS_INNER_OPS_INPUTS = ((Step("rms_norm", (0, 0, 0), 0.1),
                                              Step("masked_fill", (0, 0, 0), 0.1),
                                              Step("masked_fill", (0, 0, 0), 0.1),
                                              Step("attention_bmm", (0, 0, 0), 0.1),
                                              Step("act_then_add_", (1, 0, 0), 0.1),
                                              Step("masked_fill", (1, 3, 0), 0.1)), 1, 65535)


def test_an_op_run_inside_another_holds_what_it_reads_through_the_outer_ops_forward():
    check_model(*INTERLEAVED_OP_HOLDS_ITS_INNER_OPS_INPUTS)


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(FUZZ_PROGRAMS)
# tanh, run inside act_then_add_'s Op, offered an in-place Impl overwriting the Value that Op
# holds through its forward for it: the graph refused it (FUZZ_EXAMPLES=200).
@example(((Step("linear_on_transpose", (0, 0, 0), 0.1), Step("linear", (1, 0, 0), 0.1),
           Step("act_then_add_", (1, 0, 0), 0.1)), 1, 0))
# recompute_internals kept its RNG state (5 KB) as a ctx attribute, alive with the node until
# the whole backward was done, not freed after its stage: 4,240 B over, with sdpa_mask beside it.
@example(((Step("linear", (0, 0, 0), 0.1),) * 5 + (Step("attention_sdpa", (0, 0, 0), 0.1),
          Step("linear", (0, 0, 0), 0.1), Step("attention_sdpa", (0, 0, 0), 0.1)), 1, 0))
# A Value read three times: the profiler's dispatch mode made autograd accumulate its gradients
# out of place (17384 predicted, 16360 measured); the profiled backward now runs outside it.
@example(((Step("linear", (0, 0, 0), 0.1), Step("attention_matmul", (0, 0, 0), 0.1)), 1, 0))
# Found while the runtime held CPU generator states as tensors (5 KB each, not in the model).
@example(((Step("dropout", (0, 0, 0), 0.25), Step("linear", (1, 1, 1), 0.25),
           Step("dropout", (2, 2, 2), 0.5)), 2, 3))
# Flaky until recordings stopped the cyclic collector: a free of an earlier example's garbage
# inside a profiled window lowered its workspace.
@example(((Step("linear", (0, 0, 0), 0.1), Step("linear", (0, 0, 1), 0.1)), 1, 1))
@example(((Step("linear", (0, 0, 0), 0.1), Step("split_cat", (0, 0, 1), 0.1)), 1, 0))
# The operands of a construct outlive their last use in eager code (Python locals): plain
# PyTorch peaked above the store-all prediction; the wrapper runs the traced graph.
@example(((*(Step("linear", (0, 0, 0), 0.1),) * 4, Step("attention_matmul", (0, 1, 2), 0.1),
           Step("linear", (0, 0, 0), 0.1)), 1, 0))
# A branch whose result never reached the loss held what autograd saved for it (matmul's
# operands) past their last use; every result is now an output or read (fuzz_models).
@example(((*(Step("linear", (0, 0, 0), 0.1),) * 4, Step("attention_matmul", (0, 39, 13), 0.1),
           Step("linear", (1, 0, 0), 0.1), Step("linear", (0, 0, 0), 0.1)), 1, 0))
# add_inplace_rhs wrote into `add` with a transposed view as the other operand: autograd then
# copies a gradient in the convolution's stage (+2048 bytes over budget); no longer offered.
@example(((Step("linear_on_transpose", (41, 58, 63), 0.5),
           Step("conv1d_on_transpose", (33, 48, 39), 0.5), Step("shared_linear", (11, 61, 44), 0.25),
           Step("add_param", (48, 49, 27), 0.5), Step("sigmoid_inplace", (52, 55, 38), 0.1),
           Step("batch_norm", (16, 40, 53), 0.25)), 3, 129))
# Chained exp() overflowed to inf and NaN gradients (equal, but NaN != NaN): slice_cat now uses
# tanh, so values stay finite.
@example(((*(Step("linear", (0, 0, 0), 0.1),) * 3, Step("slice_cat", (38, 0, 0), 0.1),
           *(Step("linear", (0, 0, 0), 0.1),) * 2, Step("slice_cat", (53, 0, 0), 0.1)), 1, 0))
# An unread result: an eager list kept it alive, the traced graph frees it (fuzz_models drops it).
@example(((Step("linear", (0, 0, 0), 0.1), Step("split_cat", (0, 0, 0), 0.1)), 1, 0))
# A solved schedule peaked 3.4% under its prediction in the full suite (see check_model).
@example(((Step("sigmoid_inplace", (7, 5, 29), 0.1), Step("dropout", (63, 60, 36), 0.1),
           Step("sigmoid_inplace", (8, 2, 51), 0.1), Step("chunk_cat", (1, 44, 9), 0.5),
           Step("add", (63, 60, 36), 0.25), Step("dropout", (63, 60, 36), 0.1),
           Step("reshape_permute", (46, 62, 47), 0.25), Step("attention_bmm", (1, 36, 11), 0.25),
           Step("reshape_permute", (2, 30, 56), 0.5)), 1, 65535))
# Revisited Op: autograd ran a view node of the last bmm's group after other stages; its
# interval was charged to the bmm's stage at the level of that later time (+1088 bytes).
@example(((*(Step("linear", (0, 0, 0), 0.1),) * 4, Step("linear_on_transpose", (0, 0, 0), 0.1),
           Step("linear", (49, 0, 0), 0.1), Step("linear", (0, 0, 0), 0.1),
           Step("linear", (0, 0, 28), 0.1), Step("attention_bmm", (0, 0, 59), 0.1)), 1, 0))
# The same cause, found by the two-sided check: store-all 29808 predicted, 28904 measured.
@example(((Step("linear", (0, 0, 0), 0.1),) * 2 + (Step("gelu", (0, 0, 0), 0.1),
          Step("linear", (0, 0, 0), 0.1), Step("attention_matmul", (0, 39, 0), 0.1),
          Step("reshape_permute", (0, 0, 0), 0.1)), 1, 0))
# An Op whose nodes are not contiguous (NOTE [Interleaved stages] in profile/interpreter.py):
# SiLU's saved copy lived through the stage autograd ran between, left out of it (5.2% under, in
# a hand-written model); counted against the then-current level instead, the stage's own freed
# Values came back: 17,396 B predicted, 16,424 measured; 18,480 against 16,432 for the second.
@example(((Step("linear", (0, 0, 0), 0.1), Step("act_then_add_", (1, 0, 0), 0.1)), 1, 0))
@example(((Step("act_then_add_", (0, 0, 0), 0.1), Step("linear", (1, 0, 0), 0.1)), 1, 0))
# A solved schedule held a mul's saved operand past its stage; the profile had it freed between
# the stage's peak and an out-of-place gradient sum as high: 31,984 B measured, 29,936 predicted,
# 30,960 budget (profile/interpreter.py, early_releases).
@example(((Step("linear", (0, 0, 0), 0.1), Step("relu_inplace", (0, 0, 0), 0.1),
           Step("sigmoid_inplace", (34, 0, 0), 0.1), Step("mul", (57, 42, 0), 0.1),
           Step("linear", (27, 0, 0), 0.1), Step("linear", (27, 0, 0), 0.1)), 1, 0))
# In-place Impls written into views (NOTE [In place on a view] in monetlike/runtime/executor.py):
# store-all with every in-place Impl measured 16,424 B against 14,312 predicted (add_ into a 3-d
# Linear's output, a view of its addmm), 21,736 against 19,944 (tanh_ into one).
@example(((Step("linear", (0, 0, 0), 0.1), Step("add", (1, 0, 0), 0.1)), 1, 0))
@example(((Step("linear", (31, 45, 60), 0.1), Step("linear_on_transpose", (22, 45, 54), 0.1),
           Step("tanh", (52, 46, 13), 0.1)), 1, 71))
# A conv_split's input half runs after its weight half has made the weight gradient, which a
# step starting from zero_grad(set_to_none=True) keeps as .grad; the Impl's profiling round ran
# with the gradients of earlier steps, accumulated into them and freed its own: 35,604 B measured
# at store-all with the split, 32,528 predicted (monetlike/profile/impl_timing.py now starts each
# round without gradients).
@example(((Step("linear_on_transpose", (41, 58, 63), 0.5),
           Step("conv1d_on_transpose", (33, 48, 39), 0.5), Step("shared_linear", (11, 61, 44), 0.25),
           Step("add_param", (48, 49, 27), 0.5), Step("sigmoid_inplace", (52, 55, 38), 0.1),
           Step("batch_norm", (16, 40, 53), 0.25)), 3, 129))
# An Impl measured beside a neighbour's Impl: the ReLU's mask Impl, profiled in the round that also
# split the Linear reading the same Value, took that Linear's fresh input gradient (added into in
# place) for its own; beside the default Linear (a view, added out of place) its stage needs
# 2,112 B more: 18,480 B measured, 16,436 predicted (monetlike/profile/impl_timing.py, _rounds).
@example(((Step("relu_inplace", (0, 0, 0), 0.1), Step("linear", (0, 0, 0), 0.1)), 1, 235))
# The mask Impls' input gradient was contiguous where the default's has the output's layout
# (a sum's gradient is expanded; threshold_backward follows the saved output, transposed here):
# a transposed Linear's split backward then copied it. 21,032 B measured against 18,984
# predicted for a random schedule with both Impls; a solved one 1,102 B over its budget
# (monetlike/impls/relu.py, Activation.grad_layout).
@example(((Step("linear_on_transpose", (0, 0, 0), 0.1), Step("relu_inplace", (1, 0, 0), 0.1),
           Step("linear", (0, 0, 0), 0.1)), 1, 1))
@example(((Step("linear_on_transpose", (0, 0, 0), 0.1), Step("relu_inplace", (1, 0, 0), 0.1),
           Step("linear", (0, 0, 0), 0.1), Step("linear", (2, 0, 0), 0.1)), 1, 0))
# add_inplace_rhs wrote a + b into a transposed b: the result kept b's layout where a + b takes
# a's, so the gradients behind it came transposed and the embedding's backward copied one: a
# solved schedule 16 B over its budget (512 B over its prediction), and with every in-place
# Impl a store-all peak 4% under its prediction. Binary in-place Impls now need contiguous
# operands (monetlike/profile/impl_timing.py, inplace_alternatives).
@example(((*(Step("linear", (0, 0, 0), 0.1),) * 3, Step("slice_cat", (0, 0, 0), 0.1),
           Step("contiguous", (14, 0, 0), 0.1), *(Step("linear", (0, 0, 0), 0.1),) * 2,
           Step("sigmoid_inplace", (0, 5, 0), 0.1)), 1, 0))
@example(((*(Step("linear", (0, 0, 0), 0.1),) * 3, Step("group_norm", (0, 0, 0), 0.1),
           Step("contiguous", (14, 0, 0), 0.1), *(Step("linear", (0, 0, 0), 0.1),) * 2,
           Step("sigmoid_inplace", (0, 5, 0), 0.1)), 1, 0))
# A product no gradient flows through (its result only feeds a comparison) kept the Value it
# multiplied, through its MulBackward, until the mask was made: past the Value's last use, where
# the schedule frees it; 4 B over a random schedule's prediction here, 27% on a wider model
# (tests/test_unreached_ops.py). The runtime now lets go of what such Ops save (NOTE [Ops no
# backward reaches] in monetlike/runtime/plan.py). Found by a run of 800 programs outside
# hypothesis, with the masked_fill construct.
@example(((Step("sigmoid_inplace", (53, 5, 55), 0.5), Step("mul_param", (17, 18, 57), 0.5),
           Step("masked_fill", (45, 8, 49), 0.5)), 1, 47218))
# An attention no gradient flows through (its result only makes a mask) held 12 KB of internals
# at its forward point in the model, which the runtime let go of as they were made: store-all
# measured 25,584 B against 27,816 predicted. Such an Op's forward is now its no_grad run
# (Group.forward_figures); plain autograd, which keeps them until the mask is made, measured
# 32,296 B. Found by random fuzz programs outside hypothesis.
@example(((Step("contiguous", (27, 13, 9), 0.1), Step("attention_einsum", (18, 62, 46), 0.5),
           Step("reshape_permute", (13, 20, 11), 0.1), Step("attention_sdpa", (29, 32, 12), 0.1),
           Step("rms_norm", (18, 34, 26), 0.25), Step("masked_fill", (14, 4, 52), 0.25)),
          2, 51324))
# A view between Ops, claimed by the first Op to read it (a gate that leads nowhere), ran for
# another reader: the profile counted it as the gate's backward and gave the gate a stage, which
# at run time never starts; a random schedule measured 59,056 B against 57,008 predicted, and a
# solved one found a Value missing (tests/test_unreached_ops.py). Random programs again.
@example(((Step("conv1d_on_transpose", (16, 39, 54), 0.1), Step("batch_norm", (17, 20, 31), 0.5),
           Step("sigmoid_gate", (9, 29, 48), 0.25), Step("cumsum", (38, 36, 28), 0.1),
           Step("slice_cat", (11, 58, 16), 0.1), Step("add", (29, 2, 49), 0.1),
           Step("reshape_permute", (57, 43, 28), 0.1)), 2, 33858))
# A float Value read as complex numbers, and a lazy conjugate, saved by a product's backward:
# the runtime's handle rebuilt them as float and without the conjugate bit (a random schedule
# measured 23,664 B against 21,616, gradients wrong). Found by the second hunt on unseen models.
@example(((Step("linear", (0, 0, 0), 0.1), Step("complex_mul", (1, 0, 0), 0.1),
           Step("gelu", (2, 0, 0), 0.1), Step("linear", (3, 0, 0), 0.1)), 1, 0))
# The construct itself made a complex view of a transposed batch norm's result, which PyTorch
# refuses (the pairs must be adjacent): it now makes the operands contiguous first.
@example(((Step("linear", (0, 0, 0), 0.1), Step("batch_norm", (0, 0, 0), 0.1),
           Step("relu_inplace", (53, 0, 0), 0.1), Step("complex_mul", (0, 2, 0), 0.1)), 1, 0))
# A GRU no backward reaches (its result only gates through a comparison) runs under no_grad; the
# profile measured that run inside its dispatch mode, where the GRU's intermediates live longer:
# store-all predicted 26,208 B against 24,936 measured (NOTE [No-grad runs outside the tracker]).
@example(((Step("gru", (0, 0, 0), 0.25), Step("linear", (0, 0, 0), 0.1),
           Step("sigmoid_gate", (0, 1, 0), 0.1)), 1, 0))
# What torch.export alone refuses (issue 55), in one program: a custom autograd Function, a
# custom op with a registered backward, a branch on a value (captured by export for the
# example's branch, capture="auto" falling back from fx).
@example(((Step("linear", (0, 0, 0), 0.1), Step("custom_function", (1, 0, 0), 0.1),
           Step("value_branch", (2, 0, 0), 0.1), Step("custom_op", (3, 0, 0), 0.1),
           Step("linear", (4, 0, 0), 0.1)), 1, 0))
def test_fuzzed_models(case):
    check_model(*case)


# torch.export's graphs are ATen-level and keep `+=` in place: other Ops, other groupings.
@pytest.mark.slow
@settings(max_examples=max(1, EXAMPLES // 8), deadline=None, derandomize=True,
          print_blob=True, suppress_health_check=[HealthCheck.too_slow,
                                                  HealthCheck.data_too_large])
@given(FUZZ_PROGRAMS)
@example(((Step("linear", (0, 0, 0), 0.1), Step("custom_function", (1, 0, 0), 0.1),
           Step("custom_op", (2, 0, 0), 0.1), Step("value_branch", (1, 2, 0), 0.1)), 2, 1))
def test_fuzzed_models_under_export(case):
    check_model(*case, capture="export")


# Over the budget by 116 B in the suite's worker (not alone): there, the solver returned another
# schedule of the same predicted peak, one recomputing the BatchNorms. A recomputation runs a
# BatchNorm without its running statistics (monetlike/core/recompute.py), another kernel path with
# 128 B more scratch; the profile had taken the forward's. Now measured as recomputed
# (profile/interpreter.py, _nograd_transient). The schedule below peaks at that recomputation.
BATCHNORM_RECOMPUTED = ((Step("batch_norm", (32, 6, 54), 0.1), Step("batch_norm", (25, 42, 3), 0.1),
                         Step("dropout", (20, 28, 36), 0.25), Step("slice_cat", (38, 56, 53), 0.25),
                         Step("linear", (49, 33, 12), 0.25), Step("stack_mean", (57, 34, 51), 0.25),
                         Step("slice_cat", (53, 27, 54), 0.5), Step("chunk_cat", (53, 11, 62), 0.5),
                         Step("sigmoid_inplace", (5, 36, 8), 0.25)), 1, 14495)


def test_batchnorm_recomputed_at_the_peak():
    """Allocator-measured 31,224 B against 31,096 predicted before the fix; 5 of 1,200 random
    schedules of this model were under-predicted so (128 B), within the random check's 1%."""
    model, tokens, graph = _profiled(*BATCHNORM_RECOMPUTED)
    names = [op.name for op in graph.ops]
    assert names[2:4] == ["layers_0", "layers_1"], names  # the two BatchNorms
    keep = {v.id for v in graph.values if v.producer in (4, 5)}  # dropout's and tanh's outputs
    schedule = schedule_from_keep(graph, keep, retain="none")
    stages = {st.op: st.recompute for st in schedule.stages}
    assert {2, 3} <= set(stages[11]), stages  # recomputed before tanh_1's stage, at the peak
    point = simulate(graph, schedule).peak_point
    assert (point.phase, graph.ops[point.op].name) == ("recompute", "layers_1"), point
    _assert_measured_as_predicted(graph, model, tokens, schedule)
    check_model(*BATCHNORM_RECOMPUTED)


# Found by 1,000 fuzz examples at stop 42: `a * 1.5` wraps 1.5 as a 0-dim double tensor that
# MulBackward keeps until its backward without passing the saved-tensor hooks; the profiler read
# only the hooks, so no Op's figures held its 8 B and the prediction was short by them until that
# backward (at the attention's forward). The profiler now finds such blocks by their addresses.
WRAPPED_NUMBER_HELD = ((*(Step("linear", (0, 0, 0), 0.1),) * 6,
                        Step("relu_inplace", (0, 0, 0), 0.1),
                        Step("attention_sdpa", (0, 0, 1), 0.1)), 1, 0)


def test_wrapped_number_held_by_a_backward():
    model, tokens, graph = _profiled(*WRAPPED_NUMBER_HELD)
    assert graph.ops[next(o.id for o in graph.ops if o.name == "mul")].impls[0].internal_bytes == 8
    add = next(v.id for v in graph.values if v.name == "add")
    schedule = schedule_from_keep(graph, {v.id for v in graph.values} - {add}, retain="saved")
    point = simulate(graph, schedule).peak_point
    assert (point.phase, graph.ops[point.op].name) == ("forward", "scaled_dot_product_attention")
    _assert_measured_as_predicted(graph, model, tokens, schedule)


# `a * 1.0` whose result no gradient reaches (it feeds only a comparison's mask) kept its
# MulBackward0 node, and with it the wrapped number 1.0 (8 B) that autograd saves without the
# saved-tensor hooks, while its result lived. The profiler figures such an Op's forward from its
# no_grad run (Group.forward_figures), so a random schedule measured 13,224 B against 13,216
# predicted. Such Ops now run under no_grad (NOTE [Ops no backward reaches]). Generated by the
# model fuzzer in one full run and not in others.
UNREACHED_WRAPPED_NUMBER = ((Step("masked_fill", (0, 0, 0), 0.1),
                             Step("view_add_inplace", (0, 0, 0), 0.1),
                             Step("masked_fill", (29, 0, 0), 0.1),
                             Step("masked_fill", (0, 23, 0), 0.1)), 1, 0)


def test_wrapped_number_held_by_an_op_no_gradient_reaches():
    model, tokens, graph = _profiled(*UNREACHED_WRAPPED_NUMBER)
    schedule = store_all_schedule(graph)
    _assert_measured_as_predicted(graph, model, tokens, schedule)
    check_model(*UNREACHED_WRAPPED_NUMBER)
