"""The dense linears on a GPU in one Triton launch: each (BK, BN) weight tile is read once and fed to every 32-row
chunk's own fixed-shape `tl.dot` and accumulator, so a chunk's bits are those of the chunk alone. Tiles depend on
the weight's shape and the card's SM count only (`tiles`). Programs of one tile run side by side (r fastest) and
share it through L2 (docs/engine.md, "Dense GEMMs: the chunked Triton linear").
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from .fused_ops import F16, launch_opts, pdl_enter

ROWS = 32                      # a chunk: gemm.PAD_ROWS
BK = 128
WARPS = 4
MAX_CH = 4                     # chunks one program may hold (one accumulator each)
COUNTER_POOL = 1 << 21         # split-K tickets for captured calls, per card
_SMEM = 227 * 1024             # shared memory per program on an H100 / H200


@triton.jit
def _fence_gpu():
    """Orders every thread's partial stores before the block's ticket."""
    tl.inline_asm_elementwise("fence.acq_rel.gpu;\n\tmov.u32 $0, 0;", "=r,r", [tl.zeros((1,), tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _chunk_dot(x_at, chunk, sxm, M, kk, k_ok, wt, acc):
    """The same 32 x BK x BN dot for every chunk, into the chunk's own accumulator."""
    rows = chunk * 32 + tl.arange(0, 32)
    xt = tl.load(x_at + rows.to(tl.int64)[:, None] * sxm + kk[None, :], mask=(rows < M)[:, None] & k_ok[None, :],
                 other=0.0)
    return tl.dot(xt, wt, acc)


@triton.jit
def _store_rows(out_ptr, acc, chunk, cols, c_ok, M, N, OUT_F16: tl.constexpr):
    rows = chunk * 32 + tl.arange(0, 32)
    dst = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    ok = (rows < M)[:, None] & c_ok[None, :]
    if OUT_F16:
        tl.store(dst, acc.to(tl.float16), mask=ok)
    else:
        tl.store(dst, acc, mask=ok)


@triton.jit
def _partial(part_ptr, slot, BN: tl.constexpr):
    return part_ptr + slot.to(tl.int64) * 32 * BN + tl.arange(0, 32)[:, None] * BN + tl.arange(0, BN)[None, :]


@triton.jit
def _finish(out_ptr, part_ptr, acc, chunk, slot, cols, c_ok, M, N, last, SPLIT: tl.constexpr, OUT_F16: tl.constexpr,
            BN: tl.constexpr):
    """Store the chunk; with a K split, the last ticket's program sums the partials in split order (0 first)."""
    if SPLIT > 1:
        if last:
            tot = tl.load(_partial(part_ptr, slot, BN), cache_modifier=".cg")
            for j in tl.static_range(1, SPLIT):
                tot += tl.load(_partial(part_ptr, slot + j, BN), cache_modifier=".cg")
            _store_rows(out_ptr, tot, chunk, cols, c_ok, M, N, OUT_F16)
    else:
        _store_rows(out_ptr, acc, chunk, cols, c_ok, M, N, OUT_F16)


@triton.jit
def _chunked_linear_kernel(x_ptr, w_ptr, out_ptr, part_ptr, ctr_ptr, M, N, K, R, sxm, sxg, KS,
                           SPLIT: tl.constexpr, CH: tl.constexpr, OUT_F16: tl.constexpr, BN: tl.constexpr,
                           BK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    r = tl.program_id(0)
    pid_n = tl.program_id(1)
    s = tl.program_id(2)
    cols = pid_n * BN + tl.arange(0, BN)
    c_ok = cols < N
    x_at = x_ptr + ((pid_n * BN) // R).to(tl.int64) * sxg          # this column block's group of x (BN divides R)
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * K
    c0 = r * CH
    acc0 = tl.zeros((32, BN), dtype=tl.float32)
    acc1 = tl.zeros((32, BN), dtype=tl.float32)
    acc2 = tl.zeros((32, BN), dtype=tl.float32)
    acc3 = tl.zeros((32, BN), dtype=tl.float32)
    k_lo = s * KS
    k_hi = tl.minimum(K, k_lo + KS)
    for k in range(k_lo, k_hi, BK):
        kk = k + tl.arange(0, BK)
        k_ok = kk < k_hi
        wt = tl.load(w_cols + kk[:, None], mask=k_ok[:, None] & c_ok[None, :], other=0.0)
        acc0 = _chunk_dot(x_at, c0, sxm, M, kk, k_ok, wt, acc0)
        if CH > 1:
            acc1 = _chunk_dot(x_at, c0 + 1, sxm, M, kk, k_ok, wt, acc1)
        if CH > 2:
            acc2 = _chunk_dot(x_at, c0 + 2, sxm, M, kk, k_ok, wt, acc2)
        if CH > 3:
            acc3 = _chunk_dot(x_at, c0 + 3, sxm, M, kk, k_ok, wt, acc3)
    base = (r * tl.num_programs(1) + pid_n) * CH * SPLIT
    ctr = ctr_ptr + r * tl.num_programs(1) + pid_n
    last = s < 0                                                 # a tensor False
    if SPLIT > 1:
        tl.store(_partial(part_ptr, base + s, BN), acc0)
        if CH > 1:
            tl.store(_partial(part_ptr, base + SPLIT + s, BN), acc1)
        if CH > 2:
            tl.store(_partial(part_ptr, base + 2 * SPLIT + s, BN), acc2)
        if CH > 3:
            tl.store(_partial(part_ptr, base + 3 * SPLIT + s, BN), acc3)
        _fence_gpu()
        tl.debug_barrier()
        last = tl.atomic_add(ctr, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
    _finish(out_ptr, part_ptr, acc0, c0, base, cols, c_ok, M, N, last, SPLIT, OUT_F16, BN)
    if CH > 1:
        _finish(out_ptr, part_ptr, acc1, c0 + 1, base + SPLIT, cols, c_ok, M, N, last, SPLIT, OUT_F16, BN)
    if CH > 2:
        _finish(out_ptr, part_ptr, acc2, c0 + 2, base + 2 * SPLIT, cols, c_ok, M, N, last, SPLIT, OUT_F16, BN)
    if CH > 3:
        _finish(out_ptr, part_ptr, acc3, c0 + 3, base + 3 * SPLIT, cols, c_ok, M, N, last, SPLIT, OUT_F16, BN)
    if SPLIT > 1:
        if last:
            tl.atomic_xchg(ctr, 0, sem="relaxed", scope="gpu")                 # zero for the next call


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Output columns per program (bn), K splits, chunks per program (ch), pipeline stages."""
    bn: int
    split: int
    ch: int
    stages: int


@functools.cache
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# (bn, split) per weight (N, K, groups) by SM count, measured on the H200 (docs/engine.md, "Dense GEMMs"): the full
# preset's wq_a | wkv, then wq_b, wo_a, wo_b, shared w1 | w3 and w2, each for one card and for a pair rank.
MEASURED_TILES = {132: {
    (1792, 5120, 1): (64, 4),
    (32768, 1280, 1): (128, 1),
    (16384, 1280, 1): (128, 1),
    (8192, 4096, 8): (64, 1),
    (4096, 4096, 4): (64, 4),
    (5120, 8192, 1): (64, 3),
    (5120, 4096, 1): (64, 3),
    (4608, 5120, 1): (128, 3),
    (2304, 5120, 1): (128, 5),
    (5120, 2304, 1): (64, 3),
    (5120, 1152, 1): (64, 1),
}}


def tiles(n: int, k: int, groups: int, chunks: int, sms: int) -> Tiles:
    """The launch for an (N, K) weight in `groups` column groups on `chunks` chunks, on a card of `sms` SMs."""
    bn, split = MEASURED_TILES.get(sms, {}).get((n, k, groups)) or rule_tiles(n, k, groups, sms)
    return with_split(n, bn, split, chunks, sms)


def rule_tiles(n: int, k: int, groups: int, sms: int) -> tuple[int, int]:
    """(bn, split) for an unmeasured weight: 128 columns while that gives a program per SM, else 64; then the fewest
    power-of-two K splits (two BK steps each at least) that give a program per SM."""
    width = n // groups
    bn = 128 if n // 128 >= sms and (groups == 1 or width % 128 == 0) else 64
    if groups > 1 and (width % bn or n % groups):
        raise ValueError(f"chunked_linear: group width {width} is not a multiple of {bn} columns")
    blocks = -(-n // bn)
    split = 1
    while blocks * split < sms and k // (split * 2) >= 2 * BK:
        split *= 2
    return bn, split


def with_split(n: int, bn: int, split: int, chunks: int, sms: int) -> Tiles:
    """A program per chunk within two programs per SM, else up to MAX_CH chunks a program (no bit changes)."""
    ch = 1 if -(-n // bn) * split * chunks <= 2 * sms else min(chunks, MAX_CH)
    return Tiles(bn=bn, split=split, ch=ch, stages=pipeline_stages(ch, bn))


def pipeline_stages(ch: int, bn: int) -> int:
    """Up to 4 stages while their x and weight tiles fit the shared memory."""
    stages = 4
    while stages > 2 and stages * (ch * ROWS * BK + BK * bn) * 2 > _SMEM:
        stages -= 1
    return stages


class Counters:
    """Split-K tickets, zero between calls. Eager calls reuse one slice per (card, stream), as a stream's calls
    run in order; a captured call keeps a slice of a pool zeroed by the first eager call (a memset in a graph
    would run at every replay)."""

    def __init__(self, pool: int = COUNTER_POOL):
        self.pool_size = pool
        self.eager: dict = {}
        self.pools: dict = {}              # card index -> [pool tensor, next free]

    def take(self, device: torch.device, count: int) -> torch.Tensor:
        if device.type != "cuda":
            key = (device.type, None)                # the Triton interpreter (CPU tests)
        else:
            index = device.index if device.index is not None else torch.cuda.current_device()
            if torch.cuda.is_current_stream_capturing():
                return self._captured(index, count)
            if index not in self.pools:
                self.pools[index] = [torch.zeros(self.pool_size, dtype=torch.int32, device=device), 0]
            key = (index, torch.cuda.current_stream(device).cuda_stream)
        t = self.eager.get(key)
        if t is None or t.numel() < count:
            t = self.eager[key] = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        return t[:count]

    def _captured(self, index: int, count: int) -> torch.Tensor:
        entry = self.pools.get(index)
        if entry is None:
            raise RuntimeError("chunked_linear: captured before any eager call on this card; run the step "
                               "once outside the capture first (the graph set's warm-up does)")
        if entry[1] + count > self.pool_size:
            raise RuntimeError(f"chunked_linear: the {self.pool_size} split-K counters for captured calls are "
                               f"used up (raise kernels.chunked_linear.COUNTER_POOL)")
        entry[1] += count
        return entry[0][entry[1] - count:entry[1]]

    def captured(self) -> int:
        return sum(e[1] for e in self.pools.values())

    def release(self) -> None:
        """Hand the captured counters out again; only once every graph holding them is gone."""
        for e in self.pools.values():
            e[1] = 0


COUNTERS = Counters()


def chunked_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, groups: int = 1,
                   tiles_override: Tiles | None = None) -> torch.Tensor:
    """out (chunks * 32, N) fp16 / fp32 = x @ w.T, in place. x (chunks * 32, K) fp16, or (G, chunks * 32, K) with
    group g giving columns [g * R, (g + 1) * R) of out; w (N, K) fp16."""
    if groups > 1:
        g, m, k = x.shape
        assert g == groups and x.is_contiguous()
        sxm, sxg = k, m * k
    else:
        m, k = x.shape
        assert x.stride() == (k, 1)
        sxm, sxg = k, 0
    n = w.shape[0]
    chunks = m // ROWS
    assert m == chunks * ROWS and w.shape[1] == k and w.is_contiguous() and out.shape == (m, n)
    assert out.is_contiguous() and x.dtype == w.dtype == F16 and out.dtype in (F16, torch.float32)
    if m == 0:
        return out
    t = tiles_override or tiles(n, k, groups, chunks, sm_count(x.device.index or 0))
    rp, nb = -(-chunks // t.ch), -(-n // t.bn)
    ks = -(-(-(-k // t.split)) // BK) * BK
    if t.split > 1:
        part = torch.empty((rp * nb * t.ch * t.split * ROWS * t.bn,), dtype=torch.float32, device=x.device)
        ctr = COUNTERS.take(x.device, rp * nb)
    else:
        part = ctr = out
    _chunked_linear_kernel[(rp, nb, t.split)](
        x, w, out, part, ctr, m, n, k, n // groups, sxm, sxg, ks, SPLIT=t.split, CH=t.ch, OUT_F16=out.dtype == F16,
        BN=t.bn, BK=BK, num_warps=WARPS, num_stages=t.stages, **launch_opts(out))
    return out
