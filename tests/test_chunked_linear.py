"""`kernels/chunked_linear.py`, the dense linears' one-launch kernel: every chunk's rows have the bits of that chunk
alone whatever the chunk count, the chunks per program or the neighbours; the K split's tickets are back to zero
after each call; grouped columns come from their own group; the tile choice depends on the weight and the card only.

On a CPU the kernel runs under the Triton interpreter in a subprocess (its fence, inline PTX, stubbed: the
interpreter runs programs one at a time). On a GPU (`gpu` marker): the same checks, through `gemm.padded_linear` as
the step calls it, eager and in a CUDA graph."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from interpreter import ROOT, interpreter_env

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")

_SCRIPT = textwrap.dedent("""
    import json, torch, triton
    import triton.language as tl  # noqa: F401 - the interpreter looks it up in the stub's globals
    from dspark_ray.kernels import chunked_linear as ck

    @triton.jit
    def _no_fence():
        pass

    ck._fence_gpu = _no_fence
    res = {}
    g = torch.Generator().manual_seed(0)
    for (n, k, groups) in [(200, 512, 1), (256, 384, 2)]:
        w = (torch.randn(n, k, generator=g) / k ** 0.5).half()
        x = torch.randn(groups, 3 * 32, k, generator=g).half()
        def run(rows, t, dtype=torch.float16):
            xin = (x if groups > 1 else x[:1])[:, :rows].contiguous()
            out = torch.empty((rows, n), dtype=dtype)
            return ck.chunked_linear(xin if groups > 1 else xin[0], w, out, groups, t)
        r = n // groups
        ref = torch.cat([x[i].double() @ w[i * r:(i + 1) * r].double().t() for i in range(groups)], -1)
        for split in (1, 2):
            for dtype in (torch.float16, torch.float32):
                one = ck.Tiles(bn=64, split=split, ch=1, stages=2)
                first = run(32, one, dtype)
                full = {ch: run(96, ck.Tiles(bn=64, split=split, ch=ch, stages=2), dtype) for ch in (1, 2, 3)}
                xin = x[:, 32:64].contiguous() if groups > 1 else x[0, 32:64].contiguous()
                mid = ck.chunked_linear(xin, w, torch.empty((32, n), dtype=dtype), groups, one)
                counters = [int(t.abs().sum()) for t in ck.COUNTERS.eager.values()]
                res[f"{n}x{k}/{groups} split{split} {dtype}"] = {
                    "err": float((full[1].double() - ref).abs().max() / ref.abs().max()),
                    "same_over_ch": all(torch.equal(full[1], f) for f in full.values()),
                    "first_alone": torch.equal(first, full[1][:32]),
                    "middle_alone": torch.equal(mid, full[1][32:64]),
                    "counters_zero": counters == [0] * len(counters),
                    "dtype": str(full[1].dtype)}
    res["tiles"] = {name: ck.tiles(*shape, 132).__dict__ for name, shape in {
        "wq_a 1": (1792, 5120, 1, 1), "wq_a 3": (1792, 5120, 1, 3), "wq_b tp1 3": (32768, 1280, 1, 3),
        "wq_b pair 1": (16384, 1280, 1, 1), "wo_a tp1 1": (8192, 4096, 8, 1), "head 1": (129280, 5120, 1, 1),
        "odd 1": (96, 300, 1, 1)}.items()}
    res["rule"] = {"wq_a": ck.rule_tiles(1792, 5120, 1, 132), "wq_b pair": ck.rule_tiles(16384, 1280, 1, 132),
                   "wq_a 114 SMs": list(ck.tiles(1792, 5120, 1, 1, 114).__dict__.values())[:2]}
    print(json.dumps(res))
""")


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in; a GPU host runs the kernel itself")
def test_chunked_linear_interpreter_cpu():
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=interpreter_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    tiles, rule = res.pop("tiles"), res.pop("rule")
    assert len(res) == 8
    for name, r in res.items():
        assert r["err"] < 2e-3 if "float16" in r["dtype"] else r["err"] < 1e-5, (name, r)
        assert r["same_over_ch"] and r["first_alone"] and r["middle_alone"], (name, r)
        assert r["counters_zero"], name
    # The bits-fixing part of a launch (bn, split) depends on the weight and the card, never on the chunk count.
    assert (tiles["wq_a 1"]["bn"], tiles["wq_a 1"]["split"]) == (tiles["wq_a 3"]["bn"], tiles["wq_a 3"]["split"])
    # A 132-SM card takes the measured entries (MEASURED_TILES), other shapes and cards the rule.
    assert (tiles["wq_a 1"]["bn"], tiles["wq_a 1"]["split"], tiles["wq_a 1"]["ch"]) == (64, 4, 1)
    assert tiles["wq_a 3"]["ch"] == 3                         # 112 programs a chunk: more than 2 a SM side by side
    assert (tiles["wq_b tp1 3"]["bn"], tiles["wq_b tp1 3"]["split"]) == (128, 1)
    assert (tiles["wq_b pair 1"]["bn"], tiles["wq_b pair 1"]["split"]) == (128, 1)
    assert tiles["wo_a tp1 1"]["bn"] == 64 and tiles["head 1"]["bn"] == 128 and tiles["odd 1"]["bn"] == 64
    assert rule == {"wq_a": [64, 8], "wq_b pair": [64, 1], "wq_a 114 SMs": [64, 8]}


def split_fits(steps: int, split: int) -> bool:
    """A K split of `steps` BK steps into `split` ranges of ceil(steps / split) steps: each at least two, none
    empty (the kernel's KS is a whole number of BK steps)."""
    ks = -(-steps // split)
    return split == 1 or (ks >= 2 and steps - (split - 1) * ks >= 1)


def test_measured_tiles_fit_the_kernel():
    """Every measured (bn, split) is one the kernel can run: whole BK steps per K range, none empty, and column
    blocks that do not straddle a group (a bad entry would fail only on the card): the tile sweep's own rule."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    from dspark_ray.kernels import chunked_linear as ck
    assert ck.MEASURED_TILES[132]
    for sms, table in ck.MEASURED_TILES.items():
        for (n, k, groups), (bn, split) in table.items():
            steps = -(-k // ck.BK)
            assert bn in (64, 128) and 1 <= split <= 8 and split_fits(steps, split), (n, k, groups, bn, split)
            if groups > 1:
                assert n % groups == 0 and (n // groups) % bn == 0, (n, k, groups, bn)
            assert ck.tiles(n, k, groups, 1, sms) == ck.with_split(n, bn, split, 1, sms)


def test_tiles_refuse_a_group_width_off_the_tile():
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    from dspark_ray.kernels import chunked_linear as ck
    with pytest.raises(ValueError, match="group width 96"):
        ck.tiles(192, 512, 2, 1, 132)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k,n,groups", [(5120, 1792, 1), (1280, 16384, 1), (4096, 4096, 4), (5120, 129280, 1),
                                        (8192, 5120, 1), (5120, 2304, 1), (300, 96, 1)])  # splits 4 1 4 1 3 5 1
def test_chunked_linear_gpu(k, n, groups):
    from dspark_ray.kernels import chunked_linear as ck
    from dspark_ray.kernels import gemm
    gemm.pin_determinism()
    g = torch.Generator().manual_seed(k + n)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).half().cuda()
    x = torch.randn(110, groups, k, generator=g).half().cuda()
    r = n // groups
    ref = torch.cat([x[:, i].double() @ w[i * r:(i + 1) * r].double().t() for i in range(groups)], -1)

    def lin(v):
        if groups > 1:
            buf = gemm.grouped_rows_empty(v.shape[0], groups, k, torch.float16, "cuda")
            buf.copy_(v)
            return gemm.padded_grouped_linear(buf, w, dense="triton")
        return gemm.padded_linear_f16(v[:, 0], w, dense="triton")

    full = lin(x)                                            # 4 chunks
    assert full.dtype == torch.float16
    assert ((full.double() - ref).abs().max() / ref.abs().max()).item() < 2e-3
    for rows in (1, 5, 20, 32, 33, 64, 80, 96):              # every chunk count, and rows at any place of a chunk
        assert torch.equal(lin(x[:rows]), full[:rows]), rows
    for row in (0, 31, 32, 77, 109):
        assert torch.equal(lin(x[row:row + 1]), full[row:row + 1]), row
    other = torch.randn(50, groups, k, generator=g).half().cuda()
    assert torch.equal(lin(torch.cat([other[:13], x[:40], other[13:]]))[13:53], full[:40])
    for _ in range(20):
        assert torch.equal(lin(x), full)
    for e in ck.COUNTERS.eager.values():
        assert int(e.abs().sum()) == 0
    if groups == 1:                                          # fp32 out: the same sums, one rounding fewer
        f32 = gemm.padded_linear(x[:, 0], w, dense="triton")
        assert f32.dtype == torch.float32 and torch.equal(f32.half(), full)
    xs = x[:70].clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        lin(xs)
    torch.cuda.current_stream().wait_stream(s)
    held = ck.COUNTERS.captured()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lin(xs)
    assert ck.COUNTERS.captured() >= held                   # a captured split call holds counters of its own
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, full[:70])
