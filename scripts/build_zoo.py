"""Build the schedule zoo: MONeT's models and batches at 5-10 GiB, a transformer, and two
Hugging Face transformers shapes (GPT-2 small, Llama-style 1B) at four budgets each.

    python scripts/build_zoo.py                         # everything (long: one solve per entry)
    python scripts/build_zoo.py --models resnet50 --budgets 8GiB --time-limit 120
    python scripts/build_zoo.py --models gpt2,llama_1b --time-limit 120   # their own budgets

Every entry is solved in full mode with analytical costs for a named GPU (stated in the entry),
checked by the simulator, and written as JSON into schedules/ with an index (schedules/index.json)
that `monetlike zoo` reads. Sizes follow MONeT: 3x224x224 inputs, UNet at 3x416x608 (MONeT's
UNet input), and MONeT's "GB", which are GiB (its solver converts with 1024^3). The transformers
shapes (monetlike.hf_models) make their own keyword batch (input_ids, attention_mask, labels; the
input shape is the sequence length) and have budgets of their own, spread between the least
feasible peak and store-all (HF_BUDGETS_GIB). Llama 3 8B and 70B are planned as one rank of FSDP2
on 8 and 64 H100s (FSDP_SHAPES; the budget per rank). Every model is built on the meta device: no
weights are allocated (a 1B model would take 5 GB of RAM). A rebuilt entry
replaces the old one only when its schedule is faster for the same graph and costs (a solve that
stops at its time limit may end worse than an earlier one); --force replaces it anyway.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import solver  # noqa: E402
from monetlike.modelspec import build_model  # noqa: E402
from monetlike.profile import profile  # noqa: E402
from monetlike.zoo import INDEX, ZooEntry, dominated, profile_settings  # noqa: E402
from solver.jsonio import atomic_write_text  # noqa: E402

# name -> (factory as given to the CLI, batch, input shape)
MODELS = {
    "resnet50": ("torchvision.models.resnet50", 184, (3, 224, 224)),
    "googlenet": ("torchvision.models.googlenet", 320, (3, 224, 224)),
    "unet": ("monetlike.models.unet", 11, (3, 416, 608)),
    "mobilenet_v2": ("torchvision.models.mobilenet_v2", 272, (3, 224, 224)),
    "vgg16": ("torchvision.models.vgg16", 176, (3, 224, 224)),
    "transformer": ("monetlike.models.transformer", 24, (512, 768)),
    # Hugging Face shapes: batch x 1024 tokens (input shape = sequence length).
    "gpt2": ("monetlike.models.gpt2", 8, (1024,)),
    "llama_1b": ("monetlike.models.llama_1b", 4, (1024,)),
    # One rank of FSDP2 (FSDP_SHAPES): batch 1 x 8192 tokens per rank.
    "llama3_8b": ("monetlike.models.llama3_8b", 1, (8192,)),
    "llama_70b": ("monetlike.models.llama_70b", 1, (8192,)),
}
# Planned as one rank of FSDP2 as torchtitan trains them (every decoder layer a fully_shard unit
# and the root, bf16 parameters, AdamW state, the model's own loss) on H100s: name -> the
# ZooEntry's fsdp, optimizer, loss and cost.
FSDP_SHAPES = {
    "llama3_8b": dict(fsdp={"world_size": 8, "param_dtype": "bfloat16"}, optimizer="adam",
                      loss="model", cost="analytical:H100-80GB"),
    "llama_70b": dict(fsdp={"world_size": 64, "param_dtype": "bfloat16"}, optimizer="adam",
                      loss="model", cost="analytical:H100-80GB"),
}
BUDGETS_GIB = (5, 6, 7, 8, 9, 10)
# Budgets of the transformers shapes: four, spread from just above the least feasible peak to
# just below store-all (analytical A100-40GB, no optimizer state; see docs/BENCHMARKS.md, Zoo).
HF_BUDGETS_GIB = {"gpt2": (8, 10, 12, 14), "llama_1b": (16, 19, 22, 25),
                  # per rank, within an H100's 80 GB, above per-block checkpointing's peak
                  # (33.6 and 52.3 GiB; docs/BENCHMARKS.md, FSDP shapes)
                  "llama3_8b": (60,), "llama_70b": (70,)}
DEFAULT_COST = "analytical:A100-40GB"
OUT = os.path.join(ROOT, "schedules")


def keeps(old: dict | None, graph, new_time: float) -> bool:
    """The index entry `old` stays: it was made for the same graph and costs, and its schedule
    is at least as fast as the new one (`new_time`, simulated seconds)."""
    return (old is not None and old["fingerprint"] == graph.fingerprint
            and old["cost_provenance"] == graph.cost_provenance
            and old["predicted_time"] <= new_time)


def example_batch(model, batch: int, shape):
    """The profile's input on the meta device: the model's own keyword batch when it makes one
    (shape = (seq_len,)), else one float tensor of shape (batch, *shape)."""
    if callable(getattr(model, "example_inputs", None)):
        return model.example_inputs(batch, shape[0] if len(shape) == 1 else None, device="meta")
    return torch.randn(batch, *shape, device="meta")


def build(names, budgets_gib, cost, time_limit, backend, force=False):
    """budgets_gib: the budgets for every model, or None for each model's own (BUDGETS_GIB,
    HF_BUDGETS_GIB)."""
    index_path = os.path.join(OUT, INDEX)
    entries = {}
    if os.path.exists(index_path):
        for e in json.load(open(index_path))["entries"]:
            entries[e["name"]] = e
    jobs = [(n, b) for n in names
            for b in (budgets_gib or HF_BUDGETS_GIB.get(n, BUDGETS_GIB))]
    bar = tqdm(jobs, disable=not sys.stderr.isatty(), desc="zoo")
    graphs = {}
    for name, gib in bar:
        spec, batch, shape = MODELS[name]
        settings = FSDP_SHAPES.get(name, {})
        if name not in graphs:
            with torch.device("meta"):  # shapes only: nothing allocated, no init time
                model = build_model(spec)
            graphs[name] = profile(model, example_batch(model, batch, shape),
                                   cost=settings.get("cost", cost), **profile_settings(
                                       model, **{k: v for k, v in settings.items()
                                                 if k != "cost"}))
        g = graphs[name]
        base = solver.simulate(g, solver.store_all_schedule(g))
        budget = gib * 2**30
        entry_name = f"{name}_{batch}_{gib}GiB"
        bar.set_postfix_str(entry_name)
        start = time.perf_counter()
        try:
            r = solver.solve(g, budget, mode="full", backend=backend, time_limit_s=time_limit)
        except solver.InfeasibleBudgetError as e:
            print(f"{entry_name}: infeasible: {e}", flush=True)
            continue
        if r.schedule is None:
            print(f"{entry_name}: {r.status}: {r.message}", flush=True)
            continue
        tl = solver.simulate(g, r.schedule)
        assert tl.peak_bytes == r.predicted_peak_bytes <= budget, entry_name
        old = entries.get(entry_name)
        if not force and keeps(old, g, tl.total_time):
            pct = [100 * (t / base.total_time - 1) for t in (old["predicted_time"], tl.total_time)]
            print(f"{entry_name}: kept the entry ({pct[0]:.2f}% over store-all; this solve "
                  f"{pct[1]:.2f}%)", flush=True)
            continue
        r.schedule.save(os.path.join(OUT, f"{entry_name}.json"))
        entries[entry_name] = ZooEntry(
            name=entry_name, model=spec, batch=batch, input_shape=tuple(shape),
            budget_bytes=budget, predicted_peak_bytes=tl.peak_bytes,
            predicted_time=tl.total_time, store_all_time=base.total_time,
            store_all_peak_bytes=base.peak_bytes, mode="full", status=r.status,
            mip_gap=r.mip_gap, cost_provenance=g.cost_provenance,
            fingerprint=g.fingerprint,
            **{k: v for k, v in settings.items() if k != "cost"}).to_dict()
        print(f"{entry_name}: {r.status}, peak {tl.peak_bytes / 2**30:.2f} GiB, overhead "
              f"{100 * (tl.total_time / base.total_time - 1):.2f}%, gap "
              f"{'-' if r.mip_gap is None else f'{100 * r.mip_gap:.2f}%'}, "
              f"{time.perf_counter() - start:.0f} s", flush=True)
        # Rewrite the index after every entry, so an interrupted build keeps what it made.
        atomic_write_text(index_path, json.dumps(
            {"format": "monetlike.zoo-index", "entries": sorted(entries.values(),
                                                                key=lambda e: e["name"])},
            indent=1))


def take_smaller_plans(out_dir: str = OUT) -> list[str]:
    """Every entry a smaller-budget entry of the same graph beats (monetlike.zoo.dominated)
    takes that entry's plan, stamped with its own budget: the plan fits, and it is faster than
    what this budget's solve returned, so that solve's status was not the truth. The entry is
    relabelled feasible-at-time-limit with no gap (its own bound no longer describes it).
    Returns the names changed."""
    index_path = os.path.join(out_dir, INDEX)
    data = json.load(open(index_path))
    by_name = {e["name"]: e for e in data["entries"]}
    changed = []
    for e, smaller in dominated([ZooEntry.from_dict(d, d["name"]) for d in data["entries"]]):
        plan = solver.Schedule.load(os.path.join(out_dir, f"{smaller.name}.json"))
        plan = dataclasses.replace(plan, budget_bytes=e.budget_bytes, meta={
            **plan.meta, "taken_from": f"{smaller.name}: a plan within a smaller budget, faster "
                                       f"than this budget's own solve"})
        plan.save(os.path.join(out_dir, f"{e.name}.json"))
        by_name[e.name].update(predicted_peak_bytes=smaller.predicted_peak_bytes,
                               predicted_time=smaller.predicted_time,
                               status="feasible-at-time-limit", mip_gap=None)
        changed.append(e.name)
    if changed:
        atomic_write_text(index_path, json.dumps(
            {"format": "monetlike.zoo-index", "entries": sorted(by_name.values(),
                                                                key=lambda e: e["name"])},
            indent=1))
    return changed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated model names")
    ap.add_argument("--budgets", default=None,
                    help="comma-separated budgets in GiB (default: each model's own, "
                         f"{','.join(map(str, BUDGETS_GIB))} for MONeT's models)")
    ap.add_argument("--cost", default=DEFAULT_COST, help="analytical:DEVICE cost model")
    ap.add_argument("--time-limit", type=float, default=300.0, help="seconds per solve")
    ap.add_argument("--backend", default="highs", help="MILP backend")
    ap.add_argument("--force", action="store_true",
                    help="replace an entry even when the new schedule is not faster")
    args = ap.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        ap.error(f"unknown models {unknown}; choose from {sorted(MODELS)}")
    budgets = None if args.budgets is None else \
        [int(b.lower().replace("gib", "")) for b in args.budgets.split(",") if b]
    from monetlike.cli import interruptible

    # Ctrl-C ends the build at once (HiGHS would run on to its time limit): every entry is
    # written, with the index, as it is finished, so those made so far stay.
    with interruptible("build_zoo", "entries finished so far are kept"):
        build(names, budgets, args.cost, args.time_limit, args.backend, force=args.force)
    for name in take_smaller_plans():
        print(f"{name}: took the faster plan of a smaller budget (relabelled "
              f"feasible-at-time-limit)", flush=True)


if __name__ == "__main__":
    main()
