"""A pair rank's GEMM with its weights read before the kernel ahead of it ends: how much of the GEMM would that hide?
(GPU only; a probe for item 4 of issue 7, docs/engine.md.)

Each dense GEMM of the draft step waits for the latency-bound kernel before it. Under programmatic dependent launch a kernel's programs may start
while that kernel runs, and a weight is never written inside a graph, so a GEMM could load its whole weight slice
into registers before its wait (`pdl_enter`) and, once the input is there, only multiply. A pair rank's shards
(wq_b 16384 x 1280, wo_b 5120 x 4096: 42 MB each) would nearly fit on chip spread over the SMs. (Until the
nineteenth session SHAPES held half these shards, 21 MB, whose time was then compared with the step's 42 MB GEMMs.)

Timed, in PDL graphs, behind a stand-in for the latency-bound kernel before it (a one-program kernel that spins
for `--sleep-us`): the step's GEMM (`gemm.padded_linear`, cuBLAS on 32 padded rows) and this probe's kernel (one
program per BLOCK_N weight rows, its (BLOCK_N, K) slice loaded before the wait, fp32 sums over K). The figure is the
time the GEMM adds after the stand-in: (stand-in + GEMM) - (stand-in alone), p50 of `--reps` replays of 10 pairs,
the calls rotating through COPIES copies of the weight so that none is read from L2.
The probe's output is checked against the fp32 reference (it is not the step's kernel: other bits).

    python bench/gemm_preload.py [--reps 200] [--sleep-us 10] [--out bench/results/gpu/gemm_preload_h200.json]
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import kernel_bench  # noqa: E402
from bench.tcp_roundtrip import emit  # noqa: E402
from dspark_ray.kernels.fused_ops import launch_opts  # noqa: E402

ROWS = 6                                         # 1 request x (seed + 5 drafts)
SHAPES = {"wq_b (pair rank)": (16384, 1280), "wo_b (pair rank)": (5120, 4096)}   # 32 of 64 heads, 4 of 8 o_groups
CALLS = 10
COPIES = 6                                       # weight copies the calls rotate through: 252 MB, past the 60 MB L2


@triton.jit
def _spin_kernel(cycles, PDL: tl.constexpr):
    """The stand-in for a latency-bound kernel: one program that lets the next kernel launch, then spins."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t0 = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,l", [tl.zeros((2,), tl.int64)], dtype=tl.int64,
                                   is_pure=False, pack=1)
    t = t0
    while tl.max(t - t0, axis=0) < cycles:
        t = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,l", [t0], dtype=tl.int64, is_pure=False, pack=1)


class SpinStandIn:
    """The latency-bound kernel a step's GEMM follows, stood in for by `_spin_kernel` (`sleep_us` at the H200's
    1980 MHz SM clock), and the time a call adds right behind it in a PDL graph: (spin + call) - (spin alone), p50
    of `reps` replays of CALLS pairs per call given. Also used by `bench/splitk_gemm.py`."""

    def __init__(self, dev: torch.device, sleep_us: float, reps: int):
        self.cycles, self.reps, self.flag = int(sleep_us * 1980), reps, torch.zeros(1, device=dev)
        self.alone_us = statistics.median(kernel_bench.graph_time([self.spin], CALLS, reps, pdl=True))

    def spin(self) -> None:
        _spin_kernel[(1,)](self.cycles, num_warps=1, **launch_opts(self.flag))

    def after_us(self, calls) -> float:
        """calls: one per weight copy (they rotate, so none reads from L2); each right behind a spin."""
        fns = [f for c in calls for f in (self.spin, c)]
        pair = statistics.median(kernel_bench.graph_time(fns, CALLS * len(fns), self.reps, pdl=True)) * 2
        return pair - self.alone_us


@triton.jit
def _preload_gemv_kernel(x_ptr, w_ptr, y_ptr, N, K: tl.constexpr, K_P: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """Program p: y[:, p*BLOCK_N : +BLOCK_N] = x @ w[that slice].T; the slice is loaded before the wait."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, K_P)
    w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=(n < N)[:, None] & (k < K)[None, :],
                other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for r in tl.static_range(ROWS):
        x = tl.load(x_ptr + r * K + k, mask=k < K, other=0.0).to(tl.float32)
        tl.store(y_ptr + r * N + n, tl.sum(w.to(tl.float32) * x[None, :], axis=1), mask=n < N)


def main(argv=None) -> int:
    def extra(ap):
        ap.add_argument("--sleep-us", type=float, default=10.0, help="the stand-in kernel's spin")
        ap.add_argument("--spread-gb", type=float, default=0.0, help="place the weight copies this many GB apart")
        ap.add_argument("--f16", action="store_true", help="cuBLAS with fp16 output (gemm.padded_linear_f16, as "
                        "the step's wq_a|wkv, wq_b and shared w1|w3) instead of fp32 (padded_linear, as wo_b)")
    started = kernel_bench.start("gemm_preload", __doc__, 200, argv, extra=extra, pin=True)
    if started is None:
        return 2
    args, dev, g = started
    from dspark_ray.kernels import gemm
    res = kernel_bench.header("gemm_preload", {"rows": ROWS, "shapes": SHAPES, "sleep_us": args.sleep_us,
                                               "spread_gb": args.spread_gb,
                                               "cublas_out": "fp16" if args.f16 else "fp32",
                                               "calls_per_graph": CALLS, "reps": args.reps}, cases={})
    sp = SpinStandIn(dev, args.sleep_us, args.reps)
    res["spin_alone_us"] = round(sp.alone_us, 2)
    cublas = gemm.padded_linear_f16 if args.f16 else gemm.padded_linear
    for name, (N, K) in SHAPES.items():
        if args.spread_gb:       # the copies args.spread_gb GB apart: the step's weights span 20-34 GB (TLB reach)
            pool = torch.empty(int(args.spread_gb * 2**30) * COPIES, dtype=torch.uint8, device=dev)
            stride = int(args.spread_gb * 2**30)
            ws = [pool[i * stride:i * stride + N * K * 2].view(torch.float16).view(N, K) for i in range(COPIES)]
            for c in ws:
                c.copy_((torch.randn((N, K), generator=g, device=dev) * 0.02).to(torch.float16))
        else:
            ws = [(torch.randn((N, K), generator=g, device=dev) * 0.02).to(torch.float16) for _ in range(COPIES)]
        w = ws[0]
        x = gemm.rows_empty(ROWS, K, torch.float16, dev)
        x.copy_(torch.randn((ROWS, K), generator=g, device=dev).to(torch.float16))
        y = torch.empty((ROWS, N), dtype=torch.float32, device=dev)
        ref = x.float() @ w.float().t()
        row = {"weight_mb": round(N * K * 2 / 1e6, 2)}
        row["cublas_after_spin_us"] = round(sp.after_us([lambda c=c: cublas(x, c) for c in ws]), 2)
        for bn in ((8, 16) if K > 2048 else (16, 32)):
            def probe(bn=bn, w=w):
                _preload_gemv_kernel[(triton.cdiv(N, bn),)](x, w, y, N, K=K, K_P=triton.next_power_of_2(K), ROWS=ROWS,
                                                             BLOCK_N=bn, num_warps=8, **launch_opts(y))
            try:
                probe()
                torch.cuda.synchronize()
                err = float((y - ref).abs().max() / ref.abs().max())
                row[f"preload_bn{bn}_after_spin_us"] = round(sp.after_us([lambda c=c, bn=bn: probe(bn, c) for c in ws]),
                                                              2)
                row[f"preload_bn{bn}_rel_err"] = err
            except Exception as e:       # a slice Triton cannot hold in registers
                row[f"preload_bn{bn}_error"] = f"{type(e).__name__}: {str(e)[:160]}"
        res["cases"][name] = row
        print(f"gemm_preload: {name}: {row}", file=sys.stderr, flush=True)
    emit(res, args.out, 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
