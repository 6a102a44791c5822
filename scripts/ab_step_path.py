"""A/B of the step path between two trees of the code, alternated in one call on one GPU host: the draft step
(bench/draft_step.py, one card, 1 and 4 requests) and the STEP round trip (bench/step_latency.py, one card, 1 and 4
requests), BEFORE then AFTER, `--rounds` times. Prints one JSON object: each figure's median over the rounds per
tree and the ratio after / before (within noise: 0.97-1.03).

    git archive <before-commit> | tar -x -C /tmp/before      # the tree before the change
    python scripts/ab_step_path.py --before /tmp/before --ckpt /tmp/full --out ab.json

Each tree runs its own benches with PYTHONPATH set to itself; run from the AFTER tree (default: this checkout).
Where one device call cannot hold enough rounds, a second call continues the first (`--resume first.json --first
after` runs A then B, so the drift of a warm machine falls on both trees).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
from bench import report  # noqa: E402


def run(tree: Path, args: list[str], out: Path) -> dict:
    # the tree first, the rest kept (a bundle's site folder), this checkout left out
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != HERE]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *rest])}
    cmd = [sys.executable, *args, "--out", str(out)]
    print(f"[ab] {tree.name}: {' '.join(args)}", file=sys.stderr, flush=True)
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def figures(tree: Path, a, scratch: Path, tag: str) -> dict:
    out: dict[str, float] = {}
    if "draft" in a.parts:        # (GPU only)
        d = run(tree, ["bench/draft_step.py", "--preset", a.preset, "--ckpt", a.ckpt, "--modes", "tp1", "--shapes",
                       "1,5 4,5", "--start", "900000", "--replays", str(a.replays)], scratch / f"draft_{tag}.json")
        for shape in ("1,5", "4,5"):
            out[f"draft_{shape}_p50_ms"] = d["tp1"]["draft"][shape]["p50_ms"]
    # a tree that knows spare ranks runs with --spare-ranks (default 0: like a tree from before them)
    spares = (["--spare-ranks", str(a.spare_ranks)]
              if "--spare-ranks" in (tree / "bench/step_latency.py").read_text() else [])
    for n in (1, 4) if "step" in a.parts else ():
        d = run(tree, ["bench/step_latency.py", "--preset", a.preset, "--ckpt", a.ckpt, "--tp", "1", "--requests",
                       str(n), "--rounds", str(a.step_rounds), *spares], scratch / f"step{n}_{tag}.json")
        out[f"step_R{n}_round_trip_p50_ms"] = d["target"]["round_trip_p50_ms"]
        out[f"step_R{n}_work_p50_ms"] = d["target"]["pair_work_p50_ms"]
    return out


def on_gpu() -> bool:
    import torch
    return torch.cuda.is_available()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, type=Path)
    ap.add_argument("--after", type=Path, default=HERE)
    ap.add_argument("--preset", default="full")
    ap.add_argument("--ckpt", default="/tmp/full")
    ap.add_argument("--rounds", type=int, default=3, help="before / after alternations")
    ap.add_argument("--replays", type=int, default=300, help="draft_step's timed replays a shape")
    ap.add_argument("--step-rounds", type=int, default=2000, help="step_latency's STEPs a run")
    ap.add_argument("--parts", default="draft,step", help="draft (GPU only), step, or both")
    ap.add_argument("--spare-ranks", type=int, default=0, help="for a tree whose step_latency knows them")
    ap.add_argument("--first", choices=("before", "after"), default="before", help="which tree runs first a round")
    ap.add_argument("--resume", type=Path, help="an earlier run's JSON whose runs this one adds to")
    ap.add_argument("--out")
    a = ap.parse_args()
    head = report.header(__file__, gpu="draft" in a.parts or on_gpu())
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    if a.resume:
        earlier = json.loads(a.resume.read_text())
        if earlier["device"] != head["device"]:
            sys.exit(f"--resume: {a.resume} ran on {earlier['device']}, this host has {head['device']}")
        runs = earlier["runs"]
    order = ("before", "after") if a.first == "before" else ("after", "before")
    with tempfile.TemporaryDirectory(prefix="dspark-ab-") as tmp:
        for i in range(len(runs["before"]), len(runs["before"]) + a.rounds):
            for side in order:
                tree = (a.before if side == "before" else a.after).resolve()
                runs[side].append(figures(tree, a, Path(tmp), f"{side}{i}"))
                print(f"[ab] {side} {i}: {json.dumps(runs[side][-1])}", file=sys.stderr, flush=True)
                report.save(summary(head, a, runs), a.out)     # a call cut short keeps its finished sides
    report.write(summary(head, a, runs), a.out)


def summary(head: dict, a, runs: dict[str, list[dict]]) -> dict:
    """The run's header, each figure's median per tree over its runs so far, and after / before where both have
    run."""
    med = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items() if rs}
    ratio = ({k: round(med["after"][k] / med["before"][k], 3) for k in med["before"] if med["before"][k]}
             if len(med) == 2 else {})
    return {**head, "before": str(a.before), "after": str(a.after),
            "rounds": len(runs["before"]), "spare_ranks": a.spare_ranks, "medians": med,
            "ratio_after_over_before": ratio, "runs": runs}


if __name__ == "__main__":
    main()
