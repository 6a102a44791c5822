"""Probe: which inputs change a row's bits in exllamav3's forced exl3_gemm / exl3_mgemm (GPU). Prints JSON."""
import json, sys
from pathlib import Path
import torch
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from dspark_ray.weights.loader import Checkpoint
from dspark_ray.kernels import exl3_gemm as X

ck = Checkpoint(sys.argv[1])
ext = X.ext()
out = {}
names = [n for n in ck.names() if X.on_kernels(ck, n)]
pick = [n for n in names if "wq_b" in n][:1] + [n for n in names if "experts.0.w1" in n][:1] + ["head.weight"]
g = torch.Generator(device="cuda").manual_seed(0)
for name in pick:
    (rec,) = ck.exl3(name, device="cuda")
    w = X.Exl3Weight(rec)
    x = torch.randn(48, w.k, generator=g, device="cuda").half()
    ref = x.float() @ rec.weight().float()
    r = {"shape_idx": w.shape_idx, "k": w.k, "n": w.n}
    for dt in (torch.float16, torch.float32):
        base = w.matmul(x[:1], dt)
        r[f"{dt}"] = {m: bool(torch.equal(w.matmul(x[:m], dt)[:1], base)) for m in (1, 2, 8, 15, 16, 17, 24, 48)}
        r[f"{dt}_repeat24"] = all(torch.equal(w.matmul(x[:24], dt), w.matmul(x[:24], dt)) for _ in range(10))
        r[f"{dt}_relerr"] = float((w.matmul(x, dt).float() - ref).abs().max() / ref.abs().max())
        for s in X.compatible(w.K, w.k, w.n, w.device):
            c1 = torch.empty(1, w.n, dtype=dt, device="cuda"); a1 = torch.empty_like(x[:1])
            c2 = torch.empty(24, w.n, dtype=dt, device="cuda"); a2 = torch.empty_like(x[:24])
            ext.exl3_gemm(x[:1].contiguous(), w.trellis, c1, w.suh, a1, w.svh, s, w.mcg, w.mul1, 0)
            ext.exl3_gemm(x[:24].contiguous(), w.trellis, c2, w.suh, a2, w.svh, s, w.mcg, w.mul1, 0)
            r[f"{dt}_shape{s}_m1_vs_m24"] = bool(torch.equal(c1[0], c2[0]))
    if "experts" in name:
        bank = X.Exl3Bank([w] * 8)
        p = 36
        xs = torch.randn(p, w.k, generator=g, device="cuda").half()
        idx = torch.zeros(p, dtype=torch.int64, device="cuda")
        ref2 = xs.float() @ rec.weight().float()
        for dt in (torch.float16, torch.float32):
            full = bank.matmul_indexed(xs, idx, dt)
            r[f"mgemm_{dt}_relerr"] = float((full.float() - ref2).abs().max() / ref2.abs().max())
            r[f"mgemm_{dt}_slots"] = {q: bool(torch.equal(bank.matmul_indexed(xs[:q], idx[:q], dt)[0], full[0]))
                                      for q in (1, 2, 6, 12, 24, 36)}
    out[name] = r
print(json.dumps(out, indent=1))
