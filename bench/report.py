"""What every bench's JSON carries, and how it is written: percentiles of its timings, the command, the device, the
commit; printed to stdout and, with `--out`, to a file."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np


def percentiles(xs, unit: str | None = "ms", digits: int = 3, scale: float = 1.0) -> dict:
    """p50 / p90 / p99 / min of `xs` times `scale` (e.g. 1e-3: ns to us), and their count. Keys carry the unit
    ("p50_ms"); unit None gives bare keys ("p50")."""
    a = np.asarray(xs, dtype=np.float64) * scale
    key = (lambda q: q) if unit is None else (lambda q: f"{q}_{unit}")
    out = {key(f"p{q}"): round(float(np.percentile(a, q)), digits) for q in (50, 90, 99)}
    return out | {key("min"): round(float(a.min()), digits), "n": len(a)}


def commit() -> str:
    """The checkout's commit (+dirty), wherever the bench is started from; `DSPARK_COMMIT` where there is no git
    (a copy of the tree on a device machine)."""
    if os.environ.get("DSPARK_COMMIT"):
        return os.environ["DSPARK_COMMIT"]
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=here).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, cwd=here).stdout
        return head + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu() -> str:
    """The host's CPU model, its vCPU count and the Python version."""
    try:
        with open("/proc/cpuinfo") as f:
            model = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    return f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}"


def device(gpu: bool = False) -> str:
    """The first CUDA card's name when the bench ran on GPUs, else the host's CPU."""
    if gpu:
        import torch
        return torch.cuda.get_device_name(0)
    return cpu()


def command(script: str, argv: list[str] | None = None) -> str:
    """The command line that reproduces this run, from the repository root (bench/ or scripts/)."""
    args = sys.argv[1:] if argv is None else argv
    path = Path(script)
    return " ".join(["python", f"{path.parent.name}/{path.name}", *args])


def header(script: str, argv: list[str] | None = None, gpu: bool = False) -> dict:
    """The fields every result starts with: the bench, its command, the device, the commit."""
    return {"bench": Path(script).stem, "command": command(script, argv), "device": device(gpu), "commit": commit()}


def save(result: dict, out: str | None, indent: int = 1) -> None:
    """Write the result's JSON to `out` when given (a long bench saves after each part: a run cut short keeps what
    it measured)."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=indent, default=str) + "\n")


def write(result: dict, out: str | None = None, indent: int = 1) -> None:
    """Print the result's JSON, and write it to `out` too when given."""
    print(json.dumps(result, indent=indent, default=str))
    save(result, out, indent)
