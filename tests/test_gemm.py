"""The fast-path matmuls of `kernels.gemm`: closeness to a reference, batch invariance (a row's bits alone equal its
bits in any batch), determinism and CUDA-graph replay.

Closeness is measured against the error scale of an fp32 dot product, sum_k |x_k w_k|, not |result| (a dot product
near zero by cancellation has a large relative error in any fp32 order). The CPU tests run the Triton kernel under
the interpreter in a subprocess, so TRITON_INTERPRET does not leak into the other tests of the session."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dspark_ray.kernels import gemm
from dspark_ray.model import ops
from interpreter import ROOT, interpreter_env

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")


def _err(out, ref, scale):
    """Largest |out - ref| in units of sum_k |x_k w_k| (the fp32 dot product's error scale)."""
    return ((out.double() - ref.double()).abs() / scale.double().clamp_min(1e-30)).max().item()


def _dense(m, k, n, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).half().to(device)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).half().to(device)
    return x, w


def _experts(p, k, n, e, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(p, k, generator=g).half().to(device)
    w = (torch.randn(e, n, k, generator=g) / k ** 0.5).half().to(device)
    idx = torch.randint(0, e, (p,), generator=g).to(device)
    return x, w, idx


def _indexed_scale(x, w, idx):
    return torch.einsum("pk,pnk->pn", x.double().abs(), w[idx].double().abs())


# ---------------------------------------------------------------- CPU

@pytest.mark.parametrize("m", [1, 5, 20, 33, 70])
def test_padded_linear_close_cpu(m):
    x, w = _dense(m, 300, 96, seed=m)
    out = gemm.padded_linear(x, w)
    assert out.dtype == torch.float32 and out.shape == (m, 96)
    ref = x.float() @ w.float().t()
    assert _err(out, ref, x.float().abs() @ w.float().abs().t()) < 1e-5


def test_padded_linear_lead_dims_and_fp32_input_cpu():
    x, w = _dense(12, 64, 40, seed=1)
    out = gemm.padded_linear(x.reshape(3, 4, 64), w)
    assert out.shape == (3, 4, 40)
    assert torch.equal(out.reshape(12, 40), gemm.padded_linear(x, w))
    assert torch.equal(gemm.padded_linear(x.float(), w), gemm.padded_linear(x, w))   # fp16 values held in fp32
    assert gemm.padded_linear(x[:0], w).shape == (0, 40)


def test_padded_linear_batch_invariant_cpu():
    x, w = _dense(70, 300, 96, seed=7)
    full = gemm.padded_linear(x, w)
    for r in range(70):
        assert torch.equal(gemm.padded_linear(x[r:r + 1], w), full[r:r + 1]), r
    other, _ = _dense(40, 300, 96, seed=8)                  # the same rows among different neighbours
    mixed = torch.cat([other[:13], x[:5], other[13:]])
    assert torch.equal(gemm.padded_linear(mixed, w)[13:18], full[:5])


_TRITON_SCRIPT = textwrap.dedent("""
    import json, torch
    from dspark_ray.kernels import gemm
    res = {}
    for (p, k, n, e, seed) in [(1, 64, 40, 3, 0), (9, 300, 100, 4, 1), (24, 257, 129, 6, 2)]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(p, k, generator=g).half()
        w = (torch.randn(e, n, k, generator=g) / k ** 0.5).half()
        idx = torch.randint(0, e, (p,), generator=g)
        out = gemm.indexed_linear(x, w, idx)
        ref = gemm.indexed_linear_reference(x, w, idx)
        scale = torch.einsum("pk,pnk->pn", x.double().abs(), w[idx].double().abs())
        alone = all(torch.equal(gemm.indexed_linear(x[i:i + 1], w, idx[i:i + 1]), out[i:i + 1]) for i in range(p))
        xt = torch.randn(k, p, generator=g).half()          # a non-contiguous x
        nc = torch.equal(gemm.indexed_linear(xt.t(), w, idx), gemm.indexed_linear(xt.t().contiguous(), w, idx))
        res[f"{p}x{k}x{n}"] = {"dtype": str(out.dtype), "shape": list(out.shape),
                               "err": ((out.double() - ref.double()).abs() / scale).max().item(),
                               "alone": alone, "noncontig": nc}
    res["empty"] = list(gemm.indexed_linear(x[:0], w, idx[:0]).shape)
    print(json.dumps(res))
""")


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in for the kernel; a GPU host runs the kernel "
                    "itself (test_indexed_linear_gpu_*), and its triton's interpreter may differ")
def test_indexed_linear_interpreter_cpu():
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], cwd=ROOT, env=interpreter_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res.pop("empty") == [0, 129]
    for name, r in res.items():
        assert r["dtype"] == "torch.float32", name
        assert r["err"] < 1e-5, (name, r)
        assert r["alone"], name              # each row alone equals its batched bits
        assert r["noncontig"], name


def test_kernels_for_builds_each_mode_and_refuses_unknown_ones():
    fast = gemm.kernels_for("fast")
    assert (fast.mode, fast.dense, fast.matmul_indexed) == ("fast", "triton", gemm.indexed_linear)
    assert fast.matmul.func is gemm.padded_linear and fast.matmul.keywords == {"dense": "triton"}
    assert "attend" in fast.fused_table and fast.fused("mhc_collapse_norm") is not None
    assert "mode=fast" in gemm.describe(fast) and "pad_rows=32" in gemm.describe(fast)
    assert gemm.kernels_for("exact") is ops.EXACT and "mode=exact" in gemm.describe(ops.EXACT)
    assert gemm.kernels_for("auto").mode == ("fast" if torch.cuda.is_available() else "exact")
    with pytest.raises(ValueError):
        gemm.kernels_for("fastest")
    with pytest.raises(ValueError, match="dense kernel"):
        gemm.kernels_for("fast", dense="cutlass")
    cublas = gemm.kernels_for("fast", dense="cublas")
    assert cublas.dense == "cublas" and "dense=cublas" in gemm.describe(cublas)
    # The dense choice is bound into that set's linears, not set for the process: the first set keeps its own.
    assert all(f.keywords == {"dense": "cublas"} for f in (cublas.matmul, cublas.fused("linear_f16"),
                                                          cublas.fused("linear_grouped")))
    assert fast.fused("linear_f16").keywords == {"dense": "triton"} and "dense=triton" in gemm.describe(fast)
    assert ops.active() is ops.EXACT


def test_pin_determinism_reports():
    pinned = gemm.pin_determinism()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == pinned["CUBLAS_WORKSPACE_CONFIG"]
    assert torch.backends.cuda.matmul.allow_tf32 is False
    assert torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction is False
    assert torch.backends.cudnn.benchmark is False


# ---------------------------------------------------------------- GPU

def _graph_of(fn):
    """Capture fn() once (after a warm-up on a side stream, which also compiles Triton); returns (graph, out)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["cublas", "triton"])
@pytest.mark.parametrize("k,n", [(300, 96), (5120, 1152), (1152, 5120)])
def test_padded_linear_gpu(k, n, path, monkeypatch):
    """Both paths of the dense linear: cuBLAS on padded chunks and the one-launch Triton kernel for small weights."""
    monkeypatch.setattr(gemm, "SMALL_WEIGHT_BYTES", 0 if path == "cublas" else 1 << 40)
    gemm.pin_determinism()
    x, w = _dense(64, k, n, seed=k + n, device="cuda")
    full = gemm.padded_linear(x, w)
    ref = x.double() @ w.double().t()
    assert _err(full, ref, x.float().abs() @ w.float().abs().t()) < 1e-5
    for b in range(1, 33):                                  # every sub-batch size of one chunk
        assert torch.equal(gemm.padded_linear(x[:b], w), full[:b]), b
    for r in (0, 5, 31, 32, 63):                            # rows alone, from either chunk
        assert torch.equal(gemm.padded_linear(x[r], w), full[r]), r
    other, _ = _dense(40, k, n, seed=99, device="cuda")     # the same rows at other positions, other neighbours
    mixed = torch.cat([other[:13], x[:20], other[13:]])
    assert torch.equal(gemm.padded_linear(mixed, w)[13:33], full[:20])
    assert torch.equal(gemm.padded_linear(x, w), full)      # run to run
    xs = x[:20].clone()
    g, out = _graph_of(lambda: gemm.padded_linear(xs, w))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, full[:20])
    f16 = gemm.padded_linear_f16(x, w)                       # the fp16 twin: one rounding of (nearly) the same sums
    assert f16.dtype == torch.float16 and (f16.float() - full).abs().max() <= full.abs().max() * 2 ** -10
    assert torch.equal(gemm.padded_linear_f16(x[5:9], w), f16[5:9])
    buf = gemm.rows_empty(5, k, torch.float16, "cuda")      # read in place (no copy): the same kernel, the same bits
    buf.copy_(x[:5])
    odd = x.reshape(-1)[1:1 + 5 * k].view(5, k)              # 2 bytes past an aligned start: copied
    assert gemm._in_place(buf, gemm.PAD_ROWS) and not gemm._in_place(odd, gemm.PAD_ROWS)
    assert torch.equal(gemm.padded_linear(buf, w), full[:5])
    assert torch.equal(gemm.padded_linear(odd, w), gemm.padded_linear(odd.clone(), w))
    assert torch.equal(gemm.padded_linear_f16(buf, w), f16[:5])


@pytest.mark.gpu
@pytest.mark.parametrize("k,n,e", [(300, 100, 4), (5120, 1152, 8), (1152, 5120, 8)])
def test_indexed_linear_gpu(k, n, e):
    gemm.pin_determinism()
    x, w, idx = _experts(60, k, n, e, seed=k + n, device="cuda")
    full = gemm.indexed_linear(x, w, idx)
    ref = gemm.indexed_linear_reference(x, w, idx)
    assert _err(full, ref, _indexed_scale(x, w, idx)) < 1e-5
    for b in (1, 2, 7, 15, 33):
        assert torch.equal(gemm.indexed_linear(x[:b], w, idx[:b]), full[:b]), b
    for r in (0, 17, 59):
        assert torch.equal(gemm.indexed_linear(x[r:r + 1], w, idx[r:r + 1]), full[r:r + 1]), r
    ox, _, oidx = _experts(30, k, n, e, seed=7, device="cuda")
    mixed = gemm.indexed_linear(torch.cat([ox, x[:10]]), w, torch.cat([oidx, idx[:10]]))
    assert torch.equal(mixed[30:], full[:10])
    assert torch.equal(gemm.indexed_linear(x, w, idx), full)
    assert gemm.indexed_linear(x[:0], w, idx[:0]).shape == (0, n)
    xs, ids = x[:15].clone(), idx[:15].clone()
    g, out = _graph_of(lambda: gemm.indexed_linear(xs, w, ids))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, full[:15])
