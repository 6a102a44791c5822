"""Batch-invariant GPU matmuls for the fast path (`kernels_for("fast")`): a row's bits never depend on the other
rows of the call, the process or the card kind (docs/engine.md, "Same bits everywhere"). Dense linears run on
fixed PAD_ROWS-row chunks, since cuBLAS picks its kernel by a deterministic heuristic of (shape, dtype, workspace,
alignment): a fixed shape fixes the bits. Nothing that picks kernels by timing may be on (`pin_determinism`).
"""
from __future__ import annotations

import os
from functools import partial

import torch

from ..model import ops
from .rows import BLOCK_K, BLOCK_N, NUM_WARPS, PAD_ROWS, grouped_rows_empty, rows_empty  # noqa: F401

# Weights up to this size take `fused.rows_linear` on a GPU; off: no faster (docs/engine.md, "Tried and removed").
SMALL_WEIGHT_BYTES = 0
# The two give different bits, so every process of a deployment runs the same one (`dense_for`).
DENSE_KERNELS = ("triton", "cublas")

_PINNED: dict = {}
_MM_OUT_DTYPE: dict = {}        # device type -> whether torch.mm(..., out_dtype=fp32) runs there (not on CPU)


def pin_determinism() -> dict:
    """Pin every setting that could change which kernel (and so which bits) runs; returns what was pinned.
    Call before the first cuBLAS use: the workspace, an input of cuBLAS's heuristic, is read at the first handle."""
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
    if hasattr(m, "allow_fp16_accumulation"):      # torch >= 2.7
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
    """fp32 xc @ w.T of fp16 operands: fp16-in / fp32-out where torch has it, else against a cached fp32 copy of w."""
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


def _in_place(x2: torch.Tensor, rows: int) -> bool:
    """Whether x2 can be read as `rows` rows in place; 256 B aligned like a fresh allocation, as alignment is an
    input of cuBLAS's heuristic (so the same kernel and bits as for a copy)."""
    k, es = x2.shape[1], x2.element_size()
    return (x2.is_cuda and x2.dtype == torch.float16 and x2.stride() == (k, 1) and x2.data_ptr() % 256 == 0
            and x2.untyped_storage().nbytes() - x2.storage_offset() * es >= rows * k * es)


def _padded_rows(x2: torch.Tensor, lead: tuple = ()) -> tuple[torch.Tensor, int]:
    """x2's rows as a (*lead, chunks * PAD_ROWS, K) buffer, in place when it has room (`rows_empty`). Pad rows are
    never filled: a GEMM's output row reads only its own input row."""
    m, k = x2.shape[-2], x2.shape[-1]
    chunks = -(-m // PAD_ROWS)
    full = chunks * PAD_ROWS
    if not lead and _in_place(x2, full):
        return x2.as_strided((full, k), (k, 1)), chunks
    if lead and x2.stride() == (full * k, k, 1) and _in_place(x2[0], lead[0] * full):   # grouped_rows_empty's layout
        return x2.as_strided((*lead, full, k), (full * k, k, 1)), chunks
    xp = torch.empty((*lead, chunks * PAD_ROWS, k), dtype=torch.float16, device=x2.device)
    xp[..., :m, :].copy_(x2)                          # fp16-valued: exact
    return xp, chunks


def _small(x: torch.Tensor, w: torch.Tensor) -> bool:
    return x.is_cuda and w.numel() * w.element_size() <= SMALL_WEIGHT_BYTES


def dense_for(rows: int, choice: str = "auto") -> str:
    """The dense kernel for a widest draft batch of `rows` rows; "auto": triton once it spans two chunks
    (docs/engine.md, "Dense GEMMs: the chunked Triton linear")."""
    if choice == "auto":
        return "triton" if rows > PAD_ROWS else "cublas"
    if choice not in DENSE_KERNELS:
        raise ValueError(f"dense kernel must be auto, triton or cublas, not {choice!r}")
    return choice


def _chunked(x: torch.Tensor, dense: str) -> bool:
    """Whether x runs `chunked_linear`, whose chunk is 32 rows (a bench may set another PAD_ROWS)."""
    return x.is_cuda and dense == "triton" and PAD_ROWS == 32


def _padded_mm(x: torch.Tensor, w: torch.Tensor, mm, out_dtype: torch.dtype, dense: str) -> torch.Tensor:
    """x (..., K) @ w.T on chunks of exactly PAD_ROWS rows: `chunked_linear` in one launch, or `mm` per chunk."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m, n = x2.shape[0], w.shape[0]
    if m == 0:
        return torch.empty((*lead, n), dtype=out_dtype, device=x.device)
    xp, chunks = _padded_rows(x2)
    if _chunked(x2, dense):
        from .chunked_linear import chunked_linear
        out = chunked_linear(xp, w, torch.empty((chunks * PAD_ROWS, n), dtype=out_dtype, device=x.device))
    else:
        outs = [mm(xp[c * PAD_ROWS:(c + 1) * PAD_ROWS], w) for c in range(chunks)]
        out = outs[0] if chunks == 1 else torch.cat(outs)
    return out[:m].reshape(*lead, n)


def padded_linear(x: torch.Tensor, w: torch.Tensor, dense: str = "triton") -> torch.Tensor:
    """Batch-invariant fp32 x @ w.T: x (..., K) fp16-valued, w (N, K) fp16 -> fp32 (..., N). No host sync
    (safe inside graph capture)."""
    if _small(x, w):
        from .fused import rows_linear
        return rows_linear(x, w, torch.float32)
    return _padded_mm(x, w, _mm_f32, torch.float32, dense)


def padded_linear_f16(x: torch.Tensor, w: torch.Tensor, dense: str = "triton") -> torch.Tensor:
    """`padded_linear` rounded once to fp16 in the GEMM's epilogue."""
    if _small(x, w):
        from .fused import rows_linear
        return rows_linear(x, w, torch.float16)
    if not x.is_cuda:
        return ops.f16(padded_linear(x, w, dense))
    return _padded_mm(x, w, lambda xc, w: torch.mm(xc, w.t()), torch.float16, dense)


def padded_grouped_linear(x: torch.Tensor, w: torch.Tensor, dense: str = "triton") -> torch.Tensor:
    """fp16 (n, G * R): group g of x (n, G, K) times rows [g*R, (g+1)*R) of w (G * R, K) (wo_a), one rounding."""
    n, g, k = x.shape
    r = w.shape[0] // g
    wg = w.view(g, r, k)
    if n == 0 or not x.is_cuda:
        return torch.cat([ops.f16(padded_linear(x[:, i], wg[i], dense)) for i in range(g)], dim=-1)
    xp, chunks = _padded_rows(x.transpose(0, 1), (g,))
    # Written straight into the row-major (rows, G * R) layout wo_b reads, as a strided batch: no transposing copy.
    res = rows_empty(n, g * r, torch.float16, x.device)
    if _chunked(x, dense):
        from .chunked_linear import chunked_linear
        chunked_linear(xp, w, res.as_strided((chunks * PAD_ROWS, g * r), (g * r, 1)), groups=g)
        return res
    full = res.as_strided((chunks * PAD_ROWS, g, r), (g * r, r, 1))
    for c in range(chunks):
        torch.bmm(xp[:, c * PAD_ROWS:(c + 1) * PAD_ROWS], wg.transpose(1, 2),
                  out=full[c * PAD_ROWS:(c + 1) * PAD_ROWS].transpose(0, 1))
    return res


def indexed_linear(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """fp32 (P, N): out[p] = x[p] @ w[idx[p]].T, each pair's expert read in place (a gather would copy experts).
    The fused MoE runs `fused_moe`'s grouped kernels; this is the ops-level indexed matmul and their reference."""
    from .fused import indexed_linear as kernel
    return kernel(x, w, idx)


def indexed_linear_reference(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """fp64 einsum of the gathered experts, rounded once to fp32 (for tests)."""
    return torch.einsum("pk,pnk->pn", x.double(), w[idx].double()).float()


def kernels_for(mode: str, dense: str = "triton") -> ops.Kernels:
    """The kernels to hand to a drafter: mode "exact" (`ops.EXACT`), "fast" (these and `kernels/fused.py`; pins
    determinism for the process) or "auto" (fast with CUDA); `dense` is the GPU dense kernel (`dense_for`)."""
    if dense not in DENSE_KERNELS:
        raise ValueError(f"dense kernel must be triton or cublas, not {dense!r}")
    if mode == "auto":
        mode = "fast" if torch.cuda.is_available() else "exact"
    if mode == "exact":
        return ops.EXACT
    if mode != "fast":
        raise ValueError(f"matmul mode must be exact, fast or auto, not {mode!r}")
    pin_determinism()
    from . import fused             # triton: the CPU service never imports it
    from .streams import branch, branch_parts
    return ops.Kernels(mode="fast", matmul=partial(padded_linear, dense=dense), matmul_indexed=indexed_linear,
                       dense=dense,
                       fused_table={**fused.TABLE, "linear_grouped": partial(padded_grouped_linear, dense=dense),
                                    "linear_f16": partial(padded_linear_f16, dense=dense), "branch": branch,
                                    "branch_parts": branch_parts})


def describe(kernels: ops.Kernels) -> str:
    """One line for the start-up log: the kernels, and what this process pinned."""
    pinned = ",".join(f"{k}={v}" for k, v in _PINNED.items()) or "none"
    fused = ",".join(sorted(kernels.fused_table)) or "none"
    pdl = "off"
    if kernels.mode == "fast" and torch.cuda.is_available():
        from .fused_ops import pdl_active
        pdl = "graphs" if pdl_active() else "off"
    return (f"matmul mode={kernels.mode} pad_rows={PAD_ROWS} dense={kernels.dense or 'none'} triton(BLOCK_N={BLOCK_N},"
            f"BLOCK_K={BLOCK_K},num_warps={NUM_WARPS}) fused[{fused}] pinned[{pinned}] pdl={pdl}")
