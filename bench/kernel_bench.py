"""What the one-card kernel benches (`expert_tiles`, `router_overlap`, `markov_step`, `l2_retention`, `gemm`)
share: their command line (`--reps`, `--out`, and their own flags), the CUDA check, the card and its seeded
generator, an L2 flush buffer, the timing of a captured graph, a linear's error against fp64, and the result's
header."""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys

import torch

from bench.tcp_roundtrip import _commit, _device


FLUSH_BYTES = 256 << 20        # filled before a timed kernel: nothing it reads is left in L2 (50 MB on an H200)


def start(name: str, doc: str, reps: int, argv=None, extra=None, pin: bool = False):
    """(arguments, the card, a generator on it seeded 0), or None (after saying why) when there is no CUDA device
    to run on. `extra(ap)` adds the bench's own flags; `pin` pins what the fast path pins (`gemm.pin_determinism`,
    as `gemm.kernels_for("fast")` does): for the benches that call its kernels directly."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--out")
    if extra is not None:
        extra(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{name}: needs CUDA", file=sys.stderr)
        return None
    if pin:
        from dspark_ray.kernels import gemm
        gemm.pin_determinism()
    dev = torch.device("cuda")
    return args, dev, torch.Generator(device=dev).manual_seed(0)


def stats(ts) -> dict:
    """p50 / p99 / min (us) of per-call times in us."""
    ts = sorted(ts)
    return {"p50_us": round(statistics.median(ts), 2), "p99_us": round(ts[min(len(ts) - 1, int(0.99 * len(ts)))], 2),
            "min_us": round(ts[0], 2)}


def rel_err_fp64(y: torch.Tensor, x_groups, w: torch.Tensor) -> float:
    """max |y - ref| / max |ref| for ref the fp64 linear of w (N, K): output columns in len(x_groups) equal groups,
    group i computed from x_groups[i] (M, K) (one group: an ordinary linear)."""
    r = w.shape[0] // len(x_groups)
    ref = torch.cat([x.double() @ w[i * r:(i + 1) * r].double().t() for i, x in enumerate(x_groups)], -1)
    return float((y.double() - ref).abs().max() / ref.abs().max())


def header(name: str, config: dict, **sections) -> dict:
    """bench, command, config, device (the card and the host), commit, and the bench's empty result sections."""
    return {"bench": name, "command": f"python bench/{name}.py " + " ".join(sys.argv[1:]), "config": config,
            "device": f"{torch.cuda.get_device_name(0)}; host {_device()}", "commit": _commit(), **sections}


def graph_time(fns, calls: int, replays: int, pdl: bool = False) -> list[float]:
    """Capture fns[i % len(fns)]() for i < calls in one graph (each fn run once first on a side stream, so Triton
    compiles and cuBLAS picks its handles outside the capture); us per call of each of `replays` replays timed with
    CUDA events around g.replay(), after 5 untimed. With `pdl` the fused kernels launch with programmatic dependent
    launch, as in the graph set's capture."""
    from dspark_ray.kernels.fused_ops import pdl_launches
    scope = pdl_launches if pdl else contextlib.nullcontext
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), scope():
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), scope():
        for i in range(calls):
            fns[i % len(fns)]()
    for _ in range(5):
        g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(replays):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1000.0 / calls)
    del g
    return ts
