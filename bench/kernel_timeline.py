"""Where one draft step's GPU time goes: every kernel of one graph replay (1 request, or `--requests`, n_out 5), in
order, with its start (us from the replay's first kernel) and duration, for one card (tp1) and for each rank of the
NVLink pair. GPU only (two cards for the pair); the full preset from `--ckpt`.

    python bench/kernel_timeline.py --ckpt /tmp/full --modes tp1,solo,pair \
        --out bench/results/gpu/kernel_timeline_1x5_h200x2.json

Per mode and rank: `run_us` (median host time of `GraphSet.run` over 300 free-running steps), `gpu_span_us` (first
kernel start to last kernel end of the profiled replay) and `kernels` ([name, start_us, duration_us]). The gaps
between kernels and the kernels that run beside each other (the side-stream branches) read straight off it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dspark_ray.kernels.fused_ops import pdl_capable  # noqa: E402


def _median_us(fn, n: int) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e6)
    return round(statistics.median(ts), 1)


def split_replays(ev: list, gap_us: float = 500.0) -> list[list]:
    """Profiler events (sorted by start) cut into replays at every gap of more than `gap_us` with nothing running;
    a replay's upload (a copy kernel or an HtoD memcpy) comes first in it."""
    reps, end = [], None
    for e in ev:
        if end is None or e.time_range.start - end > gap_us:
            reps.append([])
        reps[-1].append(e)
        end = max(end or e.time_range.end, e.time_range.end)
    return reps


def timeline(mode: str, rank: int, ckpt: str, start: int, coll=None, barrier=None, nvtx: bool = False,
             dense: str = "cublas", requests: int = 1, markov_cache: str = "auto") -> dict:
    """Capture a graph set of `requests` requests for this rank, then profile three replays and keep the last one's
    kernels. A pair rank meets its peer at `barrier` before each profiled replay, so both launch it at the same
    moment and a collective's time is its own, not the wait for a peer that launched later. `nvtx`: no profiler;
    one replay inside the NVTX range "ncu_replay", for Nsight Compute to time each of its kernels alone (see main's
    help). `dense`: the dense linears' kernel (`gemm.kernels_for`); `markov_cache`: the cached Markov bias rows, as
    `serve --markov-cache` sizes them (`Drafter.cache_markov_for`)."""
    from bench.draft_step import _slots
    from dspark_ray.comm.local import LocalCollectives
    from dspark_ray.graphs import GraphSet
    from dspark_ray.kernels.gemm import kernels_for
    from dspark_ray.model.drafter import Drafter
    from dspark_ray.model.layout import Layout
    from dspark_ray.modes import read_rank
    from dspark_ray.weights.loader import Checkpoint
    from torch.profiler import ProfilerActivity, profile
    kernels = kernels_for("fast", dense)
    ck = Checkpoint(ckpt)
    cfg = ck.config
    layout = Layout(cfg, 1 if mode == "tp1" else 2)     # solo: rank 0's shard of the pair, no collectives
    d = Drafter(cfg, [read_rank(ck, layout, rank, "cuda")], [layout.vocab_range(rank)[0]],
                coll or LocalCollectives(1), kernels=kernels)
    rows = d.cache_markov_for(markov_cache)
    gs = GraphSet(d, n_slots=requests + 1, max_requests=requests, n_outs=(5,), insert_buckets=(8, 128))
    gs.capture()
    states = _slots(gs, cfg, requests, cfg.sliding_window + 32, start)

    def step():
        gs.run([], states, [17 + i for i in range(requests)], 5, False)
    for _ in range(50):
        step()
    res = {"run_us": _median_us(step, 300), "markov_cache_rows": rows}
    if nvtx:
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("ncu_replay")
        step()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        return res
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            if barrier:
                barrier()
            step()
            torch.cuda.synchronize()
            time.sleep(0.002)                                 # a gap no replay has inside it
    ev = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    last = split_replays(ev)[-1]
    t0 = last[0].time_range.start
    res["gpu_span_us"] = round(max(e.time_range.end for e in last) - t0, 1)
    res["kernels"] = [[e.name[:70], round(e.time_range.start - t0, 2), round(e.time_range.elapsed_us(), 2)]
                      for e in last]
    res["grids"] = launch_grids(prof)
    return res


def launch_grids(prof) -> dict:
    """Each kernel's launch grids and block sizes in the profiled replays ({name: ["grid x,y,z / block x,y,z"]}),
    from the profiler's trace: how many programs a kernel ran (a GEMM's tile count, against the card's SMs)."""
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    grids: dict[str, set] = {}
    for e in trace.get("traceEvents", []):
        a = e.get("args") or {}
        if e.get("cat") == "kernel" and "grid" in a:
            grids.setdefault(e["name"][:70], set()).add(
                f"{','.join(map(str, a['grid']))} / {','.join(map(str, a.get('block', [])))}")
    return {k: sorted(v) for k, v in grids.items()}


def solo_timeline(ckpt: str, start: int, nvtx: bool = False, dense: str = "cublas", requests: int = 1,
                  markov_cache: str = "auto") -> dict:
    from dspark_ray.comm.solo import SoloCollectives
    return timeline("solo", 0, ckpt, start, SoloCollectives(0), nvtx=nvtx, dense=dense, requests=requests,
                    markov_cache=markov_cache)


def _pair_rank(rank: int, port: int, shm_name: str, ckpt: str, start: int, dense: str, markov_cache: str) -> dict:
    import torch.distributed as dist
    from bench.draft_step import SpinBarrier, connect_pair_rank
    gloo, pc = connect_pair_rank(rank, port, ckpt)
    barrier = SpinBarrier(shm_name, rank)
    dist.barrier(group=gloo.group)          # both attached to the shared counters
    return timeline("pair", rank, ckpt, start, pc, barrier, dense=dense, markov_cache=markov_cache)


def run_pair(ckpt: str, start: int, dense: str = "cublas", markov_cache: str = "auto") -> dict:
    from bench.card_procs import run_pair as in_two_processes
    r0, r1 = in_two_processes(_pair_rank, ckpt, start, dense, markov_cache, timeout_s=300)
    return {"pair_rank0": r0, "pair_rank1": r1}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", default="/tmp/full")
    ap.add_argument("--modes", default="tp1,pair", help="comma list of tp1, solo (one pair rank, no collectives), pair")
    ap.add_argument("--start", type=int, default=900000, help="position of the slot's context rows")
    ap.add_argument("--nvtx-replay", action="store_true",
                    help="tp1 / solo: no profiler, one replay in the NVTX range ncu_replay, for `ncu --nvtx "
                    "--nvtx-include ncu_replay/ --graph-profiling node --cache-control all` (each kernel timed alone)")
    ap.add_argument("--dense", default="cublas", choices=["triton", "cublas"],
                    help="the dense linears' kernel (1 request: what serve --dense auto runs up to --max-batch 6)")
    ap.add_argument("--requests", type=int, default=1, help="tp1 / solo: requests a replay drafts for")
    ap.add_argument("--markov-cache", default="auto", help="cached Markov bias rows, as serve --markov-cache: auto, "
                    "all, off or a row count")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.requests != 1 and "pair" in args.modes.split(","):
        ap.error("--requests: tp1 and solo only (the pair's timeline is of one request)")
    from bench.tcp_roundtrip import _commit
    out = {"bench": "kernel_timeline", "command": " ".join(["python"] + sys.argv), "commit": _commit(),
           "device": torch.cuda.get_device_name(0), "pdl": pdl_capable(), "dense": args.dense,
           "requests": args.requests, "markov_cache": args.markov_cache, "timelines": {}}
    for mode in args.modes.split(","):
        print(f"kernel_timeline: {mode} ...", file=sys.stderr, flush=True)
        if mode in ("tp1", "solo"):
            torch.set_num_threads(1)
            out["timelines"][mode] = (timeline("tp1", 0, args.ckpt, args.start, nvtx=args.nvtx_replay,
                                               dense=args.dense, requests=args.requests,
                                               markov_cache=args.markov_cache)
                                      if mode == "tp1" else solo_timeline(args.ckpt, args.start, args.nvtx_replay,
                                                                          args.dense, args.requests,
                                                                          args.markov_cache))
        else:
            out["timelines"].update(run_pair(args.ckpt, args.start, args.dense, args.markov_cache))
    text = json.dumps(out)
    if args.out:
        Path(args.out).write_text(text)
    print(json.dumps({k: {"run_us": v.get("run_us"), "gpu_span_us": v.get("gpu_span_us"), "error": v.get("error")}
                      for k, v in out["timelines"].items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
