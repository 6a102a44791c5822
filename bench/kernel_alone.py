"""Each kernel of one draft-step replay timed alone (Nsight Compute), beside the replay's own span: how much of the
step is the kernels' own work and how much is the chain between them (the wait, drain and start of each dependent
kernel). GPU only, needs `ncu` on the PATH; the full preset from `--ckpt`.

    python bench/kernel_alone.py --ckpt /tmp/full --modes solo,tp1 \
        --out bench/results/gpu/kernel_alone_1x5_h200.json

Per mode it runs `bench/kernel_timeline.py --nvtx-replay` under `ncu --graph-profiling node --cache-control all
--clock-control none`, which replays each kernel node of the marked replay by itself with a cold L2 and the clocks
left alone, and reads back its duration and DRAM bytes. `alone_us_sum` is the sum of those durations (the step's
time with no chain at all and every kernel cold; the side-stream kernels counted too, so it is an upper bound on the
work on the critical path), set beside the span of one free replay (`kernel_timeline.py`'s `gpu_span_us`, taken
in the same call). A kernel's `dram_gbps` is its own rate alone: the GEMMs' against the 4.2 TB/s that cuBLAS
reached in `../shared/probes/gemm_bw.py`.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum", "launch__grid_size")


def ncu_rows(report: str) -> list[dict]:
    """The kernels of an ncu report in launch order: name, duration (us), DRAM bytes read / written, grid size."""
    text = subprocess.run(["ncu", "--import", report, "--csv", "--page", "raw", "--print-units", "base"],
                          capture_output=True, text=True, check=True).stdout
    rows = list(csv.DictReader(io.StringIO(text)))[1:]           # the first row holds the units
    out = []
    for r in rows:
        ns = float(r["gpu__time_duration.sum"].replace(",", ""))
        out.append({"name": r["Kernel Name"][:70], "alone_us": round(ns / 1e3, 2),
                    "dram_read_mb": round(float(r["dram__bytes_read.sum"].replace(",", "")) / 1e6, 2),
                    "dram_write_mb": round(float(r["dram__bytes_write.sum"].replace(",", "")) / 1e6, 2),
                    "grid": int(float(r["launch__grid_size"].replace(",", "")))})
        out[-1]["dram_gbps"] = round(out[-1]["dram_read_mb"] / max(out[-1]["alone_us"], 1e-3), 1)   # MB/us = TB/s*1e3
    return out


def run_mode(mode: str, ckpt: str, start: int) -> dict:
    script = str(ROOT / "bench" / "kernel_timeline.py")
    with tempfile.TemporaryDirectory() as d:
        rep = os.path.join(d, "step")
        cmd = ["ncu", "--nvtx", "--nvtx-include", "ncu_replay/", "--graph-profiling", "node", "--cache-control", "all",
               "--clock-control", "none", "--metrics", ",".join(METRICS), "--export", rep, "--force-overwrite",
               sys.executable, script, "--ckpt", ckpt, "--modes", mode, "--start", str(start), "--nvtx-replay"]
        print(f"kernel_alone: {mode}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            return {"error": (p.stdout + p.stderr)[-2000:]}
        kernels = ncu_rows(rep + ".ncu-rep")
    span = json.loads(subprocess.run([sys.executable, script, "--ckpt", ckpt, "--modes", mode, "--start", str(start)],
                                     capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    return {"kernels": kernels, "n_kernels": len(kernels),
            "alone_us_sum": round(sum(k["alone_us"] for k in kernels), 1),
            "dram_read_mb_sum": round(sum(k["dram_read_mb"] for k in kernels), 1),
            "free_replay": span[mode]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", default="/tmp/full")
    ap.add_argument("--modes", default="solo,tp1", help="comma list of tp1, solo")
    ap.add_argument("--start", type=int, default=900000)
    ap.add_argument("--out")
    args = ap.parse_args()
    if shutil.which("ncu") is None:
        print("kernel_alone: needs ncu (Nsight Compute) on the PATH", file=sys.stderr)
        return 2
    import torch
    from bench.tcp_roundtrip import _commit, emit
    out = {"bench": "kernel_alone", "command": " ".join(["python"] + sys.argv), "commit": _commit(),
           "device": torch.cuda.get_device_name(0), "metrics": list(METRICS), "modes": {}}
    for mode in args.modes.split(","):
        out["modes"][mode] = run_mode(mode, args.ckpt, args.start)
    emit(out, args.out, 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
