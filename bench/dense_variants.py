"""Run another bench (bench/draft_step.py, bench/kernel_timeline.py) with a variant of the chunked dense kernel's
launch, in the same process: an in-step A/B of `kernels/chunked_linear.py` without a knob in the kernel itself.
GPU only (the benches it runs are).

    python bench/dense_variants.py VARIANT bench/draft_step.py --ckpt /tmp/full --modes tp1,solo --dense triton ...

VARIANT:
  current       `chunked_linear.tiles` as it is (the baseline of the same call)
  model         the K split that minimizes the busiest SM's BK steps, ceil(programs / SMs) * (steps a program + 2),
                instead of the fewest powers of two that give a program per SM (bn as `tiles`)
  sweep:<json>  per weight shape, the fastest (bn, split) at one chunk of a `bench/chunked_linear.py --sweep` run
  nopdl         the chunked kernel launched without programmatic dependent launch (every other kernel with it)
  evict_first   the weight tiles loaded with eviction_policy="evict_first" (streamed weights leave the L2 to the
                step's activations and small weights, as cuBLAS's TMA loads hint); no bit changes

A variant that changes (bn, split) changes the bits of the dense linears (each deployment runs one rule); the
ch choice is the kernel's (`tiles`). The 1 December 2026 calls: `bench/results/gpu/draft_step_dense_variants_h200.json`.
"""
from __future__ import annotations

import importlib.util
import json
import runpy
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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
    else:
        raise SystemExit(f"unknown variant {variant!r}: current | model | sweep:<json> | nopdl | evict_first")
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
    install(sys.argv[1])
    script = sys.argv[2]
    sys.argv = [script] + sys.argv[3:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
