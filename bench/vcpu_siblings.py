"""Which vCPUs slow each other down? On a VM that reports one thread per core, two vCPUs can still be hyperthreads
of one host core: a spinning thread on one would then slow the other's Python. (CPU only; any host.)

For each base vCPU: a 1,000-add Python loop pinned there, timed alone (p50 of 300), then again while a process
spins on each other vCPU in turn; the ratio is the slowdown. The step path's threads spin between steps
(`PairSpec.rank_cpus` / `frontend_cpus` pin them), so this says which vCPUs to keep apart.

    python bench/vcpu_siblings.py [--base 2,3,5,7] [--out FILE]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench import report                                # noqa: E402
from dspark_ray.cli import cpu_list                     # noqa: E402

SUSPECT = 1.15          # a slowdown past this marks a vCPU that shares the base's core


def spin(cpu: int, stop) -> None:
    os.sched_setaffinity(0, {cpu})
    x = 0
    while not stop.is_set():
        for _ in range(10000):
            x += 1


def loop_us(reps: int = 300) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        x = 0
        for i in range(1000):
            x += i
        ts.append(time.perf_counter_ns() - t0)
    return statistics.median(ts) / 1e3


def probe(base: int, cpus: list[int]) -> dict:
    os.sched_setaffinity(0, {base})
    alone = loop_us()
    row = {}
    for k in cpus:
        if k == base:
            continue
        stop = mp.Event()
        p = mp.Process(target=spin, args=(k, stop))
        p.start()
        time.sleep(0.05)
        row[k] = round(loop_us() / alone, 2)
        stop.set()
        p.join()
    return {"alone_us": round(alone, 2), "slowdown_by_cpu": row,
            "suspects": [k for k, v in row.items() if v > SUSPECT]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", type=cpu_list, default=[0])
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    out = {}
    for b in a.base:
        out[str(b)] = probe(b, cpus)
        print(f"[vcpu_siblings] vCPU {b}: alone {out[str(b)]['alone_us']} us, suspects {out[str(b)]['suspects']}",
              file=sys.stderr, flush=True)
    report.write({**report.header(__file__, argv), "config": {"base": a.base, "vcpus": len(cpus),
                                                              "suspect_above": SUSPECT}, "by_base_vcpu": out}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
