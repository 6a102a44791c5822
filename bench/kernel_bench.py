"""What the one-card kernel benches (`expert_tiles`, `router_overlap`, `markov_step`, `l2_retention`) share: their
command line (`--reps`, `--out`, and their own flags), the CUDA check, the card and its seeded generator, an L2
flush buffer, and the result's header."""
from __future__ import annotations

import argparse
import sys

import torch

from bench.tcp_roundtrip import _commit, _device


FLUSH_BYTES = 256 << 20        # filled before a timed kernel: nothing it reads is left in L2 (50 MB on an H200)


def start(name: str, doc: str, reps: int, argv=None, extra=None, matmul: str | None = None):
    """(arguments, the card, a generator on it seeded 0), or None (after saying why) when there is no CUDA device
    to run on. `extra(ap)` adds the bench's own flags; `matmul` installs that matmul path (`gemm.use_matmul`)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--out")
    if extra is not None:
        extra(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{name}: needs CUDA", file=sys.stderr)
        return None
    if matmul is not None:
        from dspark_ray.kernels import gemm
        gemm.use_matmul(matmul)
    dev = torch.device("cuda")
    return args, dev, torch.Generator(device=dev).manual_seed(0)


def header(name: str, config: dict, **sections) -> dict:
    """bench, command, config, device (the card and the host), commit, and the bench's empty result sections."""
    return {"bench": name, "command": f"python bench/{name}.py " + " ".join(sys.argv[1:]), "config": config,
            "device": f"{torch.cuda.get_device_name(0)}; host {_device()}", "commit": _commit(), **sections}
