"""Shared pieces of the fused kernels: fp64 transcendentals rounded once to fp32, the norm scale, the head-norm
weight rule, the SwiGLU math, the PDL launch options; and `model/ops.py`'s RMS norm and small-linear kernels."""
from __future__ import annotations

import contextlib
import threading

import torch
import triton
import triton.language as tl

from ..settings import current as settings
from .rows import rows_empty

F16, F32 = torch.float16, torch.float32
# Every launch: no FMA contraction (a * b + c rounds twice, as the reference's separate torch ops do).
_PLAIN_OPTS = dict(enable_fp_fusion=False, PDL=False)
_PDL_OPTS = dict(enable_fp_fusion=False, PDL=True, launch_pdl=True)
_pdl_ok: bool | None = None
_scope = threading.local()


def pdl_capable() -> bool:
    """Whether this Triton can launch with programmatic dependent launch (`DSPARK_PDL=0`: off)."""
    if not settings().pdl:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    gdc = getattr(getattr(tl.extra, "cuda", None), "gdc_wait", None)
    return gdc is not None and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@contextlib.contextmanager
def pdl_launches():
    """This thread's fused kernels launch with PDL inside the block (the graph set's capture); eager steps do not
    (docs/collectives.md)."""
    _scope.depth = getattr(_scope, "depth", 0) + 1
    try:
        yield
    finally:
        _scope.depth -= 1


def pdl_active(device: torch.device | None = None) -> bool:
    """A capable Triton on Hopper or later; decided once (one card kind per process)."""
    global _pdl_ok
    if _pdl_ok is None:
        _pdl_ok = pdl_capable() and torch.cuda.get_device_capability(device)[0] >= 9
    return _pdl_ok


def launch_opts(t: torch.Tensor) -> dict:
    if not t.is_cuda or not getattr(_scope, "depth", 0):
        return _PLAIN_OPTS
    return _PDL_OPTS if pdl_active(t.device) else _PLAIN_OPTS


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the previous kernel, then let the next one in; call before any read but weights (never written in
    a graph: derived copies are made before capture) and before the first write."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def rsqrt64(x):
    """rsqrt in fp64, rounded once to fp32 (as `ops.rsqrt`)."""
    return (1.0 / tl.sqrt(x.to(tl.float64))).to(tl.float32)      # sqrt.rn.f64, div.rn.f64


@triton.jit
def sigmoid64(x):
    """sigmoid in fp64, rounded once to fp32 (as `ops.sigmoid`)."""
    return (1.0 / (1.0 + tl.exp(-x.to(tl.float64)))).to(tl.float32)


@triton.jit
def exp64(x):
    return tl.exp(x.to(tl.float64)).to(tl.float32)


@triton.jit
def norm_scale(ss, n, eps):
    """As `ops.rms_norm` and `ops.head_norm` (n: fp32)."""
    return rsqrt64(tl.math.div_rn(ss, n) + eps)


@triton.jit
def apply_head_weight(xr, w, W_MODE: tl.constexpr):
    """`ops.head_norm`'s weight rule on xr = x * r: 0 none, 1 fp16 weight (round xr first), 2 bf16 / fp32 (once)."""
    if W_MODE == 0:
        return xr.to(tl.float16)
    elif W_MODE == 1:
        return (xr.to(tl.float16).to(tl.float32) * w).to(tl.float16)
    else:
        return (xr * w).to(tl.float16)



@triton.jit
def swiglu_math(g, u, limit):
    """`ops.swiglu(f16(g), f16(u), limit)` elementwise: silu in fp16 steps (exp in fp64), clamps, one rounding."""
    g = g.to(tl.float16).to(tl.float32)
    u = u.to(tl.float16).to(tl.float32)
    t = exp64(-g).to(tl.float16).to(tl.float32)
    t = (1.0 + t).to(tl.float16).to(tl.float32)
    rc = tl.math.div_rn(tl.full(g.shape, 1.0, tl.float32), t).to(tl.float16).to(tl.float32)
    s = (g * rc).to(tl.float16).to(tl.float32)
    if limit > 0:
        s = tl.minimum(s, limit, propagate_nan=tl.PropagateNan.ALL)      # torch.clamp keeps a NaN
        u = tl.minimum(tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                       propagate_nan=tl.PropagateNan.ALL)
    return (s * u).to(tl.float16)



@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, H, SX, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    r = tl.program_id(0).to(tl.int64)
    ss = tl.zeros((BLOCK,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK):
        offs = h0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + r * SX + offs, mask=offs < H, other=0.0).to(tl.float32)
        ss += x * x
    rn = norm_scale(tl.sum(ss, axis=0), H.to(tl.float32), eps)
    for h0 in range(0, H, BLOCK):
        offs = h0 + tl.arange(0, BLOCK)
        m = offs < H
        x = tl.load(x_ptr + r * SX + offs, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + r * H + offs, ((x * w) * rn).to(tl.float16), mask=m)


def rows_2d(x: torch.Tensor) -> torch.Tensor:
    """x as (rows, last dim), a view where it can be: a column slice of a wider GEMM output keeps its row stride."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.shape[-1]
    x2 = rows_2d(x)
    out = rows_empty(x2.shape[0], h, F16, x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, w, out, h, x2.stride(0), eps, BLOCK=1024, num_warps=4, **launch_opts(out))
    return out.reshape(x.shape)


@triton.jit
def _rows_linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, OUT_F16: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    """Each row is its own row of a fixed-shape tl.dot, so its bits never depend on the other rows."""
    pdl_enter(PDL)
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    c_ok = cols < N
    r_ok = rows < M
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        k_ok = kk < K
        xt = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + kk[None, :], mask=r_ok[:, None] & k_ok[None, :],
                     other=0.0).to(tl.float16)
        wt = tl.load(w_ptr + cols.to(tl.int64)[None, :] * K + kk[:, None], mask=k_ok[:, None] & c_ok[None, :],
                     other=0.0)
        acc = tl.dot(xt, wt, acc)
    dst = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    if OUT_F16:
        tl.store(dst, acc.to(tl.float16), mask=r_ok[:, None] & c_ok[None, :])
    else:
        tl.store(dst, acc, mask=r_ok[:, None] & c_ok[None, :])


ROWS_BM, ROWS_BN, ROWS_BK = 32, 16, 128


def rows_linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype = F32) -> torch.Tensor:
    """x (..., K) fp16-valued @ w (N, K).T -> out_dtype (..., N) in one launch (`gemm.SMALL_WEIGHT_BYTES`)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    m, n = x2.shape[0], w.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m:
        _rows_linear_kernel[(triton.cdiv(n, ROWS_BN), triton.cdiv(m, ROWS_BM))](
            x2, w.contiguous(), out, m, n, k, OUT_F16=out_dtype == F16, BM=ROWS_BM, BN=ROWS_BN, BK=ROWS_BK,
            num_warps=4, num_stages=4, **launch_opts(out))
    return out.reshape(*lead, n)
