"""Dynamic shapes: optimize plans for the largest shape the user names (max_seq_len=,
max_batch=) and runs any shape up to it, each proven within the budget by the simulator."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import monetlike
from monetlike.max_shape import at_largest
from solver.errors import ScheduleMismatchError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.usefixtures("one_thread")


def test_at_largest_grows_rows_and_positions_by_repeating_them():
    ids = torch.arange(6).reshape(2, 3)
    out = at_largest({"input_ids": ids, "mask": torch.ones(2, 3), "scale": torch.ones(5)},
                     max_batch=3, max_seq_len=5)
    assert out["input_ids"].tolist() == [[0, 1, 2, 0, 1], [3, 4, 5, 3, 4], [0, 1, 2, 0, 1]]
    assert out["mask"].shape == (3, 5) and out["scale"].shape == (5,)
    with pytest.raises(ValueError, match="max_seq_len: expected an integer at least the "
                                         "example's 3"):
        at_largest(ids, max_seq_len=2)


def test_a_longer_sequence_within_the_planned_maximum_runs_exactly(tmp_path):
    T = pytest.importorskip("transformers")
    T.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = T.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=100,
                       use_cache=False)
    model = T.GPT2LMHeadModel(cfg).train()
    plain = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)

    def batch(seq):
        ids = torch.randint(0, 100, (2, seq), generator=g)
        return dict(input_ids=ids, attention_mask=torch.ones(2, seq, dtype=torch.long),
                    labels=ids.clone())

    first = batch(32)
    wrapped = monetlike.optimize(model, first, budget="95%", cost="analytical:A100-40GB",
                                 cache_dir=tmp_path, time_limit_s=10, max_seq_len=48)
    budget = wrapped.schedule.budget_bytes
    for b in (first, batch(48)):  # the first batch's length, then a longer one
        assert wrapped.schedule_for(**b).predicted_peak_bytes <= budget
        for m in (model, plain):
            m.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        wrapped(**b).loss.backward()
        torch.manual_seed(0)
        plain(**b).loss.backward()
        for (n, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
            assert torch.equal(p.grad, q.grad), n
    with pytest.raises(ScheduleMismatchError):
        wrapped(**batch(56))  # beyond the planned maximum
