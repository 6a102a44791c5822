"""Copies between pinned host memory and the device as one kernel: the graph set's captured upload and download.

In a CUDA graph a memcpy node waits for a copy engine. In the kernel timeline of a pair rank's draft graph (H200),
the download of the packed outputs began 7-9 us after the last kernel had ended, and the copy of the collectives'
control words 2 us after that: ~15 us from the last result to the last byte for ~1 KB. Under unified addressing
a pinned host buffer's address is valid on the device, so a kernel reads or writes it directly; in the graphs it
launches behind the kernel before it with programmatic dependent launch and moves a step's bytes at once (every
segment of a copy in the same launch). Byte for byte, no arithmetic: the bits cannot change.

`DSPARK_COPY_KERNEL=0` makes the graph set use memcpy nodes instead (`graphs.py`), for an A/B.

`released_copy_bytes` is the upload of a graph launched ahead of its inputs (`graphs.GraphSet.launch_ahead`): each
program polls a word in pinned host memory until the host writes the replay's number there, then copies. The poll
is an acquire at system scope, so the copy reads what the host staged before it wrote the number.
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
    """Program (i, s): bytes [i * BLOCK, (i + 1) * BLOCK) of segment s; a program past its segment's end copies
    nothing. The wait first: the source may be what the kernel before this one wrote."""
    pdl_enter(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if tl.program_id(1) == 0:
        m = offs < n0
        tl.store(dst0 + offs, tl.load(src0 + offs, mask=m), mask=m)
    else:
        m = offs < n1
        tl.store(dst1 + offs, tl.load(src1 + offs, mask=m), mask=m)


# How long a graph launched ahead may wait for its release before it traps (a CUDA error that ends the process's
# context: fail closed). The service releases or parks a graph long before (the front-end parks an idle pair after
# `StepService.park_after_s`); only a host that stopped serving without parking reaches it.
RELEASE_TIMEOUT_NS = 120 * 10**9


@triton.jit
def _ld_acquire_sys(addr):
    return tl.inline_asm_elementwise("ld.acquire.sys.global.u32 $0, [$1];", "=r,l", [addr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _ld_acquire_gpu(addr):
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.u32 $0, [$1];", "=r,l", [addr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _globaltimer(like):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [like], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _trap(like):
    return tl.inline_asm_elementwise("trap; mov.b32 $0, $1;", "=r,r", [like], dtype=tl.int32, is_pure=False,
                                     pack=1)


@triton.jit(do_not_specialize=["n"])
def _released_copy_kernel(flag, seen, dst, src, n, timeout_ns, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program i copies bytes [i * BLOCK, (i + 1) * BLOCK) once this release is out: the host's flag reads the
    release's number, the device's count of releases so far (`seen[0]`, counted up by the graph right after this
    kernel) plus one. Program 0 alone polls the host's word across the bus (each poll is a read of host memory; 60
    programs polling slowed the host's own staging), then publishes the number in `seen[1]`, device memory, where
    the others wait for it. Past `timeout_ns` of waiting program 0 traps, which ends the whole kernel."""
    pdl_enter(PDL)
    want = tl.load(seen) + 1
    lanes = tl.arange(0, 2)                             # two lanes, one word: a block shape for the asm
    if tl.program_id(0) == 0:
        addr = (flag + lanes * 0).to(tl.int64)
        t0 = tl.max(_globaltimer(lanes), axis=0)
        v = tl.max(_ld_acquire_sys(addr), axis=0)
        waited = t0 - t0                                # an int64 zero (the loop keeps its type)
        while (v != want) & (waited < timeout_ns):
            v = tl.max(_ld_acquire_sys(addr), axis=0)
            waited = tl.max(_globaltimer(lanes), axis=0) - t0
        if v != want:
            _trap(lanes)
        tl.atomic_xchg(seen + 1, want, sem="release", scope="gpu")
    else:
        addr = (seen + 1 + lanes * 0).to(tl.int64)
        v = tl.max(_ld_acquire_gpu(addr), axis=0)
        while v != want:
            v = tl.max(_ld_acquire_gpu(addr), axis=0)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


def released_copy_bytes(like: torch.Tensor, flag: int, seen: torch.Tensor, dst: int, src: int, n: int,
                        timeout_ns: int = RELEASE_TIMEOUT_NS) -> None:
    """Copy n bytes from src to dst once the int32 at host address `flag` equals seen[0] + 1 (`seen`: two int32 on
    the device; the caller counts seen[0] up after this copy, in stream order; seen[1] is the kernel's own)."""
    _released_copy_kernel[(triton.cdiv(max(n, 1), COPY_BLOCK),)](
        Address(flag), seen, Address(dst), Address(src), n, timeout_ns, BLOCK=COPY_BLOCK, num_warps=4,
        **launch_opts(like))


def copy_bytes(like: torch.Tensor, *segments: tuple[int, int, int]) -> None:
    """Copy each (dst address, src address, nbytes), at most two, in one launch on torch's current stream of
    `like`'s device (a tensor there: it picks the launch options)."""
    if not 1 <= len(segments) <= 2:
        raise ValueError(f"copy_bytes takes one or two segments, not {len(segments)}")
    d0, s0, n0 = segments[0]
    d1, s1, n1 = segments[1] if len(segments) == 2 else (d0, s0, 0)      # none: the first's, none of its bytes
    blocks = triton.cdiv(max(n0, n1, 1), COPY_BLOCK)
    _copy_kernel[(blocks, len(segments))](Address(d0), Address(s0), n0, Address(d1), Address(s1), n1,
                                          BLOCK=COPY_BLOCK, num_warps=4, **launch_opts(like))
