"""Chain combination against the ranked rule on the scale transformers, and against the MILP on
generated chains of a random block (solver/rules/chain.py; issue 20, item 2).

    python scripts/bench_chain.py --models gpt12,gpt24,gpt48 --fractions 0.5,0.33

Part 1, per model and budget (analytical A100-40GB costs, checkpoint mode, Impl 0): the chain
rule's answer and seconds, on the chain's segments (chain) and with runs of up to 2 and 3
segments as links too (runs2, runs3: a plan may recompute a boundary inside a run); the ranked
rule's prefix alone (its first fitting schedule) and with
its clean-up (`rules.keep_more`, cut at --clean-up-s, as `solve` runs it); the stage bound (with
its closure LP). Part 2: on --generated chains (solver_cases.random_repeated, 2-3 blocks of 1-3
ops, budgets drawn between the boundaries-only peak and store-all's, seeds from --first-seed),
how often the chain's answer on single segments, on runs of up to 2 (what solve's `chain/runs`
rule uses) and of up to 3 equals the monolithic MILP's proven optimum, and by how much the
runs of 3 are slower where they are not; then the same on chains whose boundaries cannot be
recomputed and whose blocks share no Value.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import solver  # noqa: E402
from solver import format_bytes, simulate, store_all_schedule  # noqa: E402
from solver.analysis import GraphFacts  # noqa: E402
from solver.rules.blocks import find_blocks  # noqa: E402
from solver.rules.chain import chain_schedule  # noqa: E402
from solver.rules.simple import ranked_schedule, schedule_from_keep  # noqa: E402
from solver.stage_bound import stage_bound  # noqa: E402


def _pct(seconds: float, base: float) -> float:
    return round(100 * (seconds / base - 1), 2)


def scale_rows(models, fractions, clean_up_s: float) -> list[dict]:
    from bench_solver_scale import profile

    rows = []
    for name in models:
        g = profile(name)
        facts = GraphFacts(g, "checkpoint")
        base = simulate(g, store_all_schedule(g))
        for fraction in fractions:
            budget = int(base.peak_bytes * fraction)
            row = {"model": name, "ops": len(g.ops), "fraction": fraction,
                   "budget": format_bytes(budget)}
            for longest, tag in ((1, "chain"), (2, "runs2"), (3, "runs3")):
                t = time.perf_counter()
                s = chain_schedule(g, budget, facts, longest=longest)
                row[f"{tag}_s"] = round(time.perf_counter() - t, 2)
                row[f"{tag}_pct"] = None if s is None else _pct(simulate(g, s).total_time,
                                                                base.total_time)
            t = time.perf_counter()
            s = ranked_schedule(g, budget, facts, deadline=t)
            row["ranked_prefix_s"] = round(time.perf_counter() - t, 2)
            row["ranked_prefix_pct"] = None if s is None else _pct(simulate(g, s).total_time,
                                                                   base.total_time)
            t = time.perf_counter()
            s = ranked_schedule(g, budget, facts, deadline=t + clean_up_s)
            row["ranked_s"] = round(time.perf_counter() - t, 2)
            row["ranked_pct"] = None if s is None else _pct(simulate(g, s).total_time,
                                                            base.total_time)
            row["stage_bound_pct"] = _pct(stage_bound(facts, budget), base.total_time)
            print(row, flush=True)
            rows.append(row)
    return rows


def generated_rows(n: int, fixed_boundaries: bool, first_seed: int = 0) -> dict:
    """The chain's answers against the MILP's proven optimum on n generated chains; with
    `fixed_boundaries`, boundaries that cannot be recomputed and only chains with no Value
    shared by the blocks (the family's two limits taken away)."""
    from solver_cases import random_repeated

    equal = {1: 0, 2: 0, 3: 0}
    slower, seed, done = [], first_seed, 0
    while done < n:
        rng = random.Random(seed)
        k, inner, frac = rng.randint(2, 3), rng.randint(1, 3), rng.random()
        g = random_repeated(random.Random(seed), k, inner, fixed_boundaries=fixed_boundaries)
        seed += 1
        facts = GraphFacts(g, "checkpoint")
        chain = find_blocks(g)
        if fixed_boundaries and chain.classes[0].broadcast:
            continue
        lo = simulate(g, schedule_from_keep(g, set().union(*chain.cuts), retain="saved",
                                            facts=facts)).peak_bytes
        hi = simulate(g, store_all_schedule(g)).peak_bytes
        budget = lo + int(frac * max(0, hi - lo))  # recomputing can need more than store-all
        r = solver.solve(g, budget, mode="checkpoint", time_limit_s=30, mip_gap=0)
        if r.status != "optimal":
            raise RuntimeError(f"seed {seed - 1}: the MILP did not prove its answer ({r.status})")
        done += 1
        for longest in equal:
            plan = chain_schedule(g, budget, facts, chain=chain, longest=longest)
            ours = simulate(g, plan).total_time if plan is not None else math.inf
            if ours <= r.predicted_time * (1 + 1e-9):
                equal[longest] += 1
            elif longest == 3:
                slower.append(100 * (ours / r.predicted_time - 1))
    return {"chains": n, "seeds": f"{first_seed}-{seed - 1}",
            "boundaries": "fixed, nothing shared" if fixed_boundaries else "free",
            "same_optimum_segments": equal[1], "same_optimum_runs2": equal[2],
            "same_optimum_runs3": equal[3], "runs3_slower": len(slower),
            "runs3_worst_pct": round(max(slower), 2) if slower else 0.0,
            "runs3_median_slower_pct": round(sorted(slower)[len(slower) // 2], 2)
            if slower else 0.0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt12,gpt24,gpt48")
    ap.add_argument("--fractions", default="0.5,0.33")
    ap.add_argument("--clean-up-s", type=float, default=90.0,
                    help="the ranked rule's clean-up limit (solve gives the rules 30%% of its "
                         "time limit: 90 s of 300 s)")
    ap.add_argument("--generated", type=int, default=60)
    ap.add_argument("--first-seed", type=int, default=0)
    args = ap.parse_args(argv)
    import pandas as pd

    from bench_doc import header
    from bench_solver import code_version, markdown_table

    commit = code_version()  # the code the rows come from, before anything runs
    models = [m for m in args.models.split(",") if m]
    fractions = [float(f) for f in args.fractions.split(",") if f]
    df = pd.DataFrame(scale_rows(models, fractions, args.clean_up_s))
    df = df.astype(object).where(df.notna(), "")
    gen = (pd.DataFrame([generated_rows(args.generated, fixed, args.first_seed)
                         for fixed in (False, True)]) if args.generated else None)
    command = "python scripts/bench_chain.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(header(command.strip()))
    print(f"Commit {commit}. Overheads (_pct) over store-all's predicted step time.\n")
    if models:
        print(markdown_table(df))
        print()
    if gen is not None:
        print(markdown_table(gen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
