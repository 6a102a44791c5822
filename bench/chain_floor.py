"""What one dependent step of a latency-bound chain costs: a kernel boundary (PDL or plain) against a software grid
barrier inside one persistent kernel. GPU only; a probe for item 4 of issue 7 (docs/engine.md).

The draft step's replicated work is ~30 latency-bound kernels a block (mHC, norms, router, attention), 3-7 us each
even alone (`bench/kernel_alone.py`). If a kernel boundary is what costs, a persistent kernel per site or per block
(its stages separated by grid barriers) would cut that time on both cards alike, which is what the 0.6 target needs.
Each stage here reads READ values spread over the whole vector the previous stage wrote (every program's slice),
sums them and writes its own slice: the data dependence of an mHC or norm stage, with almost no work.

    python bench/chain_floor.py [--reps 200] [--out bench/results/gpu/chain_floor_h200.json]

Per variant: the graph's time for 20 and for 60 stages (p50 of `--reps` replays, CUDA events), and the cost of one
stage, (t60 - t20) / 40 us: `chain_pdl` (one kernel a stage, programmatic dependent launch as in the graph set),
`chain_plain` (one kernel a stage, plain launches), `persistent` (one kernel, a grid barrier between stages: an
atomic ticket per program, then a spin on the counter with acquire loads; one program per SM, all resident).
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

SLICE = 256                     # values each program writes a stage


@triton.jit
def _gather_sum(src, p, n, READ: tl.constexpr):
    i = tl.arange(0, READ)
    return tl.sum(tl.load(src + (i * 7919 + p * 131) % n, cache_modifier=".cg"), axis=0)


@triton.jit
def _stage_kernel(src, dst, n, READ: tl.constexpr, SL: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    p = tl.program_id(0)
    s = _gather_sum(src, p, n, READ)
    j = tl.arange(0, SL)
    tl.store(dst + p * SL + j, s * 1e-6 + j.to(tl.float32))


@triton.jit
def _persistent_kernel(buf, bar, n, stages, READ: tl.constexpr, SL: tl.constexpr):
    p = tl.program_id(0)
    nprog = tl.num_programs(0)
    j = tl.arange(0, SL)
    for st in range(stages):
        src = buf + (st % 2) * n
        dst = buf + ((st + 1) % 2) * n
        s = _gather_sum(src, p, n, READ)
        tl.store(dst + p * SL + j, s * 1e-6 + j.to(tl.float32))
        tl.debug_barrier()
        tl.atomic_add(bar, 1, sem="release", scope="gpu")
        want = (st + 1) * nprog
        while tl.atomic_add(bar, 0, sem="acquire", scope="gpu") < want:
            pass


def main(argv=None) -> int:
    def extra(ap):
        ap.add_argument("--reads", default="256,4096,16384", help="values each program gathers a stage")
        ap.add_argument("--programs", default="132,32", help="programs a stage (132: one per SM of an H200)")
    started = kernel_bench.start("chain_floor", __doc__, 200, argv, extra=extra)
    if started is None:
        return 2
    args, dev, _ = started
    from dspark_ray.kernels.fused_ops import launch_opts
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    res = kernel_bench.header("chain_floor", {"slice": SLICE, "reps": args.reps, "sms": sms}, cases={})
    for nprog in map(int, args.programs.split(",")):
        nprog = min(nprog, sms)
        n = nprog * SLICE
        buf = torch.rand(2 * n, device=dev)
        bar = torch.zeros(1, dtype=torch.int32, device=dev)
        for read in map(int, args.reads.split(",")):
            row = {}

            def total_us(fns, calls, pdl):
                return statistics.median(kernel_bench.graph_time(fns, calls, args.reps, pdl=pdl)) * calls

            for name, pdl in (("chain_pdl", True), ("chain_plain", False)):
                def stage(a, b):
                    return lambda: _stage_kernel[(nprog,)](buf[a * n:], buf[b * n:], n, READ=read, SL=SLICE,
                                                           num_warps=4, **launch_opts(buf))
                fns = [stage(0, 1), stage(1, 0)]
                t = {k: total_us(fns, k, pdl) for k in (20, 60)}
                row[name] = {"t20_us": round(t[20], 2), "t60_us": round(t[60], 2),
                             "per_stage_us": round((t[60] - t[20]) / 40, 3)}
            t = {}
            for k in (20, 60):
                fns = [lambda: bar.zero_(),
                       lambda k=k: _persistent_kernel[(nprog,)](buf, bar, n, k, READ=read, SL=SLICE, num_warps=4)]
                t[k] = total_us(fns, 2, False)
            row["persistent"] = {"t20_us": round(t[20], 2), "t60_us": round(t[60], 2),
                                 "per_stage_us": round((t[60] - t[20]) / 40, 3)}
            res["cases"][f"programs {nprog}, read {read}"] = row
            print(f"chain_floor: programs {nprog}, read {read}: " +
                  ", ".join(f"{k} {v['per_stage_us']} us" for k, v in row.items()), file=sys.stderr, flush=True)
    emit(res, args.out, 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
