"""The Markov loop's tiling: time and bits of `fused_head.markov_step` per tiling (GPU only).

The loop is 5 dependent steps, each reading all of markov_w2 (vocab x 256 fp16: 66 MB on one card, 33 MB on a pair
rank) to add a bigram bias to the head's logits and take the argmax. In the kernel timeline a step took 24.5 us on
one card and 10-14 us on a pair rank: 2.7 TB/s, under the card's byte rate, with 128-row tiles (one 64 KB tile
per 8-warp program, about one program per SM at a time). This times the 5 chained steps of one replay, as the
graphs run them (captured with programmatic dependent launch), for each (rows per tile, tiles per program, warps),
behind an L2 flush (in the draft step the head GEMM streams 0.7-1.3 GB just before the loop), and checks that
every tiling gives the bits of the first: drafts, Markov embeddings, top-1 / runner-up, and the logits.

    python bench/markov_step.py [--reps 300] [--out bench/results/gpu/markov_step_h200.json]
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

R, N_OUT = 256, 5
SHAPES = {"tp1": 129280, "pair_rank": 64768}          # the vocab a card holds: all of it, or rank 0's shard
TILINGS = [(128, 1, 8), (64, 1, 4), (32, 1, 4), (16, 1, 1), (32, 2, 4), (32, 2, 2), (16, 2, 2), (16, 4, 2),
           (32, 3, 4), (64, 2, 8), (32, 4, 4)]


def chain(step, lg, seeds, w1, w2, tiling, keep):
    """The loop's 5 steps, each fed the last one's argmax: per step (me, top1, top2, idx, logits)."""
    prev, out = seeds, []
    for i in range(N_OUT):
        res = step(lg, i, prev, w1, w2, None, 0, keep, tiling=tiling)
        out.append(res)
        prev = res[3]
    return out


def main(argv=None) -> int:
    started = kernel_bench.start("markov_step", __doc__, 300, argv)
    if started is None:
        return 2
    args, dev, g = started
    from dspark_ray.kernels import fused_ops
    from dspark_ray.kernels.fused_head import markov_step
    flush = torch.empty(kernel_bench.FLUSH_BYTES, dtype=torch.uint8, device=dev)
    res = kernel_bench.header("markov_step", {"rank": R, "n_out": N_OUT, "shapes": SHAPES, "reps": args.reps,
                                              "flush_mib": kernel_bench.FLUSH_BYTES >> 20,
                                              "pdl": fused_ops.pdl_active(dev)},
                              cases={})

    def replay_us(fn) -> float:         # as the graphs run it: captured with programmatic dependent launch
        return statistics.median(kernel_bench.graph_time([fn], 1, args.reps, pdl=True))

    for shape, V in SHAPES.items():
        w2 = torch.randn((V, R), generator=g, device=dev, dtype=torch.float16) * 0.05
        w1 = (torch.randn((V, R), generator=g, device=dev) * 0.5).to(torch.bfloat16)
        for bsz in (1, 4):
            lg = torch.randn((bsz, N_OUT, V), generator=g, device=dev, dtype=torch.float16) * 2
            lg[:, :, 1000:1003] = 30.0              # a tie at the top of every step: the lower id must win
            seeds = torch.randint(0, V, (bsz,), generator=g, device=dev)
            ref = None
            flush_us = replay_us(lambda: flush.fill_(1))
            for tiling in TILINGS:
                name = f"{shape} bsz{bsz} {tiling[0]}x{tiling[1]} w{tiling[2]}"
                out = chain(markov_step, lg, seeds, w1, w2, tiling, True)
                bits = [torch.cat([t.reshape(-1).view(torch.uint8) for t in step]) for step in out]
                if ref is None:
                    ref = bits
                same = all(torch.equal(a, b) for a, b in zip(ref, bits))
                cold_us = replay_us(lambda: (flush.fill_(1), chain(markov_step, lg, seeds, w1, w2, tiling, False)))
                cold_us -= flush_us
                warm_us = replay_us(lambda: chain(markov_step, lg, seeds, w1, w2, tiling, False))
                res["cases"][name] = {"shape": shape, "vocab": V, "bsz": bsz, "tiling": list(tiling),
                                      "loop_us_after_flush": round(cold_us, 1), "loop_us_l2_warm": round(warm_us, 1),
                                      "bits_equal_first_tiling": same}
                print(f"markov_step: {name}: {cold_us:.1f} us after a flush, {warm_us:.1f} us warm, "
                      f"bits {'equal' if same else 'DIFFER'}", file=sys.stderr, flush=True)
    emit(res, args.out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
