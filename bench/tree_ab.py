"""One bench, two checkouts, alternating: what a change costs, measured in one sitting on one host.

Each run starts `python <tree>/<bench> <args>` in that tree (its own code first on PYTHONPATH), reads the JSON it
prints, and keeps the `--field`s (dotted paths into it); the trees alternate, and which goes first alternates too, so
drift of a shared host (other jobs, frequency) lands on both. Prints the per-run values and their medians.

    .venv/bin/python bench/tree_ab.py --before /tmp/before --after . --runs 10 \\
        --field pieces.frontend_step_instant_pair.p50_us -- bench/host_path.py --n 5000
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tcp_roundtrip import _device, emit        # noqa: E402


def _get(d: dict, path: str):
    for k in path.split("."):
        d = d[k]
    return d


def run_once(tree: str, bench: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, *bench], cwd=tree, env=env, capture_output=True, text=True, check=True,
                         timeout=1800).stdout
    return json.loads(out[out.index("{"):])            # (a bench may print a line before its JSON)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="checkout of the code before the change")
    ap.add_argument("--after", required=True, help="checkout of the code after it")
    ap.add_argument("--runs", type=int, default=10, help="runs per tree")
    ap.add_argument("--field", action="append", required=True, help="dotted path of a number in the bench's JSON")
    ap.add_argument("--out")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- the bench script (relative to each tree) and args")
    a = ap.parse_args()
    bench = a.bench[1:] if a.bench[:1] == ["--"] else a.bench
    trees = {"before": os.path.abspath(a.before), "after": os.path.abspath(a.after)}
    runs, commits = [], {}
    for k in range(a.runs):
        for which in (("before", "after") if k % 2 == 0 else ("after", "before")):
            res = run_once(trees[which], bench)
            commits[which] = res.get("commit")
            runs.append({"tree": which, **{f: _get(res, f) for f in a.field}})
            print(json.dumps(runs[-1]), file=sys.stderr)
    result = {"bench": "tree_ab", "command": "python bench/tree_ab.py " + " ".join(sys.argv[1:]),
              "bench_command": " ".join(["python", *bench]), "trees": trees, "commits": commits,
              "median": {w: {f: statistics.median(r[f] for r in runs if r["tree"] == w) for f in a.field}
                         for w in ("before", "after")},
              "runs": runs, "device": _device()}
    emit(result, a.out, indent=2)


if __name__ == "__main__":
    main()
