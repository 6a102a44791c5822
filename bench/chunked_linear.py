"""The draft step's dense linears: cuBLAS once per 32-row chunk (`serve --dense cublas`, one weight read per chunk)
against `kernels/chunked_linear.py` (one launch, each weight tile read once for every chunk). GPU only.

    python bench/chunked_linear.py [--reps 50] [--chunks 1,2,3,4] [--modes tp1,pair] [--sweep] \
        [--out bench/results/gpu/chunked_linear_h200.json]

Per (mode, shape, chunks), each time (spin + call) - (spin alone) right behind a latency-bound stand-in in a PDL
graph, p50 of `--reps` replays, the calls rotating through copies of the weight past the L2 (as the step's GEMMs):
`cublas_us`; `chunked_us`, the kernel with the tiles the step uses (`chunked_linear.tiles`); `other_ch_us`, the same
tiles with the other chunks-per-program choice (1 or every chunk), which gives the same bits; the error against
fp64; whether each chunk's rows equal that chunk run alone, and 20 repeated calls (deterministic).
With `--sweep`: instead, a sweep of (bn, split, ch) tilings per shape (`tilings`), each checked chunk by chunk
against a one-chunk call of the same (bn, split) (`gpu/chunked_linear_sweep_h200.json`: the data behind `tiles`).
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import kernel_bench  # noqa: E402
from bench.gemm_preload import SpinStandIn  # noqa: E402
from bench.tcp_roundtrip import emit  # noqa: E402
from dspark_ray.kernels.chunked_linear import (BK, COUNTERS, MAX_CH, ROWS, Tiles,  # noqa: E402
                                               chunked_linear, pipeline_stages, tiles)

# (N, K, groups, fp16 out) of the draft step's dense linears, for one pair rank and for one card; the head is the
# largest read of all.
SHAPES = {
    "pair": {"wq_a|wkv": (1792, 5120, 1, True), "wq_b": (16384, 1280, 1, True), "wo_a": (4096, 4096, 4, True),
             "wo_b": (5120, 4096, 1, False), "shared w1|w3": (2304, 5120, 1, True),
             "shared w2": (5120, 1152, 1, False), "head": (64640, 5120, 1, True)},
    "tp1": {"wq_a|wkv": (1792, 5120, 1, True), "wq_b": (32768, 1280, 1, True), "wo_a": (8192, 4096, 8, True),
            "wo_b": (5120, 8192, 1, False), "shared w1|w3": (4608, 5120, 1, True),
            "shared w2": (5120, 2304, 1, False), "head": (129280, 5120, 1, True)},
}


def split_fits(steps: int, split: int) -> bool:
    """A K split of `steps` BK steps into `split` ranges of ceil(steps / split) steps: each at least two, none
    empty (the kernel's KS is a whole number of BK steps)."""
    ks = -(-steps // split)
    return split == 1 or (ks >= 2 and steps - (split - 1) * ks >= 1)


def tilings(n: int, k: int, chunks: int, sms: int):
    """The sweep: 1 chunk a program (side by side) or every chunk; 64 or 128 columns; every K split from 1 to 8
    (not only powers of two: the busiest SM's share depends on how the programs divide among the SMs) that gives
    each split at least two BK steps, leaves none empty and makes at most four programs per SM."""
    steps = -(-k // BK)
    for ch in sorted({1, min(chunks, MAX_CH)}):
        rp = -(-chunks // ch)
        for bn in (64, 128):
            blocks = -(-n // bn) * rp
            for split in range(1, 9):
                if split_fits(steps, split) and (split == 1 or blocks * split <= 4 * sms):
                    yield Tiles(bn=bn, split=split, ch=ch, stages=pipeline_stages(ch, bn))


class Case:
    """One (shape, chunks): its input, the weight copies, and the two kernels to compare on them."""

    def __init__(self, n, k, groups, f16, chunks, ws, g, dev):
        from dspark_ray.kernels import gemm
        self.n, self.k, self.groups, self.chunks, self.ws = n, k, groups, chunks, ws
        self.out_dtype = torch.float16 if f16 else torch.float32
        shape = (groups, chunks * ROWS, k) if groups > 1 else (chunks * ROWS, k)
        self.x = torch.randn(shape, generator=g, device=dev).to(torch.float16)
        rows = chunks * ROWS
        if groups > 1:     # the step's grouped layout, read in place (`gemm.grouped_rows_empty`)
            self.xg = self.x.as_strided((rows, groups, k), (k, rows * k, 1))
            self.cublas = lambda w: gemm.padded_grouped_linear(self.xg, w, dense="cublas")
        else:
            self.cublas = lambda w: (gemm.padded_linear_f16 if f16 else gemm.padded_linear)(self.x, w, dense="cublas")

    def run(self, w, t: Tiles | None = None, x=None):
        x = self.x if x is None else x
        out = torch.empty((x.shape[-2], self.n), dtype=self.out_dtype, device=x.device)
        return chunked_linear(x, w, out, self.groups, t)

    def chunk(self, c: int):
        return self.x[..., c * ROWS:(c + 1) * ROWS, :].contiguous()

    def x_groups(self) -> list:
        """x as the groups of the output's columns take it (one group: x itself)."""
        return list(self.x) if self.groups > 1 else [self.x]

    def alone_same_bits(self, y, t: Tiles) -> bool:
        one = dataclasses.replace(t, ch=1)          # each chunk alone, one program per chunk
        return all(torch.equal(self.run(self.ws[0], one, self.chunk(c)), y[c * ROWS:(c + 1) * ROWS])
                   for c in range(self.chunks))


def main(argv=None) -> int:
    def extra(ap):
        ap.add_argument("--sleep-us", type=float, default=10.0, help="the stand-in kernel's spin")
        ap.add_argument("--chunks", default="1,2,3,4", help="32-row chunks per call (3: 16 requests of 5 rows)")
        ap.add_argument("--modes", default="tp1,pair")
        ap.add_argument("--only", default="", help="comma list of shape names")
        ap.add_argument("--sweep", action="store_true", help="time a sweep of tilings instead of the step's tiles")
    started = kernel_bench.start("chunked_linear", __doc__, 50, argv, extra=extra, pin=True)
    if started is None:
        return 2
    args, dev, g = started
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    chunk_counts = [int(c) for c in args.chunks.split(",")]
    res = kernel_bench.header("chunked_linear", {"chunks": chunk_counts, "sleep_us": args.sleep_us, "reps": args.reps,
                                                 "sweep": args.sweep, "shapes": SHAPES}, cases={})
    spin = SpinStandIn(dev, args.sleep_us, args.reps)

    def after_us(calls) -> float:
        us = spin.after_us(calls)
        COUNTERS.release()               # graph_time's graph, which held the captured calls' counters, is gone
        return us

    res["spin_alone_us"] = round(spin.alone_us, 2)
    only = set(filter(None, args.only.split(",")))
    for mode in args.modes.split(","):
        for name, (n, k, groups, f16) in SHAPES[mode].items():
            if only and name not in only:
                continue
            copies = max(2, -(-200_000_000 // (n * k * 2)))
            ws = [(torch.randn((n, k), generator=g, device=dev) * 0.02).to(torch.float16) for _ in range(copies)]
            for chunks in chunk_counts:
                c = Case(n, k, groups, f16, chunks, ws, g, dev)
                row = {"weight_mb": round(n * k * 2 / 1e6, 2), "copies": copies}
                row["cublas_us"] = round(after_us([lambda w=w: c.cublas(w) for w in ws]), 2)
                if args.sweep:
                    row["tilings"] = []
                    for t in tilings(n, k, chunks, sms):
                        us = after_us([lambda w=w, t=t: c.run(w, t) for w in ws])
                        row["tilings"].append({"tiles": t.__dict__, "us": round(us, 2),
                                               "chunks_alone_same_bits": c.alone_same_bits(c.run(ws[0], t), t)})
                    best = min(row["tilings"], key=lambda r: r["us"])
                    row["best"], t = best, Tiles(**best["tiles"])
                else:
                    t = tiles(n, k, groups, chunks, sms)
                    other = dataclasses.replace(t, ch=1 if t.ch > 1 else min(chunks, MAX_CH))
                    row["tiles"] = t.__dict__
                    row["chunked_us"] = round(after_us([lambda w=w: c.run(w, t) for w in ws]), 2)
                    row["other_ch_us"] = round(after_us([lambda w=w: c.run(w, other) for w in ws]), 2)
                    row["other_ch"] = other.ch
                    row["chunked_over_cublas"] = round(row["chunked_us"] / row["cublas_us"], 3)
                y = c.run(ws[0], t)
                row["rel_err"] = kernel_bench.rel_err_fp64(y, c.x_groups(), ws[0])
                row["chunks_alone_same_bits"] = c.alone_same_bits(y, t)
                row["deterministic"] = all(torch.equal(y, c.run(ws[0], t)) for _ in range(20))
                res["cases"][f"{mode} {name} x{chunks}"] = row
                print(f"chunked_linear: {mode} {name} x{chunks}: cublas {row['cublas_us']} us, chunked "
                      f"{row.get('chunked_us', row.get('best', {}).get('us'))} us {t}, other ch "
                      f"{row.get('other_ch_us')}, alone-bits {row['chunks_alone_same_bits']}, deterministic "
                      f"{row['deterministic']}", file=sys.stderr, flush=True)
            del ws
    emit(res, args.out, 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
