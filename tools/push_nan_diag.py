"""Diagnostic (GPU): print the words where push and the oracle disagree in the NaN-pair all-reduce case, with both
ranks' inputs and torch's own add of the same words at several tensor positions."""
import threading

import torch

from dspark_ray.kernels.push import make_single_card_pair
from dspark_ray.kernels.selftest import nan_pair_partial

for variant in ("flag", "lamport"):
    a, b = make_single_card_pair(0, allreduce=variant)
    for n in (16, 1003):
        x = [nan_pair_partial(r, n, a.device) for r in (0, 1)]
        out = [None, None]

        def go(r, pc):
            out[r] = pc.all_reduce([x[r]])
        t = threading.Thread(target=go, args=(1, b))
        t.start()
        go(0, a)
        t.join()
        torch.cuda.synchronize()
        want = x[0] + x[1]
        xi = [v.view(torch.int32).cpu() for v in x]
        oi = [o.view(torch.int32).cpu() for o in out]
        wi = want.view(torch.int32).cpu()
        bad = (oi[0] != wi).nonzero().flatten().tolist()
        print(f"{variant} n={n} nan_rule={a.nan_rule:#x} mismatches at {bad}")
        for i in bad[:16]:
            h = lambda v: f"{int(v) & 0xFFFFFFFF:08x}"
            small = (x[0][i:i + 1] + x[1][i:i + 1]).view(torch.int32).cpu()[0]
            print(f"  [{i}] p0 {h(xi[0][i])} p1 {h(xi[1][i])} push r0 {h(oi[0][i])} r1 {h(oi[1][i])} "
                  f"torch {h(wi[i])} torch(1 elem) {h(small)}")
    a.close()
    b.close()
