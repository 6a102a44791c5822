"""The routed experts' grouped kernel over its tile settings, at the full preset's shapes (GPU only).

At one request a block routes 5 rows x top-3 = 15 pairs to ~6 distinct experts (`--requests R`: 15 R pairs, to the
distinct experts a full-preset block reads at R requests on a pair rank: 6 / 8 / 11 / 14 for R = 1-4). The grouped
kernel (`kernels/fused_moe._grouped_expert_kernel`) gives each (expert, block of N outputs) one program that streams
that tile of the expert's weights over K. This times each setting (BLOCK_N, BLOCK_K, num_warps, num_stages) on one
card's and one pair rank's shapes, gated (w1 | w3 + SwiGLU) and plain (w2), on cold weights (a captured graph of 8
launches, each routed to another set of experts, replayed), beside the time to read the bytes at 4.2 TB/s, and
records whether each setting gives the bits of the base tiles (any fixed setting is batch invariant:
tests/test_fused.py). On the H200 every setting gave the base tiles' bits; the best per shape ran at 85-94 % of the
byte rate (gated) and 73-88 % (plain), narrower tiles (more programs per expert) ran slower, and the fastest are
`fused_moe.GROUPED_TILES` / `GROUPED_TILES_BY_SHAPE` (bench/results/gpu/expert_tiles_h200.json); those of 1-4
requests' few pairs are `fused_moe.FEW_PAIR_TIERS` (expert_tiles_bm_h200.json, expert_tiles_r{2,4}_h200.json, then
in the step).

    python bench/expert_tiles.py [--reps 200] [--requests 1] [--out bench/results/gpu/expert_tiles_h200.json]
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import kernel_bench  # noqa: E402
from bench.tcp_roundtrip import emit  # noqa: E402

H, E, TOPK, SETS = 5120, 128, 3, 8
# distinct experts a block reads at 1-4 requests (draft_step's "distinct experts" of a pair rank over its 3 blocks,
# bench/results/draft_step_h200x2.md: 17 / 25 / 34 / 42)
DISTINCT = {1: 6, 2: 8, 3: 11, 4: 14}
SHAPES = {"tp1_gated": (True, 2304, H), "tp1_w2": (False, H, 2304),
          "rank_gated": (True, 1152, H), "rank_w2": (False, H, 1152)}       # (gated, N, K)
BASE = (64, 128, 4, 3)             # the tiles before this bench (BLOCK_N, BLOCK_K, num_warps, Triton's default stages)
# (BLOCK_N, BLOCK_K, num_warps, num_stages[, pairs a pass BM]): narrower tiles spread an expert over more SMs;
# deeper stages keep more bytes in flight per SM; a smaller BM (the x tile's rows: ~3 pairs an expert at one
# request) shrinks the x loads and the dot of a K step. Each setting compiles twice (gated, plain), ~1.5 s each: the
# list is kept short.
SETTINGS = [BASE, (64, 128, 4, 4), (64, 128, 8, 3), (64, 64, 4, 4),
            (32, 128, 4, 3), (32, 128, 4, 4), (32, 128, 8, 4), (32, 256, 4, 3), (32, 256, 8, 3),
            (16, 128, 4, 3), (16, 128, 4, 4), (16, 256, 4, 3), (16, 256, 4, 4), (16, 256, 8, 3),
            # the nineteenth session's: shorter K steps with deeper pipelines, wider N
            (64, 64, 4, 5), (64, 64, 4, 6), (64, 64, 8, 4), (64, 32, 4, 8), (128, 64, 4, 4), (128, 64, 8, 4),
            (128, 64, 8, 3), (128, 128, 8, 3),
            # the twenty-fifth session's: fewer pairs a pass (BM 16 / 32)
            (64, 128, 4, 4, 16), (64, 64, 4, 6, 16), (32, 128, 4, 4, 16), (32, 256, 4, 4, 16), (16, 256, 4, 4, 16),
            (128, 64, 4, 4, 16), (128, 128, 4, 4, 16), (32, 128, 2, 4, 16), (64, 128, 4, 6, 16), (64, 128, 4, 4, 32),
            # the twenty-seventh session's: 32-pair passes for 2-4 requests' 30-60 pairs
            (32, 128, 2, 4, 32), (128, 64, 4, 4, 32), (64, 64, 4, 4, 32)]


def routing(g: torch.Generator, device, pairs: int, distinct: int) -> list[torch.Tensor]:
    """SETS routings of `pairs` pairs: rows of 3 distinct experts each, drawn from `distinct` experts (as a
    full-preset block), each set on experts of its own so that the timed launches read cold weights."""
    out = []
    for s in range(SETS):
        pool = torch.randperm(E // SETS, generator=g)[:distinct] + s * (E // SETS)
        rows = [pool[torch.randperm(distinct, generator=g)[:TOPK]].sort().values for _ in range(pairs // TOPK)]
        out.append(torch.cat(rows).to(torch.int32).to(device))
    return out


def launch(x, w1, w3, idx, out, gated, setting, x_div):
    from dspark_ray.kernels.fused_moe import ExpertTiles, grouped_launch
    grouped_launch(x, w1, w3 if gated else None, idx, out, x_div, 7.0, ExpertTiles(*setting))


def main(argv=None) -> int:
    started = kernel_bench.start("expert_tiles", __doc__, 200, argv,
                                 extra=lambda ap: (ap.add_argument("--shapes", default=",".join(SHAPES)),
                                                   ap.add_argument("--requests", type=int, default=1,
                                                                   choices=sorted(DISTINCT))))
    if started is None:
        return 2
    args, dev, gw = started                         # gw: weights and inputs, made on the card
    from dspark_ray.kernels.fused_moe import ExpertTiles, grouped_tiles
    g = torch.Generator().manual_seed(0)            # routing (host)
    pairs, distinct = 5 * TOPK * args.requests, DISTINCT[args.requests]
    res = kernel_bench.header("expert_tiles", {"requests": args.requests, "pairs": pairs, "distinct_experts": distinct,
                                               "experts": E,
                                               "routing_sets": SETS, "reps": args.reps, "base": BASE}, shapes={})
    for name in args.shapes.split(","):
        gated, n, k = SHAPES[name]
        w1 = torch.randn((E, n, k), generator=gw, device=dev, dtype=torch.float16) * 0.02
        w3 = torch.randn((E, n, k), generator=gw, device=dev, dtype=torch.float16) * 0.02 if gated else None
        x = torch.randn((pairs // TOPK if gated else pairs, k), generator=gw, device=dev, dtype=torch.float16)
        x_div = TOPK if gated else 1
        sets = routing(g, dev, pairs, distinct)
        out = torch.empty((pairs, n), dtype=torch.float16 if gated else torch.float32, device=dev)
        launch(x, w1, w3, sets[0], out, gated, BASE, x_div)
        ref = out.clone()
        byte_ms = distinct * n * k * 2 * (2 if gated else 1) / 4.2e12 * 1e3
        rows = []
        for st in SETTINGS:
            try:
                out.fill_(float("nan"))
                launch(x, w1, w3, sets[0], out, gated, st, x_div)
                torch.cuda.synchronize()
            except Exception as e:      # noqa: BLE001 - a setting that does not compile (shared memory) is skipped
                rows.append({"setting": st, "error": f"{type(e).__name__}: {str(e)[:120]}"})
                continue
            same = bool(torch.equal(out.view(torch.int16) if gated else out.view(torch.int32),
                                    ref.view(torch.int16) if gated else ref.view(torch.int32)))
            # SETS launches in one graph, one per routing set: no host launch cost timed
            calls = [functools.partial(launch, x, w1, w3, idx, out, gated, st, x_div) for idx in sets]
            rows.append({"setting": st, "same_bits": same,
                         **kernel_bench.stats(kernel_bench.graph_time(calls, SETS, args.reps))})
            print(f"[expert_tiles] {name} {st}: {rows[-1]['p50_us']} us same_bits={same}", file=sys.stderr,
                  flush=True)
        ok = [r for r in rows if "p50_us" in r]
        best = min(ok, key=lambda r: r["p50_us"])
        base = next(r for r in ok if tuple(r["setting"]) == BASE)
        in_use = grouped_tiles(gated, n, k, dev.index or 0, pairs)
        used = next((r for r in ok if ExpertTiles(*r["setting"]) == in_use), None)
        res["shapes"][name] = {"gated": gated, "N": n, "K": k, "byte_bound_us": round(byte_ms * 1e3, 1),
                               "base": base, "in_use": used, "best": best, "all": rows}
        del w1, w3
        torch.cuda.empty_cache()
    emit(res, args.out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
