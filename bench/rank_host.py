"""A rank's host work per step, without the GPU: decode the ring's batch, check, stage, unpack, answer, encode.

The rank's step loop around a graph set whose replays return their first outputs at once (the tiny preset's graph
set runs uncaptured on a CPU; its replays are replaced by a cached answer, so only the host's work is timed). Each
phase comes from the engine's and the graph set's stamps, as in bench/step_latency.py's timeline. On a CPU host the
"stage" phase includes the one host-to-device copy a CPU graph set does itself (a GPU's graphs copy their inputs).

    .venv/bin/python bench/rank_host.py [--rows 3] [--steps 600] [--out bench/results/rank_host_cpu.json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dspark_ray import contract as C                 # noqa: E402
from dspark_ray import records as M                 # noqa: E402
from dspark_ray.config import tiny                          # noqa: E402
from dspark_ray.engine import RankEngine                    # noqa: E402
from dspark_ray.modes import make_drafter                   # noqa: E402
from dspark_ray.recorders import StepMarks                  # noqa: E402
from dspark_ray.weights.loader import Checkpoint            # noqa: E402
from dspark_ray.weights.synth import synthesize             # noqa: E402
from tcp_roundtrip import _commit, _device, emit             # noqa: E402

# (phase, from stamp, to stamp): "loop_*" stamps are this script's, the rest the engine's and the graph set's.
PHASES = (("decode", "loop_got", "loop_decoded"), ("reset", "engine_in", "started"),
          ("stage", "started", "first_launch"), ("unpack", "synced", "ran"), ("finish", "ran", "engine_out"),
          ("encode", "engine_out", "loop_encoded"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=3)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = tiny()
    with tempfile.TemporaryDirectory() as ckpt:
        synthesize(cfg, ckpt, progress=False)
        marks = StepMarks()                             # the engine's and the graph set's stamps of a step
        eng = RankEngine(make_drafter(cfg, "tp1", ckpt=Checkpoint(ckpt)), 4, graphs=True, observer=marks)
    gs, cached = eng.graphs, {}
    replay = gs._replay

    def instant(g):                      # the first replay's outputs, every time after
        if id(g) not in cached:
            cached[id(g)] = replay(g)
        return cached[id(g)]
    gs._replay = instant

    width = cfg.n_taps * cfg.hidden_size
    taps = np.random.default_rng(0).standard_normal((a.rows, width)).astype(np.float16)
    ids = np.arange(a.rows)
    phases: dict[str, list[int]] = {k: [] for k, _, _ in PHASES}
    pos = 0
    for i in range(a.steps):
        resets = []
        if pos + a.rows >= cfg.max_model_len // 2:
            resets, pos = [0], 0
        e = C.make_entry(slot=0, generation=1, seed_token=5, start_pos=pos, token_ids=ids, taps=taps)
        view = memoryview(M.encode(M.RingBatch(resets, [M.RingEntry.of(e, (0, pos + a.rows))]))).toreadonly()
        row = {"loop_got": time.monotonic_ns()}
        batch = M.decode_batch(view)                    # what RankWorker._loop does with a ring slot
        row["loop_decoded"] = time.monotonic_ns()
        marks.row = {}
        results = eng.step(batch)
        row.update(marks.row)
        M.encode(M.RingReply(results))
        row["loop_encoded"] = time.monotonic_ns()
        pos += a.rows
        if i >= a.steps // 5:                           # the first fifth warms up
            for k, x, y in PHASES:
                phases[k].append(row[y] - row[x])
    res = {"bench": "rank_host", "command": "python bench/rank_host.py " + " ".join(sys.argv[1:]),
           "config": {"preset": "tiny", "rows": a.rows, "n_out": 5, "steps": a.steps},
           "device": _device(),
           "commit": _commit(),
           "phases_us": {k: {"p50": round(statistics.median(v) / 1e3, 2),
                             "p99": round(sorted(v)[int(0.99 * (len(v) - 1))] / 1e3, 2),
                             "min": round(min(v) / 1e3, 2)} for k, v in phases.items()}}
    res["host_p50_us"] = round(sum(p["p50"] for p in res["phases_us"].values()), 1)
    emit(res, a.out, indent=1)


if __name__ == "__main__":
    main()
