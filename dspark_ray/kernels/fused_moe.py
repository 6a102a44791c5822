"""Fused MoE kernels (`model/moe.py`): SwiGLU, the router's logits and top-k, the routed experts (per pair and
grouped by expert, each expert read once a pass: docs/engine.md, "Routed experts")."""
from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .fused_ops import F16, F32, launch_opts, pdl_enter, rows_2d, swiglu_math
from .rows import BLOCK_K, BLOCK_N, NUM_WARPS, rows_empty

log = logging.getLogger(__name__)


@triton.jit(do_not_specialize=["N"])
def _swiglu_kernel(g_ptr, u_ptr, out_ptr, N, SG, SU, limit, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    g = tl.load(g_ptr + r * SG + offs, mask=m, other=0.0)
    u = tl.load(u_ptr + r * SU + offs, mask=m, other=0.0)
    tl.store(out_ptr + r * N + offs, swiglu_math(g, u, limit), mask=m)


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """g, u (fp32 or fp16; may be column slices of one w1 | w3 GEMM output) -> fp16 activation."""
    g2, u2 = rows_2d(g), rows_2d(u)
    rows, n = g2.shape
    out = rows_empty(rows, n, F16, g.device)              # feeds w2, read in place
    if rows and n:
        _swiglu_kernel[(rows, triton.cdiv(n, 1024))](g2, u2, out, n, g2.stride(0), u2.stride(0), float(limit),
                                                     BLOCK=1024, num_warps=4, **launch_opts(out))
    return out.view(g.shape)


@triton.jit
def _expert_dot(x_row, w_rows, K, n_mask, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 W[rows] @ x: BLOCK_K chunks in sequence, each a fixed tl.sum tree, one row only (batch invariant)."""
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
def _indexed_kernel(x_ptr, w_ptr, idx_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PDL: tl.constexpr):
    pdl_enter(PDL)
    p = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    e = tl.load(idx_ptr + p).to(tl.int64)          # int64: e * N * K exceeds 2^31 for large expert stacks
    acc = _expert_dot(x_ptr + p * K, w_ptr + (e * N + offs_n) * K, K, n_mask, BLOCK_N, BLOCK_K)
    tl.store(out_ptr + p * N + offs_n, acc, mask=n_mask)


@triton.jit
def _pass_rows(idx_ptr, p, P, e, g0, BM: tl.constexpr, SCAN: tl.constexpr):
    """(pair index, held) for expert e's pairs ranked g0 .. g0 + BM - 1 in pair order, one per tile row."""
    slot = tl.arange(0, BM)
    t = tl.zeros((BM,), dtype=tl.int32)
    ok = slot < 0
    seen = 0
    for c0 in range(p, P, SCAN):
        tc = c0 + tl.arange(0, SCAN)
        m = (tc < P) & (tl.load(idx_ptr + tc, mask=tc < P, other=-1) == e)
        rank = seen + tl.cumsum(m.to(tl.int32), axis=0) - 1
        sel = m[:, None] & (rank[:, None] == (g0 + slot)[None, :])
        t += tl.sum(tl.where(sel, tc[:, None], 0), axis=0)
        ok = ok | (tl.sum(sel.to(tl.int32), axis=0) > 0)
        seen += tl.sum(m.to(tl.int32), axis=0)
    return t, ok


@triton.jit
def _grouped_expert_kernel(x_ptr, w1_ptr, w3_ptr, idx_ptr, out_ptr, P, N, K, X_DIV, limit,
                           GATED: tl.constexpr, BM: tl.constexpr, SCAN: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Program (pair p, block of N), working only where p is its expert's first pair: every pair of that expert,
    BM at a time, through one weight read a pass. Pair t reads row t // X_DIV; GATED: swiglu(x W1^T, x W3^T) fp16,
    else x W1^T fp32. Each pair is its own row of a tl.dot, so its bits do not depend on its tile-mates."""
    pdl_enter(PDL)
    p = tl.program_id(0)
    e = tl.load(idx_ptr + p)
    first = P
    count = 0
    for c0 in range(0, P, SCAN):
        t = c0 + tl.arange(0, SCAN)
        ids = tl.load(idx_ptr + t, mask=t < P, other=-1)
        first = tl.minimum(first, tl.min(tl.where(ids == e, t, P), axis=0))
        count += tl.sum((ids == e).to(tl.int32), axis=0)
    if first == p:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        w_rows = (e.to(tl.int64) * N + offs_n) * K
        for g0 in range(0, count, BM):
            t, ok = _pass_rows(idx_ptr, p, P, e, g0, BM, SCAN)
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
                tl.store(dst, swiglu_math(acc1, acc3, limit), mask=ok[:, None] & n_ok[None, :])
            else:
                tl.store(dst, acc1, mask=ok[:, None] & n_ok[None, :])


@triton.jit
def _expert_combine_kernel(d_ptr, idx_ptr, wt_ptr, shared_ptr, out_ptr, H,
                           KC: tl.constexpr, KCP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[r] = sum_j w_j * d[r*KC + j] over the row's choices in ascending expert id (as `Experts`), + shared."""
    pdl_enter(PDL)
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


EXPERT_BLOCK_N, EXPERT_BLOCK_K, EXPERT_WARPS = BLOCK_N, BLOCK_K, NUM_WARPS


def indexed_linear(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """fp32 (P, N): out[p] = x[p] @ w[idx[p]].T, the expert read in place."""
    p, k = x.shape
    n = w.shape[1]
    out = torch.empty((p, n), dtype=F32, device=x.device)
    if p:
        _indexed_kernel[(p, triton.cdiv(n, EXPERT_BLOCK_N))](
            x.to(F16).contiguous(), w.contiguous(), idx.contiguous(), out, n, k,
            BLOCK_N=EXPERT_BLOCK_N, BLOCK_K=EXPERT_BLOCK_K, num_warps=EXPERT_WARPS, **launch_opts(out))
    return out


GROUP_BM = 64      # pairs of one expert per pass
SCAN = 64          # pairs a program scans at a time (any width gives the same pairs)


class ExpertTiles(NamedTuple):
    """A grouped call's blocking. None changes a bit (a pair's products are summed in the MMA's ascending K order
    whatever the blocking), so a call may pick its tiles by its pair count and stay batch invariant."""
    bn: int
    bk: int
    warps: int
    stages: int
    bm: int = GROUP_BM


# Gated (w1 | w3 + SwiGLU) and plain (w2) tiles, measured on the H200 (docs/engine.md, "Routed experts").
GROUPED_TILES = {True: ExpertTiles(64, 128, 4, 4), False: ExpertTiles(128, 64, 4, 4)}
GROUPED_TILES_BY_SHAPE = {(True, 2304, 5120): ExpertTiles(64, 64, 4, 4)}       # (gated, N, K)

# (most pairs, tiles by (gated, N, K)): calls of 1-4 requests take 16-pair passes (docs/engine.md, "Routed
# experts"); the first tier that fits and holds the shape wins. Keys: one card's N 2304, a pair rank's 1152.
FEW_PAIR_TIERS = (
    (16, {(True, 2304, 5120): ExpertTiles(64, 128, 4, 4, 16),
          (False, 5120, 2304): ExpertTiles(128, 64, 4, 4, 16)}),
    (60, {(True, 1152, 5120): ExpertTiles(32, 128, 2, 4, 16),
          (False, 5120, 1152): ExpertTiles(128, 64, 4, 4, 16),
          (True, 2304, 5120): ExpertTiles(32, 128, 2, 4, 16),
          (False, 5120, 2304): ExpertTiles(64, 128, 4, 4, 16)}),
)


def fit_stages(tiles: ExpertTiles, gated: bool, smem_limit: int) -> ExpertTiles:
    """As many pipeline stages as `smem_limit` bytes of shared memory per block hold."""
    stages = tiles.stages
    while stages > 1 and stages * (tiles.bm * tiles.bk + (2 if gated else 1) * tiles.bk * tiles.bn) * 2 > smem_limit:
        stages -= 1
    return tiles._replace(stages=stages)


def grouped_tiles(gated: bool, n: int, k: int, device_index: int | None, pairs: int | None = None) -> ExpertTiles:
    """The tiles of an (N, K) call of `pairs` pairs on a card (None: the interpreter)."""
    key = (gated, n, k)
    tiles = next((t[key] for most, t in FEW_PAIR_TIERS if pairs is not None and pairs <= most and key in t), None)
    return _fit_card(tiles or GROUPED_TILES_BY_SHAPE.get(key, GROUPED_TILES[gated]), gated, device_index)


@functools.cache
def _fit_card(tiles: ExpertTiles, gated: bool, device_index: int | None) -> ExpertTiles:
    if device_index is None:
        return tiles
    try:
        limit = triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]
    except Exception as e:      # noqa: BLE001 - a query this Triton lacks must not stop the step; the tiles as set
        log.warning("grouped experts: no shared-memory size for cuda:%s (%s); tiles as set", device_index, e)
        return tiles
    return fit_stages(tiles, gated, limit)


def grouped_launch(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor | None, experts: torch.Tensor,
                   out: torch.Tensor, x_div: int, limit: float, tiles: ExpertTiles) -> torch.Tensor:
    gated = w3 is not None
    _grouped_expert_kernel[(experts.numel(), triton.cdiv(w1.shape[1], tiles.bn))](
        x, w1, w3 if gated else w1, experts, out, experts.numel(), w1.shape[1], w1.shape[2], x_div, float(limit),
        GATED=gated, BM=tiles.bm, SCAN=SCAN, BLOCK_N=tiles.bn, BLOCK_K=tiles.bk, num_warps=tiles.warps,
        num_stages=tiles.stages, **launch_opts(out))
    return out


def _grouped(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor | None, experts: torch.Tensor, x_div: int,
             limit: float) -> torch.Tensor:
    p = experts.numel()
    n = w1.shape[1]
    gated = w3 is not None
    out = torch.empty((p, n), dtype=F16 if gated else F32, device=x.device)
    if p:
        grouped_launch(x.to(F16).contiguous(), w1, w3, experts.contiguous(), out, x_div, limit,
                       grouped_tiles(gated, n, w1.shape[2], x.device.index if x.is_cuda else None, p))
    return out


def expert_act(f: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, experts: torch.Tensor,
               limit: float) -> torch.Tensor:
    """fp16 (n*k, I): the SwiGLU activation of each (row, choice) pair."""
    return _grouped(f, w1, w3, experts, experts.shape[1], limit)


def expert_out(act: torch.Tensor, w2: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
               shared: torch.Tensor) -> torch.Tensor:
    return expert_combine(_grouped(act, w2, None, experts, 1, 0.0), experts, weights, shared)


def expert_combine(d: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                   shared: torch.Tensor) -> torch.Tensor:
    n, kc = experts.shape
    h = d.shape[1]
    out = torch.empty((n, h), dtype=F32, device=d.device)
    if n:
        _expert_combine_kernel[(n, triton.cdiv(h, 1024))](
            d, experts.contiguous(), weights.contiguous(), shared.contiguous(), out, h,
            KC=kc, KCP=triton.next_power_of_2(kc), BLOCK=1024, num_warps=4, **launch_opts(out))
    return out


@triton.jit
def _router_logits_kernel(f_ptr, w_ptr, out_ptr, n, E, K: tl.constexpr, RB: tl.constexpr, BK: tl.constexpr,
                          PDL: tl.constexpr):
    """Program (expert, RB rows): lane j sums columns j, j + BK, ... in order, then a fixed tl.sum over the lanes,
    so a row's bits depend on no other row; the gate row is read once for all RB rows."""
    e = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * RB + tl.arange(0, RB)
    r_ok = rows < n
    kk = tl.arange(0, BK)
    w = tl.load(w_ptr + e * K + kk, mask=kk < K, other=0.0).to(tl.float32)   # the first chunk: read before the wait
    pdl_enter(PDL)
    acc = tl.zeros((RB, BK), dtype=tl.float32)
    for k0 in tl.static_range(0, K, BK):
        kc = k0 + kk
        k_ok = kc < K
        if k0 > 0:
            w = tl.load(w_ptr + e * K + kc, mask=k_ok, other=0.0).to(tl.float32)
        x = tl.load(f_ptr + rows.to(tl.int64)[:, None] * K + kc[None, :], mask=r_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += x * w[None, :]              # fp16 x fp16 products are exact in fp32
    tl.store(out_ptr + rows.to(tl.int64) * E + e, tl.sum(acc, axis=1).to(tl.float16), mask=r_ok)


# (rows per program, K chunk, warps), fixed (docs/engine.md, "Fused kernels and the chain", the router).
ROUTER_TILING = (4, 1024, 4)


def router_logits(f: torch.Tensor, gate: torch.Tensor, tiling: tuple[int, int, int] | None = None) -> torch.Tensor:
    """fp16 (n, E) = f16(f @ gate.T) as a GEMV over (expert, row block) programs."""
    n, k = f.shape
    E = gate.shape[0]
    rb, bk, warps = tiling or ROUTER_TILING
    out = torch.empty((n, E), dtype=F16, device=f.device)
    if n:
        _router_logits_kernel[(E, triton.cdiv(n, rb))](
            f.contiguous(), gate, out, n, E, K=k, RB=rb, BK=min(bk, triton.next_power_of_2(k)), num_warps=warps,
            **launch_opts(out))
    return out


@triton.jit
def _route_kernel(lg_ptr, bsel_ptr, experts_ptr, weights_ptr, E, scaling,
                  TOPK: tl.constexpr, EP: tl.constexpr, PDL: tl.constexpr):
    """`Router` on one row of fp16 logits: sc = sqrt(softplus(l)) (fp64 softplus), key = sc + bias (NaN -> -inf),
    top-k by key with ties to the lower id (the stable sort's order), weights f16(sc * scaling / (sum + 1e-20))
    with the sum in selection order."""
    pdl_enter(PDL)
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


# Maxes, mins and one-hot sums: any warp count gives the same bits; one warp was the fastest.
ROUTE_WARPS = 1


def route(lg: torch.Tensor, bsel: torch.Tensor, top_k: int, scaling: float,
          warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """lg (n, E) fp16 -> (experts (n, k) int64 in selection order, weights (n, k) fp16)."""
    n, E = lg.shape
    experts = torch.empty((n, top_k), dtype=torch.int64, device=lg.device)
    weights = torch.empty((n, top_k), dtype=F16, device=lg.device)
    if n:
        _route_kernel[(n,)](lg.contiguous(), bsel, experts, weights, E, float(scaling), TOPK=top_k,
                            EP=triton.next_power_of_2(E), num_warps=warps or ROUTE_WARPS, **launch_opts(lg))
    return experts, weights
