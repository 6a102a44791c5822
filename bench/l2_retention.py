"""Does a weight read once stay in L2 for the GEMM that reads it next? (GPU only.)

The one lever found so far that would shorten the pair's step more than one card's: a pair rank's GEMM shards are
half one card's (wq_b 42 MB against 84, wo_a 34 against 67, wo_b 42 against 84, the shared expert 35 against 71),
and a block spends ~85 us in latency-bound kernels that read little. If a shard read ahead of time on a side stream
(during that chain) stayed in L2, the pair's GEMMs would read it from L2 while one card's, twice the size, would
not fit. The Markov loop says it may not: a pair rank's 33 MB markov_w2, read 5 times in a row, read at the HBM
rate every time (`gpu/markov_step_h200.json`).

This times the batch-invariant GEMM (`gemm.padded_linear_f16`: 5 rows padded to 32, fp16 out) of a (N, 5120)
weight of each size, behind a 256 MB L2 flush ("cold"), and behind the flush and one read of the weight
("read ahead": a sum over it, on the same stream), p50 of `--reps` each. Each case is queued behind a GPU sleep,
so the events time the GEMM and not the host's launch of it. The chain cases put ~25 us of GPU sleep (a stand-in
for a block's latency-bound chain) before the GEMM: "chain" alone, "chain_prefetch" with `prefetch` below reading
the weight into L2 on a side stream beside it (one prefetch per 32-byte sector; "chain_prefetch128": per 128-byte
line).

What it found on the H200 (`bench/results/gpu/l2_retention_h200.json`): a whole read ahead leaves a 32-64 MB
weight's GEMM 0.81-0.84x as long, but prefetch instructions beside the chain save only 0.3-4 us (1.4 us at 32 MB),
and as a hint in the draft step (a pair rank's wq_b, wo_a, the shared expert's w1 | w3) they made the step slower:
the GPU's part 803 / 802 -> 817 / 817 us on a pair rank, and 1250 -> 1300 us on one card, whose shared w1 | w3 sat
at the fit line (tried at a5003b6, removed). A ratio well under 1 at a shard's size
means the read-ahead would pay.

    python bench/l2_retention.py [--reps 200] [--out bench/results/gpu/l2_retention_h200.json]
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

K, ROWS = 5120, 5
SIZES_MB = (8, 12, 16, 20, 24, 32, 40, 48, 64)
HOLD_CYCLES = 1_000_000      # ~0.5 ms: longer than the host takes to queue a case (its first run timed the launches)
CHAIN_CYCLES = 50_000        # ~25 us of "latency-bound chain" (a sleep) before the GEMM in the chain cases
CASES = ("cold", "read_ahead", "chain", "chain_prefetch", "chain_prefetch128")


@triton.jit
def _prefetch_kernel(base_ptr, n, STRIDE_BYTES: tl.constexpr, BLOCK: tl.constexpr):
    """Program p prefetches (into L2, evict-last) the addresses base + STRIDE_BYTES * i of its BLOCK-wide steps."""
    p = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    for start in range(p * BLOCK, n, step):
        i = start + tl.arange(0, BLOCK)
        addr = base_ptr + tl.where(i < n, i, 0).to(tl.int64) * STRIDE_BYTES    # past the end: the first again
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                                  [addr.to(tl.int64)], dtype=tl.int32, is_pure=False, pack=1)


def prefetch(w: torch.Tensor, stride: int, programs: int = 16) -> None:
    """Queue prefetches of every `stride` bytes of w (contiguous) from a few programs: they hold no registers for
    the data and the kernel ends once they are issued."""
    n = -(-w.numel() * w.element_size() // stride)
    _prefetch_kernel[(programs,)](w.view(-1).view(torch.uint8), n, STRIDE_BYTES=stride, BLOCK=1024, num_warps=4)


def main(argv=None) -> int:
    started = kernel_bench.start("l2_retention", __doc__, 200, argv, pin=True)
    if started is None:
        return 2
    args, dev, g = started
    from dspark_ray.kernels import gemm
    flush = torch.empty(kernel_bench.FLUSH_BYTES, dtype=torch.uint8, device=dev)
    x = gemm.rows_empty(ROWS, K, torch.float16, dev)
    x.copy_(torch.randn((ROWS, K), generator=g, device=dev, dtype=torch.float16))
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    res = kernel_bench.header("l2_retention", {"k": K, "rows": ROWS, "sizes_mb": SIZES_MB, "reps": args.reps,
                                               "flush_mib": kernel_bench.FLUSH_BYTES >> 20,
                                               "l2_bytes": torch.cuda.get_device_properties(dev).L2_cache_size},
                              sizes={})
    side = torch.cuda.Stream()
    for mb in SIZES_MB:
        n = (mb << 20) // (2 * K) // 128 * 128
        w = torch.randn((n, K), generator=g, device=dev, dtype=torch.float16) * 0.02
        times = {c: [] for c in CASES}
        for i in range(args.reps + 10):
            for case in times:
                torch.cuda._sleep(HOLD_CYCLES)     # the GPU waits while the host queues the rest: no launch gap
                flush.fill_(i & 0xFF)
                if case == "read_ahead":
                    w.sum(dtype=torch.float32)
                ev[0].record()
                if case.startswith("chain_prefetch"):       # the prefetch beside a latency-bound chain
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        prefetch(w, stride=32 if case == "chain_prefetch" else 128)
                if case.startswith("chain"):
                    torch.cuda._sleep(CHAIN_CYCLES)
                gemm.padded_linear_f16(x, w)
                ev[1].record()
                ev[1].synchronize()
                torch.cuda.current_stream().wait_stream(side)
                if i >= 10:
                    times[case].append(ev[0].elapsed_time(ev[1]) * 1e3)
        med = {c: statistics.median(t) for c, t in times.items()}
        row = {"rows": n, "bytes": n * K * 2, **{f"{c}_us": round(v, 1) for c, v in med.items()},
               "ratio": round(med["read_ahead"] / med["cold"], 3),
               "prefetch_saves_us": round(med["chain"] - med["chain_prefetch"], 1),
               "cold_tb_s": round(n * K * 2 / med["cold"] / 1e6, 2)}
        res["sizes"][f"{mb} MB"] = row
        print(f"l2_retention: {mb} MB: " + ", ".join(f"{c} {v:.1f} us" for c, v in med.items())
              + f"; read ahead / cold {row['ratio']:.2f}; the prefetch beside the chain saves "
              f"{row['prefetch_saves_us']:.1f} us", file=sys.stderr, flush=True)
        del w
    emit(res, args.out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
