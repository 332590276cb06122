"""A training loop on generated data under a memory budget.

    python examples/training.py --model resnet18 --batch 32 --image-size 64 --budget 150MiB
    python examples/training.py --model resnet50 --batch 184 --zoo resnet50_184_8GiB   # on a GPU

The schedule comes from the zoo (`--zoo NAME`, checked against the model) or is solved here with
measured costs (`--budget`). Each step prints the loss and, on the first step, the measured peak.
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
    ap.add_argument("--image-size", type=int, default=64, help="input height and width")
    ap.add_argument("--classes", type=int, default=10, help="number of classes")
    ap.add_argument("--budget", default=None, help="memory budget, e.g. 150MiB (solved here)")
    ap.add_argument("--zoo", default=None, help="use this zoo schedule instead of solving")
    ap.add_argument("--steps", type=int, default=3, help="training steps")
    ap.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(args.model, num_classes=args.classes).to(device)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size, device=device)
    y = torch.randint(0, args.classes, (args.batch,), device=device)
    if args.zoo:
        wrapped = monetlike.ScheduleWrapper(model, monetlike.zoo.load(args.zoo, model))
    elif args.budget:
        wrapped = monetlike.optimize(model, x, budget=args.budget, cost="measured",
                                     optimizer="sgd")
    else:
        ap.error("give --budget or --zoo")
    opt = torch.optim.SGD(wrapped.parameters(), lr=args.lr, momentum=0.9)
    losses = []
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)

        def train_step():
            loss = torch.nn.functional.cross_entropy(wrapped(x), y)
            loss.backward()
            return loss

        if step == 0:
            m = monetlike.measure_step(train_step, warmup=0, repeat=1)
            print(f"measured peak of one step: {m.peak_bytes / 2**20:.1f} MiB, {m.seconds:.3f} s")
            opt.zero_grad(set_to_none=True)
        loss = train_step()
        opt.step()
        losses.append(loss.item())
        print(f"step {step}: loss {loss.item():.4f}")
    return {"losses": losses}


if __name__ == "__main__":
    main()
