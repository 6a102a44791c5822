"""Diagnostic (GPU): every edge word of the NaN-pair all-reduce case, as the push kernels (flag, Lamport), torch's
add (whole tensor, one element, CPU) and bare FADD / FFMA kernels compute it, so a mismatch names its culprit."""
import sys
import threading
from pathlib import Path

import cupy as cp
from cupy.cuda import compiler
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))     # support.push_selftest

from dspark_ray.comm.push import make_single_card_pair  # noqa: E402
from dspark_ray.comm.source import COMPILE_OPTIONS  # noqa: E402
from support.push_selftest import nan_pair_partial  # noqa: E402

_BARE_SRC = r"""
extern "C" __global__ void bare(const float* a, const float* b, float one, unsigned* fadd, unsigned* ffma,
                                 unsigned* isnan2, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float p0 = a[i], p1 = b[i];
  fadd[i] = __float_as_uint(__fadd_rn(p0, p1));
  ffma[i] = __float_as_uint(__fmaf_rn(one, p1, p0));
  isnan2[i] = (p0 != p0 && p1 != p1) ? 1u : 0u;
}"""
# cupy.RawModule appends -ftz=true (denormals flushed); the push kernels are compiled by NVRTC with -ftz=false
_BARE_FTZ = cp.RawModule(code=_BARE_SRC, options=COMPILE_OPTIONS).get_function("bare")
_mod = cp.cuda.function.Module()
_mod.load(compiler.compile_using_nvrtc(_BARE_SRC, COMPILE_OPTIONS)[0])
_BARE = _mod.get_function("bare")


def h(v):
    return f"{int(v) & 0xFFFFFFFF:08x}"


def push_sum(variant, x):
    a, b = make_single_card_pair(0, allreduce=variant)
    out = [None, None]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]   # each rank on its own stream, as the selftest drives them
    torch.cuda.synchronize()

    def go(r, pc):
        torch.cuda.set_device(0)
        with torch.cuda.stream(streams[r]):
            out[r] = pc.all_reduce([x[r]])
            torch.cuda.current_stream().synchronize()
    t = threading.Thread(target=go, args=(1, b))
    t.start()
    go(0, a)
    t.join()
    torch.cuda.synchronize()
    a.check_error()
    b.check_error()
    rule = a.nan_rule
    a.close()
    b.close()
    return [o.view(torch.int32).cpu() for o in out], rule


for n in (16, 1003):
    x = [nan_pair_partial(r, n, "cuda") for r in (0, 1)]
    xi = [v.view(torch.int32).cpu() for v in x]
    res = {v: push_sum(v, x) for v in ("flag", "lamport")}
    whole = (x[0] + x[1]).view(torch.int32).cpu()
    cpu = (x[0].cpu() + x[1].cpu()).view(torch.int32)
    fadd, ffma, both, fadd_ftz, ffma_ftz = (cp.zeros(n, dtype=cp.uint32) for _ in range(5))
    _BARE(((n + 127) // 128,), (128,), (cp.asarray(x[0]), cp.asarray(x[1]), np.float32(1.0), fadd, ffma, both,
                                        np.int32(n)))
    _BARE_FTZ(((n + 127) // 128,), (128,), (cp.asarray(x[0]), cp.asarray(x[1]), np.float32(1.0), fadd_ftz,
                                            ffma_ftz, both, np.int32(n)))
    fadd, ffma, both, fadd_ftz, ffma_ftz = fadd.get(), ffma.get(), both.get(), fadd_ftz.get(), ffma_ftz.get()
    print(f"n={n} nan_rule={res['flag'][1]:#x}")
    for i in list(range(8)) + list(range(n - 8, n)) if n > 16 else range(n):
        one = (x[0][i:i + 1] + x[1][i:i + 1]).view(torch.int32).cpu()[0]
        row = [h(xi[0][i]), h(xi[1][i]), h(res["flag"][0][0][i]), h(res["flag"][0][1][i]),
               h(res["lamport"][0][0][i]), h(res["lamport"][0][1][i]), h(whole[i]), h(one), h(cpu[i]),
               h(fadd[i]), h(ffma[i]), str(int(both[i])), h(fadd_ftz[i]), h(ffma_ftz[i])]
        print(f"  [{i:4d}] p0 p1 {row[0]} {row[1]} | flag r0 r1 {row[2]} {row[3]} | lamport r0 r1 {row[4]} {row[5]}"
              f" | torch whole {row[6]} one {row[7]} cpu {row[8]} | bare fadd {row[9]} ffma {row[10]} nan2 {row[11]}"
              f" | RawModule (ftz) fadd {row[12]} ffma {row[13]}")
