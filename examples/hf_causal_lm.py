"""Fine-tune a Hugging Face causal LM under a memory budget, beside plain PyTorch and HF checkpointing.

    python examples/hf_causal_lm.py --model gpt2 --layers 2 --hidden 128 --heads 4 --vocab 1000 \
        --batch 8 --seq 128 --steps 4 --bf16
    python examples/hf_causal_lm.py --model llama_1b --layers 2 --hidden 256 --heads 8 --batch 4

The model is one of the named transformers shapes (monetlike.hf_models) (random init from its config,
nothing downloaded) with overrides; the batch is in the Hugging Face calling convention
(input_ids, attention_mask, labels, use_cache=False), so the loss is computed inside the model
and is part of the captured graph (torch.export; monetlike/capture/api.py). Three runs from the same
initial weights, each an AdamW loop (optionally under bf16 autocast):
- plain PyTorch;
- Hugging Face's own `gradient_checkpointing_enable()` (every decoder layer recomputed; called
  `activation_checkpointing_enable()` in transformers 5.x);
- `monetlike.optimize` at `--budget` (default: half-way between the sqrt(n) checkpointing
  baseline's predicted peak and store-all's), profiled with measured costs here.
For each it prints tokens per second (median step) and the step's peak tensor memory, counted by
storage on the CPU (monetlike.measure_step; on a GPU, the allocator's peak), and the final loss.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time

import torch

import monetlike
import monetlike.hf_models
from solver.baselines import chen_sqrt_n, store_all
from solver.units import format_bytes, parse_bytes


def _autocast(enabled: bool, device: str):
    return torch.autocast(device, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def _run(name: str, module, params, batch, steps: int, bf16: bool, device: str, lr: float) -> dict:
    opt = torch.optim.AdamW(params, lr=lr)

    def step():
        with _autocast(bf16, device):
            out = module(**batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.detach()

    torch.manual_seed(0)
    step()  # warm-up (the wrapper builds its plan; the optimizer makes its state)
    m = monetlike.measure_step(step, warmup=0, repeat=1)
    # The step's own peak (activations, gradients, the optimizer's temporaries) above what was
    # live before it, plus this run's parameters and optimizer state: other runs' models alive
    # in this process are not counted.
    state = {}
    for p in module.parameters():
        state.setdefault(p.untyped_storage()._cdata, p.untyped_storage().nbytes())
    for per_param in opt.state.values():
        for t in per_param.values():
            if isinstance(t, torch.Tensor):
                state.setdefault(t.untyped_storage()._cdata, t.untyped_storage().nbytes())
    peak = m.peak_bytes - m.start_bytes + sum(state.values())
    times, loss = [], None
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    tokens = batch["input_ids"].numel()
    return {"run": name, "tokens_per_s": tokens / statistics.median(times), "peak_bytes": peak,
            "loss": float(loss)}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2", choices=["gpt2", "gpt2_medium", "llama_1b"],
                    help="named causal-LM shape (monetlike.models)")
    ap.add_argument("--layers", type=int, default=2, help="number of layers (override)")
    ap.add_argument("--hidden", type=int, default=128, help="model width (override)")
    ap.add_argument("--heads", type=int, default=4, help="attention heads (override)")
    ap.add_argument("--vocab", type=int, default=1000, help="vocabulary size (override)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per batch")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run")
    ap.add_argument("--budget", default=None,
                    help="memory budget, e.g. 60MiB (default: half-way between the sqrt(n) "
                         "baseline's peak and store-all's)")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    ap.add_argument("--time-limit", type=float, default=30, help="solver time limit, seconds")
    args = ap.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    overrides = dict(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab,
                     positions=max(args.seq, 16))
    if args.model == "llama_1b":
        overrides.update(ffn=4 * args.hidden, kv_heads=max(1, args.heads // 4))
    base = monetlike.hf_models.hf_model(args.model, **overrides).to(device)
    batch = base.example_inputs(args.batch, args.seq, device=device)

    rows = []
    plain = copy.deepcopy(base)
    rows.append(_run("plain PyTorch", plain, plain.parameters(), batch, args.steps, args.bf16,
                     device, args.lr))
    del plain
    hf = copy.deepcopy(base)
    if hasattr(hf, "activation_checkpointing_enable"):  # its name from transformers 5.x on
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rows.append(_run("HF gradient checkpointing", hf, hf.parameters(), batch, args.steps,
                     args.bf16, device, args.lr))
    del hf

    ours = copy.deepcopy(base)
    with _autocast(args.bf16, device):  # the graph is profiled as it will run
        graph = monetlike.profile(ours, batch, cost="measured", repeat=1, optimizer="adamw")
    if args.budget is None:
        budget = (store_all(graph).predicted_peak_bytes
                  + chen_sqrt_n(graph).predicted_peak_bytes) // 2
    else:
        budget = parse_bytes(args.budget)
    with _autocast(args.bf16, device):
        wrapped = monetlike.optimize(ours, batch, budget=budget, cost="measured",
                                     optimizer="adamw", time_limit_s=args.time_limit)
    row = _run(f"monetlike at {format_bytes(budget)}", wrapped, wrapped.parameters(), batch,
               args.steps, args.bf16, device, args.lr)
    rows.append(row)

    print(f"{args.model} layers={args.layers} d={args.hidden} batch {args.batch} x {args.seq} "
          f"tokens, AdamW{', bf16 autocast' if args.bf16 else ''}, {device}; capture "
          f"{graph.meta['capture']}, {len(graph.ops)} ops")
    for r in rows:
        print(f"  {r['run']:<34} {r['tokens_per_s']:>10.0f} tokens/s   peak "
              f"{format_bytes(r['peak_bytes']):>12}   loss {r['loss']:.4f}")
    return rows


if __name__ == "__main__":
    main()
