"""Profiler benchmark: how long a measured-cost profile takes, this tree against another commit.

    python scripts/bench_profile.py --against b290c55            # writes the "Profile" section
    python scripts/bench_profile.py --against HEAD~1 --models resnet18 --rounds 1 --no-write
    python scripts/bench_profile.py --against 59a8b31 --analytical  # the "Profile (analytical)"

Per model, `monetlike.profile(model, x)` with its defaults (measured costs, repeat=5, every Impl
measured) runs in a fresh interpreter for each tree, the two trees alternating round by round so
that load from other processes hits both alike; the table gives the median wall time of each and
their ratio, and checks that both graphs have the same fingerprint (the same Ops and Impls). The
other tree is a `git worktree` of `--against`, removed afterwards. One intra-op thread, as the
other CPU benchmarks. `--analytical`: analytical profiles instead (the model and its input on the
meta device, costs of an A100 preset), at the sizes of the zoo and of the README's first command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from bench_doc import header_with_commit, replace_section  # noqa: E402

MODELS = {
    "resnet18": ("torchvision.models.resnet18()", (32, 3, 64, 64)),
    "mobilenet_v2": ("torchvision.models.mobilenet_v2()", (16, 3, 64, 64)),
    "densenet121": ("torchvision.models.densenet121()", (8, 3, 64, 64)),
}

ANALYTICAL = {
    "resnet50": ("torchvision.models.resnet50()", (184, 3, 224, 224)),
    "googlenet": ("torchvision.models.googlenet(aux_logits=False, init_weights=False)",
                  (320, 3, 224, 224)),
    "densenet121": ("torchvision.models.densenet121()", (64, 3, 224, 224)),
}
COST = "analytical:A100-40GB"

_CHILD = """
import json, sys, time, torch, torchvision
import monetlike
torch.set_num_threads(1)
torch.manual_seed(0)
with torch.device({device!r}):
    model = {factory}
    x = torch.randn(*{shape})
start = time.perf_counter()
g = monetlike.profile(model, x, **{kwargs!r})
print(json.dumps({{"seconds": time.perf_counter() - start, "fingerprint": g.fingerprint,
                   "ops": len(g.ops), "impls": sum(len(op.impls) for op in g.ops),
                   "file": monetlike.__file__}}))
"""


def profile_once(tree: str, name: str, analytical: bool = False) -> dict:
    factory, shape = (ANALYTICAL if analytical else MODELS)[name]
    child = _CHILD.format(factory=factory, shape=shape, device="meta" if analytical else "cpu",
                          kwargs={"cost": COST} if analytical else {})
    env = dict(os.environ, PYTHONPATH=tree)
    r = subprocess.run([sys.executable, "-c", child],
                       capture_output=True, text=True, env=env, cwd=tree, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"profiling {name} in {tree} failed:\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if not out["file"].startswith(tree):
        raise RuntimeError(f"{tree}: imported monetlike from {out['file']}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", required=True, help="the commit to compare with")
    ap.add_argument("--analytical", action="store_true",
                    help=f"analytical profiles on the meta device ({COST})")
    ap.add_argument("--models", default=None, help="comma-separated (default: every one)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    models = ANALYTICAL if args.analytical else MODELS
    names = args.models.split(",") if args.models else list(models)
    unknown = sorted(set(names) - set(models))
    if unknown:
        ap.error(f"unknown models {unknown}; expected some of {sorted(models)}")
    other = tempfile.mkdtemp(prefix="bench_profile_")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", other, args.against],
                   check=True, capture_output=True)
    rev = subprocess.run(["git", "-C", other, "rev-parse", "--short", "HEAD"], check=True,
                         capture_output=True, text=True).stdout.strip()
    rows = []
    try:
        for name in names:
            runs = {"this tree": [], rev: []}
            for _ in range(args.rounds):
                for label, tree in (("this tree", ROOT), (rev, other)):
                    runs[label].append(profile_once(tree, name, args.analytical))
                    print(name, label, f"{runs[label][-1]['seconds']:.1f} s", flush=True)
            new = statistics.median(r["seconds"] for r in runs["this tree"])
            old = statistics.median(r["seconds"] for r in runs[rev])
            same = len({r["fingerprint"] for rs in runs.values() for r in rs}) == 1
            first = runs["this tree"][0]
            rows.append(f"| {name} {models[name][1]} | {first['ops']} | {first['impls']} | "
                        f"{old:.1f} | {new:.1f} | {new / old:.2f} | "
                        f"{'yes' if same else 'no'} |")
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", other],
                       capture_output=True)
    body = "\n".join([
        header_with_commit("bench_profile.py", argv if argv is not None else sys.argv[1:]),
        "",
        (f"`monetlike.profile(model, x, cost={COST!r})`, the model and its input on the meta "
         f"device" if args.analytical else
         "`monetlike.profile(model, x)` with its defaults (measured costs, repeat=5, every Impl "
         "measured)")
        + f", one thread, wall time, median of {args.rounds} runs per tree, the trees "
        f"alternating, each run in a fresh interpreter.",
        "",
        f"| model (input) | ops | Impls | {rev} s | this tree s | ratio | same fingerprint |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ])
    print(body)
    if not args.no_write:
        replace_section("profile-analytical" if args.analytical else "profile", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
