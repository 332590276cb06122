"""Hand-computed accounting of the profiler on tiny models: grouping, saved tensors, internals,
fixed memory, fingerprints, recompute-unsafe detection and trace errors."""

import pytest
import torch
import torch.nn as nn

import monetlike
import solver
from monetlike.profile import UnknownDeviceError
from monetlike.capture.trace import TraceError

N, C, H, W = 2, 3, 8, 8


pytestmark = pytest.mark.usefixtures("one_thread")


def x_img(c=C):
    torch.manual_seed(0)
    return torch.randn(N, c, H, W)


def prof(model, x, **kw):
    kw.setdefault("repeat", 1)
    return monetlike.profile(model, x, **kw)


def by_name(g, name):
    (op,) = [o for o in g.ops if o.name == name]
    return op


# -- saved tensors, by hand ----------------------------------------------------------------------
def test_inplace_relu_joins_conv_and_saves_output():
    m = nn.Sequential(nn.Conv2d(C, 4, 3, padding=1), nn.ReLU(inplace=True))
    g = prof(m, x_img())
    assert len(g.ops) == 1
    op = g.ops[0]
    assert op.nodes == ("_0", "_1") and op.kind == "Conv2d"
    out = g.values[op.outputs[0]]
    assert out.shape == (N, 4, H, W) and out.bytes == N * 4 * H * W * 4
    # conv saves its input (a graph input: fixed) and weight (a parameter: fixed); ReLU saves its
    # output, which is the conv's storage: one Value, counted once.
    assert op.impls[0].saved == (out.id,)
    assert op.impls[0].internal_bytes == 0
    assert op.inputs == (0,) and g.values[0].producer is None
    assert g.backward_order == (0,) and op.has_backward


def test_dropout_train_internal_is_the_mask():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5))
    m.train()
    x = torch.randn(4, 16)
    g = prof(m, x)
    drop = by_name(g, "_1")
    assert drop.kind == "Dropout"
    # On CPU (and meta) PyTorch's dropout is input * (bernoulli noise / (1-p)), the noise in the
    # input's dtype; the fused kernel with a bool mask (1 byte/element) is CUDA-only.
    assert drop.impls[0].saved == ()
    assert drop.impls[0].internal_bytes == 4 * 32 * 4
    assert drop.recompute_unsafe is None  # default generator: replayable
    # Analytical profiles describe a GPU: the fused kernel's bool mask, 1 byte per element.
    ga = prof(m, x, cost="analytical:A100-40GB")
    assert by_name(ga, "_1").impls[0].internal_bytes == 4 * 32 * 1
    # A CPU profile also offers dropout_mask (ImplSpec.devices), a GPU one does not: the same
    # structure once the meta profile offers the CPU's Impls, as the runtime's check does.
    assert [im.name for im in by_name(g, "_1").impls][-1] == "dropout_mask"
    assert ga.fingerprint != g.fingerprint
    assert prof(m, x, cost="analytical:A100-40GB", impl_target="cpu").fingerprint == g.fingerprint


def test_dropout_eval_is_an_alias_not_an_op():
    m = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5)).eval()
    g = prof(m, torch.randn(4, 16))
    assert [o.kind for o in g.ops] == ["Linear"]
    assert g.outputs == (g.ops[0].outputs[0],)


def test_batchnorm_train_saves_input_and_statistics():
    m = nn.Sequential(nn.Conv2d(C, 5, 3, padding=1, bias=False), nn.BatchNorm2d(5)).train()
    g = prof(m, x_img())
    conv, bn = g.ops
    assert bn.kind == "BatchNorm2d" and bn.inputs == conv.outputs
    assert bn.impls[0].saved == conv.outputs  # the input Value; running stats are fixed memory
    assert bn.impls[0].internal_bytes == 2 * 5 * 4  # save_mean + save_invstd, float32
    assert bn.recompute_unsafe is None  # running-stat updates are allowed (runtime handles them)
    assert conv.impls[0].saved == ()  # its input is the graph input


class HomemadeNorm(nn.Module):
    """A module of its own that keeps a running mean under BatchNorm's buffer name: the runtime
    does not rewrite it for recomputation, so a recomputation would update the mean again."""

    def __init__(self, c):
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(c))

    def forward(self, x):
        self.running_mean.mul_(0.9).add_(x.detach().mean((0, 2, 3)), alpha=0.1)
        return x - self.running_mean[:, None, None]


def test_a_buffer_named_like_batchnorms_is_unsafe_outside_torchs_batchnorm():
    """The profiler asks the runtime's rule (recompute.allowed_buffer_writes) of the module that
    owns a written buffer, not the buffer's name: torch's BatchNorm may write its running
    statistics (the recomputation leaves them out), a module of one's own may not (as a leaf
    module its update is part of its op, which a recomputation would run again)."""
    m = nn.Sequential(nn.Conv2d(C, 5, 3, padding=1), HomemadeNorm(5),
                      nn.BatchNorm2d(5)).train()
    g = prof(m, x_img(), leaf_modules=[HomemadeNorm])
    assert "writes parameter or buffer '1.running_mean'" in by_name(g, "_1").recompute_unsafe
    assert by_name(g, "_2").kind == "BatchNorm2d" and by_name(g, "_2").recompute_unsafe is None


def test_maxpool_saves_input_and_int64_indices():
    m = nn.Sequential(nn.Conv2d(C, 4, 3, padding=1), nn.MaxPool2d(2))
    g = prof(m, x_img())
    conv, pool = g.ops
    assert pool.impls[0].saved == conv.outputs
    assert pool.impls[0].internal_bytes == N * 4 * (H // 2) * (W // 2) * 8
    out = g.values[pool.outputs[0]]
    assert out.bytes == N * 4 * (H // 2) * (W // 2) * 4 and out.dtype == "float32"


class _ScaledByNumbers(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x) * 0.5) / 3.0 + 2.0)


def test_python_numbers_autograd_keeps_are_held_by_their_op():
    """`h * 0.5` and `h / 3.0` wrap the number as a 0-dim double that the backward keeps without
    the saved-tensor hooks (autograd skips them for wrapped numbers); `+ 2.0` keeps nothing. The
    profiler finds them among the allocator's blocks: 8 B held by each Op to its backward, and
    store-all's prediction is what the allocator measures."""
    from runtime_support import measured_peak, peak_of
    from solver.rules.simple import schedule_from_keep

    torch.manual_seed(0)
    m, x = _ScaledByNumbers(), torch.randn(4, 16)
    g = prof(m, x)
    held = {op.name: op.impls[0].internal_bytes for op in g.ops}
    assert held["mul"] == 8 and held["truediv"] == 8 and held["add"] == 0, held
    for keep in ({v.id for v in g.values}, set()):
        schedule = schedule_from_keep(g, keep, retain="saved")
        wrapped = monetlike.ScheduleWrapper(m, schedule, graph=g)
        assert measured_peak(g, m, wrapped, (x,)) == peak_of(g, schedule)


def test_views_belong_to_no_op_and_map_to_their_storage():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8 * 4 * 4, 3)
            self.conv = nn.Conv2d(C, 8, 3, stride=2, padding=1)

        def forward(self, x):
            y = self.conv(x)
            return self.fc(y.flatten(1))

    g = prof(M(), x_img())
    assert [o.kind for o in g.ops] == ["Conv2d", "Linear"]
    conv, fc = g.ops
    assert fc.inputs == conv.outputs  # the flatten view reads the conv's storage
    assert fc.impls[0].saved == conv.outputs  # linear saves its (viewed) input


def test_bf16_bytes_are_dtype_aware():
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU()).to(torch.bfloat16)
    g = prof(m, torch.randn(4, 16, dtype=torch.bfloat16))
    assert g.values[g.ops[0].outputs[0]].bytes == 4 * 32 * 2
    assert g.values[g.ops[0].outputs[0]].dtype == "bfloat16"
    assert g.input_bytes == 4 * 16 * 2


# -- fixed memory -----------------------------------------------------------------------------
def test_fixed_memory_and_optimizer_state():
    m = nn.Sequential(nn.Conv2d(C, 4, 3), nn.BatchNorm2d(4))
    m[0].bias.requires_grad_(False)
    x = x_img()
    trainable = (4 * C * 9 + 4 + 4) * 4  # conv weight, bn weight and bias
    params = trainable + 4 * 4
    buffers = 2 * 4 * 4 + 8  # running mean/var, num_batches_tracked (int64)
    g0 = prof(m, x, cost="analytical:A100-40GB")
    assert g0.param_bytes == params + buffers
    assert g0.input_bytes == x.numel() * 4
    assert g0.optimizer_bytes == 0
    assert prof(m, x, cost="analytical:A100-40GB", optimizer="sgd").optimizer_bytes == trainable
    assert prof(m, x, cost="analytical:A100-40GB", optimizer="adam").optimizer_bytes == 2 * trainable
    with pytest.raises(ValueError, match="optimizer"):
        prof(m, x, optimizer="lbfgs")


def test_shared_parameters_counted_once():
    lin = nn.Linear(8, 8)
    m = nn.Sequential(lin, nn.ReLU(), lin)
    g = prof(m, torch.randn(2, 8), cost="analytical:H100-80GB")
    assert g.param_bytes == (64 + 8) * 4


def test_two_inputs_two_outputs():
    from monetlike.models import TwoInOut

    m = TwoInOut(width=8)
    img, vec = torch.randn(2, 3, 16, 16), torch.randn(2, 32)
    g = prof(m, (img, vec))
    inputs = [v for v in g.values if v.producer is None]
    assert [v.name for v in inputs] == ["image", "vec"]
    assert g.input_bytes == (img.numel() + vec.numel()) * 4
    assert len(g.outputs) == 2
    logits, emb = (g.values[v] for v in g.outputs)
    assert logits.shape == (2, 10) and emb.shape == (2, 32)
    assert g.batch == 2


def test_user_model_untouched_and_rng_restored():
    m = nn.Sequential(nn.Conv2d(C, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    x = x_img()
    torch.manual_seed(123)
    state = torch.get_rng_state()
    prof(m, x, repeat=2)
    assert torch.equal(torch.get_rng_state(), state)
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in m.parameters())
    assert m.training


# -- fingerprints ---------------------------------------------------------------------------
def test_fingerprint_stable_batch_sensitive_and_cost_independent():
    import torchvision

    m = torchvision.models.resnet18(num_classes=10)
    x2, x3 = torch.randn(2, 3, 32, 32), torch.randn(3, 3, 32, 32)
    a = prof(m, x2)
    b = prof(m, x2)
    c = prof(m, x3)
    d = prof(m, x2, cost="analytical:A100-40GB")
    assert a.fingerprint == b.fingerprint
    assert a.fingerprint != c.fingerprint
    assert a.fingerprint == d.fingerprint
    assert a.cost_provenance == "measured:cpu" and d.cost_provenance == "analytical:A100-40GB"
    assert d.batch == 2 and c.batch == 3
    # Costs differ, structure does not.
    assert [o.impls[0].saved for o in a.ops] == [o.impls[0].saved for o in d.ops]
    assert a.stage_grad_bytes == d.stage_grad_bytes
    # JSON round trip keeps the fingerprint.
    assert solver.OpGraph.from_dict(a.to_dict()).fingerprint == a.fingerprint


def test_unknown_device_lists_presets():
    with pytest.raises(UnknownDeviceError, match="A100-40GB.*H100-80GB"):
        prof(nn.Linear(2, 2), torch.randn(1, 2), cost="analytical:TPUv9")
    with pytest.raises(ValueError, match="measured"):
        prof(nn.Linear(2, 2), torch.randn(1, 2), cost="guessed")


# -- recompute-unsafe detection ----------------------------------------------------------------
class TopK(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).topk(3, dim=1).values


class NonZero(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        idx = (y > 0).nonzero()
        return y.sum() + idx.float().sum()


def test_data_dependent_ops_are_unsafe():
    g = prof(TopK(), torch.randn(4, 8))
    (topk,) = [o for o in g.ops if o.kind == "topk"]
    assert "topk" in topk.recompute_unsafe
    assert by_name(g, "fc").recompute_unsafe is None
    g = prof(NonZero(), torch.randn(4, 8))
    assert any(o.recompute_unsafe and "nonzero" in o.recompute_unsafe for o in g.ops)


def test_analytical_cannot_run_data_dependent_ops_and_says_so():
    from monetlike.profile import ProfileError

    with pytest.raises(ProfileError, match="nonzero.*meta device.*cost='measured'"):
        prof(NonZero(), torch.randn(4, 8), cost="analytical:A100-40GB")


def test_forward_hook_makes_module_a_leaf_and_unsafe():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x):
            return self.b(self.a(x).relu())

    m = nn.Sequential(Block(), nn.Linear(8, 2))
    calls = []
    m[0].register_forward_hook(lambda mod, inp, out: calls.append(1))
    g = prof(m, torch.randn(4, 8))
    blk = by_name(g, "_0")
    assert blk.kind == "Block" and "forward hooks" in blk.recompute_unsafe
    assert by_name(g, "_1").recompute_unsafe is None
    # The hook runs for real while profiling (on the deep copy, which carries it along).
    assert calls


def test_forward_pre_hook_on_leaf_is_unsafe():
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    m[0].register_forward_pre_hook(lambda mod, inp: None)
    g = prof(m, torch.randn(4, 8))
    assert "forward hooks" in by_name(g, "_0").recompute_unsafe


def test_buffer_update_unsafe_but_batchnorm_safe():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x):
            self.seen.add_(1)
            return self.fc(x) * 2

    # Kept whole (a leaf), the module's Op updates the buffer: recomputing it would count twice.
    g = prof(nn.Sequential(Counter()), torch.randn(4, 8), leaf_modules=[Counter])
    assert "seen" in g.ops[0].recompute_unsafe
    # The recorded leaf list traces the same graph again (classes recorded as dotted names).
    from monetlike.capture.trace import trace

    gm = trace(nn.Sequential(Counter()), g.meta["leaf_modules"])
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_module", "output"]
    # Traced through, `self.seen.add_(1)` is a node of its own that creates no storage: it belongs
    # to no Op, so no recomputation ever repeats it, and the ops around it stay safe.
    g = prof(Counter(), torch.randn(4, 8))
    assert all(o.recompute_unsafe is None for o in g.ops)
    g = prof(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)), torch.randn(4, 8))
    assert all(o.recompute_unsafe is None for o in g.ops)


def test_explicit_generator_is_unsafe():
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.gen = torch.Generator().manual_seed(0)

        def forward(self, x):
            y = self.fc(x)
            return y * torch.empty_like(y).bernoulli_(0.5, generator=self.gen)

    m = Noisy()
    g = prof(m, torch.randn(4, 8))
    assert any(o.recompute_unsafe and "Generator" in o.recompute_unsafe for o in g.ops)


# -- in-place corner cases --------------------------------------------------------------------
def test_inplace_after_other_reader_becomes_its_own_unsafe_op():
    class SiLUInplace(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(C, 4, 3, padding=1)
            self.c2 = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            y = self.c(x)
            y.mul_(torch.sigmoid(y))
            return self.c2(y)

    g = prof(SiLUInplace(), x_img())
    c, sig, mul, c2 = g.ops
    assert mul.kind == "mul_" and mul.outputs == () and set(mul.inputs) == {c.outputs[0],
                                                                           sig.outputs[0]}
    assert c.recompute_unsafe and mul.recompute_unsafe
    # sigmoid read y before mul_ overwrote it: recomputed, it would read the new contents
    assert "which node mul_ of another op later overwrites in place" in sig.recompute_unsafe
    assert c2.inputs == c.outputs
    solver.simulate(g, solver.store_all_schedule(g))


def test_inplace_join_reading_a_later_value_is_ordered_topologically():
    class LateAdd(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Conv2d(C, 4, 3, padding=1)
            self.bn = nn.BatchNorm2d(4)
            self.b = nn.Conv2d(C, 4, 3, padding=1)

        def forward(self, x):
            out = self.bn(self.a(x))
            identity = self.b(x)  # made after bn, like a ResNet downsample branch
            out.add_(identity)
            return torch.relu_(out)

    g = prof(LateAdd(), x_img())
    assert [o.name for o in g.ops] == ["a", "b", "bn"]
    bn = g.ops[2]
    assert bn.nodes == ("bn", "add_", "relu_")
    assert set(bn.inputs) == {g.ops[0].outputs[0], g.ops[1].outputs[0]}
    assert bn.recompute_unsafe is None


def test_copy_into_a_fresh_buffer_joins_it_and_owns_the_copy_backward():
    class Fill(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(16, 4)

        def forward(self, x):
            buf = x.new_zeros(x.shape[0], 16)
            buf.narrow(1, 0, 8).copy_(self.a(x))
            return self.b(buf)

    g = prof(Fill(), torch.randn(4, 8))
    a, fill, b = g.ops
    assert fill.nodes == ("new_zeros", "copy_") and a.outputs[0] in fill.inputs
    assert fill.has_backward  # the CopySlices node belongs to the Op that owns the buffer
    assert g.values[fill.outputs[0]].requires_grad
    assert b.impls[0].saved == fill.outputs


# -- trace errors -----------------------------------------------------------------------------
def test_untraceable_model_names_module_and_line():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow
                return self.fc(x)
            return x

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Branchy()

        def forward(self, x):
            return self.inner(x)

    # capture="fx": under "auto" torch.export captures it for the example's branch (issue 55).
    with pytest.raises(TraceError) as ei:
        prof(Outer(), torch.randn(2, 4), capture="fx")
    msg = str(ei.value)
    assert "'inner'" in msg and "Branchy" in msg
    assert "if x.sum() > 0" in msg and "test_profile_accounting.py" in msg
    assert "leaf_modules=['inner']" in msg and "torch.export" in msg
    assert isinstance(ei.value, solver.MonetlikeError)
    # The way out works.
    g = prof(Outer(), torch.ones(2, 4), leaf_modules=["inner"])  # the branch with an op
    assert [o.kind for o in g.ops] == ["Branchy"]
    assert g.meta["leaf_modules"] == ["inner"]


def test_untraceable_root_says_to_move_the_code_into_a_leaf():
    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            if y.max() > 0:
                y = y * 2
            return y

    with pytest.raises(TraceError, match=r"if y.max\(\) > 0.*submodule.*leaf"):
        prof(Root(), torch.randn(2, 4), capture="fx")  # "auto": export, for the example's branch


def test_bad_inputs():
    with pytest.raises(ValueError, match="example_inputs"):
        prof(nn.Linear(2, 2), [1, 2])
    with pytest.raises(ValueError, match="batch dimension"):
        prof(nn.Linear(2, 2), torch.tensor(1.0))
