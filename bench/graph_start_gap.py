"""What a graph's first kernel costs the one after it: the gap from its end to the next kernel's start.

In the kernel timeline (`bench/kernel_timeline.py`) every draft graph starts with its upload (`kernels/host_copy.py`,
a copy kernel that reads the pinned host buffer), and the first model kernel (the embedding gather) starts ~8.6 us
after it ends, on one card and on the pair; every later kernel-to-kernel gap is under 1 us. This captures small
graphs that isolate the cause: the copy's source (pinned host / device memory), its launch (with or without
programmatic dependent launch), the kernel after it (torch's gather, a Triton kernel), each followed by two torch
kernels as a yardstick, the graph's size (a chain of 100 or 300 more kernels) and its shape (20 fork / join
pairs of side-stream branches). One GPU.

    python bench/graph_start_gap.py --out bench/results/gpu/graph_start_gap_h200.json

Per case: the median over 30 replays (each alone, 1 ms apart) of the gap after the first kernel (`gap_after_first_us`)
and of the gaps between the later kernels (`gap_later_us`), and the kernel names.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.kernel_timeline import split_replays  # noqa: E402
from dspark_ray.kernels.fused_ops import pdl_active, pdl_launches  # noqa: E402
from dspark_ray.kernels.host_copy import copy_bytes  # noqa: E402

NBYTES = 1024               # about a one-request draft's upload


def case(src: str, pdl: bool, after: str, replays: int, chain: int = 0, branches: int = 0) -> dict:
    dev = torch.device("cuda")
    host = torch.arange(NBYTES, dtype=torch.uint8).pin_memory()
    src_buf = host if src == "host" else host.to(dev)
    dst = torch.zeros(NBYTES, dtype=torch.uint8, device=dev)
    dst2 = torch.zeros(NBYTES, dtype=torch.uint8, device=dev)
    table = torch.randn(4096, 5120, device=dev, dtype=torch.bfloat16)
    ids = torch.zeros(5, dtype=torch.int64, device=dev)
    acc = torch.zeros(5, 5120, device=dev)
    acc2 = torch.zeros(5, 5120, device=dev)
    side = torch.cuda.Stream()

    def body():
        if src != "none":
            copy_bytes(dst, (dst.data_ptr(), src_buf.data_ptr(), NBYTES))
        if after == "triton":
            copy_bytes(dst, (dst2.data_ptr(), dst.data_ptr(), NBYTES))
        e = table[ids]                          # torch's gather, as the drafter's embedding lookup
        acc.add_(e.float())
        acc.mul_(0.5)
        for _ in range(chain):                  # a graph of a draft's size (~100 kernels)
            acc.mul_(0.5)
        for _ in range(branches):               # forks and joins, as the drafter's side-stream branches
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                acc2.mul_(0.5)
                acc2.add_(1.0)
            acc.mul_(0.5)
            acc.add_(1.0)
            torch.cuda.current_stream().wait_stream(side)

    g = torch.cuda.CUDAGraph()
    ctx = pdl_launches() if pdl else contextlib.nullcontext()
    with ctx:
        body()                                  # compiles / loads every kernel before the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            body()
    for _ in range(20):
        g.replay()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
            torch.cuda.synchronize()
            time.sleep(0.001)
    ev = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    reps = split_replays(ev, gap_us=300.0)
    first, later = [], []
    for r in reps:
        gaps = [b.time_range.start - a.time_range.end for a, b in zip(r, r[1:])]
        if gaps:
            first.append(gaps[0])
            later += gaps[1:]
    return {"src": src, "pdl": pdl, "after": after, "chain": chain, "branches": branches,
            "kernels": [e.name[:60] for e in reps[-1][:6]],
            "gap_after_first_us": round(statistics.median(first), 2),
            "gap_later_us": round(statistics.median(later), 2) if later else None,
            "first_kernel_us": round(statistics.median(r[0].time_range.elapsed_us() for r in reps), 2),
            "replays": len(reps)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "graph_start_gap", "skipped": "no CUDA"}))
        return 0
    cases = []
    for src, pdl, after, *chain in [("host", True, "torch"), ("host", False, "torch"), ("device", True, "torch"),
                            ("device", False, "torch"), ("host", True, "triton"), ("none", False, "torch"),
                            ("host", True, "torch", 100), ("host", True, "torch", 300), ("none", False, "torch", 100),
                            ("host", True, "torch", 0, 20), ("none", False, "torch", 0, 20)]:
        c = case(src, pdl and pdl_active(), after, args.replays, *chain)
        print(json.dumps(c), file=sys.stderr)
        cases.append(c)
    out = {"bench": "graph_start_gap", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "pdl_active": pdl_active(), "copy_bytes": NBYTES, "cases": cases}
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
