"""Probe (GPU): exllamav3's row tiles for the dense EXL3 products of a checkpoint. For every tp1 `gemm` shape, each
tile shape 1..7 the kernel accepts (1..4: 16-row tiles; 5, 6, 7: 32, 48, 64 rows sharing each decoded fragment)
is timed at 1 and 4 requests' rows (rows padded to whole tiles, CUDA-graph replays), and each shape's bits for the
first rows are compared with shape 2's and with every other shape of the same (TILESIZE_K, TILESIZE_N).

    python tools/exl3_tile_probe.py /tmp/parity_exl3/full_exl3 > probe.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from exl3_kernel_table import _time, shapes_of  # noqa: E402

from dspark_ray.kernels import exl3_gemm as X  # noqa: E402
from dspark_ray.weights.loader import Checkpoint  # noqa: E402

TILE_M = {1: 16, 2: 16, 3: 16, 4: 16, 5: 32, 6: 48, 7: 64}
TILE_KN = {1: (16, 128), 2: (32, 128), 3: (32, 256), 4: (16, 512), 5: (32, 128), 6: (32, 128), 7: (32, 128)}


def main() -> int:
    ck = Checkpoint(sys.argv[1])
    cfg = ck.config
    ext = X.ext()
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for (op, K, cb, k, n), (rec, name) in sorted(shapes_of(ck).items(), key=lambda kv: str(kv[0])):
        if op != "gemm":
            continue
        bits, half = int(K), not float(K).is_integer()
        x = torch.randn(64, k, generator=g, device="cuda").half()
        r = {"name": name, "times_us": {}, "bits_equal_shape2": {}, "bits_equal_same_kn": {}}
        rows_out = {}
        for s in range(1, 8):
            if not ext.exl3_gemm_shape_compat(s, TILE_M[s], k, n, bits, half):
                continue
            times = []
            for rows in (cfg.block_size, 4 * cfg.block_size):
                mp = -(-rows // TILE_M[s]) * TILE_M[s]
                xs = x[:mp].contiguous() if mp <= 64 else torch.randn(mp, k, device="cuda").half()
                c = torch.empty(mp, n, dtype=torch.half, device="cuda")
                ah = torch.empty_like(xs)
                times.append(round(_time(lambda: ext.exl3_gemm(xs, rec.trellis, c, rec.suh, ah, rec.svh, s,
                                                               cb == "mcg", cb == "mul1", 0)), 2))
                if rows == cfg.block_size:
                    rows_out[s] = c[:rows].clone()
            r["times_us"][s] = times
        for s, c in rows_out.items():
            if 2 in rows_out:
                r["bits_equal_shape2"][s] = bool(torch.equal(c, rows_out[2]))
            r["bits_equal_same_kn"][s] = [t for t, c2 in rows_out.items()
                                          if t != s and TILE_KN[t] == TILE_KN[s] and torch.equal(c, c2)]
        out[X.shape_key(op, X._cc(rec.trellis.device), K, cb, k, n)] = r
        print(X.shape_key(op, "", K, cb, k, n), r["times_us"], file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
