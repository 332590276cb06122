"""A training loop on generated data under a memory budget: one epoch, last batch partial.

    python examples/training.py --model resnet18 --batch 32 --image-size 64 --budget 150MiB
    python examples/training.py --model resnet50 --batch 184 --zoo resnet50_184_8GiB   # on a GPU

The schedule comes from the zoo (`--zoo NAME`, checked against the model) or is solved here with
measured costs (`--budget`) for the full batch. The data loader keeps its last, smaller batch
(no drop_last, as a real epoch does): the wrapper runs it with the same decisions, proven within
the budget by the simulator at that batch (NOTE [Smaller shapes] in monetlike/wrapper.py).
Each step prints its batch, loss, the measured peak of the step and the simulator's prediction.
"""

from __future__ import annotations

import argparse

import torch

import monetlike
from monetlike.modelspec import build_model


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet18", help="model factory, e.g. resnet18")
    ap.add_argument("--batch", type=int, default=16, help="batch size")
    ap.add_argument("--samples", type=int, default=None,
                    help="samples in the epoch (default 2.5 batches: the last batch is partial)")
    ap.add_argument("--image-size", type=int, default=64, help="input height and width")
    ap.add_argument("--classes", type=int, default=10, help="number of classes")
    ap.add_argument("--budget", default=None, help="memory budget, e.g. 150MiB (solved here)")
    ap.add_argument("--zoo", default=None, help="use this zoo schedule instead of solving")
    ap.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    ap.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(args.model, num_classes=args.classes).to(device)
    samples = args.samples or (5 * args.batch) // 2
    data = torch.utils.data.TensorDataset(
        torch.randn(samples, 3, args.image_size, args.image_size),
        torch.randint(0, args.classes, (samples,)))
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=True,
                                         drop_last=False)
    x_full = torch.randn(args.batch, 3, args.image_size, args.image_size, device=device)
    if args.zoo:
        wrapped = monetlike.ScheduleWrapper(model, monetlike.zoo.load(args.zoo, model))
    elif args.budget:
        wrapped = monetlike.optimize(model, x_full, budget=args.budget, cost="measured",
                                     optimizer="sgd")
    else:
        ap.error("give --budget or --zoo")
    budget = wrapped.schedule.budget_bytes
    print(f"schedule for batch {args.batch}, budget "
          f"{'-' if budget is None else f'{budget / 2**20:.1f} MiB'}; epoch of {samples} samples")
    opt = torch.optim.SGD(wrapped.parameters(), lr=args.lr, momentum=0.9)
    out = {"losses": [], "batches": [], "peaks": [], "predicted": []}
    for step, (x, y) in enumerate(loader):
        if args.steps is not None and step >= args.steps:
            break
        x, y = x.to(device), y.to(device)
        opt.zero_grad(set_to_none=True)
        losses = []

        def train_step():
            loss = torch.nn.functional.cross_entropy(wrapped(x), y)
            loss.backward()
            losses.append(loss.detach())

        # A new shape is checked (profiled on the meta device, replayed by the simulator) on
        # its first call: done here, so the measured step is the step alone.
        predicted = wrapped.schedule_for(x).predicted_peak_bytes
        m = monetlike.measure_step(train_step, warmup=0, repeat=1)
        opt.step()
        loss = losses[-1].item()
        for k, v in (("losses", loss), ("batches", len(x)), ("peaks", m.peak_bytes),
                     ("predicted", predicted)):
            out[k].append(v)
        print(f"step {step}: batch {len(x):3d}, loss {loss:.4f}, measured peak "
              f"{m.peak_bytes / 2**20:.1f} MiB, predicted {predicted / 2**20:.1f} MiB, "
              f"{m.seconds:.3f} s, start {m.start_bytes / 2**20:.1f}")
    return out


if __name__ == "__main__":
    main()
