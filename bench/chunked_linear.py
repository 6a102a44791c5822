"""Wide batches' dense linears: cuBLAS on each 32-row chunk (what the step does: `kernels/gemm.py`, one weight read
per chunk) against one Triton launch that reads each weight tile once and applies it to every chunk. GPU only; an
experiment for the next GPU session, not used by the step.

    python bench/chunked_linear.py [--reps 50] [--chunks 1,2,3] [--modes tp1,pair] \
        [--out bench/results/gpu/chunked_linear_h200.json]

Why: batch invariance pads a batch's rows to chunks of exactly 32 for cuBLAS, so 16 requests (80 rows) read every
dense weight three times; on one H200 that is ~1.2 ms of a 5.3 ms draft step (notes/engine.md, twenty-second
session). The kernel here keeps one (BK, BN) weight tile in registers for every chunk's 32-row `tl.dot`, each chunk
its own accumulator: a row's products and their order depend on that row and the weights only, whatever the chunk
count (checked below, bit for bit). Adopting it would mean the same kernel at every batch width, one request too, so
its 1-chunk time against cuBLAS matters as much as its 3-chunk time.

Per (mode, shape, chunks): `cublas_us` (chunks calls of the padded 32-row GEMM) and `chunked_us` (one launch), each
(spin + call) - (spin alone) right behind a latency-bound stand-in in a PDL graph, p50 of `--reps` replays, the calls
rotating through copies of the weight past the L2; the chunked kernel's error against fp64, and whether each chunk's
rows equal the same rows run as one chunk (batch invariant) and 20 repeated calls (deterministic).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import kernel_bench  # noqa: E402
from bench.gemm_preload import SpinStandIn  # noqa: E402
from bench.tcp_roundtrip import emit  # noqa: E402
from dspark_ray.kernels.fused_ops import F16, launch_opts, pdl_enter  # noqa: E402

ROWS = 32               # kernels/gemm.PAD_ROWS: a chunk

# (N, K, fp16 out) of the draft step's dense linears with one row block per call (the grouped wo_a left out), for
# one pair rank and for one card; the head is the largest read of all.
SHAPES = {
    "pair": {"wq_a|wkv": (1792, 5120, True), "wq_b": (16384, 1280, True), "wo_b": (5120, 4096, False),
             "shared w1|w3": (2304, 5120, True), "head": (64640, 5120, True)},
    "tp1": {"wq_a|wkv": (1792, 5120, True), "wq_b": (32768, 1280, True), "wo_b": (5120, 8192, False),
            "shared w1|w3": (4608, 5120, True), "head": (129280, 5120, True)},
}


@triton.jit
def _chunk_dot(x_ptr, kk, k_ok, wt, acc, c: tl.constexpr, K):
    """One chunk's 32 rows against the weight tile: the same 32 x BK x BN dot for every chunk."""
    rows = c * 32 + tl.arange(0, 32)
    xt = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + kk[None, :], mask=k_ok[None, :], other=0.0)
    return tl.dot(xt, wt, acc)


@triton.jit
def _store_chunk(out_ptr, acc, c: tl.constexpr, cols, c_ok, N, OUT_F16: tl.constexpr):
    dst = out_ptr + (c * 32 + tl.arange(0, 32)).to(tl.int64)[:, None] * N + cols[None, :]
    if OUT_F16:
        tl.store(dst, acc.to(tl.float16), mask=c_ok[None, :])
    else:
        tl.store(dst, acc, mask=c_ok[None, :])


@triton.jit
def _chunked_linear_kernel(x_ptr, w_ptr, out_ptr, N, K, CHUNKS: tl.constexpr, OUT_F16: tl.constexpr,
                           BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    """Program p: columns [p * BN, (p + 1) * BN) of out for every chunk of x ((CHUNKS * 32, K) fp16, padded)."""
    pdl_enter(PDL)
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    c_ok = cols < N
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * K
    acc0 = tl.zeros((32, BN), dtype=tl.float32)
    acc1 = tl.zeros((32, BN), dtype=tl.float32)
    acc2 = tl.zeros((32, BN), dtype=tl.float32)
    acc3 = tl.zeros((32, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        kk = k + tl.arange(0, BK)
        k_ok = kk < K
        wt = tl.load(w_cols + kk[:, None], mask=k_ok[:, None] & c_ok[None, :], other=0.0)
        acc0 = _chunk_dot(x_ptr, kk, k_ok, wt, acc0, 0, K)
        if CHUNKS > 1:
            acc1 = _chunk_dot(x_ptr, kk, k_ok, wt, acc1, 1, K)
        if CHUNKS > 2:
            acc2 = _chunk_dot(x_ptr, kk, k_ok, wt, acc2, 2, K)
        if CHUNKS > 3:
            acc3 = _chunk_dot(x_ptr, kk, k_ok, wt, acc3, 3, K)
    _store_chunk(out_ptr, acc0, 0, cols, c_ok, N, OUT_F16)
    if CHUNKS > 1:
        _store_chunk(out_ptr, acc1, 1, cols, c_ok, N, OUT_F16)
    if CHUNKS > 2:
        _store_chunk(out_ptr, acc2, 2, cols, c_ok, N, OUT_F16)
    if CHUNKS > 3:
        _store_chunk(out_ptr, acc3, 3, cols, c_ok, N, OUT_F16)


def chunked_linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype, bn: int = 64, bk: int = 128,
                   warps: int = 4, stages: int = 3) -> torch.Tensor:
    """x (chunks * 32, K) fp16, its rows padded to whole chunks (1-4), @ w (N, K).T -> (chunks * 32, N)."""
    m, k = x.shape
    chunks = m // ROWS
    assert m == chunks * ROWS and 1 <= chunks <= 4 and x.is_contiguous() and w.is_contiguous()
    n = w.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    _chunked_linear_kernel[(triton.cdiv(n, bn),)](x, w, out, n, k, CHUNKS=chunks, OUT_F16=out_dtype == F16,
                                                  BN=bn, BK=bk, num_warps=warps, num_stages=stages,
                                                  **launch_opts(out))
    return out


def main(argv=None) -> int:
    def extra(ap):
        ap.add_argument("--sleep-us", type=float, default=10.0, help="the stand-in kernel's spin")
        ap.add_argument("--chunks", default="1,2,3", help="32-row chunks per call (3: 16 requests of 5 rows)")
        ap.add_argument("--modes", default="tp1,pair")
        ap.add_argument("--only", default="", help="comma list of shape names")
    started = kernel_bench.start("chunked_linear", __doc__, 50, argv, extra=extra, matmul="fast")
    if started is None:
        return 2
    args, dev, g = started
    from dspark_ray.kernels import gemm
    chunk_counts = [int(c) for c in args.chunks.split(",")]
    res = kernel_bench.header("chunked_linear", {"chunks": chunk_counts, "sleep_us": args.sleep_us, "reps": args.reps,
                                                 "shapes": SHAPES}, cases={})
    sp = SpinStandIn(dev, args.sleep_us, args.reps)
    res["spin_alone_us"] = round(sp.alone_us, 2)
    only = set(filter(None, args.only.split(",")))
    for mode in args.modes.split(","):
        for name, (n, k, f16) in SHAPES[mode].items():
            if only and name not in only:
                continue
            copies = max(2, -(-200_000_000 // (n * k * 2)))
            ws = [(torch.randn((n, k), generator=g, device=dev) * 0.02).to(torch.float16) for _ in range(copies)]
            out = torch.float16 if f16 else torch.float32
            mm = gemm.padded_linear_f16 if f16 else gemm.padded_linear
            for chunks in chunk_counts:
                x = (torch.randn((chunks * ROWS, k), generator=g, device=dev)).to(torch.float16)
                row = {"weight_mb": round(n * k * 2 / 1e6, 2), "copies": copies}
                row["cublas_us"] = round(sp.after_us([lambda w=w: mm(x, w) for w in ws]), 2)
                row["chunked_us"] = round(sp.after_us([lambda w=w: chunked_linear(x, w, out) for w in ws]), 2)
                row["chunked_over_cublas"] = round(row["chunked_us"] / row["cublas_us"], 3)
                y = chunked_linear(x, ws[0], out)
                ref = x.double() @ ws[0].double().t()
                row["rel_err"] = float((y.double() - ref).abs().max() / ref.abs().max())
                row["chunks_alone_same_bits"] = all(
                    torch.equal(chunked_linear(x[c * ROWS:(c + 1) * ROWS].contiguous(), ws[0], out),
                                y[c * ROWS:(c + 1) * ROWS]) for c in range(chunks))
                row["deterministic"] = all(torch.equal(y, chunked_linear(x, ws[0], out)) for _ in range(20))
                res["cases"][f"{mode} {name} x{chunks}"] = row
                print(f"chunked_linear: {mode} {name} x{chunks}: {row}", file=sys.stderr, flush=True)
            del ws
    emit(res, args.out, 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
