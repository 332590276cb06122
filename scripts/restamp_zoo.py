"""Re-stamp the zoo after a change to what the graph records; never re-solve.

    python scripts/restamp_zoo.py                # every entry
    python scripts/restamp_zoo.py --check        # say what would change, write nothing
    python scripts/restamp_zoo.py --repredict    # also accept (and record) new predictions

Two kinds of change leave a stored schedule valid but refused by the zoo's replay test:
- the fingerprint covers more of the graph (issue 23 added parameter and buffer shapes and
  dtypes: NEW_PARTS);
- the profiler offers new Impls (NEW_IMPLS: issue 22's split backwards), appended after every
  Impl an Op had, so a schedule's Impl indices still name the Impls it was solved with.
Solving the zoo again would take hours and change its schedules; this script only proves that
each entry's schedule is still for today's graph and records the new fingerprint:
1. each entry's model is profiled again as the zoo built it (analytical costs, meta device);
2. the hash of that graph's structure *without the newly covered parts and Impls* must equal the
   entry's recorded fingerprint, and every new Impl must come after the old ones: the graph is
   otherwise identical (else: rebuild that entry with scripts/build_zoo.py; this script refuses);
3. the simulator replays the schedule on the new graph and must give the entry's recorded peak
   and time; with --repredict (an Impl's bytes or costs changed: issue 22's 1-bit masks) it may
   give others, which are recorded, provided the peak is still within the entry's budget (the
   store-all figures are recorded again too, and the MIP gap, which was relative to the old
   costs, is dropped);
4. the schedule file gets the new fingerprint and graph summary, the index the new fingerprint
   (both written atomically). Decisions and budgets: untouched. The new Impls go unused by a
   re-stamped entry: only a rebuild (scripts/build_zoo.py) can choose them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import solver  # noqa: E402
from monetlike.modelspec import build_model  # noqa: E402
from monetlike.profile import profile  # noqa: E402
from monetlike.zoo import ZooEntry, example_batch  # noqa: E402
from solver.graph import fingerprint_of  # noqa: E402
from solver.jsonio import atomic_write_text  # noqa: E402
from solver.schedule import Schedule  # noqa: E402

OUT = os.path.join(ROOT, "schedules")
# Parts of the fingerprint structure added since the zoo's fingerprints were taken.
NEW_PARTS: tuple[str, ...] = ()  # every entry has carried "params" since issue 23's re-stamp
# Since the last re-stamp (which took the split backwards in): recompute_internals on
# hand-written matmuls (the transformer's attention) and on exported attention
# (aten.scaled_dot_product_attention: GPT-2, Llama), dropout_regen on exported dropouts
# (aten.dropout). No zoo graph had either on another Op: no nn.MultiheadAttention, RNN or
# fx-traced SDPA among them, and the fx graphs' nn.Dropout entries were stamped with it.
NEW_IMPLS = ("recompute_internals", "dropout_regen")


def old_kind(structure: dict) -> dict | None:
    """The structure as the zoo's fingerprints were taken: without NEW_PARTS and NEW_IMPLS; None
    when a new Impl sits before an old one (old Impl indices would then point elsewhere)."""
    out = {k: v for k, v in structure.items() if k not in NEW_PARTS}
    ops = []
    for op in out["ops"]:
        impls = op[-1]
        new = [i for i, im in enumerate(impls) if im[0] in NEW_IMPLS]
        if new and new != list(range(len(impls) - len(new), len(impls))):
            return None
        ops.append(op[:-1] + [[im for im in impls if im[0] not in NEW_IMPLS]])
    out["ops"] = ops
    return out


def _replays(tl, e: dict) -> bool:
    """The replay `tl` gives the entry's recorded peak and time (the time as tests/test_zoo.py
    compares it: summation order may move the last bit)."""
    return (tl.peak_bytes == e["predicted_peak_bytes"]
            and abs(tl.total_time - e["predicted_time"]) <= 1e-12 * e["predicted_time"])


def restamp(folder: str = OUT, *, write: bool = True, repredict: bool = False
            ) -> tuple[list[str], list[str]]:
    """Re-stamp every entry under `folder` that passes the checks; return (one line per entry,
    the names refused because their graph changed beyond NEW_PARTS and NEW_IMPLS, or their
    replay differs (with `repredict`: peaks above the budget))."""
    index_path = os.path.join(folder, "index.json")
    with open(index_path, encoding="utf-8") as f:
        index = json.load(f)
    graphs: dict = {}
    lines, schedules, refused = [], {}, []
    for e in index["entries"]:
        key = (e["model"], e["batch"], tuple(e["input_shape"]), e["cost_provenance"])
        if key not in graphs:
            with torch.device("meta"):
                model = build_model(e["model"])
            # The batch the entry was solved for (a transformers model's own keyword batch).
            x = example_batch(ZooEntry.from_dict(e, "index"), model)
            graphs[key] = profile(model, x, cost=e["cost_provenance"])
        g = graphs[key]
        old = old_kind(g.fingerprint_structure())
        old_hash = None if old is None else fingerprint_of(old)
        path = os.path.join(folder, f"{e['name']}.json")
        sched = Schedule.load(path)
        current = sched.fingerprint == g.fingerprint == e["fingerprint"]
        if current and sched.graph_summary == g.summary() and _replays(
                solver.simulate(g, sched), e):
            lines.append(f"{e['name']}: already {g.fingerprint}")
            continue
        if not current and not (old_hash == e["fingerprint"] == sched.fingerprint):
            refused.append(e["name"])
            lines.append(f"{e['name']}: REFUSED: today's graph differs from the one it was solved "
                         f"for beyond {NEW_PARTS} and {NEW_IMPLS} (old-kind hash {old_hash}, "
                         f"entry {e['fingerprint']}); rebuild it with scripts/build_zoo.py")
            continue
        new = dataclasses.replace(sched, fingerprint=g.fingerprint, graph_summary=g.summary())
        tl = solver.simulate(g, new)
        same = _replays(tl, e)
        if not same and not (repredict and tl.peak_bytes <= e["budget_bytes"]):
            refused.append(e["name"])
            lines.append(f"{e['name']}: REFUSED: replay gives peak {tl.peak_bytes} and time "
                         f"{tl.total_time}, the entry records {e['predicted_peak_bytes']} and "
                         f"{e['predicted_time']} (budget {e['budget_bytes']}); rebuild it with "
                         f"scripts/build_zoo.py")
            continue
        if same:
            lines.append(f"{e['name']}: {e['fingerprint']} -> {g.fingerprint} (replay equal)")
        else:
            new = dataclasses.replace(new, predicted_peak_bytes=tl.peak_bytes,
                                      predicted_time=tl.total_time)
            store = solver.simulate(g, solver.store_all_schedule(g))
            lines.append(f"{e['name']}: {e['fingerprint']} -> {g.fingerprint}, predicted peak "
                         f"{e['predicted_peak_bytes']} -> {tl.peak_bytes}, time "
                         f"{e['predicted_time']:.6g} -> {tl.total_time:.6g}")
            e.update(predicted_peak_bytes=tl.peak_bytes, predicted_time=tl.total_time,
                     store_all_time=store.total_time, store_all_peak_bytes=store.peak_bytes,
                     mip_gap=None)
        schedules[path] = new
        e["fingerprint"] = g.fingerprint
    if write and schedules:
        for path, new in schedules.items():
            new.save(path)
        atomic_write_text(index_path, json.dumps(index, indent=1))
    return lines, refused


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="report only; write nothing")
    ap.add_argument("--repredict", action="store_true",
                    help="accept a replay that differs from the entry's predictions when its "
                         "peak is within the budget, and record the new predictions")
    args = ap.parse_args(argv)
    lines, refused = restamp(write=not args.check, repredict=args.repredict)
    for line in lines:
        print(line, flush=True)
    if refused:
        print(f"{len(refused)} entries refused (left as they were): {', '.join(refused)}",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
