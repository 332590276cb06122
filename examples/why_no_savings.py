"""The forum case: "checkpointing does not reduce my memory".

A small CNN on 19x22 inputs with a large Linear head. Its weights, their gradients and the
optimizer state dwarf the activations, so no recomputation schedule can help; `explain` says so
and why. The model is built on the meta device: nothing is allocated, whatever its size.

    python examples/why_no_savings.py
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from monetlike.explain import explain


class ForumCNN(nn.Module):
    """Two small convs on a 19x22 map, then a large fully connected head."""

    def __init__(self, channels: int = 64, hidden: int = 8192, classes: int = 1000):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU())
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(channels * 19 * 22, hidden), nn.ReLU(),
                                  nn.Linear(hidden, classes))

    def forward(self, x):
        return self.head(self.features(x))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32, help="batch size")
    ap.add_argument("--hidden", type=int, default=8192, help="width of the large Linear layer")
    ap.add_argument("--optimizer", default="adam", choices=("none", "sgd", "adam"),
                    help="optimizer whose state counts")
    ap.add_argument("--plot", default=None, help="write the memory plot here")
    args = ap.parse_args(argv)
    with torch.device("meta"):
        model = ForumCNN(hidden=args.hidden)
        x = torch.randn(args.batch, 1, 19, 22)
    ex = explain(model, x, optimizer=None if args.optimizer == "none" else args.optimizer)
    print(ex.report())
    if args.plot:
        ex.plot(args.plot)
    return ex


if __name__ == "__main__":
    main()
