"""Read a weight into L2 ahead of the GEMM that needs it, while the GPU runs latency-bound kernels (`ops.prefetch`).

Why: a block's replicated, latency-bound chain (the mHC mix and collapse, the wq_a | wkv GEMM, the norms, the
attention) leaves HBM mostly idle for tens of microseconds before each large GEMM. A weight that fits in L2 can be
read in during that time, and the GEMM then reads it from L2. On the H200 (60 MB of L2; `bench/l2_retention.py`,
`bench/results/gpu/l2_retention_h200.json`) a 32-48 MB weight read once before its GEMM made the GEMM 0.74-0.78x
as long. A pair rank's wq_b (42 MB) and wo_a (34 MB) fit; one card's (84 / 67 MB) do not, and are left alone: the
rule is the weight's size against the card's L2, so the pair gains what one card cannot.

How: one kernel of a few programs issues `prefetch.global.L2::evict_last` for every 32-byte sector of the weight.
Prefetches return nothing, so the kernel holds no registers for the data and ends once they are issued; it runs
on a side stream (`ops.branch`) beside the main chain. It writes nothing and changes no value: the bits are those
of the step without it. `DSPARK_L2_PREFETCH=0` turns it off.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

STRIDE = 32                 # bytes between prefetches: one per 32-byte sector (what a miss brings in from HBM)
PROGRAMS = 16               # few: the main chain keeps the rest of the SMs
FIT = 0.75                  # prefetch a weight of at most this share of the card's L2 (the rest holds the chain's data)
_l2_bytes: dict[int, int] = {}


@triton.jit
def _prefetch_kernel(base_ptr, n, STRIDE_BYTES: tl.constexpr, BLOCK: tl.constexpr):
    """Program p prefetches the addresses base + STRIDE_BYTES * i for i in its BLOCK-wide steps of [0, n)."""
    p = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    for start in range(p * BLOCK, n, step):
        i = start + tl.arange(0, BLOCK)
        addr = base_ptr + tl.where(i < n, i, 0).to(tl.int64) * STRIDE_BYTES    # past the end: the first again
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                                  [addr.to(tl.int64)], dtype=tl.int32, is_pure=False, pack=1)


def enabled() -> bool:
    return os.environ.get("DSPARK_L2_PREFETCH", "1") != "0"


def l2_bytes(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _l2_bytes:
        _l2_bytes[idx] = int(torch.cuda.get_device_properties(idx).L2_cache_size)
    return _l2_bytes[idx]


def fits(w: torch.Tensor) -> bool:
    """Whether w is worth reading ahead on its card: a CUDA tensor of at most FIT of the L2."""
    return w.is_cuda and w.numel() * w.element_size() <= FIT * l2_bytes(w.device)


def prefetch(w: torch.Tensor, stride: int = STRIDE, programs: int = PROGRAMS, force: bool = False) -> None:
    """Queue the reading of w (contiguous) into L2 on the current stream, when it fits (else nothing; `force`:
    whatever its size, for the bench)."""
    if not (force or (enabled() and fits(w))):
        return
    n = -(-w.numel() * w.element_size() // stride)
    _prefetch_kernel[(programs,)](w.view(-1).view(torch.uint8), n, STRIDE_BYTES=stride, BLOCK=1024, num_warps=4)
