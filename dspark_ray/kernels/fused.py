"""Fused Triton kernels for the draft step's chains of small ops (the fast path, `kernels.gemm.use_matmul("fast")`).

Why: in the reference form (`model/*`), the mHC mixes, the 20 Sinkhorn rounds, every norm, RoPE, the attention
softmax and SwiGLU are chains of small torch ops, and every tree-sum level is a kernel of its own. The full drafter
ran ~3,300 kernels per step, so a graph replay took 9 ms against a 0.8 ms byte bound. Each kernel here does one
chain in a single launch.

What they keep and what they change, against the reference:
* Every rounding point stays where the reference has it: fp16 rounding of the mixing rows, of c, of the norm
  outputs, of the exponentials before PV, of each SwiGLU step. Transcendentals run in fp64 and are rounded once
  to fp32. Divisions are IEEE (`div_rn`). Kernels launch with `enable_fp_fusion=False`, so a * b + c is never
  contracted into an FMA.
* Reductions (RMS means, mixing dots, Sinkhorn sums, attention dots) use the kernel's own fixed order (`tl.sum`
  over fixed blocks, `tl.dot`), not the reference's pairwise tree. So the fast path is close to the exact path,
  not bit-equal to it, as for the cuBLAS matmuls. Elementwise kernels with no reduction (`mhc_expand`, `swiglu`)
  give the reference's exact bits.
* Batch invariance: one program per row (or per (row, block)), and no program reads another row's data. A
  request's bits never depend on its neighbours, and the order depends only on the tensor shapes of one row.
* No autotune, fixed num_warps: the compiled code, and so the bits, are the same in every process on a card
  kind.

`TABLE` maps the names that `model.ops.fused` looks up to these kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm import BLOCK_K, BLOCK_N, NUM_WARPS

F16, F32 = torch.float16, torch.float32
_OPTS = dict(enable_fp_fusion=False)


# ----------------------------------------------------------------------------------------------- device helpers

@triton.jit
def _rsqrt64(x):
    """rsqrt in fp64, rounded once to fp32 (as `ops.rsqrt`)."""
    return (1.0 / tl.sqrt(x.to(tl.float64))).to(tl.float32)      # sqrt.rn.f64, div.rn.f64


@triton.jit
def _sigmoid64(x):
    """sigmoid in fp64, rounded once to fp32 (as `ops.sigmoid`)."""
    return (1.0 / (1.0 + tl.exp(-x.to(tl.float64)))).to(tl.float32)


@triton.jit
def _exp64(x):
    return tl.exp(x.to(tl.float64)).to(tl.float32)


@triton.jit
def _norm_scale(ss, n, eps):
    """r = rsqrt(sum(x^2) / n + eps), as `ops.rms_norm` and `ops.head_norm` compute it (n: fp32)."""
    return _rsqrt64(tl.math.div_rn(ss, n) + eps)


@triton.jit
def _apply_head_weight(xr, w, W_MODE: tl.constexpr):
    """`ops.head_norm`'s weight rule on xr = x * r (fp32): 0 no weight, 1 fp16 weight (round xr first), 2 a
    bf16 / fp32 weight (one rounding). Returns fp16."""
    if W_MODE == 0:
        return xr.to(tl.float16)
    elif W_MODE == 1:
        return (xr.to(tl.float16).to(tl.float32) * w).to(tl.float16)
    else:
        return (xr * w).to(tl.float16)


# ------------------------------------------------------------------------------------------------------ mHC

@triton.jit
def _mhc_mix_kernel(x_ptr, fn_ptr, out_ptr, L, N_OUT, BLOCK: tl.constexpr):
    """Program (row, o): o < N_OUT: dot(X_row, fn16[o]); o == N_OUT: sum(X_row^2). X_row is the row's M*h streams."""
    r = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1)
    is_sq = o == N_OUT
    oc = tl.minimum(o, N_OUT - 1).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, L, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        m = offs < L
        x = tl.load(x_ptr + r * L + offs, mask=m, other=0.0)
        f = tl.load(fn_ptr + oc * L + offs, mask=m, other=0.0).to(tl.float32)
        acc += x * tl.where(is_sq, x, f)
    tl.store(out_ptr + r * (N_OUT + 1) + o, tl.sum(acc, axis=0))


@triton.jit
def _mhc_combine_kernel(x_ptr, v_ptr, base_ptr, scale_ptr, w_ptr, norm_out_ptr, pre_out_ptr, post_ptr, comb_ptr,
                        H, L, N_OUT, hc_eps, norm_eps, iters,
                        HEAD: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: logits -> pre / post / Sinkhorn comb, c = sum_k pre_k X_k, then the RMS norm of c.
    HEAD (the HyperHead): only pre; c stays fp32 and is also written out (the head's pre-norm state)."""
    r = tl.program_id(0).to(tl.int64)
    L1 = N_OUT + 1
    rho = _rsqrt64(tl.math.div_rn(tl.load(v_ptr + r * L1 + N_OUT), L.to(tl.float32)) + norm_eps)
    i4 = tl.arange(0, 4)
    s0 = tl.load(scale_ptr)
    pre = _sigmoid64((tl.load(v_ptr + r * L1 + i4) * rho) * s0 + tl.load(base_ptr + i4)) + hc_eps
    if not HEAD:
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        post = 2.0 * _sigmoid64((tl.load(v_ptr + r * L1 + 4 + i4) * rho) * s1 + tl.load(base_ptr + 4 + i4))
        ij = i4[:, None] * 4 + i4[None, :]                        # [source a, destination b]
        s = (tl.load(v_ptr + r * L1 + 8 + ij) * rho) * s2 + tl.load(base_ptr + 8 + ij)
        e = _exp64(s - tl.max(s, axis=1)[:, None])
        p = tl.math.div_rn(e, tl.sum(e, axis=1)[:, None]) + hc_eps
        p = tl.math.div_rn(p, tl.sum(p, axis=0)[None, :] + hc_eps)
        for _ in range(iters - 1):
            p = tl.math.div_rn(p, tl.sum(p, axis=1)[:, None] + hc_eps)
            p = tl.math.div_rn(p, tl.sum(p, axis=0)[None, :] + hc_eps)
        tl.store(post_ptr + r * 4 + i4, post)
        tl.store(comb_ptr + r * 16 + ij, p)
    p0 = tl.sum(tl.where(i4 == 0, pre, 0.0), axis=0)
    p1 = tl.sum(tl.where(i4 == 1, pre, 0.0), axis=0)
    p2 = tl.sum(tl.where(i4 == 2, pre, 0.0), axis=0)
    p3 = tl.sum(tl.where(i4 == 3, pre, 0.0), axis=0)
    xr = x_ptr + r * 4 * H
    # Pass 1: c and its sum of squares. Pass 2 recomputes c (same ops, same bits) rather than re-reading it, so no
    # program reads what another thread of it wrote.
    ss = tl.zeros((BLOCK,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK):
        offs = h0 + tl.arange(0, BLOCK)
        m = offs < H
        c = p0 * tl.load(xr + offs, mask=m, other=0.0)
        c = c + p1 * tl.load(xr + H + offs, mask=m, other=0.0)
        c = c + p2 * tl.load(xr + 2 * H + offs, mask=m, other=0.0)
        c = c + p3 * tl.load(xr + 3 * H + offs, mask=m, other=0.0)
        if HEAD:
            tl.store(pre_out_ptr + r * H + offs, c, mask=m)
        else:
            c = c.to(tl.float16).to(tl.float32)
        ss += c * c
    rn = _norm_scale(tl.sum(ss, axis=0), H.to(tl.float32), norm_eps)
    for h0 in range(0, H, BLOCK):
        offs = h0 + tl.arange(0, BLOCK)
        m = offs < H
        c = p0 * tl.load(xr + offs, mask=m, other=0.0)
        c = c + p1 * tl.load(xr + H + offs, mask=m, other=0.0)
        c = c + p2 * tl.load(xr + 2 * H + offs, mask=m, other=0.0)
        c = c + p3 * tl.load(xr + 3 * H + offs, mask=m, other=0.0)
        if not HEAD:
            c = c.to(tl.float16).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(norm_out_ptr + r * H + offs, ((c * w) * rn).to(tl.float16), mask=m)


@triton.jit
def _mhc_expand_kernel(x_ptr, y_ptr, post_ptr, comb_ptr, out_ptr, H, BLOCK: tl.constexpr):
    """X'[k] = post_k * y + sum_i comb[i, k] * X[i], i in order, no FMA: the reference's exact bits."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < H
    xr = x_ptr + r * 4 * H
    x0 = tl.load(xr + offs, mask=m)
    x1 = tl.load(xr + H + offs, mask=m)
    x2 = tl.load(xr + 2 * H + offs, mask=m)
    x3 = tl.load(xr + 3 * H + offs, mask=m)
    y = tl.load(y_ptr + r * H + offs, mask=m)
    for k in tl.static_range(4):
        acc = tl.load(post_ptr + r * 4 + k) * y
        acc = acc + tl.load(comb_ptr + r * 16 + k) * x0
        acc = acc + tl.load(comb_ptr + r * 16 + 4 + k) * x1
        acc = acc + tl.load(comb_ptr + r * 16 + 8 + k) * x2
        acc = acc + tl.load(comb_ptr + r * 16 + 12 + k) * x3
        tl.store(out_ptr + r * 4 * H + k * H + offs, acc, mask=m)


def _fn16(fn: torch.Tensor) -> torch.Tensor:
    """The mixing rows rounded to fp16 (the reference's rounding point), made once per weight."""
    t = getattr(fn, "_dspark_fn16", None)
    if t is None:
        t = fn.to(F16).contiguous()
        fn._dspark_fn16 = t
    return t


def _mix(x: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    rows, L = x.shape[0], x.shape[1] * x.shape[2]
    n_out = fn.shape[0]
    v = torch.empty((rows, n_out + 1), dtype=F32, device=x.device)
    _mhc_mix_kernel[(rows, n_out + 1)](x, _fn16(fn), v, L, n_out, BLOCK=4096, num_warps=8, **_OPTS)
    return v


def mhc_collapse_norm(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                      norm_w: torch.Tensor, *, iters: int, hc_eps: float, norm_eps: float):
    """`HcSite.collapse` followed by `rms_norm(c, norm_w)`: x (rows, 4, h) fp32 -> (normed (rows, h) fp16,
    post (rows, 4), comb (rows, 4, 4))."""
    x = x.contiguous()
    rows, m, h = x.shape
    v = _mix(x, fn)
    normed = torch.empty((rows, h), dtype=F16, device=x.device)
    post = torch.empty((rows, m), dtype=F32, device=x.device)
    comb = torch.empty((rows, m, m), dtype=F32, device=x.device)
    _mhc_combine_kernel[(rows,)](x, v, base, scale, norm_w, normed, normed, post, comb, h, m * h, fn.shape[0],
                                 hc_eps, norm_eps, iters, HEAD=False, BLOCK=2048, num_warps=8, **_OPTS)
    return normed, post, comb


def hyper_head_norm(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                    norm_w: torch.Tensor, *, hc_eps: float, norm_eps: float):
    """`HyperHead` then the final `rms_norm`: x (rows, 4, h) -> (prenorm (rows, h) fp32, normed (rows, h) fp16)."""
    x = x.contiguous()
    rows, m, h = x.shape
    v = _mix(x, fn)
    normed = torch.empty((rows, h), dtype=F16, device=x.device)
    prenorm = torch.empty((rows, h), dtype=F32, device=x.device)
    _mhc_combine_kernel[(rows,)](x, v, base, scale, norm_w, normed, prenorm, prenorm, prenorm, h, m * h,
                                 fn.shape[0], hc_eps, norm_eps, 1, HEAD=True, BLOCK=2048, num_warps=8, **_OPTS)
    return prenorm, normed


def mhc_expand(x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    x, y = x.contiguous(), y.contiguous()
    rows, m, h = x.shape
    out = torch.empty_like(x)
    _mhc_expand_kernel[(rows, triton.cdiv(h, 1024))](x, y, post.contiguous(), comb.contiguous(), out, h,
                                                     BLOCK=1024, num_warps=4, **_OPTS)
    return out


# ------------------------------------------------------------------------------------------------ norms, RoPE

@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, H, eps, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    ss = tl.zeros((BLOCK,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK):
        offs = h0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + r * H + offs, mask=offs < H, other=0.0).to(tl.float32)
        ss += x * x
    rn = _norm_scale(tl.sum(ss, axis=0), H.to(tl.float32), eps)
    for h0 in range(0, H, BLOCK):
        offs = h0 + tl.arange(0, BLOCK)
        m = offs < H
        x = tl.load(x_ptr + r * H + offs, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + r * H + offs, ((x * w) * rn).to(tl.float16), mask=m)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """`ops.rms_norm`: x (..., h) fp16 / fp32 -> fp16."""
    h = x.shape[-1]
    x2 = x.reshape(-1, h).contiguous()
    out = torch.empty(x2.shape, dtype=F16, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, w, out, h, eps, BLOCK=1024, num_warps=4, **_OPTS)
    return out.reshape(x.shape)


@triton.jit
def _head_norm_rope_kernel(x_ptr, w_ptr, pos_ptr, inv_freq_ptr, out_ptr, NH, eps,
                           D: tl.constexpr, RD: tl.constexpr, W_MODE: tl.constexpr):
    """One program per (row, head): `ops.head_norm` over D, then RoPE on the last RD dims (interleaved pairs)
    at the row's position, as `Attention._rope_tail` does (rotate the fp16 values in fp32, round once)."""
    pid = tl.program_id(0).to(tl.int64)
    row = pid // NH
    base = x_ptr + pid * D
    d = tl.arange(0, D)
    x = tl.load(base + d).to(tl.float32)
    rn = _norm_scale(tl.sum(x * x, axis=0), tl.full((), D, tl.float32), eps)
    w = 1.0
    if W_MODE != 0:
        w = tl.load(w_ptr + d).to(tl.float32)
    y = _apply_head_weight(x * rn, w, W_MODE)
    DN: tl.constexpr = D - RD
    tl.store(out_ptr + pid * D + d, y, mask=d < DN)
    i = tl.arange(0, RD // 2)
    ev = DN + 2 * i
    xe = tl.load(base + ev).to(tl.float32)
    xo = tl.load(base + ev + 1).to(tl.float32)
    we = 1.0
    wo = 1.0
    if W_MODE != 0:
        we = tl.load(w_ptr + ev).to(tl.float32)
        wo = tl.load(w_ptr + ev + 1).to(tl.float32)
    ye = _apply_head_weight(xe * rn, we, W_MODE).to(tl.float32)
    yo = _apply_head_weight(xo * rn, wo, W_MODE).to(tl.float32)
    ang = tl.load(pos_ptr + row).to(tl.float32) * tl.load(inv_freq_ptr + i)
    cos = tl.cos(ang.to(tl.float64)).to(tl.float32)
    sin = tl.sin(ang.to(tl.float64)).to(tl.float32)
    tl.store(out_ptr + pid * D + ev, (ye * cos - yo * sin).to(tl.float16))
    tl.store(out_ptr + pid * D + ev + 1, (yo * cos + ye * sin).to(tl.float16))


def head_norm_rope(x: torch.Tensor, w: torch.Tensor | None, eps: float, pos: torch.Tensor,
                   inv_freq: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """x (n, ..., D) fp16 heads (or the kv row) -> head_norm, then RoPE on the last rope_dim dims at pos (n,)."""
    n, D = x.shape[0], x.shape[-1]
    x3 = x.reshape(n, -1, D).contiguous()
    nh = x3.shape[1]
    out = torch.empty(x3.shape, dtype=F16, device=x.device)
    mode = 0 if w is None else (1 if w.dtype == F16 else 2)
    if n:
        _head_norm_rope_kernel[(n * nh,)](x3, x3 if w is None else w, pos.contiguous(), inv_freq, out, nh, eps,
                                          D=D, RD=rope_dim, W_MODE=mode, num_warps=4, **_OPTS)
    return out.reshape(x.shape)


# ------------------------------------------------------------------------------------------------- attention

@triton.jit
def _attend_kernel(q_ptr, win_ptr, valid_ptr, kv_ptr, sink_ptr, pos_ptr, inv_freq_ptr, out_ptr, scale,
                   NH, BLK, W,
                   D: tl.constexpr, RD: tl.constexpr, BM: tl.constexpr, BW: tl.constexpr, BB: tl.constexpr,
                   BD: tl.constexpr):
    """Program (request b, block of BM query rows of the request's BLK*NH (row j, head h) pairs): scores against
    the W window rows and the BLK block rows (V = K; the two sets read from their own buffers, row-contiguous so
    the loads vectorise), sink softmax with fp64 exponentials, exponentials rounded to fp16 for PV, de-rotation
    of the RoPE tail. tl.dot takes the products (fp16 x fp16, fp32 sums)."""
    b = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    row_ok = rows < BLK * NH
    j = rows // NH
    hd = rows % NH
    q_rows = q_ptr + (b * BLK * NH + rows.to(tl.int64)) * D
    kw = tl.arange(0, BW)
    w_ok = (kw < W) & (tl.load(valid_ptr + b * W + kw, mask=kw < W, other=0) != 0)
    kb = tl.arange(0, BB)
    b_ok = kb < BLK
    win_rows = win_ptr + (b * W + kw) * D
    blk_rows = kv_ptr + (b * BLK + kb) * D
    sw = tl.zeros((BM, BW), dtype=tl.float32)
    sb = tl.zeros((BM, BB), dtype=tl.float32)
    for d0 in range(0, D, BD):             # a runtime loop: Triton pipelines its loads (num_stages)
        dd = d0 + tl.arange(0, BD)
        qt = tl.load(q_rows[:, None] + dd[None, :], mask=row_ok[:, None], other=0.0)
        kwt = tl.load(win_rows[:, None] + dd[None, :], mask=w_ok[:, None], other=0.0)
        kbt = tl.load(blk_rows[:, None] + dd[None, :], mask=b_ok[:, None], other=0.0)
        sw = tl.dot(qt, tl.trans(kwt), sw)
        sb = tl.dot(qt, tl.trans(kbt), sb)
    sw = tl.where(w_ok[None, :], sw * scale, float("-inf"))
    sb = tl.where(b_ok[None, :], sb * scale, float("-inf"))
    sink = tl.load(sink_ptr + hd, mask=row_ok, other=0.0)
    mu = tl.maximum(tl.maximum(tl.max(sw, axis=1), tl.max(sb, axis=1)), sink)
    ew = _exp64(sw - mu[:, None])
    eb = _exp64(sb - mu[:, None])
    den = _exp64(sink - mu) + (tl.sum(ew, axis=1) + tl.sum(eb, axis=1))
    pw = ew.to(tl.float16)
    pb = eb.to(tl.float16)
    o_rows = out_ptr + (b * BLK * NH + rows.to(tl.int64)) * D
    DN: tl.constexpr = D - RD
    for d0 in range(0, DN, BD):
        dd = d0 + tl.arange(0, BD)
        kwt = tl.load(win_rows[:, None] + dd[None, :], mask=w_ok[:, None], other=0.0)
        kbt = tl.load(blk_rows[:, None] + dd[None, :], mask=b_ok[:, None], other=0.0)
        o = tl.math.div_rn(tl.dot(pb, kbt, tl.dot(pw, kwt)), den[:, None])
        tl.store(o_rows[:, None] + dd[None, :], o.to(tl.float16), mask=row_ok[:, None])
    dt = DN + tl.arange(0, RD)
    kwt = tl.load(win_rows[:, None] + dt[None, :], mask=w_ok[:, None], other=0.0)
    kbt = tl.load(blk_rows[:, None] + dt[None, :], mask=b_ok[:, None], other=0.0)
    ot = tl.math.div_rn(tl.dot(pb, kbt, tl.dot(pw, kwt)), den[:, None])           # (BM, RD), pairs interleaved
    oe, oo = tl.split(tl.reshape(ot, (BM, RD // 2, 2)))
    i = tl.arange(0, RD // 2)
    ang = tl.load(pos_ptr + b * BLK + j, mask=row_ok, other=0).to(tl.float32)[:, None] * tl.load(inv_freq_ptr + i)[None, :]
    cos = tl.cos(ang.to(tl.float64)).to(tl.float32)
    sin = tl.sin(ang.to(tl.float64)).to(tl.float32)
    y = tl.reshape(tl.join(oe * cos + oo * sin, oo * cos - oe * sin), (BM, RD))
    tl.store(o_rows[:, None] + dt[None, :], y.to(tl.float16), mask=row_ok[:, None])


def attend(q: torch.Tensor, window: torch.Tensor, valid: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor,
           scale: float, pos: torch.Tensor, inv_freq: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """`Attention._attend` on the unconcatenated keys: q (bsz, B, H, D) fp16, window (bsz, W, D) fp16 with valid
    (bsz, W), kv (bsz, B, D) fp16 the block's own rows, pos (bsz*B,) -> o (bsz, B, H, D) fp16."""
    bsz, blk, nh, D = q.shape
    W = window.shape[1]
    out = torch.empty_like(q)
    bm, bd = 16, 64
    if (D - rope_dim) % bd:
        raise ValueError(f"attend: head_dim - rope_dim = {D - rope_dim} must be a multiple of {bd}")
    grid = (bsz, triton.cdiv(blk * nh, bm))
    # bool -> uint8 is a view (no kernel)
    vb = valid.contiguous().view(torch.uint8) if valid.dtype == torch.bool else valid.to(torch.uint8).contiguous()
    _attend_kernel[grid](q.contiguous(), window.contiguous(), vb, kv.contiguous(),
                         sink, pos.contiguous(), inv_freq, out, scale, nh, blk, W,
                         D=D, RD=rope_dim, BM=bm, BW=max(16, triton.next_power_of_2(W)),
                         BB=max(16, triton.next_power_of_2(blk)), BD=bd, num_warps=4, num_stages=3, **_OPTS)
    return out


# -------------------------------------------------------------------------------------------------------- FFN

@triton.jit
def _swiglu_math(g, u, limit):
    """`ops.swiglu(f16(g), f16(u), limit)` elementwise: silu in fp16 steps (exp in fp64), clamps, one rounding."""
    g = g.to(tl.float16).to(tl.float32)
    u = u.to(tl.float16).to(tl.float32)
    t = _exp64(-g).to(tl.float16).to(tl.float32)
    t = (1.0 + t).to(tl.float16).to(tl.float32)
    rc = tl.math.div_rn(tl.full(g.shape, 1.0, tl.float32), t).to(tl.float16).to(tl.float32)
    s = (g * rc).to(tl.float16).to(tl.float32)
    if limit > 0:
        s = tl.minimum(s, limit, propagate_nan=tl.PropagateNan.ALL)      # torch.clamp keeps a NaN
        u = tl.minimum(tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                       propagate_nan=tl.PropagateNan.ALL)
    return (s * u).to(tl.float16)


@triton.jit(do_not_specialize=["N"])
def _swiglu_kernel(g_ptr, u_ptr, out_ptr, N, limit, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    g = tl.load(g_ptr + offs, mask=m, other=0.0)
    u = tl.load(u_ptr + offs, mask=m, other=0.0)
    tl.store(out_ptr + offs, _swiglu_math(g, u, limit), mask=m)


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """g, u: the gate / up projections (fp32 accumulators or fp16), same shape -> fp16 activation."""
    g, u = g.contiguous(), u.contiguous()
    out = torch.empty(g.shape, dtype=F16, device=g.device)
    n = g.numel()
    if n:
        _swiglu_kernel[(triton.cdiv(n, 1024),)](g, u, out, n, float(limit), BLOCK=1024, num_warps=4, **_OPTS)
    return out


# ------------------------------------------------------------------------------------------------ small linears

@triton.jit
def _rows_linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, OUT_F16: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr):
    """out (M, N) = x (M, K) @ w (N, K).T, fp32 accumulation: program (block of BN outputs, block of BM rows).
    Each row is its own row of a tl.dot of a fixed tile shape, so its bits never depend on the other rows."""
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
    """x (..., K) fp16-valued @ w (N, K).T -> out_dtype (..., N), one launch reading x in place: the small
    linears of the step, where cuBLAS's padded call costs a pad copy, the GEMM and a split-K reduce."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    m, n = x2.shape[0], w.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m:
        _rows_linear_kernel[(triton.cdiv(n, ROWS_BN), triton.cdiv(m, ROWS_BM))](
            x2, w.contiguous(), out, m, n, k, OUT_F16=out_dtype == F16, BM=ROWS_BM, BN=ROWS_BN, BK=ROWS_BK,
            num_warps=4, num_stages=4, **_OPTS)
    return out.reshape(*lead, n)


# ------------------------------------------------------------------------------------------------ routed experts

@triton.jit
def _expert_dot(x_row, w_rows, K, n_mask, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 (BLOCK_N,) = W[rows] @ x over K: BLOCK_K chunks in sequence, each a fixed tl.sum tree. One row, one
    expert: no other row takes part (batch invariant). Shared by every indexed kernel, so they agree bit for bit."""
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        xk = tl.load(x_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        wt = tl.load(w_rows[:, None] + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                     other=0.0).to(tl.float32)
        acc += tl.sum(wt * xk[None, :], axis=1)      # fp16 x fp16 products are exact in fp32
    return acc


@triton.jit
def _indexed_kernel(x_ptr, w_ptr, idx_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[p] = x[p] @ w[idx[p]].T, one program per (row p, block of N); reads the expert in place."""
    p = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    e = tl.load(idx_ptr + p).to(tl.int64)          # int64: e * N * K exceeds 2^31 for large expert stacks
    acc = _expert_dot(x_ptr + p * K, w_ptr + (e * N + offs_n) * K, K, n_mask, BLOCK_N, BLOCK_K)
    tl.store(out_ptr + p * N + offs_n, acc, mask=n_mask)


@triton.jit
def _grouped_expert_kernel(x_ptr, w1_ptr, w3_ptr, idx_ptr, out_ptr, P, N, K, X_DIV, limit,
                           GATED: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Routed experts, grouped: program (pair p, block of N) works only when p is the first pair routed to its
    expert; it then takes every pair of that expert (up to BM per pass) through one read of the expert's weights.
    Pair t reads input row t // X_DIV. GATED: out[t] = swiglu(x W1^T, x W3^T) fp16, else out[t] = x W1^T fp32.

    Each pair's row is its own row of a tl.dot: the products and the accumulation order of an output element
    depend only on that row and the weights, not on which other pairs share the tile or where in the tile it
    sits (batch invariant; tested alone against batched)."""
    p = tl.program_id(0)
    e = tl.load(idx_ptr + p)
    first = P
    for c0 in range(0, P, BM):
        t = c0 + tl.arange(0, BM)
        ids = tl.load(idx_ptr + t, mask=t < P, other=-1)
        first = tl.minimum(first, tl.min(tl.where(ids == e, t, P), axis=0))
    if first == p:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        w_rows = (e.to(tl.int64) * N + offs_n) * K
        for c0 in range(p, P, BM):
            t = c0 + tl.arange(0, BM)
            ok = (t < P) & (tl.load(idx_ptr + t, mask=t < P, other=-1) == e)
            if tl.max(ok.to(tl.int32), axis=0) > 0:
                x_rows = x_ptr + (t // X_DIV).to(tl.int64) * K
                acc1 = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
                acc3 = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    kk = k0 + tl.arange(0, BLOCK_K)
                    k_ok = kk < K
                    xk = tl.load(x_rows[:, None] + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
                    w1 = tl.load(w1_ptr + w_rows[None, :] + kk[:, None], mask=k_ok[:, None] & n_ok[None, :],
                                 other=0.0)
                    acc1 = tl.dot(xk, w1, acc1)
                    if GATED:
                        w3 = tl.load(w3_ptr + w_rows[None, :] + kk[:, None], mask=k_ok[:, None] & n_ok[None, :],
                                     other=0.0)
                        acc3 = tl.dot(xk, w3, acc3)
                dst = out_ptr + t.to(tl.int64)[:, None] * N + offs_n[None, :]
                if GATED:
                    tl.store(dst, _swiglu_math(acc1, acc3, limit), mask=ok[:, None] & n_ok[None, :])
                else:
                    tl.store(dst, acc1, mask=ok[:, None] & n_ok[None, :])


@triton.jit
def _expert_combine_kernel(d_ptr, idx_ptr, wt_ptr, shared_ptr, out_ptr, H,
                           KC: tl.constexpr, KCP: tl.constexpr, BLOCK: tl.constexpr):
    """out[r] = sum_j w_j * d[r*KC + j] over the row's choices in ascending expert id (as `Experts`), + shared."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < H
    jj = tl.arange(0, KCP)
    ids = tl.load(idx_ptr + r * KC + jj, mask=jj < KC, other=2147483647)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for _ in tl.static_range(KC):
        e = tl.min(ids, axis=0)
        j = tl.min(tl.where(ids == e, jj, KCP), axis=0)        # the choice holding the lowest remaining id
        ids = tl.where(jj == j, 2147483647, ids)
        d = tl.load(d_ptr + (r * KC + j) * H + offs, mask=m, other=0.0)
        acc = acc + tl.load(wt_ptr + r * KC + j).to(tl.float32) * d
    acc = acc + tl.load(shared_ptr + r * H + offs, mask=m, other=0.0)
    tl.store(out_ptr + r * H + offs, acc, mask=m)


# Fixed blocking of every expert kernel (no autotune: see the module docstring).
EXPERT_BLOCK_N, EXPERT_BLOCK_K, EXPERT_WARPS = BLOCK_N, BLOCK_K, NUM_WARPS


def indexed_linear(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """fp32 (P, N): out[p] = x[p] @ w[idx[p]].T. x (P, K) fp16-valued, w (E, N, K) fp16 contiguous, idx (P,)."""
    p, k = x.shape
    n = w.shape[1]
    out = torch.empty((p, n), dtype=F32, device=x.device)
    if p:
        _indexed_kernel[(p, triton.cdiv(n, EXPERT_BLOCK_N))](
            x.to(F16).contiguous(), w.contiguous(), idx.contiguous(), out, n, k,
            BLOCK_N=EXPERT_BLOCK_N, BLOCK_K=EXPERT_BLOCK_K, num_warps=EXPERT_WARPS, **_OPTS)
    return out


GROUP_BM = 64      # pairs of one expert per pass (a graph step has at most 4 x 5 rows x top-3 = 60 pairs)


def _grouped(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor | None, experts: torch.Tensor, x_div: int,
             limit: float) -> torch.Tensor:
    p = experts.numel()
    n, k = w1.shape[1], w1.shape[2]
    gated = w3 is not None
    out = torch.empty((p, n), dtype=F16 if gated else F32, device=x.device)
    if p:
        _grouped_expert_kernel[(p, triton.cdiv(n, EXPERT_BLOCK_N))](
            x.to(F16).contiguous(), w1, w3 if gated else w1, experts.contiguous(), out, p, n, k, x_div,
            float(limit), GATED=gated, BM=GROUP_BM, BLOCK_N=EXPERT_BLOCK_N, BLOCK_K=EXPERT_BLOCK_K,
            num_warps=EXPERT_WARPS, **_OPTS)
    return out


def expert_act(f: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, experts: torch.Tensor,
               limit: float) -> torch.Tensor:
    """fp16 (n*k, I): the SwiGLU activation of each (row, choice) pair; f (n, h) fp16, experts (n, k)."""
    return _grouped(f, w1, w3, experts, experts.shape[1], limit)


def expert_out(act: torch.Tensor, w2: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
               shared: torch.Tensor) -> torch.Tensor:
    """fp32 (n, h): the weighted routed outputs (ascending expert id) plus the shared expert's `shared`."""
    n, kc = experts.shape
    h = w2.shape[1]
    d = _grouped(act, w2, None, experts, 1, 0.0)
    out = torch.empty((n, h), dtype=F32, device=act.device)
    if n:
        _expert_combine_kernel[(n, triton.cdiv(h, 1024))](
            d, experts.contiguous(), weights.contiguous(), shared.contiguous(), out, h,
            KC=kc, KCP=triton.next_power_of_2(kc), BLOCK=1024, num_warps=4, **_OPTS)
    return out


# ---------------------------------------------------------------------------------------------------- router

@triton.jit
def _route_kernel(lg_ptr, bsel_ptr, experts_ptr, weights_ptr, E, scaling,
                  TOPK: tl.constexpr, EP: tl.constexpr):
    """`Router` on one row of fp16 logits: sc = sqrt(softplus(l)) (fp64 softplus), key = sc + bias (NaN -> -inf),
    top-k by key with ties to the lower id (the stable sort's order), weights f16(sc * scaling / (sum + 1e-20))
    with the sum in selection order."""
    r = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EP)
    ok = e < E
    l = tl.load(lg_ptr + r * E + e, mask=ok, other=0.0).to(tl.float64)
    y = tl.exp(l)
    u = 1.0 + y
    lp = tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))      # log1p(y) to a few fp64 ulps (Goldberg)
    sp = tl.where(l > 20.0, l, lp).to(tl.float32)
    sc = tl.sqrt_rn(sp)
    key = sc + tl.load(bsel_ptr + e, mask=ok, other=0.0)
    key = tl.where(key != key, float("-inf"), key)
    taken = ~ok
    den = 0.0
    for t in tl.static_range(TOPK):
        best = tl.max(tl.where(taken, float("-inf"), key), axis=0)
        pick = tl.min(tl.where((key == best) & ~taken, e, EP), axis=0)
        taken = taken | (e == pick)
        tl.store(experts_ptr + r * TOPK + t, pick.to(tl.int64))
        c = tl.sum(tl.where(e == pick, sc, 0.0), axis=0)
        if t == 0:
            den = c
        else:
            den = den + c
    for t in tl.static_range(TOPK):
        pick = tl.load(experts_ptr + r * TOPK + t)
        c = tl.sum(tl.where(e == pick, sc, 0.0), axis=0)
        tl.store(weights_ptr + r * TOPK + t, tl.math.div_rn(c * scaling, den + 1e-20).to(tl.float16))


def route(lg: torch.Tensor, bsel: torch.Tensor, top_k: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """lg (n, E) fp16 router logits -> (experts (n, k) int64 in selection order, weights (n, k) fp16)."""
    n, E = lg.shape
    experts = torch.empty((n, top_k), dtype=torch.int64, device=lg.device)
    weights = torch.empty((n, top_k), dtype=F16, device=lg.device)
    if n:
        _route_kernel[(n,)](lg.contiguous(), bsel, experts, weights, E, float(scaling), TOPK=top_k,
                            EP=triton.next_power_of_2(E), num_warps=4, **_OPTS)
    return experts, weights


# ------------------------------------------------------------------------------------------------------ head

@triton.jit
def _markov_partial_kernel(lg_ptr, lg_row, prev_ptr, w1_ptr, w2_ptr, b2_ptr, me_ptr, logits_ptr, part_ptr,
                           V, NB, R: tl.constexpr, BV: tl.constexpr, HAS_BIAS: tl.constexpr, KEEP: tl.constexpr):
    """Program (request b, block of BV vocab rows) of one Markov step: me = f16(markov_w1[prev[b]]);
    l = lg[b, step] + f16(markov_w2 me + b2), NaN -> -inf; the block's (max, first argmax, runner-up)."""
    b = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    r = tl.arange(0, R)
    me = tl.load(w1_ptr + tl.load(prev_ptr + b) * R + r).to(tl.float16)
    if nb == 0:
        tl.store(me_ptr + b * R + r, me)
    v = nb * BV + tl.arange(0, BV)
    ok = v < V
    w2 = tl.load(w2_ptr + v.to(tl.int64)[:, None] * R + r[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    y = tl.sum(w2 * me.to(tl.float32)[None, :], axis=1)
    if HAS_BIAS:
        y = y + tl.load(b2_ptr + v, mask=ok, other=0.0).to(tl.float32)
    l = tl.load(lg_ptr + b * lg_row + v, mask=ok, other=0.0).to(tl.float32) + y.to(tl.float16).to(tl.float32)
    if KEEP:
        tl.store(logits_ptr + b * V + v, l, mask=ok)
    l = tl.where((l != l) | ~ok, float("-inf"), l)
    m1 = tl.max(l, axis=0)
    i1 = tl.min(tl.where(l == m1, v, 2147483647), axis=0)
    m2 = tl.max(tl.where(v == i1, float("-inf"), l), axis=0)
    base = part_ptr + (b * NB + nb) * 3
    tl.store(base, m1)
    tl.store(base + 1, i1.to(tl.float32))         # < 2^24: exact in fp32
    tl.store(base + 2, m2)


@triton.jit
def _markov_top_kernel(part_ptr, top1_ptr, top2_ptr, idx_ptr, NB, start, NBP: tl.constexpr):
    """Per request: the blocks' partials -> (max, first argmax + start, runner-up). Blocks are in vocabulary
    order, so the lowest block holding the max holds the first argmax."""
    b = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, NBP)
    ok = k < NB
    base = part_ptr + (b * NB + k) * 3
    m1 = tl.load(base, mask=ok, other=float("-inf"))
    i1 = tl.load(base + 1, mask=ok, other=0.0)
    m2 = tl.load(base + 2, mask=ok, other=float("-inf"))
    best = tl.max(m1, axis=0)
    win = tl.min(tl.where(ok & (m1 == best), k, NBP), axis=0)
    tl.store(top1_ptr + b, best)
    tl.store(top2_ptr + b, tl.max(tl.where(k == win, m2, m1), axis=0))
    tl.store(idx_ptr + b, tl.sum(tl.where(k == win, i1, 0.0), axis=0).to(tl.int64) + start)


MARKOV_BV = 128


def markov_step(lg: torch.Tensor, step: int, prev: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                b2: torch.Tensor | None, start: int, keep_logits: bool):
    """One step of the Markov loop on one vocabulary shard: lg (bsz, n_out, V) fp16 / fp32 trunk logits,
    prev (bsz,) the previous tokens -> (me (bsz, r) fp16, top1 (bsz,) fp32, top2 (bsz,) fp32, global argmax
    (bsz,) int64, logits (bsz, V) fp32 or None). Ties go to the lower id; a NaN logit never wins."""
    bsz, _, V = lg.shape
    R = w2.shape[1]
    dev = lg.device
    nb = triton.cdiv(V, MARKOV_BV)
    me = torch.empty((bsz, R), dtype=F16, device=dev)
    logits = torch.empty((bsz, V), dtype=F32, device=dev) if keep_logits else me
    part = torch.empty((bsz, nb, 3), dtype=F32, device=dev)
    top1 = torch.empty(bsz, dtype=F32, device=dev)
    top2 = torch.empty(bsz, dtype=F32, device=dev)
    idx = torch.empty(bsz, dtype=torch.int64, device=dev)
    lg_s = lg[:, step]
    _markov_partial_kernel[(bsz, nb)](lg_s, lg.stride(0), prev.contiguous(), w1, w2, w2 if b2 is None else b2, me,
                                      logits, part, V, nb, R=R, BV=MARKOV_BV, HAS_BIAS=b2 is not None,
                                      KEEP=keep_logits, num_warps=8, **_OPTS)
    _markov_top_kernel[(bsz,)](part, top1, top2, idx, nb, start, NBP=triton.next_power_of_2(nb), num_warps=8,
                               **_OPTS)
    return me, top1, top2, idx, (logits if keep_logits else None)


TABLE = {
    "markov_step": markov_step,
    "route": route,
    "expert_act": expert_act,
    "expert_out": expert_out,
    "mhc_collapse_norm": mhc_collapse_norm,
    "hyper_head_norm": hyper_head_norm,
    "mhc_expand": mhc_expand,
    "rms_norm": rms_norm,
    "head_norm_rope": head_norm_rope,
    "attend": attend,
    "swiglu": swiglu,
}
