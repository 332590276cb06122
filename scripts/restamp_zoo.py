"""Re-stamp the zoo's fingerprints after a change to what the fingerprint covers; never re-solve.

    python scripts/restamp_zoo.py            # every entry
    python scripts/restamp_zoo.py --check    # say what would change, write nothing

When the fingerprint starts to cover more of the graph (issue 23 added parameter and buffer
shapes and dtypes), every stored schedule keeps a fingerprint of the old kind and the zoo's replay
test refuses it. Solving the zoo again would take hours and change its schedules; this script only
proves that each entry's schedule is still for today's graph and records the new fingerprint:
1. each entry's model is profiled again as the zoo built it (analytical costs, meta device);
2. the hash of that graph's structure *without the newly covered part* must equal the entry's
   recorded fingerprint: the graph is otherwise identical (else: rebuild that entry with
   scripts/build_zoo.py; this script refuses);
3. the simulator replays the schedule on the new graph and must give the entry's recorded peak
   and time;
4. the schedule file gets the new fingerprint and graph summary, the index the new fingerprint
   (both written atomically). Decisions, budgets, predictions: untouched.
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
from solver.graph import atomic_write_text, fingerprint_of  # noqa: E402
from solver.schedule import Schedule  # noqa: E402

OUT = os.path.join(ROOT, "schedules")
# Parts of the fingerprint structure added since the zoo's fingerprints were taken.
NEW_PARTS = ("params",)


def restamp(folder: str = OUT, *, write: bool = True) -> tuple[list[str], list[str]]:
    """Re-stamp every entry under `folder` that passes the checks; return (one line per entry,
    the names refused because their graph changed beyond NEW_PARTS or their replay differs)."""
    index_path = os.path.join(folder, "index.json")
    with open(index_path, encoding="utf-8") as f:
        index = json.load(f)
    graphs: dict = {}
    lines, schedules, refused = [], {}, []
    for e in index["entries"]:
        key = (e["model"], e["batch"], tuple(e["input_shape"]), e["cost_provenance"])
        if key not in graphs:
            x = torch.randn(e["batch"], *e["input_shape"], device="meta")
            graphs[key] = profile(build_model(e["model"]), x, cost=e["cost_provenance"])
        g = graphs[key]
        old_kind = {k: v for k, v in g.fingerprint_structure().items() if k not in NEW_PARTS}
        path = os.path.join(folder, f"{e['name']}.json")
        sched = Schedule.load(path)
        if sched.fingerprint == g.fingerprint == e["fingerprint"]:
            if sched.graph_summary != g.summary():  # the summary gained a fact: record it
                schedules[path] = dataclasses.replace(sched, graph_summary=g.summary())
                lines.append(f"{e['name']}: fingerprint {g.fingerprint}, summary updated")
            else:
                lines.append(f"{e['name']}: already {g.fingerprint}")
            continue
        if not (fingerprint_of(old_kind) == e["fingerprint"] == sched.fingerprint):
            refused.append(e["name"])
            lines.append(f"{e['name']}: REFUSED: today's graph differs from the one it was solved "
                         f"for beyond {NEW_PARTS} (old-kind hash {fingerprint_of(old_kind)}, "
                         f"entry {e['fingerprint']}); rebuild it with scripts/build_zoo.py")
            continue
        new = dataclasses.replace(sched, fingerprint=g.fingerprint, graph_summary=g.summary())
        tl = solver.simulate(g, new)
        # The time as tests/test_zoo.py compares it (summation order may move the last bit).
        if (tl.peak_bytes != e["predicted_peak_bytes"]
                or abs(tl.total_time - e["predicted_time"]) > 1e-12 * e["predicted_time"]):
            refused.append(e["name"])
            lines.append(f"{e['name']}: REFUSED: replay gives peak {tl.peak_bytes} and time "
                         f"{tl.total_time}, the entry records {e['predicted_peak_bytes']} and "
                         f"{e['predicted_time']}; rebuild it with scripts/build_zoo.py")
            continue
        schedules[path] = new
        lines.append(f"{e['name']}: {e['fingerprint']} -> {g.fingerprint} (replay equal)")
        e["fingerprint"] = g.fingerprint
    if write and schedules:
        for path, new in schedules.items():
            new.save(path)
        atomic_write_text(index_path, json.dumps(index, indent=1))
    return lines, refused


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="report only; write nothing")
    args = ap.parse_args(argv)
    lines, refused = restamp(write=not args.check)
    for line in lines:
        print(line, flush=True)
    if refused:
        print(f"{len(refused)} entries refused (left as they were): {', '.join(refused)}",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
