"""The fast-path matmuls of `dspark_ray.kernels.gemm` against what a library would do, at the full model's draft
shapes (rank 0 of a tp2 pair), all inside CUDA graphs.

* dense: `padded_linear` (cuBLAS, always 32 rows) vs plain `torch.mm(x, w.t(), out_dtype=fp32)` at the true row
  count (cuBLAS's own choice, not batch invariant), for M = 5, 10, 15, 20 rows.
* grouped: `padded_grouped_linear` (the attention's wo_a, one batched GEMM writing the row-major layout wo_b reads)
  vs the same batched GEMM written group-major and transposed by a copy kernel (the form before 2026-11-30).
* experts: `indexed_linear` (Triton, each pair reads its own expert) vs gather + bmm
  (`torch.bmm(x[:, None], w[idx].transpose(1, 2))`), E = 128 experts of (1152, 5120), P = 3 * M pairs, random idx.

Method (as bench/collectives.py): each op captured --calls times back to back in one graph; a replay is timed with
CUDA events around g.replay(); per-call time = replay time / calls; p50 / p99 / min over --replays replays, after 5
warm-up replays. Consecutive calls of a dense shape cycle through enough copies of the weight (>= 256 MB in all) that
each call reads its weight from HBM, not L2, as the drafter does (each layer's weights are read once per step).
Effective TB/s = weight bytes read per call / p50 (experts: the distinct experts of idx).

    python bench/gemm.py --out bench/results/gemm_h200.json
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.kernel_bench import graph_time, stats  # noqa: E402
from bench.tcp_roundtrip import _commit, emit  # noqa: E402

# (name, N, K) of the dense GEMMs one rank runs (tp2 halves where the layer is split; wq_a | wkv and the shared
# expert's w1 | w3 run as one GEMM each in the draft, wkv alone in the insert).
DENSE = [("main_proj", 5120, 15360), ("wq_a|wkv", 1792, 5120), ("wq_b", 16384, 1280), ("wkv", 512, 5120),
         ("wo_b", 5120, 4096), ("shared_w1|w3", 2304, 5120), ("shared_w2", 5120, 1152), ("head", 64640, 5120)]
GROUPED = (4, 1024, 4096)            # a pair rank's wo_a: G = 4 of the 8 o_groups, R = o_lora_rank, K = 8 heads * D
EXPERTS = (128, 1152, 5120)          # E, N, K: one rank's half of a routed expert's w1 / w3
TOP_K = 3
COLD_BYTES = 256 << 20


def entry(kind, name, m, n, k, wbytes, ours, base, extra=None):
    e = {"kind": kind, "name": name, "rows": m, "N": n, "K": k, "weight_mb": round(wbytes / 1e6, 2),
         "fast": stats(ours), "baseline": stats(base)}
    e["ratio_p50"] = round(e["fast"]["p50_us"] / e["baseline"]["p50_us"], 3)
    e["fast_tbs"] = round(wbytes / (e["fast"]["p50_us"] * 1e-6) / 1e12, 3)
    e["baseline_tbs"] = round(wbytes / (e["baseline"]["p50_us"] * 1e-6) / 1e12, 3)
    e.update(extra or {})
    return e


def add(rows: list, e: dict, label: str, base_name: str, extra: str = "") -> None:
    """Keep an entry and say it in one line."""
    rows.append(e)
    print(f"{label}  fast {e['fast']['p50_us']:8.1f} us ({e['fast_tbs']:.2f} TB/s)  {base_name} "
          f"{e['baseline']['p50_us']:8.1f} us  ratio {e['ratio_p50']:.2f}{extra}", file=sys.stderr, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="5,10,15,20", help="draft row counts M (comma separated)")
    ap.add_argument("--calls", type=int, default=20, help="calls captured per graph")
    ap.add_argument("--replays", type=int, default=200, help="timed replays per entry")
    ap.add_argument("--only", choices=["dense", "grouped", "experts"], help="run one half only")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()

    import torch
    from dspark_ray.kernels import gemm
    if not torch.cuda.is_available():
        sys.exit("bench/gemm.py needs CUDA")
    pinned = gemm.pin_determinism()                 # before the first cuBLAS call of the process
    dev = torch.device("cuda")
    rows_list = [int(r) for r in args.rows.split(",")]
    f32 = torch.float32
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)

    if args.only in (None, "dense"):
        for name, n, k in DENSE:
            wbytes = n * k * 2
            copies = max(1, min(args.calls, -(-COLD_BYTES // wbytes)))
            ws = [(torch.randn(n, k, device=dev, generator=gen) / k ** 0.5).half() for _ in range(copies)]
            for m in rows_list:
                x = torch.randn(m, k, device=dev, generator=gen).half()
                ours = graph_time([lambda w=w: gemm.padded_linear(x, w) for w in ws], args.calls, args.replays)
                base = graph_time([lambda w=w: torch.mm(x, w.t(), out_dtype=f32) for w in ws],
                                  args.calls, args.replays)
                full = gemm.padded_linear(x, ws[0])
                inv = bool(torch.equal(gemm.padded_linear(x[:1], ws[0]), full[:1]))
                add(rows, entry("dense", name, m, n, k, wbytes, ours, base,
                                {"weight_copies": copies, "row0_alone_equal": inv}),
                    f"dense {name:10s} M={m:3d} N={n:6d} K={k:6d}", "cublas")
            del ws
            torch.cuda.empty_cache()

    if args.only in (None, "grouped"):
        g_, r_, k = GROUPED
        wbytes = g_ * r_ * k * 2
        copies = max(1, min(args.calls, -(-COLD_BYTES // wbytes)))
        ws = [(torch.randn(g_ * r_, k, device=dev, generator=gen) / k ** 0.5).half() for _ in range(copies)]

        def group_major(x, w):          # the batched GEMM group-major, then a transposing copy
            xp, _ = gemm._padded_rows(x.transpose(0, 1), (g_,))
            out = torch.bmm(xp, w.view(g_, r_, k).transpose(1, 2))
            res = gemm.rows_empty(x.shape[0], g_ * r_, torch.float16, dev)
            res.view(-1, g_, r_).copy_(out[:, :x.shape[0]].transpose(0, 1))
            return res

        for m in rows_list:
            x = torch.randn(m, g_, k, device=dev, generator=gen).half()
            ours = graph_time([lambda w=w: gemm.padded_grouped_linear(x, w) for w in ws], args.calls, args.replays)
            base = graph_time([lambda w=w: group_major(x, w) for w in ws], args.calls, args.replays)
            same = bool(torch.equal(gemm.padded_grouped_linear(x, ws[0]), group_major(x, ws[0])))
            add(rows, entry("grouped", "wo_a", m, g_ * r_, k, wbytes, ours, base,
                            {"groups": g_, "weight_copies": copies, "same_bits_as_baseline": same}),
                f"grouped wo_a M={m:3d}", "group-major + copy", f"  same bits {same}")
        del ws
        torch.cuda.empty_cache()

    if args.only in (None, "experts"):
        e_, n, k = EXPERTS
        w = (torch.randn(e_, n, k, device=dev, generator=gen) / k ** 0.5).half()
        for m in rows_list:
            p = TOP_K * m
            x = torch.randn(p, k, device=dev, generator=gen).half()
            idx = torch.randint(0, e_, (p,), device=dev, generator=gen)
            distinct = int(torch.unique(idx).numel())
            wbytes = distinct * n * k * 2
            ours = graph_time([lambda: gemm.indexed_linear(x, w, idx)], args.calls, args.replays)
            base = graph_time([lambda: torch.bmm(x[:, None], w[idx].transpose(1, 2))],
                              args.calls, args.replays)
            ref = gemm.indexed_linear_reference(x, w, idx)
            err = (gemm.indexed_linear(x, w, idx).double() - ref.double()).abs().max().item()
            add(rows, entry("experts", "routed_w1", m, n, k, wbytes, ours, base,
                            {"E": e_, "pairs": p, "distinct_experts": distinct, "max_abs_err_vs_fp64": err}),
                f"experts P={p:3d} distinct={distinct:3d}", "gather+bmm")

    result = {"bench": "gemm", "device": torch.cuda.get_device_name(), "commit": _commit(),
              "torch": torch.__version__, "calls_per_graph": args.calls, "replays": args.replays,
              "pad_rows": gemm.PAD_ROWS, "matmul": gemm.describe(gemm.kernels_for("fast")), "pinned": pinned,
              "rows": rows}
    emit(result, args.out, 1)


if __name__ == "__main__":
    main()
