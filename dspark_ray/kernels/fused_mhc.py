"""Fused mHC kernels (`model/mhc.py`): the mix, the collapse with Sinkhorn and norm, the HyperHead, the expand."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_ops import F16, F32, exp64, launch_opts, norm_scale, pdl_enter, rsqrt64, sigmoid64
from .rows import rows_empty


MIX_CHUNK = 512          # columns of X_row per mix program
MIX_OUT = 32             # the 24 mixing rows and the sum of squares, padded to a power of two
COLLAPSE_BLOCK = 8192    # h up to this is collapsed and normed in one pass from registers
COMBINE_WARPS = 8


@triton.jit
def _mhc_mix_kernel(x_ptr, fn_ptr, part_ptr, L, N_OUT, NCH, CHUNK: tl.constexpr, OUT: tl.constexpr, PDL: tl.constexpr):
    """Program (chunk, row): partial dots of X_row with every fn16 row and its partial sum of squares (o == N_OUT);
    the combine sums the chunks in order."""
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    m = offs < L
    o = tl.arange(0, OUT)
    f = tl.load(fn_ptr + o[:, None].to(tl.int64) * L + offs[None, :], mask=(o[:, None] < N_OUT) & m[None, :],
                other=0.0).to(tl.float32)     # made before capture: read before the wait
    pdl_enter(PDL)
    x = tl.load(x_ptr + r * L + offs, mask=m, other=0.0)
    f = tl.where(o[:, None] == N_OUT, x[None, :], f)
    tl.store(part_ptr + (r * NCH + c) * OUT + o, tl.sum(f * x[None, :], axis=1))


@triton.jit
def _row_logits(part_ptr, v_ptr, r, L, N_OUT, NCH, norm_eps, NCH_P: tl.constexpr, OUT: tl.constexpr):
    """Row r's chunk sums, in order, into scratch row v_ptr (read back in a plain load's small layout); rho."""
    ch = tl.arange(0, NCH_P)
    o = tl.arange(0, OUT)
    t = tl.load(part_ptr + (r * NCH + ch[:, None]) * OUT + o[None, :], mask=ch[:, None] < NCH, other=0.0)
    tl.store(v_ptr + o, tl.sum(t, axis=0))
    tl.debug_barrier()
    return rsqrt64(tl.math.div_rn(tl.load(v_ptr + N_OUT), L.to(tl.float32)) + norm_eps)


@triton.jit
def _sinkhorn(v_ptr, rho, base_ptr, scale_ptr, post_ptr, comb_ptr, r, hc_eps, iters):
    i4 = tl.arange(0, 4)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    post = 2.0 * sigmoid64((tl.load(v_ptr + 4 + i4) * rho) * s1 + tl.load(base_ptr + 4 + i4))
    ij = i4[:, None] * 4 + i4[None, :]                        # [source a, destination b]
    s = (tl.load(v_ptr + 8 + ij) * rho) * s2 + tl.load(base_ptr + 8 + ij)
    e = exp64(s - tl.max(s, axis=1)[:, None])
    p = tl.math.div_rn(e, tl.sum(e, axis=1)[:, None]) + hc_eps
    p = tl.math.div_rn(p, tl.sum(p, axis=0)[None, :] + hc_eps)
    for _ in range(iters - 1):
        p = tl.math.div_rn(p, tl.sum(p, axis=1)[:, None] + hc_eps)
        p = tl.math.div_rn(p, tl.sum(p, axis=0)[None, :] + hc_eps)
    tl.store(post_ptr + r * 4 + i4, post)
    tl.store(comb_ptr + r * 16 + ij, p)


@triton.jit
def _collapse_chunk(xr, H, offs, m, pre_ptr, r, HEAD: tl.constexpr):
    """c = sum_k pre_k X_k, k in order, no FMA (`mhc._weighted_streams`); fp16-rounded unless HEAD (fp32 prenorm)."""
    c = tl.load(pre_ptr + r * 4) * tl.load(xr + offs, mask=m, other=0.0)
    c = c + tl.load(pre_ptr + r * 4 + 1) * tl.load(xr + H + offs, mask=m, other=0.0)
    c = c + tl.load(pre_ptr + r * 4 + 2) * tl.load(xr + 2 * H + offs, mask=m, other=0.0)
    c = c + tl.load(pre_ptr + r * 4 + 3) * tl.load(xr + 3 * H + offs, mask=m, other=0.0)
    if not HEAD:
        c = c.to(tl.float16).to(tl.float32)
    return c


@triton.jit
def _collapse_norm(x_ptr, w_ptr, w_one, norm_out_ptr, pre_out_ptr, pre_ptr, r, H, norm_eps, HEAD: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Row r: c, then its RMS norm (HEAD: c written out too). Wider than BLOCK, pass 2 recomputes c (same bits)
    rather than reading what another thread wrote. w_one: the one-BLOCK norm weight, loaded before the PDL wait."""
    xr = x_ptr + r * 4 * H
    if BLOCK >= H:
        offs = tl.arange(0, BLOCK)
        m = offs < H
        c = _collapse_chunk(xr, H, offs, m, pre_ptr, r, HEAD)
        if HEAD:
            tl.store(pre_out_ptr + r * H + offs, c, mask=m)
        rn = norm_scale(tl.sum(c * c, axis=0), H.to(tl.float32), norm_eps)
        tl.store(norm_out_ptr + r * H + offs, ((c * w_one) * rn).to(tl.float16), mask=m)
    else:
        ss = tl.zeros((BLOCK,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK):
            offs = h0 + tl.arange(0, BLOCK)
            m = offs < H
            c = _collapse_chunk(xr, H, offs, m, pre_ptr, r, HEAD)
            if HEAD:
                tl.store(pre_out_ptr + r * H + offs, c, mask=m)
            ss += c * c
        rn = norm_scale(tl.sum(ss, axis=0), H.to(tl.float32), norm_eps)
        for h0 in range(0, H, BLOCK):
            offs = h0 + tl.arange(0, BLOCK)
            m = offs < H
            c = _collapse_chunk(xr, H, offs, m, pre_ptr, r, HEAD)
            w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
            tl.store(norm_out_ptr + r * H + offs, ((c * w) * rn).to(tl.float16), mask=m)


@triton.jit
def _mhc_combine_kernel(x_ptr, part_ptr, v_ptr, base_ptr, scale_ptr, w_ptr, norm_out_ptr, pre_out_ptr, pre_ptr,
                        post_ptr, comb_ptr, H, L, N_OUT, NCH, hc_eps, norm_eps, iters, HEAD: tl.constexpr,
                        BLOCK: tl.constexpr, NCH_P: tl.constexpr, OUT: tl.constexpr, PDL: tl.constexpr):
    """Program (row, half); both halves sum the row's logits (same bits). Half 0: pre, collapse, norm; half 1: post
    and Sinkhorn, needed only by the expand, beside it (docs/engine.md, "Fused kernels and the chain")."""
    r = tl.program_id(0).to(tl.int64)
    half = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    w_one = tl.load(w_ptr + offs, mask=offs < (1 - half) * H, other=0.0).to(tl.float32)
    pdl_enter(PDL)
    v_row = v_ptr + (r * 2 + half) * OUT
    rho = _row_logits(part_ptr, v_row, r, L, N_OUT, NCH, norm_eps, NCH_P, OUT)
    if half == 0:
        i4 = tl.arange(0, 4)
        pre = sigmoid64((tl.load(v_row + i4) * rho) * tl.load(scale_ptr) + tl.load(base_ptr + i4)) + hc_eps
        tl.store(pre_ptr + r * 4 + i4, pre)
        tl.debug_barrier()
        _collapse_norm(x_ptr, w_ptr, w_one, norm_out_ptr, pre_out_ptr, pre_ptr, r, H, norm_eps, HEAD, BLOCK)
    elif not HEAD:
        _sinkhorn(v_row, rho, base_ptr, scale_ptr, post_ptr, comb_ptr, r, hc_eps, iters)


@triton.jit
def _mhc_expand_kernel(x_ptr, y_ptr, post_ptr, comb_ptr, out_ptr, H, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """X'[k] = post_k * y + sum_i comb[i, k] * X[i], i in order, no FMA: the reference's bits."""
    pdl_enter(PDL)
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
    """The mixing rows rounded to fp16 (the reference's rounding point), once per weight."""
    t = getattr(fn, "_dspark_fn16", None)
    if t is None:
        t = fn.to(F16).contiguous()
        fn._dspark_fn16 = t
    return t


def _collapse(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_w: torch.Tensor,
              normed: torch.Tensor, pre_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *, iters: int,
              hc_eps: float, norm_eps: float, head: bool) -> None:
    """One mHC site's collapse in two launches: the mix per (chunk, row), then the combine per (row, half)."""
    rows, m, h = x.shape
    L, n_out = m * h, fn.shape[0]
    assert n_out < MIX_OUT
    nch = triton.cdiv(L, MIX_CHUNK)
    part = torch.empty((rows, nch, MIX_OUT), dtype=F32, device=x.device)
    v = torch.empty((rows, 2, MIX_OUT), dtype=F32, device=x.device)
    pre = torch.empty((rows, 4), dtype=F32, device=x.device)
    _mhc_mix_kernel[(nch, rows)](x, _fn16(fn), part, L, n_out, nch, CHUNK=MIX_CHUNK, OUT=MIX_OUT, num_warps=8,
                                 **launch_opts(x))
    block = min(triton.next_power_of_2(h), COLLAPSE_BLOCK)
    _mhc_combine_kernel[(rows, 1 if head else 2)](
        x, part, v, base, scale, norm_w, normed, pre_out, pre, post, comb, h, L, n_out, nch, hc_eps, norm_eps, iters,
        HEAD=head, BLOCK=block, NCH_P=triton.next_power_of_2(nch), OUT=MIX_OUT, num_warps=COMBINE_WARPS,
        **launch_opts(x))


def mhc_collapse_norm(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                      norm_w: torch.Tensor, *, iters: int, hc_eps: float, norm_eps: float):
    """`HcSite.collapse` then `rms_norm`: x (rows, 4, h) fp32 -> (normed fp16, post (rows, 4), comb (rows, 4, 4))."""
    x = x.contiguous()
    rows, m, h = x.shape
    normed = rows_empty(rows, h, F16, x.device)
    post = torch.empty((rows, m), dtype=F32, device=x.device)
    comb = torch.empty((rows, m, m), dtype=F32, device=x.device)
    _collapse(x, fn, base, scale, norm_w, normed, normed, post, comb, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps,
              head=False)
    return normed, post, comb


def hyper_head_norm(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                    norm_w: torch.Tensor, *, hc_eps: float, norm_eps: float):
    """`HyperHead` then the final `rms_norm`: x (rows, 4, h) -> (prenorm fp32, normed fp16)."""
    x = x.contiguous()
    rows, m, h = x.shape
    normed = rows_empty(rows, h, F16, x.device)
    prenorm = torch.empty((rows, h), dtype=F32, device=x.device)
    _collapse(x, fn, base, scale, norm_w, normed, prenorm, prenorm, prenorm, iters=1, hc_eps=hc_eps,
              norm_eps=norm_eps, head=True)
    return prenorm, normed


def mhc_expand(x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    x, y = x.contiguous(), y.contiguous()
    rows, m, h = x.shape
    out = torch.empty_like(x)
    _mhc_expand_kernel[(rows, triton.cdiv(h, 1024))](x, y, post.contiguous(), comb.contiguous(), out, h,
                                                     BLOCK=1024, num_warps=4, **launch_opts(out))
    return out


@triton.jit
def _embed_streams_kernel(seeds_ptr, p0_ptr, emb_ptr, out_ptr, pos_ptr, H, B, noise, M: tl.constexpr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < H
    tok = tl.where(row % B == 0, tl.load(seeds_ptr + row // B), noise).to(tl.int64)
    e = tl.load(emb_ptr + tok * H + offs, mask=m).to(tl.float32)
    for k in tl.static_range(M):
        tl.store(out_ptr + (row * M + k) * H + offs, e, mask=m)
    if tl.program_id(1) == 0:
        tl.store(pos_ptr + row, tl.load(p0_ptr + row // B) + row % B)


def embed_streams(seeds: torch.Tensor, p0: torch.Tensor, embed: torch.Tensor, block: int, noise_id: int,
                  m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's input streams (bsz * block, m, h) fp32 (row 0 the seed's embedding, the rest the noise token's,
    exact in fp32) and positions p0[b] + j, in one launch."""
    bsz, h = seeds.shape[0], embed.shape[1]
    out = torch.empty((bsz * block, m, h), dtype=F32, device=embed.device)
    pos = torch.empty(bsz * block, dtype=torch.int64, device=embed.device)
    _embed_streams_kernel[(bsz * block, triton.cdiv(h, 1024))](seeds.contiguous(), p0.to(torch.int64).contiguous(),
                                                               embed, out, pos, h, block, noise_id, M=m, BLOCK=1024,
                                                               num_warps=4, **launch_opts(out))
    return out, pos
