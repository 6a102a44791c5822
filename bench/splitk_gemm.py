"""The draft step's dense linears: cuBLAS (the padded 32-row call the step makes now) against the one-launch split-K
Triton kernel (`kernels/splitk_linear.py`) over a sweep of its tiles, each timed as in the step: in a PDL graph,
right behind a latency-bound kernel (a one-program spin, `--sleep-us`), its weight read from HBM. GPU only.

    python bench/splitk_gemm.py [--reps 100] [--rows 6] [--modes pair,tp1] \
        [--out bench/results/gpu/splitk_gemm_h200.json]

Per shape: `cublas_us` and each tiling's `us` = (spin + linear) - (spin alone), p50 of `--reps` replays of 10 pairs,
the calls rotating through copies of the weight (together past the 60 MB L2); the best tiling; and for it the
error against an fp64 reference, the bits of 100 repeated calls (deterministic) and of row 0 alone against in the
batch (batch invariant).

The kernel, kept here as the record (the step does not use it: at best 0.88-1.0x of cuBLAS on a pair rank's shards,
0.92-0.95x on one card's, bench/results/gpu/splitk_gemm_h200.json): program (block of N, split s) sums its K range
in BK-wide `tl.dot` steps, each row its own row of the fixed tile (batch invariant); with SPLIT > 1 each program
writes its fp32 partial and takes a ticket on its block's counter, and the one that takes the last ticket sums the
partials in split order (partial 0 first, whichever program it is) and resets the counter. Its programs start under
programmatic dependent launch while the kernel before drains, and may load their first weight tile before the wait.
"""
from __future__ import annotations

import dataclasses
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import kernel_bench  # noqa: E402
from bench.gemm_preload import CALLS, SpinStandIn  # noqa: E402
from bench.tcp_roundtrip import emit  # noqa: E402
from dspark_ray.kernels.chunked_linear import _fence_gpu  # noqa: E402
from dspark_ray.kernels.fused_ops import F16, F32, launch_opts  # noqa: E402


@dataclasses.dataclass(frozen=True)
class LinearTiles:
    """One shape's launch: rows per tile (BM, also the most rows of one tile: more rows take more row blocks),
    output columns per program (BN), K step (BK), K splits, warps, pipeline stages, and whether each program loads
    its first weight tile before its PDL wait."""
    bm: int = 32
    bn: int = 64
    bk: int = 128
    split: int = 1
    warps: int = 4
    stages: int = 4
    preload: bool = False


@triton.jit
def _splitk_linear_kernel(x_ptr, w_ptr, out_ptr, part_ptr, ctr_ptr, M, N, K, R, sxm, sxg, KS,
                          SPLIT, OUT_F16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr, PRELOAD: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    pid_m = tl.program_id(2)
    cols = pid_n * BN + tl.arange(0, BN)
    c_ok = cols < N
    rows = pid_m * BM + tl.arange(0, BM)
    r_ok = rows < M
    g = (pid_n * BN) // R                                    # the group of this block of columns (BN divides R)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * sxm + g.to(tl.int64) * sxg
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * K
    k_lo = s * KS
    k_hi = tl.minimum(K, k_lo + KS)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k0 = k_lo
    if PRELOAD:       # the first weight tile before the wait: read while the kernel before this one drains
        kk = k0 + tl.arange(0, BK)
        k_ok = kk < k_hi
        w0 = tl.load(w_cols + kk[:, None], mask=k_ok[:, None] & c_ok[None, :], other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        xt = tl.load(x_rows + kk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(xt, w0, acc)
        k0 += BK
    elif PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for k in range(k0, k_hi, BK):
        kk = k + tl.arange(0, BK)
        k_ok = kk < k_hi
        xt = tl.load(x_rows + kk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_cols + kk[:, None], mask=k_ok[:, None] & c_ok[None, :], other=0.0)
        acc = tl.dot(xt, wt, acc)
    dst = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    ok = r_ok[:, None] & c_ok[None, :]
    if SPLIT == 1:
        if OUT_F16:
            tl.store(dst, acc.to(tl.float16), mask=ok)
        else:
            tl.store(dst, acc, mask=ok)
    else:
        tile = (pid_m * tl.num_programs(0) + pid_n) * SPLIT          # this (row block, column block)'s partials
        offs = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
        tl.store(part_ptr + (tile + s).to(tl.int64) * BM * BN + offs, acc)
        _fence_gpu()                           # every thread's partial visible at L2 before the ticket is taken
        tl.debug_barrier()
        ctr = ctr_ptr + pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(ctr, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:      # the last of the SPLIT programs
            tot = tl.load(part_ptr + tile.to(tl.int64) * BM * BN + offs, cache_modifier=".cg")
            for j in range(1, SPLIT):
                tot += tl.load(part_ptr + (tile + j).to(tl.int64) * BM * BN + offs, cache_modifier=".cg")
            if OUT_F16:
                tl.store(dst, tot.to(tl.float16), mask=ok)
            else:
                tl.store(dst, tot, mask=ok)
            tl.atomic_xchg(ctr, 0, sem="relaxed", scope="gpu")                 # ready for the next call


class Counters:
    """Split-K ticket counters, zero between calls (the last program of a block resets its own), from one pool made
    on the first call (an eager one: `graph_time` runs each call once before capturing it). Each call takes a
    slice of its own, so kernels beside each other never share a counter; `release` hands the pool out again once
    the graphs that captured calls are gone."""

    def __init__(self, n: int = 1 << 22):
        self.n, self.pool, self.at = n, None, 0

    def take(self, device: torch.device, count: int) -> torch.Tensor:
        if self.pool is None:
            self.pool = torch.zeros(self.n, dtype=torch.int32, device=device)
        if self.at + count > self.n:
            raise RuntimeError(f"splitk_linear: {self.n} counters used up")
        self.at += count
        return self.pool[self.at - count:self.at]

    def release(self) -> None:
        self.at = 0


COUNTERS = Counters()


def splitk_linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype, tiles: LinearTiles,
                  groups: int = 1) -> torch.Tensor:
    """x (M, K) fp16 (or (M, G, K) when grouped, any strides with unit column stride) @ w (N, K).T -> out_dtype
    (M, N); grouped: columns [g*R, (g+1)*R) of out from group g of x, R = N / G."""
    t = tiles
    if groups > 1:
        m, g, k = x.shape
        assert g == groups and x.stride(2) == 1
        sxm, sxg = x.stride(0), x.stride(1)
    else:
        x = x.reshape(-1, x.shape[-1])
        if x.stride(-1) != 1:
            x = x.contiguous()
        m, k = x.shape
        sxm, sxg = x.stride(0), 0
    n = w.shape[0]
    r = n // groups
    assert w.shape[1] == k and w.is_contiguous() and (groups == 1 or r % t.bn == 0)
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    nb, mb = triton.cdiv(n, t.bn), triton.cdiv(m, t.bm)
    ks = triton.cdiv(triton.cdiv(k, t.split), t.bk) * t.bk
    if t.split > 1:
        part = torch.empty((mb * nb * t.split * t.bm * t.bn,), dtype=F32, device=x.device)
        ctr = COUNTERS.take(x.device, mb * nb)
    else:
        part = ctr = out
    _splitk_linear_kernel[(nb, t.split, mb)](
        x, w, out, part, ctr, m, n, k, r, sxm, sxg, ks, t.split, OUT_F16=out_dtype == F16, BM=t.bm, BN=t.bn,
        BK=t.bk, PRELOAD=t.preload, num_warps=t.warps, num_stages=t.stages, **launch_opts(out))
    return out


# (N, K, groups, fp16 out) of each dense linear on a draft step's critical path (the shared expert's two run beside
# the routed experts), for one pair rank and for one card.
SHAPES = {
    "pair": {"wq_a|wkv": (1792, 5120, 1, True), "wq_b": (16384, 1280, 1, True), "wo_a": (4096, 4096, 4, True),
             "wo_b": (5120, 4096, 1, False), "shared w1|w3": (2304, 5120, 1, True), "shared w2": (5120, 1152, 1, False)},
    "tp1": {"wq_a|wkv": (1792, 5120, 1, True), "wq_b": (32768, 1280, 1, True), "wo_a": (8192, 4096, 8, True),
            "wo_b": (5120, 8192, 1, False), "shared w1|w3": (4608, 5120, 1, True), "shared w2": (5120, 2304, 1, False)},
}
SMEM = 227 * 1024


def tilings(n: int, k: int, groups: int, sms: int):
    for bn, bk, preload in itertools.product((32, 64, 128), (128, 256), (False, True)):
        if (n // groups) % bn:
            continue
        blocks = n // bn
        splits = sorted({s for s in (1, 2, 3, 4, 6, 8, 12, 16) if k // s >= bk and sms <= blocks * s <= 6 * sms})
        for split in splits[:3] or [1]:
            stages = 4
            while stages > 2 and stages * (32 * bk + bk * bn) * 2 > SMEM:
                stages -= 1
            yield LinearTiles(bm=32, bn=bn, bk=bk, split=split, warps=4, stages=stages, preload=preload)


def main(argv=None) -> int:
    def extra(ap):
        ap.add_argument("--sleep-us", type=float, default=10.0, help="the stand-in kernel's spin")
        ap.add_argument("--rows", type=int, default=6, help="rows of x (1 request x (seed + 5 drafts) = 6)")
        ap.add_argument("--modes", default="pair,tp1")
        ap.add_argument("--only", default="", help="comma list of shape names")
        ap.add_argument("--pad-rows", default="32", help="cuBLAS's padded row counts to time (the step: 32)")
        ap.add_argument("--no-triton", action="store_true", help="time cuBLAS only")
    started = kernel_bench.start("splitk_gemm", __doc__, 100, argv, extra=extra, pin=True)
    if started is None:
        return 2
    args, dev, g = started
    from dspark_ray.kernels import gemm
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    res = kernel_bench.header("splitk_gemm", {"rows": args.rows, "sleep_us": args.sleep_us, "calls_per_graph": CALLS,
                                              "reps": args.reps, "shapes": SHAPES}, cases={})
    sp = SpinStandIn(dev, args.sleep_us, args.reps)

    def after_spin_us(calls) -> float:
        us = sp.after_us(calls)
        COUNTERS.release()             # graph_time's graph is gone: its counters may be handed out again
        return us

    res["spin_alone_us"] = round(sp.alone_us, 2)
    only = set(filter(None, args.only.split(",")))
    pads = sorted({32, *map(int, args.pad_rows.split(","))})
    for mode in args.modes.split(","):
        for name, (n, k, groups, f16) in SHAPES[mode].items():
            if only and name not in only:
                continue
            copies = max(2, -(-200_000_000 // (n * k * 2)))
            ws = [(torch.randn((n, k), generator=g, device=dev) * 0.02).to(torch.float16) for _ in range(copies)]
            out = torch.float16 if f16 else torch.float32
            row = {"weight_mb": round(n * k * 2 / 1e6, 2), "copies": copies, "tilings": []}
            xs = {}
            for pad in pads:            # cuBLAS's padded call; PAD_ROWS is read at each call (32 in the step)
                gemm.PAD_ROWS = pad
                x = (gemm.grouped_rows_empty(args.rows, groups, k, torch.float16, dev) if groups > 1
                     else gemm.rows_empty(args.rows, k, torch.float16, dev))
                x.copy_(torch.randn(x.shape, generator=g, device=dev).to(torch.float16))
                xs[pad] = x

                def cublas(w, x=x):         # the baseline: cuBLAS on padded chunks
                    if groups > 1:
                        return gemm.padded_grouped_linear(x, w, dense="cublas")
                    return (gemm.padded_linear_f16 if f16 else gemm.padded_linear)(x, w, dense="cublas")
                us = round(after_spin_us([lambda w=w: cublas(w) for w in ws]), 2)
                row["cublas_us" if pad == 32 else f"cublas_pad{pad}_us"] = us
                gemm.PAD_ROWS = 32
            x = xs[32]                  # the Triton kernel reads the step's 32-row layout
            if args.no_triton:
                res["cases"][f"{mode} {name}"] = row
                print(f"splitk_gemm: {mode} {name}: {row}", file=sys.stderr, flush=True)
                continue
            for t in tilings(n, k, groups, sms):
                try:
                    us = after_spin_us([lambda w=w, t=t: splitk_linear(x, w, out, t, groups) for w in ws])
                except Exception as e:          # noqa: BLE001 - a tiling this Triton cannot build: recorded
                    row["tilings"].append({"tiles": t.__dict__, "error": f"{type(e).__name__}: {str(e)[:120]}"})
                    continue
                row["tilings"].append({"tiles": t.__dict__, "us": round(us, 2)})
            ok = [r for r in row["tilings"] if "us" in r]
            if ok:
                best = min(ok, key=lambda r: r["us"])
                row["best"] = best
                t = LinearTiles(**best["tiles"])
                w = ws[0]
                y = splitk_linear(x, w, out, t, groups)
                row["best_rel_err"] = kernel_bench.rel_err_fp64(
                    y, [x[:, i] for i in range(groups)] if groups > 1 else [x], w)
                row["best_deterministic"] = all(torch.equal(y, splitk_linear(x, ws[0], out, t, groups))
                                                for _ in range(100))     # a racy ticket would show as other bits
                row["best_row_alone_same_bits"] = bool(torch.equal(splitk_linear(x[:1], w, out, t, groups)[0], y[0]))
                row["best_over_cublas"] = round(best["us"] / row["cublas_us"], 3)
            res["cases"][f"{mode} {name}"] = row
            print(f"splitk_gemm: {mode} {name}: cublas {row['cublas_us']} us, best "
                  f"{row.get('best', {}).get('us')} us {row.get('best', {}).get('tiles')}", file=sys.stderr, flush=True)
            del ws
    emit(res, args.out, 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
