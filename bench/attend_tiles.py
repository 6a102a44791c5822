"""The attention's tiling: time and bits of `fused_attention.attend` per launch shape of its two kernels (GPU only).

In the kernel timeline of a draft step (1 request, n_out 5, full preset) the scores kernel ends ~9 us after the q
heads it reads are ready and the PV kernel ~6 us after it, three times a step on one card and on a pair rank alike
(latency, not bytes: the window is 128 rows of 1 KB). This times `attend` at the draft step's shapes (6 rows a
request, a pair rank's 32 heads and one card's 64, 128 window rows, D 512) for each tiling: the scores' (BM, BN,
BD, warps, stages) with the PV's default, and the PV's (BM, BD, warps, stages) with the scores' default. Each call
is timed in a captured chain of calls launched with programmatic dependent launch, as the graphs run them, and each
tiling's output must equal the default's bit for bit.

    python bench/attend_tiles.py [--reps 300] [--out bench/results/gpu/attend_tiles_h200.json]
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import kernel_bench  # noqa: E402
from bench.tcp_roundtrip import emit  # noqa: E402

B, D, RD, W = 6, 512, 64, 128
CASES = [(1, 32), (1, 64), (4, 32)]          # (requests, heads): a pair rank and one card at 1 request; 4 requests
SCORES = [dict(s_bm=16, s_bn=16, s_bd=128), dict(s_bd=256, s_warps=4, s_stages=2), dict(s_bd=128, s_warps=4),
          dict(s_warps=4), dict(s_warps=1), dict(s_stages=2), dict(s_stages=4), dict(s_bn=32, s_warps=4),
          dict(s_bm=32, s_warps=4), dict(s_bd=512, s_warps=4, s_stages=1)]
PV = [dict(p_warps=4), dict(p_bd=32, p_warps=4), dict(p_bd=32), dict(p_stages=1), dict(p_bm=32), dict(p_bm=32,
      p_warps=4)]


def main(argv=None) -> int:
    started = kernel_bench.start("attend_tiles", __doc__, 300, argv, extra=lambda ap: ap.add_argument(
        "--cold-only", action="store_true", help="the default tiling alone, warm and cold, at 1 request x 32 heads"))
    if started is None:
        return 2
    args, dev, g = started
    from dspark_ray.kernels import fused_attention as fa
    from dspark_ray.model.ops import Rope
    rope = Rope(RD, 10000.0, dev)
    flush = torch.empty(kernel_bench.FLUSH_BYTES, dtype=torch.uint8, device=dev)
    res = kernel_bench.header("attend_tiles", {"block": B, "head_dim": D, "rope_dim": RD, "window": W,
                                               "reps": args.reps, "default": dataclasses.asdict(fa.TILING)},
                              cases={})
    for bsz, nh in CASES[:1] if args.cold_only else CASES:
        q = torch.randn((bsz, B, nh, D), generator=g, device=dev).to(torch.float16)
        win = torch.randn((bsz, W, D), generator=g, device=dev).to(torch.float16)
        kv = torch.randn((bsz, B, D), generator=g, device=dev).to(torch.float16)
        valid = torch.ones((bsz, W), dtype=torch.bool, device=dev)
        valid[:, :7] = False                                    # a partial window: its oldest rows masked
        sink = torch.randn(nh, generator=g, device=dev)
        pos = (900000 + torch.arange(bsz * B, device=dev) % B).to(torch.int64)

        def call(t):
            return fa.attend(q, win, valid, kv, sink, D ** -0.5, pos, rope.inv_freq, RD, groups=nh // 8,
                             tiling=t)
        want = call(fa.TILING).clone()
        rows = {}
        for name, t in [("default", fa.TILING)] + [
                (",".join(f"{k}={v}" for k, v in kw.items()), dataclasses.replace(fa.TILING, **kw))
                for kw in ([] if args.cold_only else SCORES + PV)]:
            try:
                same = torch.equal(call(t), want)
                us = statistics.median(kernel_bench.graph_time([lambda: call(t)], 20, args.reps, pdl=True))
                rows[name] = {"p50_us": round(us, 2), "same_bits": same}
            except Exception as e:               # a tiling Triton cannot build here (registers, shared memory)
                rows[name] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
            print(f"attend_tiles: {bsz} req {nh} heads {name}: {rows[name]}", file=sys.stderr, flush=True)
        # The default with the inputs cold, as in the draft step (the experts' and GEMMs' weights stream through L2
        # between two blocks' attention): a graph of (L2 flush, attend) less a graph of the flush alone.
        flush_us = statistics.median(kernel_bench.graph_time([flush.zero_], 1, args.reps, pdl=True))
        both_us = 2 * statistics.median(kernel_bench.graph_time([flush.zero_, lambda: call(fa.TILING)], 2, args.reps,
                                                                pdl=True))
        rows["default, inputs cold"] = {"p50_us": round(both_us - flush_us, 2), "flush_p50_us": round(flush_us, 2)}
        print(f"attend_tiles: {bsz} req {nh} heads cold: {rows['default, inputs cold']}", file=sys.stderr, flush=True)
        res["cases"][f"{bsz}x{nh}"] = rows
    emit(res, args.out, 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
