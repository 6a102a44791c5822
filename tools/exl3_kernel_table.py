"""Make the committed EXL3 kernel table (dspark_ray/kernels/exl3_shapes.json) for this card kind.

    source .devbundle/setup.sh && python tools/exl3_kernel_table.py --ckpt DIR [--ckpt DIR2 ...] [--out FILE]

For every EXL3 Linear shape a rank of the checkpoint(s) multiplies by (tp1 and both ranks of tp2; routed experts as
`mgemm`, their fallback where the fused MoE kernel does not take them, every other Linear as `gemm`), each 16-row
tile shape exllamav3 accepts, and for a gemm the row-tile family (`exl3_gemm.ROWS`), is timed at the decode's row
counts (1 and 4 requests of one block: rows = block_size x requests, padded to whole tiles as the rank pads them;
times top-k slots for the experts): CUDA-graph replays of 50 launches, the median of 7. The shape of least regret
is written (`regret`: its worst ratio to the best shape at any one row count). This is the only place kernels are
timed: a rank reads the table and never times anything (`kernels/exl3_gemm.py`). Existing entries of other card
kinds are kept. Prints the table's entries with their timings as JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dspark_ray.kernels import exl3_gemm  # noqa: E402
from dspark_ray.model.layout import Layout  # noqa: E402
from dspark_ray.weights.loader import Checkpoint  # noqa: E402


def shapes_of(ck: Checkpoint) -> dict[tuple, tuple]:
    """(op, K, codebook, k, n) -> (one record of that shape on the GPU, its tensor's name), over every rank's cut
    of tp1 and tp2. Routed experts: expert 0 of each block stands for its bank (one mix group, one bitrate)."""
    out: dict[tuple, tuple] = {}
    cfg = ck.config
    names = [n for n in ck.names()
             if exl3_gemm.on_kernels(ck, n) and (".ffn.experts." not in n or ".ffn.experts.0." in n)]
    for tp in (1, 2):
        lay = Layout(cfg, tp)
        for rank in range(tp):
            for name in names:
                s = lay.slice_of(name, tuple(ck.shape(name)), rank)
                (rec,) = ck.exl3(name, *(s or ()), device="cuda")
                op = "mgemm" if ".ffn.experts." in name else "gemm"
                out.setdefault((op, rec.K, rec.codebook, rec.in_features, rec.out_features), (rec, name))
    return out


def _time(fn, reps: int = 50, rounds: int = 7) -> float:
    """Median microseconds of one launch, from graph replays of `reps` launches."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    times = []
    for _ in range(rounds):
        ev[0].record()
        g.replay()
        ev[1].record()
        torch.cuda.synchronize()
        times.append(ev[0].elapsed_time(ev[1]) * 1000 / reps)
    return statistics.median(times)


def time_shape(op: str, rec, shape_idx, rows: int, slots: int, experts: int) -> float:
    ext = exl3_gemm.ext()
    dev = rec.trellis.device
    k, n = rec.in_features, rec.out_features
    if op == "gemm":                        # padded as Exl3Weight.matmul pads: whole tiles
        rows, s = exl3_gemm.tile_for(shape_idx, rows)
        x = torch.randn(rows, k, device=dev).half()
        c = torch.empty(rows, n, dtype=torch.half, device=dev)
        ah = torch.empty_like(x)
        return _time(lambda: ext.exl3_gemm(x, rec.trellis, c, rec.suh, ah, rec.svh, s,
                                           rec.codebook == "mcg", rec.codebook == "mul1", 0))
    p = rows * slots
    ptr = [torch.tensor([t.data_ptr()] * experts, dtype=torch.int64, device=dev) for t in (rec.trellis, rec.suh,
                                                                                          rec.svh)]
    a = torch.randn(p, 1, k, device=dev).half()
    c = torch.empty(p, 1, n, dtype=torch.half, device=dev)
    ah = torch.empty_like(a)
    idx = torch.randint(0, experts, (1, p), device=dev)
    return _time(lambda: ext.exl3_mgemm(a, ptr[0], c, ptr[1], ah, ptr[2], idx, None, float(rec.K), shape_idx,
                                        rec.codebook == "mcg", rec.codebook == "mul1", -1, -1, 0, 1, None, None,
                                        None, None, 0))


def regret(times: dict, s) -> float:
    """How far shape s is from the best shape at its worst row count: max over row counts of t(s) / min_s' t(s').
    The table takes the shape of least regret: one shape must serve every batch (batch invariance), and the sum of
    the times would let the wide batch's time decide for the one-request step."""
    cols = range(len(times[s]))
    return max(times[s][j] / min(t[j] for t in times.values()) for j in cols)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", action="append", required=True)
    ap.add_argument("--out", default=str(exl3_gemm.TABLE_PATH))
    ap.add_argument("--requests", default="1,4")
    a = ap.parse_args(argv)
    if not exl3_gemm.available():
        print("tools/exl3_kernel_table.py needs CUDA and exllamav3", file=sys.stderr)
        return 2
    dev = torch.device("cuda:0")
    cc = exl3_gemm._cc(dev)
    path = Path(a.out)
    table = json.loads(path.read_text()) if path.is_file() else {"shapes": {}, "timings_us": {}}
    table.setdefault("timings_us", {})
    reqs = [int(r) for r in a.requests.split(",")]
    for d in a.ckpt:
        ck = Checkpoint(d)
        cfg = ck.config
        for (op, K, cb, k, n), (rec, name) in sorted(shapes_of(ck).items(), key=lambda kv: str(kv[0])):
            ok = exl3_gemm.compatible(K, k, n, dev)
            if op == "gemm" and exl3_gemm.rows_compatible(K, k, n, dev):
                ok.append(exl3_gemm.ROWS)
            times = {s: [time_shape(op, rec, s, r * cfg.block_size, cfg.num_experts_per_tok if op == "mgemm" else 1,
                                    cfg.n_routed_experts) for r in reqs] for s in ok}
            best = min(times, key=lambda s: (regret(times, s), str(s)))
            key = exl3_gemm.shape_key(op, cc, K, cb, k, n)
            table["shapes"][key] = best
            table["timings_us"][key] = {str(s): [round(t, 2) for t in v] for s, v in times.items()}
            print(f"{key}: shape {best}  " + "  ".join(f"{s}:{'/'.join(f'{t:.1f}' for t in v)}"
                                                      for s, v in times.items()), file=sys.stderr, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    table["made_by"] = {"command": "python tools/exl3_kernel_table.py " + " ".join(sys.argv[1:] if argv is None
                                                                                    else argv),
                        "device": torch.cuda.get_device_name(dev), "commit": commit or "unknown",
                        "rows": f"block_size x requests {reqs} (experts: x top-k slots)",
                        "timing": "median of 7 CUDA-graph replays of 50 launches, us per launch"}
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    exl3_gemm._table.cache_clear()
    print(json.dumps(table, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
