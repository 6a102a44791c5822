"""A step with its graph launched ahead against a step that launches it: one process, one card (GPU only).

`GraphSet.launch_ahead` launches the next step's graph while the rank waits for its STEP; the graph's upload polls
a pinned word until the step has staged its inputs (`kernels/host_copy.released_copy_bytes`). Here one graph set
(full preset, one request, n_out 5, 3 fresh rows a step as a decode round brings) runs rounds that alternate the
two ways in the same process and the same seconds: "launch" stages and launches the step graph when the step
comes; "ahead" had it launched right after the round before and only stages and releases it. Each round is timed
from the step's start (`GraphSet.run`) to its outputs read on the host, after `--gap-us` of host spin (a closed
loop's turnaround between two steps); the graph set's stamps split it into staging, launch (or release) and the
wait for the GPU. `tp1` is one card's graph set, `solo` a pair rank's shard with local stand-ins for the
collectives (the pair's launch, without a peer).

    python bench/launch_ahead.py --ckpt /tmp/full [--rounds 1000] [--gap-us 300] [--modes tp1,solo] [--out FILE]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.draft_step import _slots, log  # noqa: E402
from bench.graph_launch import us_stats  # noqa: E402
from bench.tcp_roundtrip import _commit, _device, emit  # noqa: E402

WAYS = ("launch", "ahead")
PIECES = {"step": ("run_in", "out"), "stage": ("run_in", "draft_staged"), "launch_or_release":
          ("draft_staged", "launched"), "gpu_wait": ("launched", "synced")}


def graph_set(mode: str, ckpt: str):
    """A minimal graph set that launches ahead, one slot filled from position 900,000."""
    from dspark_ray.collectives import LocalCollectives, SoloCollectives
    from dspark_ray.graphs import GraphSet
    from dspark_ray.kernels.gemm import use_matmul
    from dspark_ray.model.drafter import Drafter
    from dspark_ray.model.layout import Layout
    from dspark_ray.modes import read_rank
    from dspark_ray.weights.loader import Checkpoint
    use_matmul("fast")
    ck = Checkpoint(ckpt)
    tp, coll = (1, LocalCollectives(1)) if mode == "tp1" else (2, SoloCollectives(0))
    layout = Layout(ck.config, tp)
    d = Drafter(ck.config, [read_rank(ck, layout, 0, "cuda")], [layout.vocab_range(0)[0]], coll)
    gs = GraphSet(d, n_slots=2, max_requests=1, n_outs=(5,), insert_buckets=(8,), launch_ahead=True)
    gs.capture()
    return gs, _slots(gs, ck.config, 1, ck.config.sliding_window + 32, 900000)[0], ck.config


def time_rounds(mode: str, args) -> dict:
    from dspark_ray import workload
    from dspark_ray.stamps import now
    gs, slot, cfg = graph_set(mode, args.ckpt)
    log(f"{mode}: graph set captured")
    g = torch.Generator().manual_seed(1)
    taps = [workload.make_taps(cfg, 3, g) for _ in range(16)]
    got = {w: {p: [] for p in PIECES} for w in WAYS}
    warm = 100
    for i in range(2 * args.rounds + warm):
        way, next_way = WAYS[i % 2], WAYS[(i + 1) % 2]
        until = now() + args.gap_us * 1e3
        while now() < until:
            pass
        gs.run([(slot, slot.position, taps[i % 16])], [slot], [17 + i % 5], 5, False, host=True)
        st = {**gs.last_stamps, "out": now()}
        if next_way == "ahead":
            gs.launch_ahead()
        if i >= warm:
            for p, (a, b) in PIECES.items():
                got[way][p].append((st[b] - st[a]) / 1e3)
    gs.settle()
    torch.cuda.synchronize()
    res = {w: {p: us_stats(v) for p, v in r.items()} for w, r in got.items()}
    res["ahead_counts"] = dict(gs.ahead_counts)          # every "ahead" round took the graph launched for it
    assert res["ahead_counts"]["taken"] == args.rounds + warm // 2, res["ahead_counts"]
    res["ahead_minus_launch_step_p50_us"] = round(res["ahead"]["step"]["p50_us"] - res["launch"]["step"]["p50_us"],
                                                  1)
    log(f"{mode}: {res['ahead_minus_launch_step_p50_us']} us; launch {res['launch']['step']}, "
        f"ahead {res['ahead']['step']}")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", required=True, help="a full-preset checkpoint (bench/draft_step.py synthesizes one)")
    ap.add_argument("--rounds", type=int, default=1000, help="timed rounds of each way")
    ap.add_argument("--gap-us", type=float, default=300.0)
    ap.add_argument("--modes", default="tp1,solo")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("launch_ahead: needs a CUDA device", file=sys.stderr)
        return 2
    out = {"bench": "launch_ahead", "command": "python bench/launch_ahead.py " + " ".join(sys.argv[1:]),
           "config": {"preset": "full", "requests": 1, "n_out": 5, "rows": 3, "rounds": args.rounds,
                      "gap_us": args.gap_us},
           "device": f"{torch.cuda.get_device_name(0)}; host {_device()}", "commit": _commit()}
    for mode in args.modes.split(","):
        out[mode] = time_rounds(mode, args)
    emit(out, args.out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
