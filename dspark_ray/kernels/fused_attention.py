"""Fused attention: head norm + RoPE of the q heads and the kv row, and the sink attention in two kernels (scores
over key chunks, then softmax + PV over output columns), which fill the card at one request where one kernel is
latency bound (docs/engine.md, "Fused kernels and the chain")."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .fused_ops import F16, apply_head_weight, exp64, launch_opts, norm_scale, pdl_enter
from .rows import grouped_rows_empty


@triton.jit
def _head_norm_rope_kernel(x_ptr, w_ptr, pos_ptr, inv_freq_ptr, out_ptr, NH, SX, eps,
                           D: tl.constexpr, RD: tl.constexpr, W_MODE: tl.constexpr, PDL: tl.constexpr):
    """Per (row, head): `ops.head_norm`, then RoPE on the last RD dims as `Attention._rope_tail` (fp32, round once)."""
    pdl_enter(PDL)
    pid = tl.program_id(0).to(tl.int64)
    row = pid // NH
    base = x_ptr + row * SX + (pid % NH) * D
    d = tl.arange(0, D)
    x = tl.load(base + d).to(tl.float32)
    rn = norm_scale(tl.sum(x * x, axis=0), tl.full((), D, tl.float32), eps)
    w = 1.0
    if W_MODE != 0:
        w = tl.load(w_ptr + d).to(tl.float32)
    y = apply_head_weight(x * rn, w, W_MODE)
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
    ye = apply_head_weight(xe * rn, we, W_MODE).to(tl.float32)
    yo = apply_head_weight(xo * rn, wo, W_MODE).to(tl.float32)
    ang = tl.load(pos_ptr + row).to(tl.float32) * tl.load(inv_freq_ptr + i)
    cos = tl.cos(ang.to(tl.float64)).to(tl.float32)
    sin = tl.sin(ang.to(tl.float64)).to(tl.float32)
    tl.store(out_ptr + pid * D + ev, (ye * cos - yo * sin).to(tl.float16))
    tl.store(out_ptr + pid * D + ev + 1, (yo * cos + ye * sin).to(tl.float16))


def head_norm_rope(x: torch.Tensor, w: torch.Tensor | None, eps: float, pos: torch.Tensor,
                   inv_freq: torch.Tensor, rope_dim: int) -> torch.Tensor:
    n, D = x.shape[0], x.shape[-1]
    x3 = x.reshape(n, -1, D)
    nh = x3.shape[1]
    if x3.stride(2) != 1 or (nh > 1 and x3.stride(1) != D):
        x3 = x3.contiguous()
    out = torch.empty(x3.shape, dtype=F16, device=x.device)
    mode = 0 if w is None else (1 if w.dtype == F16 else 2)
    if n:
        _head_norm_rope_kernel[(n * nh,)](x3, x3 if w is None else w, pos.contiguous(), inv_freq, out, nh,
                                          x3.stride(0), eps,
                                          D=D, RD=rope_dim, W_MODE=mode, num_warps=4, **launch_opts(out))
    return out.reshape(x.shape)


@triton.jit
def _scores_tile(q_rows, row_ok, k_rows, k_ok, s_cols, scale, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BD: tl.constexpr):
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for d0 in range(0, D, BD):             # a runtime loop, so Triton pipelines its loads
        dd = d0 + tl.arange(0, BD)
        qt = tl.load(q_rows[:, None] + dd[None, :], mask=row_ok[:, None], other=0.0)
        kt = tl.load(k_rows[:, None] + dd[None, :], mask=k_ok[:, None], other=0.0)    # a masked row reads 0, no NaN
        acc = tl.dot(qt, tl.trans(kt), acc)
    tl.store(s_cols, tl.where(k_ok[None, :], acc * scale, float("-inf")), mask=row_ok[:, None])


@triton.jit
def _attend_scores_kernel(q_ptr, win_ptr, valid_ptr, kv_ptr, s_ptr, scale, NH, BLK, W,
                          D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BW: tl.constexpr, BB: tl.constexpr,
                          BD: tl.constexpr, PDL: tl.constexpr):
    """Program (request, BM query rows, BN key columns of [window ; block]) -> fp32 scores (-inf where masked).
    Each branch runs the whole tile on its own pointers: one key pointer picked by the branch gave other last bits
    on the H200 (the operands reached the MMA another way)."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    row_ok = rows < BLK * NH
    c0 = tl.program_id(2) * BN
    q_rows = q_ptr + (b * BLK * NH + rows.to(tl.int64)) * D
    s_cols = s_ptr + ((b * BLK * NH + rows.to(tl.int64)) * (BW + BB))[:, None] + (c0 + tl.arange(0, BN))[None, :]
    if c0 < BW:
        kw = c0 + tl.arange(0, BN)
        w_ok = (kw < W) & (tl.load(valid_ptr + b * W + kw, mask=kw < W, other=0) != 0)
        _scores_tile(q_rows, row_ok, win_ptr + (b * W + kw) * D, w_ok, s_cols, scale, D, BM, BN, BD)
    else:
        kb = c0 - BW + tl.arange(0, BN)
        _scores_tile(q_rows, row_ok, kv_ptr + (b * BLK + kb) * D, kb < BLK, s_cols, scale, D, BM, BN, BD)


@triton.jit
def _attend_pv_kernel(s_ptr, win_ptr, valid_ptr, kv_ptr, sink_ptr, pos_ptr, inv_freq_ptr, out_ptr,
                      NH, BLK, W, HPG, GS, RS,
                      D: tl.constexpr, RD: tl.constexpr, BM: tl.constexpr, BW: tl.constexpr, BB: tl.constexpr,
                      BD: tl.constexpr, PDL: tl.constexpr):
    """Program (request, BM query rows, BD output columns or the RD RoPE tail): the sink softmax (recomputed per
    column chunk), exponentials rounded to fp16 for PV, den fp32 from the unrounded ones, IEEE division, and the
    tail's de-rotation. Head h of row n goes to (h // HPG) * GS + n * RS + (h % HPG) * D (plain or grouped)."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    row_ok = rows < BLK * NH
    j = rows // NH
    hd = rows % NH
    kw = tl.arange(0, BW)
    w_ok = (kw < W) & (tl.load(valid_ptr + b * W + kw, mask=kw < W, other=0) != 0)
    kb = tl.arange(0, BB)
    b_ok = kb < BLK
    win_rows = win_ptr + (b * W + kw) * D
    blk_rows = kv_ptr + (b * BLK + kb) * D
    s_rows = s_ptr + (b * BLK * NH + rows.to(tl.int64)) * (BW + BB)
    # rows past B*H read -inf everywhere: mu is their sink, finite (never stored)
    sw = tl.load(s_rows[:, None] + kw[None, :], mask=row_ok[:, None], other=float("-inf"))
    sb = tl.load(s_rows[:, None] + (BW + kb)[None, :], mask=row_ok[:, None], other=float("-inf"))
    sink = tl.load(sink_ptr + hd, mask=row_ok, other=0.0)
    mu = tl.maximum(tl.maximum(tl.max(sw, axis=1), tl.max(sb, axis=1)), sink)
    ew = exp64(sw - mu[:, None])
    eb = exp64(sb - mu[:, None])
    den = exp64(sink - mu) + (tl.sum(ew, axis=1) + tl.sum(eb, axis=1))
    pw = ew.to(tl.float16)
    pb = eb.to(tl.float16)
    o_rows = out_ptr + (hd // HPG).to(tl.int64) * GS + (b * BLK + j) * RS + (hd % HPG) * D
    DN: tl.constexpr = D - RD
    d0 = tl.program_id(2) * BD
    if d0 < DN:
        dd = d0 + tl.arange(0, BD)
        kwt = tl.load(win_rows[:, None] + dd[None, :], mask=w_ok[:, None], other=0.0)
        kbt = tl.load(blk_rows[:, None] + dd[None, :], mask=b_ok[:, None], other=0.0)
        o = tl.math.div_rn(tl.dot(pb, kbt, tl.dot(pw, kwt)), den[:, None])
        tl.store(o_rows[:, None] + dd[None, :], o.to(tl.float16), mask=row_ok[:, None])
    else:
        dt = DN + tl.arange(0, RD)
        kwt = tl.load(win_rows[:, None] + dt[None, :], mask=w_ok[:, None], other=0.0)
        kbt = tl.load(blk_rows[:, None] + dt[None, :], mask=b_ok[:, None], other=0.0)
        ot = tl.math.div_rn(tl.dot(pb, kbt, tl.dot(pw, kwt)), den[:, None])       # (BM, RD), pairs interleaved
        oe, oo = tl.split(tl.reshape(ot, (BM, RD // 2, 2)))
        i = tl.arange(0, RD // 2)
        ang = tl.load(pos_ptr + b * BLK + j, mask=row_ok, other=0).to(tl.float32)[:, None] * tl.load(inv_freq_ptr + i)[None, :]
        cos = tl.cos(ang.to(tl.float64)).to(tl.float32)
        sin = tl.sin(ang.to(tl.float64)).to(tl.float32)
        y = tl.reshape(tl.join(oe * cos + oo * sin, oo * cos - oe * sin), (BM, RD))
        tl.store(o_rows[:, None] + dt[None, :], y.to(tl.float16), mask=row_ok[:, None])


@dataclass(frozen=True)
class AttendTiling:
    """The two kernels' launch shapes, fixed: some change the bits (on the H200 the scores' BN 32, the PV's warps
    or BM do), and no other tiling was measurably faster (docs/engine.md)."""
    s_bm: int = 16
    s_bn: int = 16
    s_bd: int = 64
    s_warps: int = 2
    s_stages: int = 3
    p_bm: int = 16
    p_bd: int = 64
    p_warps: int = 8
    p_stages: int = 3


TILING = AttendTiling()


def attend(q: torch.Tensor, window: torch.Tensor, valid: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor,
           scale: float, pos: torch.Tensor, inv_freq: torch.Tensor, rope_dim: int,
           groups: int | None = None, tiling: AttendTiling = TILING) -> torch.Tensor:
    """`Attention._attend` on the unconcatenated keys: q (bsz, B, H, D), window (bsz, W, D) with valid (bsz, W), kv
    (bsz, B, D) the block's rows, pos (bsz*B,) -> o (bsz, B, H, D) fp16, or with `groups` the grouped output
    GEMM's in-place input (bsz*B, groups, H/groups * D). A request's programs read only its own rows."""
    bsz, blk, nh, D = q.shape
    W = window.shape[1]
    if groups:
        hpg = nh // groups
        out = grouped_rows_empty(bsz * blk, groups, hpg * D, F16, q.device)
        gs, rs = out.stride(1), out.stride(0)
    else:
        out = torch.empty_like(q)
        hpg, gs, rs = nh, 0, nh * D
    t = tiling
    bn = t.s_bn
    if (D - rope_dim) % t.p_bd or D % t.s_bd:
        raise ValueError(f"attend: head_dim - rope_dim = {D - rope_dim} must be a multiple of {t.p_bd}, head_dim "
                         f"{D} of {t.s_bd}")
    # key columns padded to powers of two (tl.dot sizes), both multiples of bn
    bw, bb = max(bn, triton.next_power_of_2(W)), max(bn, triton.next_power_of_2(blk))
    scores = torch.empty((bsz, blk * nh, bw + bb), dtype=torch.float32, device=q.device)
    vb = valid.contiguous().view(torch.uint8) if valid.dtype == torch.bool else valid.to(torch.uint8).contiguous()
    qc, wc, kc = q.contiguous(), window.contiguous(), kv.contiguous()
    _attend_scores_kernel[(bsz, triton.cdiv(blk * nh, t.s_bm), (bw + bb) // bn)](
        qc, wc, vb, kc, scores, scale, nh, blk, W, D=D, BM=t.s_bm, BN=bn, BW=bw, BB=bb, BD=t.s_bd,
        num_warps=t.s_warps, num_stages=t.s_stages, **launch_opts(scores))
    _attend_pv_kernel[(bsz, triton.cdiv(blk * nh, t.p_bm), (D - rope_dim) // t.p_bd + 1)](
        scores, wc, vb, kc, sink, pos.contiguous(), inv_freq, out, nh, blk, W, hpg, gs, rs, D=D, RD=rope_dim,
        BM=t.p_bm, BW=bw, BB=bb, BD=t.p_bd, num_warps=t.p_warps, num_stages=t.p_stages, **launch_opts(out))
    return out
