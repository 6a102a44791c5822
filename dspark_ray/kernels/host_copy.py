"""Pinned host <-> device copies as one kernel: the graph set's captured upload and download. A memcpy node waits
for a copy engine after the previous kernel; a kernel reads the pinned buffer directly behind it under PDL
(docs/engine.md, "CUDA graphs"). Bytes only: no bit can change.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_ops import launch_opts, pdl_enter

COPY_BLOCK = 4096           # bytes per program


class Address:
    """A raw device-visible address (a pinned host buffer, a CuPy allocation) as a Triton pointer argument."""

    dtype = torch.uint8

    def __init__(self, ptr: int):
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


@triton.jit(do_not_specialize=["n0", "n1"])     # one compiled kernel for every size
def _copy_kernel(dst0, src0, n0, dst1, src1, n1, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (i, s) copies block i of segment s. The PDL wait first: the source may be the previous kernel's."""
    pdl_enter(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if tl.program_id(1) == 0:
        m = offs < n0
        tl.store(dst0 + offs, tl.load(src0 + offs, mask=m), mask=m)
    else:
        m = offs < n1
        tl.store(dst1 + offs, tl.load(src1 + offs, mask=m), mask=m)


def copy_bytes(like: torch.Tensor, *segments: tuple[int, int, int]) -> None:
    """Copy each (dst address, src address, nbytes), at most two, in one launch on `like`'s device's stream."""
    if not 1 <= len(segments) <= 2:
        raise ValueError(f"copy_bytes takes one or two segments, not {len(segments)}")
    d0, s0, n0 = segments[0]
    d1, s1, n1 = segments[1] if len(segments) == 2 else (d0, s0, 0)
    blocks = triton.cdiv(max(n0, n1, 1), COPY_BLOCK)
    _copy_kernel[(blocks, len(segments))](Address(d0), Address(s0), n0, Address(d1), Address(s1), n1,
                                          BLOCK=COPY_BLOCK, num_warps=4, **launch_opts(like))
