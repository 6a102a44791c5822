"""Batch-invariant GPU matmuls for the drafter's fast path (`use_matmul("fast")`).

The exact tree-sum GEMM of `model.ops` is batch invariant by construction but far too slow on a GPU for the full
model. These kernels keep its property (a row's bits never depend on which other rows share the call, nor on the
process or the card of a given kind) with library-speed throughput:

* `padded_linear` (dense layers): cuBLAS, always called with one (PAD_ROWS, N, K) shape. cuBLAS picks its
  algorithm by a deterministic heuristic of (shape, dtype, device, workspace, alignment), so fixing the shape
  fixes the kernel, and a GEMM kernel never mixes rows, so a row's result cannot depend on the batch.
* `indexed_linear` (routed experts): a Triton kernel, one program per (row, N block), a fixed reduction order over
  K, reading only the row's own expert (gathering `w[idx]` would copy up to 15 experts x 23.6 MB per matrix).

`pin_determinism` pins what could otherwise change bits between processes or cards. Nothing that picks kernels by
timing (per card, per process, per run) may be on, since timings differ and so would the chosen kernel and its bits:

* CUBLAS_WORKSPACE_CONFIG=:4096:8: a fixed workspace, one of the inputs of cuBLAS's heuristic; it must be set
  before the first cuBLAS handle of the process, hence "call before the first cuBLAS use".
* allow_tf32 = False (cuBLAS and cuDNN): TF32 would round the fp32 operands of the fallback path to 10 bits.
* allow_fp16/bf16_reduced_precision_reduction = False, allow_fp16_accumulation = False: reductions stay fp32
  (split-K partial sums in half precision would lose bits and tie them to the split chosen).
* cudnn.benchmark = False: benchmark mode times candidate kernels per process.
* preferred_blas_library("cublas"): cuBLASLt / hipBLASLt selection differs by backend; pin one.
"""
from __future__ import annotations

import os

import torch

from ..model import ops

PAD_ROWS = 32
# Fixed Triton config. No autotune: autotuning picks the fastest config by timing in each process, so the
# reduction blocking, and with it the bits, would depend on the process and the load of the card.
BLOCK_N = 64
BLOCK_K = 128
NUM_WARPS = 4

_PINNED: dict = {}
_MM_OUT_DTYPE: dict = {}        # device type -> whether torch.mm(..., out_dtype=fp32) runs there (not on CPU)
_KERNEL = None


def pin_determinism() -> dict:
    """Pin every setting that could change which kernel runs (see the module docstring); returns what was pinned."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    m = torch.backends.cuda.matmul
    m.allow_tf32 = False
    m.allow_fp16_reduced_precision_reduction = False
    m.allow_bf16_reduced_precision_reduction = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    pinned = {"CUBLAS_WORKSPACE_CONFIG": os.environ["CUBLAS_WORKSPACE_CONFIG"], "matmul.allow_tf32": False,
              "fp16_reduced_precision_reduction": False, "bf16_reduced_precision_reduction": False,
              "cudnn.allow_tf32": False, "cudnn.benchmark": False}
    if hasattr(m, "allow_fp16_accumulation"):      # torch >= 2.7: fp16 accumulators in cuBLAS
        m.allow_fp16_accumulation = False
        pinned["fp16_accumulation"] = False
    try:
        torch.backends.cuda.preferred_blas_library("cublas")
        pinned["blas"] = "cublas"
    except Exception as e:                      # a build without the switch: report it, keep going
        pinned["blas"] = f"unpinned ({type(e).__name__})"
    _PINNED.clear()
    _PINNED.update(pinned)
    return dict(pinned)


def _mm_f32(xc: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 (rows, N) = xc @ w.T for fp16 operands: the fp16-in / fp32-out cuBLAS GEMM where torch has it
    (CUDA, torch >= 2.8), else an fp32 GEMM against an fp32 copy of w kept on the weight itself."""
    dev = xc.device.type
    if _MM_OUT_DTYPE.get(dev, True):
        try:
            out = torch.mm(xc, w.t(), out_dtype=torch.float32)
            _MM_OUT_DTYPE[dev] = True
            return out
        except (TypeError, NotImplementedError):   # old torch (TypeError) / no kernel on this backend (CPU)
            _MM_OUT_DTYPE[dev] = False
    w32 = getattr(w, "_dspark_w32", None)
    if w32 is None:
        w32 = w.float()
        w._dspark_w32 = w32
    return torch.mm(xc.float(), w32.t())


def padded_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Batch-invariant fp32 x @ w.T: x (..., K) fp16-valued, w (N, K) fp16 -> fp32 (..., N).

    Rows go through cuBLAS in chunks of exactly PAD_ROWS (the last zero-padded), so every GEMM has the same shape
    and runs the same kernel whatever the batch. The rows are copied into a fresh zeroed buffer (never a view of
    x): each chunk then starts at an aligned address, since pointer alignment is also an input of the heuristic.
    No host sync, and the shapes depend only on x's shape (safe inside CUDA graph capture)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m, n = x2.shape[0], w.shape[0]
    if m == 0:
        return torch.empty((*lead, n), dtype=torch.float32, device=x.device)
    chunks = -(-m // PAD_ROWS)
    xp = torch.zeros((chunks * PAD_ROWS, k), dtype=torch.float16, device=x.device)
    xp[:m].copy_(x2)                                  # fp16 values: the conversion is exact
    outs = [_mm_f32(xp[c * PAD_ROWS:(c + 1) * PAD_ROWS], w) for c in range(chunks)]
    out = outs[0] if chunks == 1 else torch.cat(outs)
    return out[:m].reshape(*lead, n)


def _kernel():
    """Build the Triton kernel on first use (triton is imported lazily: the CPU service never needs it)."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def indexed_kernel(x_ptr, w_ptr, idx_ptr, out_ptr, N, K,
                       sxp, sxk, swe, swn, swk, sop, son,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # One program per (row p, block of N): the row's reduction never sees another row (batch invariant), and
        # its order over K (BLOCK_K chunks in sequence, each a fixed tl.sum tree) depends only on the config.
        p = tl.program_id(0)
        nb = tl.program_id(1)
        e = tl.load(idx_ptr + p).to(tl.int64)          # int64: e * swe exceeds 2^31 for large expert stacks
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        w_rows = w_ptr + e * swe + offs_n[:, None] * swn
        x_row = x_ptr + p.to(tl.int64) * sxp
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            xk = tl.load(x_row + offs_k * sxk, mask=k_mask, other=0.0).to(tl.float32)
            wt = tl.load(w_rows + offs_k[None, :] * swk, mask=n_mask[:, None] & k_mask[None, :],
                         other=0.0).to(tl.float32)
            acc += tl.sum(wt * xk[None, :], axis=1)      # fp16 x fp16 products are exact in fp32
        tl.store(out_ptr + p.to(tl.int64) * sop + offs_n * son, acc, mask=n_mask)

    _KERNEL = (triton, indexed_kernel)
    return _KERNEL


def indexed_linear(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """fp32 (P, N): out[p] = x[p] @ w[idx[p]].T. x (P, K) fp16-valued, w (E, N, K) fp16, idx (P,) int64 on the
    device. Batch invariant; reads each pair's expert in place (no gather). No host sync."""
    p, k = x.shape
    n = w.shape[1]
    out = torch.empty((p, n), dtype=torch.float32, device=x.device)
    if p == 0:
        return out
    triton, kernel = _kernel()
    x = x.to(torch.float16).contiguous()
    idx = idx.contiguous()
    grid = (p, triton.cdiv(n, BLOCK_N))
    kernel[grid](x, w, idx, out, n, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
                 out.stride(0), out.stride(1), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)
    return out


def indexed_linear_reference(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """fp64 einsum of the gathered experts, rounded once to fp32 (for tests)."""
    return torch.einsum("pk,pnk->pn", x.double(), w[idx].double()).float()


def use_matmul(mode: str) -> str:
    """Install the matmuls of `model.ops`: "exact" (the tree sum), "fast" (these kernels; pins determinism
    first), "auto" (fast with CUDA, else exact). A start-up choice; returns the mode installed."""
    if mode == "auto":
        mode = "fast" if torch.cuda.is_available() else "exact"
    if mode == "exact":
        ops.set_matmul(ops.linear_tree, ops.linear_indexed_tree, mode="exact")
    elif mode == "fast":
        pin_determinism()
        ops.set_matmul(padded_linear, indexed_linear, mode="fast")
    else:
        raise ValueError(f"matmul mode must be exact, fast or auto, not {mode!r}")
    return mode


def describe_matmul() -> str:
    """One line for the start-up log."""
    mode = ops.current_matmul()[2]
    pinned = ",".join(f"{k}={v}" for k, v in _PINNED.items()) or "none"
    return (f"matmul mode={mode} pad_rows={PAD_ROWS} triton(BLOCK_N={BLOCK_N},BLOCK_K={BLOCK_K},"
            f"num_warps={NUM_WARPS}) pinned[{pinned}]")
