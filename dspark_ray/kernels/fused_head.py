"""Fused head kernels (`model/heads.py`): one Markov step on a vocabulary shard, its cached bias rows, the
confidence head, the output packing."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_ops import F16, F32, launch_opts, pdl_enter, sigmoid64


@triton.jit
def _markov_weights(w2_ptr, b2_ptr, v0, V, R: tl.constexpr, BV: tl.constexpr, HAS_BIAS: tl.constexpr):
    r = tl.arange(0, R)
    v = v0 + tl.arange(0, BV)
    ok = v < V
    w2 = tl.load(w2_ptr + v.to(tl.int64)[:, None] * R + r[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    if HAS_BIAS:
        b2 = tl.load(b2_ptr + v, mask=ok, other=0.0).to(tl.float32)
    else:
        b2 = tl.zeros((BV,), dtype=tl.float32)
    return w2, b2


@triton.jit
def _markov_bias(w2, b2, me, HAS_BIAS: tl.constexpr):
    """f16(markov_w2 me + b2), as fp32. The sum's order is fixed by R and the layout along R, never by BV or the
    grid, and the cached rows (`markov_rows`) come from this same sum: they hold the live step's bits."""
    y = tl.sum(w2 * me.to(tl.float32)[None, :], axis=1)
    if HAS_BIAS:
        y = y + b2
    return y.to(tl.float16).to(tl.float32)


@triton.jit
def _markov_tile(lg_ptr, lg_row, logits_ptr, b, bias, v0, V, BV: tl.constexpr, KEEP: tl.constexpr):
    """l = lg[b, step] + bias on a tile, NaN -> -inf: (max, first argmax, runner-up)."""
    v = v0 + tl.arange(0, BV)
    ok = v < V
    l = tl.load(lg_ptr + b * lg_row + v, mask=ok, other=0.0).to(tl.float32) + bias
    if KEEP:
        tl.store(logits_ptr + b * V + v, l, mask=ok)
    l = tl.where((l != l) | ~ok, float("-inf"), l)
    m1 = tl.max(l, axis=0)
    i1 = tl.min(tl.where(l == m1, v, 2147483647), axis=0)
    m2 = tl.max(tl.where(v == i1, float("-inf"), l), axis=0)
    return m1, i1, m2


@triton.jit
def _markov_tile_bias(w2_ptr, b2_ptr, cache_ptr, row, me, v0, V, R: tl.constexpr, BV: tl.constexpr,
                      HAS_BIAS: tl.constexpr):
    v = v0 + tl.arange(0, BV)
    if row >= 0:
        bias = tl.load(cache_ptr + row * V + v, mask=v < V, other=0.0).to(tl.float32)
    else:
        w2, b2 = _markov_weights(w2_ptr, b2_ptr, v0, V, R, BV, HAS_BIAS)
        bias = _markov_bias(w2, b2, me, HAS_BIAS)
    return bias


@triton.jit
def _markov_partial_kernel(lg_ptr, lg_row, prev_ptr, w1_ptr, w2_ptr, b2_ptr, map_ptr, cache_ptr, me_ptr, me_row,
                           logits_ptr, part_ptr, V, NB, R: tl.constexpr, BV: tl.constexpr, SUB: tl.constexpr,
                           HAS_BIAS: tl.constexpr, CACHED: tl.constexpr, KEEP: tl.constexpr, PDL: tl.constexpr):
    """Program (request, SUB tiles of BV vocab rows): me = f16(markov_w1[prev]) and the tiles' (max, first argmax,
    runner-up), merged in vocabulary order (exact: a merge only compares). CACHED: map[prev] >= 0 reads that row."""
    b = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    v0 = nb * (SUB * BV)
    if not CACHED:
        # weights: read before the PDL wait
        w2, b2 = _markov_weights(w2_ptr, b2_ptr, v0, V, R, BV, HAS_BIAS)
    pdl_enter(PDL)
    r = tl.arange(0, R)
    prev = tl.load(prev_ptr + b)
    me = tl.load(w1_ptr + prev * R + r).to(tl.float16)
    if nb == 0:
        tl.store(me_ptr + b * me_row + r, me)
    if CACHED:
        row = tl.load(map_ptr + prev).to(tl.int64)
        bias = _markov_tile_bias(w2_ptr, b2_ptr, cache_ptr, row, me, v0, V, R, BV, HAS_BIAS)
    else:
        bias = _markov_bias(w2, b2, me, HAS_BIAS)
    m1, i1, m2 = _markov_tile(lg_ptr, lg_row, logits_ptr, b, bias, v0, V, BV, KEEP)
    for k in tl.static_range(1, SUB):
        if CACHED:
            bias = _markov_tile_bias(w2_ptr, b2_ptr, cache_ptr, row, me, v0 + k * BV, V, R, BV, HAS_BIAS)
        else:
            w2, b2 = _markov_weights(w2_ptr, b2_ptr, v0 + k * BV, V, R, BV, HAS_BIAS)
            bias = _markov_bias(w2, b2, me, HAS_BIAS)
        n1, j1, n2 = _markov_tile(lg_ptr, lg_row, logits_ptr, b, bias, v0 + k * BV, V, BV, KEEP)
        # the lower rows win a tie (the first argmax)
        lo = m1 >= n1
        m2 = tl.where(lo, tl.maximum(m2, n1), tl.maximum(m1, n2))
        i1 = tl.where(lo, i1, j1)
        m1 = tl.where(lo, m1, n1)
    base = part_ptr + (b * NB + nb) * 3
    tl.store(base, m1)
    tl.store(base + 1, i1.to(tl.float32))         # < 2^24: exact in fp32
    tl.store(base + 2, m2)


@triton.jit
def _markov_table_kernel(lg_ptr, lg_row, prev_ptr, w1_ptr, table_ptr, me_ptr, me_row, logits_ptr, part_ptr, V, NB,
                         R: tl.constexpr, BV: tl.constexpr, KEEP: tl.constexpr, PDL: tl.constexpr):
    """The Markov step when every token's bias row is cached (row t token t's): no weight read, so wide tiles."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    v0 = nb * BV
    prev = tl.load(prev_ptr + b)
    if nb == 0:
        r = tl.arange(0, R)
        tl.store(me_ptr + b * me_row + r, tl.load(w1_ptr + prev * R + r).to(tl.float16))
    v = v0 + tl.arange(0, BV)
    bias = tl.load(table_ptr + prev * V + v, mask=v < V, other=0.0).to(tl.float32)
    m1, i1, m2 = _markov_tile(lg_ptr, lg_row, logits_ptr, b, bias, v0, V, BV, KEEP)
    base = part_ptr + (b * NB + nb) * 3
    tl.store(base, m1)
    tl.store(base + 1, i1.to(tl.float32))
    tl.store(base + 2, m2)


@triton.jit
def _markov_rows_kernel(tok_ptr, w1_ptr, w2_ptr, b2_ptr, out_ptr, V, T, TG: tl.constexpr, R: tl.constexpr,
                        BV: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Program (TG tokens, BV vocab rows): their bias rows in the live step's sum, the weight tile read once."""
    t0 = tl.program_id(0) * TG
    v0 = tl.program_id(1) * BV
    v = v0 + tl.arange(0, BV)
    r = tl.arange(0, R)
    w2, b2 = _markov_weights(w2_ptr, b2_ptr, v0, V, R, BV, HAS_BIAS)
    for j in range(TG):
        if t0 + j < T:
            me = tl.load(w1_ptr + tl.load(tok_ptr + t0 + j) * R + r).to(tl.float16)
            y = _markov_bias(w2, b2, me, HAS_BIAS)
            tl.store(out_ptr + (t0 + j).to(tl.int64) * V + v, y.to(tl.float16), mask=v < V)


@triton.jit
def _markov_top_kernel(part_ptr, top1_ptr, top2_ptr, idx_ptr, NB, start, NBP: tl.constexpr, PDL: tl.constexpr):
    """Per request: the partials, in vocabulary order, -> (max, first argmax + start, runner-up)."""
    pdl_enter(PDL)
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


# (rows per tile, tiles per program, warps); every tiling gives the same bits (docs/engine.md, "The Markov head").
MARKOV_TILING = (32, 2, 4)
MARKOV_TABLE_TILING = (1024, 4)


def markov_step(lg: torch.Tensor, step: int, prev: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                b2: torch.Tensor | None, start: int, keep_logits: bool, tiling: tuple[int, int, int] | None = None,
                me_out: torch.Tensor | None = None, cache: tuple[torch.Tensor, torch.Tensor] | None = None):
    """One Markov step on a vocabulary shard: lg (bsz, n_out, V) trunk logits, prev (bsz,) -> (me (bsz, r) fp16,
    top1, top2, global argmax (bsz,) int64, logits (bsz, V) fp32 or None). Ties go to the lower id; a NaN never
    wins. me_out: a (bsz, r) view to write me into. cache: (map (V_all,) int32, rows (n, V) fp16) from
    `markov_rows`, same bits; with n == V_all row t must be token t's."""
    bsz, _, V = lg.shape
    R = w2.shape[1]
    dev = lg.device
    table = cache is not None and cache[1].shape[0] == w1.shape[0]
    bv, sub, warps = (MARKOV_TABLE_TILING[0], 1, MARKOV_TABLE_TILING[1]) if table else (tiling or MARKOV_TILING)
    nb = triton.cdiv(V, bv * sub)
    me = torch.empty((bsz, R), dtype=F16, device=dev) if me_out is None else me_out
    assert me.shape == (bsz, R) and me.stride(1) == 1
    if cache is not None:
        assert cache[0].dtype == torch.int32 and cache[1].shape[1] == V and cache[1].is_contiguous()
    logits = torch.empty((bsz, V), dtype=F32, device=dev) if keep_logits else me
    part = torch.empty((bsz, nb, 3), dtype=F32, device=dev)
    top1 = torch.empty(bsz, dtype=F32, device=dev)
    top2 = torch.empty(bsz, dtype=F32, device=dev)
    idx = torch.empty(bsz, dtype=torch.int64, device=dev)
    lg_s = lg[:, step]
    if table:
        _markov_table_kernel[(bsz, nb)](lg_s, lg.stride(0), prev.contiguous(), w1, cache[1], me, me.stride(0), logits,
                                        part, V, nb, R=R, BV=bv, KEEP=keep_logits, num_warps=warps,
                                        **launch_opts(me))
    else:
        cmap, rows = cache if cache is not None else (me, me)
        _markov_partial_kernel[(bsz, nb)](lg_s, lg.stride(0), prev.contiguous(), w1, w2, w2 if b2 is None else b2, cmap,
                                          rows, me, me.stride(0), logits, part, V, nb, R=R, BV=bv, SUB=sub,
                                          HAS_BIAS=b2 is not None, CACHED=cache is not None, KEEP=keep_logits,
                                          num_warps=warps, **launch_opts(me))
    _markov_top_kernel[(bsz,)](part, top1, top2, idx, nb, start, NBP=triton.next_power_of_2(nb), num_warps=8,
                               **launch_opts(part))
    return me, top1, top2, idx, (logits if keep_logits else None)


MARKOV_ROWS_TOKENS = 64         # tokens a program makes rows for


def markov_rows(tokens: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor | None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """(T, V) fp16 Markov bias rows of `tokens` on this shard, in the live step's sum (`markov_step`'s cache)."""
    V, R = w2.shape
    T = tokens.shape[0]
    bv, _, warps = MARKOV_TILING        # the step's layout along R, so the step's sums
    out = torch.empty((T, V), dtype=F16, device=w2.device) if out is None else out
    assert out.shape == (T, V) and out.is_contiguous()
    grid = (triton.cdiv(T, MARKOV_ROWS_TOKENS), triton.cdiv(V, bv))
    _markov_rows_kernel[grid](tokens.to(torch.int64).contiguous(), w1, w2, w2 if b2 is None else b2, out, V, T,
                              TG=MARKOV_ROWS_TOKENS, R=R, BV=bv, HAS_BIAS=b2 is not None, num_warps=warps,
                              enable_fp_fusion=False)
    return out


@triton.jit
def _confidence_prenorm_kernel(pre_ptr, pre_row, w_ptr, part_ptr, H, N_OUT, BLOCK: tl.constexpr, NP: tl.constexpr,
                               PDL: tl.constexpr):
    """part[b, i] = f16(prenorm_i) . w[:h] in fp32. The (NP, BLOCK) tile's NP is fixed by the block size, never
    n_out, so a row's bits are the same for every n_out. Runs beside the head GEMM."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    row_ok = i < N_OUT
    acc = tl.zeros((NP, BLOCK), dtype=tl.float32)
    for h0 in range(0, H, BLOCK):
        offs = h0 + tl.arange(0, BLOCK)
        m = offs < H
        x = tl.load(pre_ptr + b * pre_row + i[:, None] * H + offs[None, :], mask=row_ok[:, None] & m[None, :],
                    other=0.0).to(tl.float16).to(tl.float32)
        acc += x * tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)[None, :]
    tl.store(part_ptr + b * NP + i, tl.sum(acc, axis=1))


@triton.jit
def _confidence_kernel(part_ptr, me_ptr, w_ptr, b_ptr, conf_ptr, len_ptr, H, R, N_OUT, threshold,
                       HAS_BIAS: tl.constexpr, RB: tl.constexpr, NP: tl.constexpr, PDL: tl.constexpr):
    """Per request: c_i = f16(part_i + me_i . w[h:] + b), its sigmoid (fp64, rounded once), and the all-confident
    prefix (`heads.confident_prefix`; a NaN score is not confident)."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    row_ok = i < N_OUT
    ro = tl.arange(0, RB)
    w_r = tl.load(w_ptr + H + ro, mask=ro < R, other=0.0).to(tl.float32)
    e = tl.load(me_ptr + (b * N_OUT + i[:, None]) * R + ro[None, :], mask=row_ok[:, None] & (ro[None, :] < R),
                other=0.0).to(tl.float32)
    y = tl.load(part_ptr + b * NP + i) + tl.sum(e * w_r[None, :], axis=1)
    if HAS_BIAS:
        y = y + tl.load(b_ptr).to(tl.float32)
    c = sigmoid64(y.to(tl.float16).to(tl.float32))
    tl.store(conf_ptr + b * N_OUT + i, c, mask=row_ok)
    n_conf = tl.min(tl.where(row_ok, tl.where(c >= threshold, N_OUT, i), N_OUT), axis=0)
    tl.store(len_ptr + b, n_conf.to(tl.int64))


def confidence_prenorm(prenorm: torch.Tensor, w: torch.Tensor, n_out: int) -> torch.Tensor:
    """The confidence head's prenorm half: prenorm (bsz, B, h) fp32 -> (bsz, NP) fp32 partial sums."""
    bsz, block, h = prenorm.shape
    prenorm = prenorm if prenorm.stride(-1) == 1 and prenorm.stride(1) == h else prenorm.contiguous()
    np_ = triton.next_power_of_2(block)
    part = torch.empty((bsz, np_), dtype=F32, device=prenorm.device)
    _confidence_prenorm_kernel[(bsz,)](prenorm, prenorm.stride(0), w, part, h, n_out, BLOCK=2048, NP=np_,
                                       num_warps=8, **launch_opts(part))
    return part


def confidence(part: torch.Tensor, me: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
               threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """part from `confidence_prenorm`, me (bsz, n_out, r) fp16 -> (scores (bsz, n_out) fp32, prefix lengths)."""
    bsz, n_out, r = me.shape
    h = w.shape[-1] - r
    me = me.contiguous()
    conf = torch.empty((bsz, n_out), dtype=F32, device=me.device)
    lens = torch.empty(bsz, dtype=torch.int64, device=me.device)
    _confidence_kernel[(bsz,)](part, me, w, w if b is None else b, conf, lens, h, r, n_out, threshold,
                               HAS_BIAS=b is not None, RB=triton.next_power_of_2(r), NP=part.shape[1], num_warps=8,
                               **launch_opts(conf))
    return conf, lens


@triton.jit
def _pack_kernel(d_ptr, c_ptr, m_ptr, l_ptr, out_ptr, N, WIDTH, HAS_M: tl.constexpr, NB: tl.constexpr,
                 PDL: tl.constexpr):
    """Row b: [drafts | scores | margins | confident length] as fp64 (exact for all four)."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, NB)
    ok = j < N
    o = out_ptr + b * WIDTH
    tl.store(o + j, tl.load(d_ptr + b * N + j, mask=ok).to(tl.float64), mask=ok)
    tl.store(o + N + j, tl.load(c_ptr + b * N + j, mask=ok).to(tl.float64), mask=ok)
    if HAS_M:
        tl.store(o + 2 * N + j, tl.load(m_ptr + b * N + j, mask=ok).to(tl.float64), mask=ok)
        tl.store(o + 3 * N, tl.load(l_ptr + b).to(tl.float64))
    else:
        tl.store(o + 2 * N, tl.load(l_ptr + b).to(tl.float64))


def pack_outputs(drafts: torch.Tensor, conf: torch.Tensor, margins: torch.Tensor | None,
                 lens: torch.Tensor) -> torch.Tensor:
    """The graph set's download in one launch: (bsz, n * (2 or 3) + 1) fp64."""
    bsz, n = drafts.shape
    width = n * (3 if margins is not None else 2) + 1
    out = torch.empty((bsz, width), dtype=torch.float64, device=drafts.device)
    conf = conf.contiguous()
    _pack_kernel[(bsz,)](drafts.contiguous(), conf, conf if margins is None else margins.contiguous(),
                         lens.contiguous(), out, n, width, HAS_M=margins is not None,
                         NB=triton.next_power_of_2(n), num_warps=1, **launch_opts(conf))
    return out
