"""What the one-card kernel benches (`expert_tiles`, `router_overlap`, `markov_step`) share: their command line
(`--reps`, `--out`, and their own flags), the CUDA check, and the result's header."""
from __future__ import annotations

import argparse
import sys

import torch

from bench.tcp_roundtrip import _commit, _device


def parse(name: str, doc: str, reps: int, argv=None, extra=None) -> argparse.Namespace | None:
    """The bench's arguments, or None (after saying why) when there is no CUDA device to run it on. `extra(ap)`
    adds the bench's own flags."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--out")
    if extra is not None:
        extra(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{name}: needs CUDA", file=sys.stderr)
        return None
    return args


def header(name: str, config: dict, **sections) -> dict:
    """bench, command, config, device (the card and the host), commit, and the bench's empty result sections."""
    return {"bench": name, "command": f"python bench/{name}.py " + " ".join(sys.argv[1:]), "config": config,
            "device": f"{torch.cuda.get_device_name(0)}; host {_device()}", "commit": _commit(), **sections}
