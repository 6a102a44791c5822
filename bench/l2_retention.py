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
so the events time the GEMM and not the host's launch of it. A ratio well under 1 at a shard's size
means the read-ahead would pay.

    python bench/l2_retention.py [--reps 200] [--out bench/results/gpu/l2_retention_h200.json]
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import kernel_bench  # noqa: E402
from bench.tcp_roundtrip import emit  # noqa: E402

K, ROWS = 5120, 5
SIZES_MB = (8, 12, 16, 20, 24, 32, 40, 48, 64)
HOLD_CYCLES = 1_000_000      # ~0.5 ms: longer than the host takes to queue a case (its first run timed the launches)


def main(argv=None) -> int:
    started = kernel_bench.start("l2_retention", __doc__, 200, argv, matmul="fast")
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
    for mb in SIZES_MB:
        n = (mb << 20) // (2 * K) // 128 * 128
        w = torch.randn((n, K), generator=g, device=dev, dtype=torch.float16) * 0.02
        times = {"cold": [], "read_ahead": []}
        for i in range(args.reps + 10):
            for case in times:
                torch.cuda._sleep(HOLD_CYCLES)     # the GPU waits while the host queues the rest: no launch gap
                flush.fill_(i & 0xFF)
                if case == "read_ahead":
                    w.sum(dtype=torch.float32)
                ev[0].record()
                gemm.padded_linear_f16(x, w)
                ev[1].record()
                ev[1].synchronize()
                if i >= 10:
                    times[case].append(ev[0].elapsed_time(ev[1]) * 1e3)
        cold, ahead = statistics.median(times["cold"]), statistics.median(times["read_ahead"])
        res["sizes"][f"{mb} MB"] = {"rows": n, "bytes": n * K * 2, "cold_us": round(cold, 1),
                                    "read_ahead_us": round(ahead, 1), "ratio": round(ahead / cold, 3),
                                    "cold_tb_s": round(n * K * 2 / cold / 1e6, 2)}
        print(f"l2_retention: {mb} MB: cold {cold:.1f} us, read ahead {ahead:.1f} us ({ahead / cold:.2f})",
              file=sys.stderr, flush=True)
        del w
    emit(res, args.out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
