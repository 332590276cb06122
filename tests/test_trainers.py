"""Drop-in for the trainers people use: Hugging Face Trainer (default arguments), Lightning and
accelerate each train 3 steps with the wrapped model exactly as with the plain one; the wrapper
keeps the model's forward signature (Trainer's column filter reads it), refuses a keyword the
schedule's graph did not take (num_items_in_batch) in words, and Trainer.save_model() writes a
GPT-2 with tied weights that reloads equal.

Recipe (Trainer): include `num_items_in_batch` (a 0-dim float tensor, as Trainer passes it) in the
example the schedule is made for, so that the loss normalised by it is part of the graph."""

from __future__ import annotations

import copy
import inspect
import os

import pytest
import torch
import torch.nn as nn

import monetlike
import solver
from solver.baselines import chen_sqrt_n
from solver.errors import ScheduleMismatchError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.usefixtures("one_thread")

S = 16


def _gpt2():
    T = pytest.importorskip("transformers")
    T.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = T.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=S, vocab_size=100,
                       use_cache=False)
    return T.GPT2LMHeadModel(cfg).train()


def _rows(n=12):
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, 100, (S,), generator=g)
        rows.append(dict(input_ids=ids, attention_mask=torch.ones(S, dtype=torch.long),
                         labels=ids.clone()))
    return rows


def _wrap_gpt2(model, example):
    graph = monetlike.profile(model, example, cost="analytical:A100-40GB", impls=False)
    result = solver.solve(graph, chen_sqrt_n(graph).predicted_peak_bytes, time_limit_s=10)
    assert result.schedule.predicted_peak_bytes < solver.simulate(
        graph, solver.store_all_schedule(graph)).peak_bytes  # it does recompute
    return monetlike.ScheduleWrapper(model, result.schedule, graph=graph)


def _trainer(model, out_dir, rows):
    T = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    # default arguments but for where it writes, the steps and the device
    args = T.TrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=4,
                               max_steps=3, report_to=[], save_strategy="no", use_cpu=True)
    return T.Trainer(model=model, args=args, train_dataset=rows)


def test_hf_trainer_with_default_arguments_trains_like_plain_and_saves(tmp_path):
    T = pytest.importorskip("transformers")
    rows = _rows()
    plain = _gpt2()
    _trainer(plain, tmp_path / "plain", rows).train()
    model = _gpt2()
    example = {k: torch.stack([r[k] for r in rows[:4]]) for k in rows[0]}
    wrapped = _wrap_gpt2(model, {**example, "num_items_in_batch": torch.tensor(60.0)})
    assert inspect.signature(wrapped.forward) == inspect.signature(model.forward)
    trainer = _trainer(wrapped, tmp_path / "wrapped", rows)
    trainer.train()
    for (n, p), (_, q) in zip(plain.named_parameters(), model.named_parameters()):
        assert torch.equal(p, q), n
    trainer.save_model(str(tmp_path / "saved"))  # GPT-2's lm_head is tied to its embedding
    loaded = T.GPT2LMHeadModel.from_pretrained(str(tmp_path / "saved"))
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    for (n, p), (_, q) in zip(loaded.named_parameters(), model.named_parameters()):
        assert torch.equal(p, q), n


def test_a_keyword_the_graph_did_not_take_is_refused_in_words():
    rows = _rows(4)
    model = _gpt2()
    example = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    wrapped = _wrap_gpt2(model, example)
    # equal to its default in the model's signature: the same call, accepted
    wrapped(**example, logits_to_keep=0).loss.backward()
    with pytest.raises(ScheduleMismatchError, match=r"forward was called with "
                                                    r"num_items_in_batch, which the example "
                                                    r"the schedule was made for did not pass"):
        wrapped(**example, num_items_in_batch=torch.tensor(60.0))


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 8 * 8, 4))


def _data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g))
            for _ in range(3)]


def _wrap_cnn(model, tmp_path):
    x = _data()[0][0]
    budget = chen_sqrt_n(monetlike.profile(model, x, cost="analytical:A100-40GB")
                         ).predicted_peak_bytes
    return monetlike.optimize(model, x, budget=budget, cost="analytical:A100-40GB",
                              cache_dir=tmp_path, time_limit_s=10)


def test_lightning_trains_like_plain(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")

    class Module(pl.LightningModule):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(net):
        trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=str(tmp_path))
        trainer.fit(Module(net), torch.utils.data.DataLoader(_data(), batch_size=None))

    plain, model = _cnn(), _cnn()
    fit(plain)
    fit(_wrap_cnn(model, tmp_path))
    _assert_same_state(plain, model)


def test_accelerate_trains_like_plain(tmp_path):
    accelerate = pytest.importorskip("accelerate")

    def fit(net):
        acc = accelerate.Accelerator(cpu=True)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        net, opt = acc.prepare(net, opt)
        for x, y in _data():
            opt.zero_grad()
            acc.backward(nn.functional.cross_entropy(net(x), y))
            opt.step()

    plain, model = _cnn(), _cnn()
    fit(plain)
    fit(_wrap_cnn(model, tmp_path))
    _assert_same_state(plain, model)


def _assert_same_state(plain: nn.Module, model: nn.Module) -> None:
    """Parameters and buffers bitwise equal after the same training."""
    for a, b in zip([*plain.parameters(), *plain.buffers()],
                    [*model.parameters(), *model.buffers()]):
        assert torch.equal(a, b)
