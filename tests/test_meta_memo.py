"""Meta kernels remembered (monetlike/profile/meta_memo.py): the same outputs as the kernel, as
fresh storages, and only for ops whose outputs are certain to be fresh."""

from __future__ import annotations

import torch
import torchvision

import monetlike
from monetlike.profile import meta_memo

aten = torch.ops.aten


def _meta(*shape, **kw):
    return torch.empty(*shape, device="meta", **kw)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
            and a.untyped_storage().nbytes() == b.untyped_storage().nbytes())


def test_a_repeated_call_gives_fresh_outputs_laid_out_as_the_kernels():
    x = _meta(4, 8, 6, 6).to(memory_format=torch.channels_last)
    w = torch.nn.Parameter(_meta(16, 8, 3, 3))
    calls = [(aten.convolution.default, (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)),
             (aten.native_batch_norm.default,
              (x, None, None, _meta(8), _meta(8), True, 0.1, 1e-5)),
             (aten.add.Tensor, (x, _meta(1, 8, 1, 1)))]
    for func, args in calls:
        first = meta_memo.call(func, args, {})
        again = meta_memo.call(func, args, {})  # from the memo
        assert meta_memo.remembers(func, args, {})
        real = func(*args)
        firsts, agains, reals = ((o,) if isinstance(o, torch.Tensor) else o
                                 for o in (first, again, real))
        assert len(agains) == len(reals)
        keys = {t.untyped_storage()._cdata for t in (*firsts, *agains, *args)
                if isinstance(t, torch.Tensor)}
        assert len(keys) == len(firsts) + len(agains) + sum(isinstance(a, torch.Tensor)
                                                              for a in args)
        for a, r in zip(agains, reals):
            assert _same_layout(a, r), func


def test_views_in_place_ops_and_random_ops_run_their_kernel():
    x = _meta(4, 6)
    for func, args in [(aten.view.default, (x, [24])), (aten.add_.Tensor, (x, x)),
                       (aten.bernoulli.default, (x,)), (aten.t.default, (x,))]:
        out = meta_memo.call(func, args, {})
        assert out is not None
        assert not meta_memo.cacheable(func)
    # an argument the memo cannot describe (a CPU tensor): the kernel runs, nothing is kept
    size = meta_memo.entries()
    meta_memo.call(aten.mul.Tensor, (torch.ones(3), torch.ones(3)), {})
    assert meta_memo.entries() == size


def test_a_factory_op_follows_the_default_dtype():
    made = [meta_memo.call(aten.arange.default, (5,), {"device": torch.device("meta")})]
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        made.append(meta_memo.call(aten.arange.start, (0.0, 5.0),
                                   {"device": torch.device("meta")}))
        made.append(meta_memo.call(aten.full.default, ([2], 1.5),
                                   {"device": torch.device("meta")}))
    finally:
        torch.set_default_dtype(old)
    made.append(meta_memo.call(aten.full.default, ([2], 1.5), {"device": torch.device("meta")}))
    assert [t.dtype for t in made] == [torch.int64, torch.float64, torch.float64, torch.float32]


def test_floats_ints_and_bools_are_different_keys():
    assert meta_memo.key_of(1.0) != meta_memo.key_of(1) != meta_memo.key_of(True)
    assert meta_memo.key_of(0.0) != meta_memo.key_of(-0.0)
    assert meta_memo.key_of(object()) is None


def test_an_analytical_profile_is_the_same_with_and_without_the_memo(monkeypatch):
    def graph():
        with torch.device("meta"):
            model = torchvision.models.resnet18()
        g = monetlike.profile(model, _meta(8, 3, 64, 64), cost="analytical:A100-40GB")
        d = g.to_dict()
        d["meta"].pop("profile_seconds")
        return d

    meta_memo.clear()
    with_memo = graph()
    assert meta_memo.entries() > 50  # the profile's meta calls went through the memo
    meta_memo.clear()
    monkeypatch.setattr(meta_memo, "ENABLED", False)
    without = graph()
    assert meta_memo.entries() == 0  # no call went through the memo
    assert without == with_memo
