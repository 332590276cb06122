"""ImageNet-style training with MONeT's arguments, on torchvision's FakeData (generated images).

    python examples/imagenet.py -a resnet18 --batch-size 16 --image-size 64 --schedule s.json
    python examples/imagenet.py -a resnet50 --batch-size 184 --schedule schedules/resnet50_184_8GiB.json

Without --schedule the model trains plainly; with it, through ScheduleWrapper (the schedule's
fingerprint is checked against the model and batch on the first step).
"""

from __future__ import annotations

import argparse
import time

import torch
import torchvision
import torchvision.transforms as T

import monetlike
import solver
from monetlike.modelspec import build_model


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-a", "--arch", default="resnet18", help="torchvision model name")
    ap.add_argument("--batch-size", type=int, default=16, help="batch size")
    ap.add_argument("--image-size", type=int, default=224, help="image height and width")
    ap.add_argument("--schedule", default=None, help="schedule JSON (from monetlike solve or zoo)")
    ap.add_argument("--steps", type=int, default=2, help="number of batches to train on")
    ap.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
    ap.add_argument("--workers", type=int, default=0, help="data loader workers")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    data = torchvision.datasets.FakeData(size=args.batch_size * args.steps,
                                         image_size=(3, args.image_size, args.image_size),
                                         num_classes=1000, transform=T.ToTensor())
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, drop_last=True,
                                         num_workers=args.workers)
    model = build_model(args.arch).to(device)
    net = monetlike.ScheduleWrapper(model, solver.Schedule.load(args.schedule)) \
        if args.schedule else model
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    losses = []
    for i, (images, target) in enumerate(loader):
        images, target = images.to(device), target.to(device)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(net(images), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        print(f"batch {i}: loss {loss.item():.4f}, {time.perf_counter() - start:.3f} s")
    return {"losses": losses}


if __name__ == "__main__":
    main()
