"""Run another bench (bench/draft_step.py, bench/kernel_timeline.py) with a variant of the step's kernels: an in-step
A/B without a knob in the kernels themselves. The variant is installed in this process and, through
`card_procs.SETUP_ENV`, in every card process the bench spawns. GPU only (the benches it runs are).

    python bench/dense_variants.py VARIANT bench/draft_step.py --ckpt /tmp/full --modes tp1,solo --dense triton ...

VARIANT:
  current       `chunked_linear.tiles` as it is (the baseline of the same call)
  rule          the dense tiles from `chunked_linear.rule_tiles` alone (without the measured table)
  model         the K split that minimizes the busiest SM's BK steps, ceil(programs / SMs) * (steps a program + 2),
                instead of the fewest powers of two that give a program per SM (bn as `tiles`)
  sweep:<json>  per weight shape, the fastest (bn, split) at one chunk of a `bench/chunked_linear.py --sweep` run
  nopdl         the chunked kernel launched without programmatic dependent launch (every other kernel with it)
  evict_first   the weight tiles loaded with eviction_policy="evict_first" (streamed weights leave the L2 to the
                step's activations and small weights, as cuBLAS's TMA loads hint); no bit changes
  shared_late   the shared expert's w2 GEMM forked after the routed experts' gate / up kernel (beside their w2
                kernel) instead of with its gate / up GEMM beside the router; no bit changes
  experts:<spec> the routed experts' grouped kernel with other tiles (the dense kernel as it is): spec is
                g<I>=bn.bk.warps.stages[.bm],p<I>=... for the gated (w1 | w3) and plain (w2) calls of
                expert width I (1152 a pair rank, 2304 one card), at every pair count; a call not named keeps
                its tiles
  few_pairs:<n> the last of `fused_moe.FEW_PAIR_TIERS` bounded at n pairs (now 60: up to 4 requests'
                blocks; `draft_step_few_pairs_s27_h200.json` compared 16, 30, 45, 60)

A variant that changes (bn, split) changes the bits of the dense linears (each deployment runs one rule); the
ch choice is the kernel's (`tiles`). Runs: `bench/results/gpu/draft_step_dense_variants_s26_h200.json` and
`draft_step_expert_tiles_s26_h200.json` (those of `draft_step_dense_variants_h200.json`, before the variants reached
the spawned processes, are void).
"""
from __future__ import annotations

import importlib.util
import json
import os
import runpy
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import card_procs  # noqa: E402
from bench.chunked_linear import SHAPES, split_fits  # noqa: E402
from dspark_ray.kernels import chunked_linear as cl  # noqa: E402
from dspark_ray.kernels import fused_ops  # noqa: E402

HEAD = cl.tiles


def balanced(n: int, k: int, groups: int, chunks: int, sms: int, fill: int = 2) -> cl.Tiles:
    bn = HEAD(n, k, groups, chunks, sms).bn
    blocks, steps = -(-n // bn), -(-k // cl.BK)
    best = None
    for split in filter(lambda s: split_fits(steps, s), range(1, 17)):
        cost = -(-blocks * split // sms) * (-(-steps // split) + fill)
        if best is None or cost < best[0]:
            best = (cost, split)
    return cl.with_split(n, bn, best[1], chunks, sms)


def from_sweep(path: str):
    best = {}
    for key, row in json.loads(Path(path).read_text())["cases"].items():
        mode, rest = key.split(" ", 1)
        name, chunks = rest.rsplit(" x", 1)
        if chunks == "1":
            n, k, groups, _ = SHAPES[mode][name]
            best[(n, k, groups)] = (row["best"]["tiles"]["bn"], row["best"]["tiles"]["split"])

    def rule(n, k, groups, chunks, sms):
        if (n, k, groups) in best:
            return cl.with_split(n, *best[(n, k, groups)], chunks, sms)
        return HEAD(n, k, groups, chunks, sms)
    return rule


def kernel_variant(old: str, new: str):
    """`_chunked_linear_kernel` compiled from the module's source with `old` replaced by `new` (Triton reads a
    kernel's source from its file, so the variant is written to one and imported)."""
    src = Path(cl.__file__).read_text()
    if src.count(old) != 1:
        raise SystemExit(f"dense_variants: {old!r} is not in kernels/chunked_linear.py exactly once")
    src = src.replace(old, new).replace("from .fused_ops import", "from dspark_ray.kernels.fused_ops import")
    path = Path(tempfile.mkdtemp()) / "chunked_linear_variant.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("chunked_linear_variant", path)
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._chunked_linear_kernel


def expert_tiles(spec: str) -> None:
    from dspark_ray.kernels import fused_moe
    chosen = {}
    for item in spec.split(","):
        key, tiles = item.split("=")
        chosen[(key[0] == "g", int(key[1:]))] = fused_moe.ExpertTiles(*map(int, tiles.split(".")))
    head = fused_moe.grouped_tiles

    def tiles(gated, n, k, device_index, pairs=None):          # the spec's tiles at every pair count
        t = chosen.get((gated, n if gated else k))
        return head(gated, n, k, device_index, pairs) if t is None else t
    fused_moe.grouped_tiles = tiles
    print(f"dense_variants[experts]: {chosen}", file=sys.stderr)


def expert_out_late(act, w2, experts, weights, late):
    """`fused_moe.expert_out` with the shared expert's branch joined only before the combine."""
    from dspark_ray.kernels import fused_moe as fm
    d = fm._grouped(act, w2, None, experts, 1, 0.0)
    return fm.expert_combine(d, experts, weights, late.join())


def shared_late() -> None:
    """The shared expert in two branches: gate / up + SwiGLU beside the router (as now), its w2 forked once the
    routed experts' gate / up kernel is queued, so it runs beside their w2 kernel, not beside the gate / up kernel."""
    from dspark_ray.model import moe, ops

    def shared(self, f):
        gu, i = ops.linear(f, self.shared_w13), self.shared_i
        return ops.swiglu(gu[..., :i], gu[..., i:], self.limit)

    def routed(self, f, experts, weights, shared_act):
        act = ops.fused("expert_act")(f, self.w1, self.w3, experts, self.limit)
        late = ops.branch(lambda a: ops.linear(a, self.shared_w2, out_dtype=ops.F32), shared_act.join())
        return expert_out_late(act, self.w2, experts, weights, late)
    moe.Experts.shared, moe.Experts.routed = shared, routed
    print("dense_variants[shared_late]: the shared expert's w2 beside the routed w2", file=sys.stderr)


def install(variant: str) -> None:
    if variant == "model":
        rule = balanced
    elif variant.startswith("sweep:"):
        rule = from_sweep(variant[len("sweep:"):])
    elif variant == "nopdl":
        cl.launch_opts = lambda t: fused_ops._PLAIN_OPTS
        rule = HEAD
    elif variant == "evict_first":
        cl._chunked_linear_kernel = kernel_variant(
            "wt = tl.load(w_cols + kk[:, None], mask=k_ok[:, None] & c_ok[None, :], other=0.0)",
            "wt = tl.load(w_cols + kk[:, None], mask=k_ok[:, None] & c_ok[None, :], other=0.0, "
            "eviction_policy=\"evict_first\")")
        rule = HEAD
    elif variant == "current":
        rule = HEAD
    elif variant == "shared_late":
        shared_late()
        rule = HEAD
    elif variant.startswith("experts:"):
        expert_tiles(variant[len("experts:"):])
        rule = HEAD
    elif variant.startswith("few_pairs:"):
        from dspark_ray.kernels import fused_moe
        most = int(variant[len("few_pairs:"):])
        fused_moe.FEW_PAIR_TIERS = (*fused_moe.FEW_PAIR_TIERS[:-1], (most, fused_moe.FEW_PAIR_TIERS[-1][1]))
        print(f"dense_variants[few_pairs]: the last few-pair tier up to {most} pairs", file=sys.stderr)
        rule = HEAD
    elif variant == "rule":
        def rule(n, k, groups, chunks, sms):
            return cl.with_split(n, *cl.rule_tiles(n, k, groups, sms), chunks, sms)
    else:
        raise SystemExit(f"unknown variant {variant!r}: current | rule | model | sweep:<json> | nopdl | evict_first "
                         "| shared_late | experts:<spec> | few_pairs:<n>")
    seen = set()

    def logged(n, k, groups, chunks, sms):
        t = rule(n, k, groups, chunks, sms)
        if (n, k, groups, chunks) not in seen:
            seen.add((n, k, groups, chunks))
            print(f"dense_variants[{variant}]: N {n} K {k} groups {groups} chunks {chunks}: {t}", file=sys.stderr)
        return t
    cl.tiles = logged


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    # The benches time a card in fresh spawned processes (bench/card_procs.py), which import the kernels anew: each
    # installs the variant too, before the bench's body runs.
    os.environ[card_procs.SETUP_ENV] = f"bench.dense_variants:install:{sys.argv[1]}"
    install(sys.argv[1])
    script = sys.argv[2]
    sys.argv = [script] + sys.argv[3:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
