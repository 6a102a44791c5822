"""Is the router slow on its own, or only beside the shared expert's GEMM? (GPU only.)

In a block's ffn site the router's logits and top-k are on the critical path (the grouped experts wait for them)
while the shared expert's gate / up GEMM runs beside them on a side stream (`ops.branch`). In the kernel timeline
the router took 13 us on a pair rank and 20 us on one card, beside a GEMM of 9 / 16 us. This times, at the full
preset's shapes for one card and one pair rank, 5 rows (1 request, n_out 5):

* the router's logits kernel alone, and the GEMM alone;
* both at once on two streams of the same priority (as in the graphs);
* both at once with the router's stream at the highest priority (where a stream's priority orders the
  scheduling of waiting thread blocks).

Both streams are held behind one event until the two launches are queued, so the host's launch order does not
decide who starts first. p50 over `--reps` of the time from that event to each kernel's end.

With `--tilings`: instead, the router's logits in each tiling of TILINGS and its top-k in each warp count, at
5 and 20 rows, each captured 20 times back to back in one graph with programmatic dependent launch (as in the
graph set), us per call (p50 over `--reps` replays); `fused_moe.ROUTER_TILING` / `ROUTE_WARPS` take the fastest.

    python bench/router_overlap.py [--reps 300] [--tilings] [--out bench/results/gpu/router_overlap_h200.json]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import kernel_bench  # noqa: E402
from bench.tcp_roundtrip import emit  # noqa: E402

H, E, ROWS = 5120, 128, 5
SHARED_N = {"tp1": 2 * 2304, "rank": 2304}       # the shared expert's w1 | w3 rows: whole, or a pair rank's half
GATE_CYCLES = 2_000_000                          # ~1 ms of the gate stream's sleep: both launches queue behind it
# (rows per program, K chunk, warps) of the router's logits to time with --tilings
TILINGS = [(1, 1024, 4), (2, 1024, 4), (4, 1024, 4), (8, 1024, 4), (8, 1024, 8), (4, 2048, 4), (8, 512, 4),
           (16, 512, 4), (8, 2048, 8), (4, 512, 2), (8, 256, 2)]


def tilings(args, dev, g) -> dict:
    """The router's logits per tiling and its top-k per warp count, in PDL graphs (see the module doc)."""
    from dspark_ray.kernels.fused_moe import route, router_logits
    gate = torch.randn((E, H), generator=g, device=dev, dtype=torch.float16) * 0.02
    bsel = torch.randn(E, generator=g, device=dev) * 0.1
    res = {}
    for rows in (ROWS, 20):
        f = torch.randn((rows, H), generator=g, device=dev, dtype=torch.float16)
        lg = router_logits(f, gate, TILINGS[0])
        for t in TILINGS:
            ts = kernel_bench.graph_time([lambda t=t: router_logits(f, gate, t)], 20, args.reps, pdl=True)
            res[f"logits_rows{rows}_{'x'.join(map(str, t))}"] = kernel_bench.stats(ts)
        for w in (1, 2, 4, 8):
            ts = kernel_bench.graph_time([lambda w=w: route(lg, bsel, 3, 1.5, w)], 20, args.reps, pdl=True)
            res[f"route_rows{rows}_warps{w}"] = kernel_bench.stats(ts)
    for k, v in res.items():
        print(f"[router_overlap] {k}: {v}", file=sys.stderr, flush=True)
    return res


def main(argv=None) -> int:
    started = kernel_bench.start("router_overlap", __doc__, 300, argv, pin=True,
                                 extra=lambda ap: ap.add_argument("--tilings", action="store_true"))
    if started is None:
        return 2
    args, dev, g = started
    if args.tilings:
        res = kernel_bench.header("router_overlap", {"rows": [ROWS, 20], "hidden": H, "experts": E,
                                                     "reps": args.reps, "calls_per_graph": 20, "pdl": True},
                                  tilings=tilings(args, dev, g))
        emit(res, args.out, indent=1)
        return 0
    from dspark_ray.kernels import gemm
    from dspark_ray.kernels.fused_moe import router_logits
    f = gemm.rows_empty(ROWS, H, torch.float16, dev)      # as the model's: the padded GEMM reads it in place
    f.copy_(torch.randn((ROWS, H), generator=g, device=dev, dtype=torch.float16))
    gate = torch.randn((E, H), generator=g, device=dev, dtype=torch.float16) * 0.02
    least, greatest = torch.cuda.Stream.priority_range()
    res = kernel_bench.header("router_overlap", {"rows": ROWS, "hidden": H, "experts": E, "shared_n": SHARED_N,
                                                 "reps": args.reps, "priority_range": [least, greatest]}, cases={})
    for shape, n in SHARED_N.items():
        w13 = torch.randn((n, H), generator=g, device=dev, dtype=torch.float16) * 0.02

        def router():
            router_logits(f, gate)

        def shared(w=w13):
            gemm.padded_linear(f, w)

        for case, (a_prio, run_router, run_shared) in {
                "router_alone": (0, True, False), "gemm_alone": (0, False, True),
                "beside": (0, True, True), "beside_router_first": (greatest, True, True)}.items():
            sa, sb, sg = (torch.cuda.Stream(priority=a_prio), torch.cuda.Stream(priority=least),
                          torch.cuda.Stream(priority=least))
            start, end_a, end_b = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            ta, tb = [], []
            for r in range(args.reps + 20):
                with torch.cuda.stream(sg):
                    torch.cuda._sleep(GATE_CYCLES)
                    start.record()
                for s, on, fn, end in ((sa, run_router, router, end_a), (sb, run_shared, shared, end_b)):
                    with torch.cuda.stream(s):
                        s.wait_event(start)
                        if on:
                            fn()
                        end.record()
                torch.cuda.synchronize()
                if r >= 20:
                    ta.append(start.elapsed_time(end_a) * 1e3)
                    tb.append(start.elapsed_time(end_b) * 1e3)
            row = {}
            for name, on, ts in (("router_end", run_router, ta), ("gemm_end", run_shared, tb)):
                if on:
                    row[name] = kernel_bench.stats(ts)
            res["cases"][f"{shape}_{case}"] = row
            print(f"[router_overlap] {shape} {case}: {row}", file=sys.stderr, flush=True)
    emit(res, args.out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
