"""Memory-efficient DenseNet three ways: plain, torch.utils.checkpoint, and ours.

torchvision's `densenet121(memory_efficient=True)` checkpoints each dense layer's concat-BN-ReLU
bottleneck with `torch.utils.checkpoint` (the memory-efficient DenseNet trick). Ours solves a
schedule at the same memory with measured costs and runs it through ScheduleWrapper. The table
gives the measured peak and step time of each, and ours is checked to give the same gradients
as plain PyTorch before any saving is reported.

    python examples/densenet_efficient.py --batch 8 --image-size 64
"""

from __future__ import annotations

import argparse

import pandas as pd
import torch
import torchvision

import monetlike
from solver.units import format_bytes


def _step(net, x):
    def run():
        for p in net.parameters():
            p.grad = None
        net(x).sum().backward()
    return run


def _grads(net, x):
    _step(net, x)()
    return [p.grad.clone() for p in net.parameters()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8, help="batch size")
    ap.add_argument("--image-size", type=int, default=64, help="input height and width")
    ap.add_argument("--repeat", type=int, default=3, help="timed repeats per variant")
    ap.add_argument("--time-limit", type=float, default=60, help="solver seconds")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    plain = torchvision.models.densenet121(num_classes=10)
    efficient = torchvision.models.densenet121(num_classes=10, memory_efficient=True)
    efficient.load_state_dict(plain.state_dict())
    x = torch.randn(args.batch, 3, args.image_size, args.image_size)

    rows = []
    m_plain = monetlike.measure_step(_step(plain, x), repeat=args.repeat)
    rows.append(("plain PyTorch", m_plain))
    m_eff = monetlike.measure_step(_step(efficient, x), repeat=args.repeat)
    rows.append(("torch.utils.checkpoint (memory_efficient=True)", m_eff))

    ours_model = torchvision.models.densenet121(num_classes=10)
    ours_model.load_state_dict(plain.state_dict())
    # BatchNorm running statistics move with every step; compare gradients from equal states.
    ref_state = {k: v.clone() for k, v in plain.state_dict().items()}
    ours = monetlike.optimize(ours_model, x, budget=m_eff.peak_bytes, cost="measured",
                              time_limit_s=args.time_limit)
    ours_model.load_state_dict(ref_state)
    plain.load_state_dict(ref_state)
    for a, b in zip(_grads(ours, x), _grads(plain, x)):
        torch.testing.assert_close(a, b)
    m_ours = monetlike.measure_step(_step(ours, x), repeat=args.repeat)
    rows.append(("ours at the checkpoint peak (gradients checked)", m_ours))

    table = pd.DataFrame([{
        "variant": name, "peak": format_bytes(m.peak_bytes),
        "peak vs plain": f"{m.peak_bytes / m_plain.peak_bytes:.2f}x",
        "step (s)": f"{m.seconds:.3f}",
        "overhead": f"{100 * (m.seconds / m_plain.seconds - 1):+.1f}%"} for name, m in rows])
    print(table.to_string(index=False))
    return table


if __name__ == "__main__":
    main()
