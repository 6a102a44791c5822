"""Batch-invariant GPU matmuls for the drafter's fast path (`kernels_for("fast")`).

The exact tree-sum GEMM of `model.ops` is batch invariant by construction but far too slow on a GPU for the full
model. These kernels keep its property (a row's bits never depend on which other rows share the call, nor on the
process or the card of a given kind) with library-speed throughput:

* `padded_linear` (dense layers): the rows in chunks of exactly PAD_ROWS (the last padded). On a GPU, one launch
  of `chunked_linear` for all chunks: each weight tile read once and applied to every chunk's own fixed-shape dot,
  its tiles fixed by the weight's shape and the card (`chunked_linear.tiles`). With `kernels_for(dense="cublas")`,
  cuBLAS once per chunk (off a GPU, torch.mm the same way), always with one (PAD_ROWS, N, K) shape: cuBLAS picks
  its algorithm by a deterministic heuristic of (shape, dtype, device, workspace, alignment), so fixing the shape
  fixes the kernel, but every chunk reads the whole weight again. Either way a row's result cannot depend on the
  batch.
* `indexed_linear` (routed experts, one (row, expert) pair at a time): a Triton kernel, one program per (row, N
  block), a fixed reduction order over K, reading only the row's own expert (gathering `w[idx]` would copy up to
  15 experts x 23.6 MB per matrix). The fast path's MoE runs the grouped kernels of `fused_moe` instead, which
  read each expert once for all its pairs; this one stays as the ops-level indexed matmul and their reference.

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
from functools import partial

import torch

from ..model import ops
from .rows import BLOCK_K, BLOCK_N, NUM_WARPS, PAD_ROWS, grouped_rows_empty, rows_empty  # noqa: F401

# Weights up to this size go through `fused.rows_linear` on a GPU (one launch, the input read in place) instead of
# cuBLAS on padded chunks. A property of the weight, never of the batch. Off (0): the step was no faster with it
# (docs/engine.md, "Tried and removed"). Kept, and tested on both paths, for tuning.
SMALL_WEIGHT_BYTES = 0
# The dense linears on a GPU (`kernels_for(..., dense=)`, bound into the kernels it builds): "triton"
# (`chunked_linear`, one weight read for every chunk) or "cublas" (a padded cuBLAS GEMM per chunk). A start-up
# choice: the two give different bits, so every process of a deployment runs the same one (`dense_for`).
DENSE_KERNELS = ("triton", "cublas")

_PINNED: dict = {}
_MM_OUT_DTYPE: dict = {}        # device type -> whether torch.mm(..., out_dtype=fp32) runs there (not on CPU)


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


def _in_place(x2: torch.Tensor, rows: int) -> bool:
    """Whether x2 (m, K) fp16 can be read as `rows` rows in place: row-contiguous, its storage runs on for that
    many rows, and it starts as aligned as a fresh allocation (256 B; alignment is an input of cuBLAS's heuristic,
    so the kernel, and the bits, are the same as for a copy)."""
    k, es = x2.shape[1], x2.element_size()
    return (x2.is_cuda and x2.dtype == torch.float16 and x2.stride() == (k, 1) and x2.data_ptr() % 256 == 0
            and x2.untyped_storage().nbytes() - x2.storage_offset() * es >= rows * k * es)


def _padded_rows(x2: torch.Tensor, lead: tuple = ()) -> tuple[torch.Tensor, int]:
    """x2's rows as a (*lead, chunks * PAD_ROWS, K) fp16 buffer: x2's own storage when it has room (`rows_empty`),
    else a fresh copy. The pad rows are left as they are: a GEMM's output row depends only on its own input row,
    so whatever they hold never reaches a real row, and skipping the zero fill saves a kernel per linear."""
    m, k = x2.shape[-2], x2.shape[-1]
    chunks = -(-m // PAD_ROWS)
    full = chunks * PAD_ROWS
    if not lead and _in_place(x2, full):
        return x2.as_strided((full, k), (k, 1)), chunks
    if lead and x2.stride() == (full * k, k, 1) and _in_place(x2[0], lead[0] * full):   # grouped_rows_empty's layout
        return x2.as_strided((*lead, full, k), (full * k, k, 1)), chunks
    xp = torch.empty((*lead, chunks * PAD_ROWS, k), dtype=torch.float16, device=x2.device)
    xp[..., :m, :].copy_(x2)                          # fp16 values: the conversion is exact
    return xp, chunks


def _small(x: torch.Tensor, w: torch.Tensor) -> bool:
    return x.is_cuda and w.numel() * w.element_size() <= SMALL_WEIGHT_BYTES


def dense_for(rows: int, choice: str = "auto") -> str:
    """The dense kernel for a deployment whose widest draft batch has `rows` rows. "auto": "triton" when that batch
    spans more than one chunk, else "cublas": at one chunk cuBLAS is a little faster, at two or more the Triton
    kernel reads each weight once, not once a chunk (docs/performance.md, `serve --dense`)."""
    if choice == "auto":
        return "triton" if rows > PAD_ROWS else "cublas"
    if choice not in DENSE_KERNELS:
        raise ValueError(f"dense kernel must be auto, triton or cublas, not {choice!r}")
    return choice


def _chunked(x: torch.Tensor, dense: str) -> bool:
    """Whether a dense linear on x runs `chunked_linear` (one launch) rather than cuBLAS once per chunk (also for
    a bench that sets another PAD_ROWS: the kernel's chunk is 32 rows)."""
    return x.is_cuda and dense == "triton" and PAD_ROWS == 32


def _padded_mm(x: torch.Tensor, w: torch.Tensor, mm, out_dtype: torch.dtype, dense: str) -> torch.Tensor:
    """x (..., K) @ w.T on chunks of exactly PAD_ROWS rows of a padded copy of x: `chunked_linear` in one launch,
    or `mm(chunk, w)` per chunk."""
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
    """Batch-invariant fp32 x @ w.T: x (..., K) fp16-valued, w (N, K) fp16 -> fp32 (..., N). On a GPU, `dense`
    "triton" runs `chunked_linear` over every chunk in one launch (module docstring); "cublas" as follows.

    Rows go through cuBLAS in chunks of exactly PAD_ROWS (the last padded), so every GEMM has the same shape
    and runs the same kernel whatever the batch. The rows are read in place when x sits at the start of a padded
    allocation (`rows_empty`), else copied into a fresh buffer: either way each chunk starts at an aligned address,
    since pointer alignment is also an input of the heuristic.
    No host sync, and the shapes depend only on x's shape (safe inside CUDA graph capture). Small weights on a
    GPU take `fused.rows_linear` instead (see SMALL_WEIGHT_BYTES)."""
    if _small(x, w):
        from .fused import rows_linear
        return rows_linear(x, w, torch.float32)
    return _padded_mm(x, w, _mm_f32, torch.float32, dense)


def padded_linear_f16(x: torch.Tensor, w: torch.Tensor, dense: str = "triton") -> torch.Tensor:
    """`padded_linear` rounded to fp16 by cuBLAS's epilogue (fp32 accumulation, one rounding), which saves the
    separate conversion kernel. The same fixed shape per chunk, so the same batch invariance."""
    if _small(x, w):
        from .fused import rows_linear
        return rows_linear(x, w, torch.float16)
    if not x.is_cuda:
        return ops.f16(padded_linear(x, w, dense))
    return _padded_mm(x, w, lambda xc, w: torch.mm(xc, w.t()), torch.float16, dense)


def padded_grouped_linear(x: torch.Tensor, w: torch.Tensor, dense: str = "triton") -> torch.Tensor:
    """fp16 (n, G * R): group g of x (n, G, K) times rows [g*R, (g+1)*R) of w (G * R, K) (the attention's grouped
    wo_a; fp32 accumulation, one rounding to fp16). On a GPU: `chunked_linear` over every group and chunk in one
    launch, or (dense "cublas") one batched GEMM of a fixed (G, PAD_ROWS, K) x (G, K, R) shape per chunk.
    Off CUDA: one `padded_linear` per group."""
    n, g, k = x.shape
    r = w.shape[0] // g
    wg = w.view(g, r, k)
    if n == 0 or not x.is_cuda:
        return torch.cat([ops.f16(padded_linear(x[:, i], wg[i], dense)) for i in range(g)], dim=-1)
    xp, chunks = _padded_rows(x.transpose(0, 1), (g,))
    # Each chunk's GEMM writes its (G, PAD_ROWS, R) result straight into the row-major (rows, G * R) layout wo_b
    # reads in place: as a strided batch (row stride G * R, group stride R), which cuBLAS takes as its output
    # without a copy. (Written group-major, it took a transposing copy kernel.)
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
    """fp32 (P, N): out[p] = x[p] @ w[idx[p]].T. x (P, K) fp16-valued, w (E, N, K) fp16, idx (P,) int64 on the
    device. Batch invariant; reads each pair's expert in place (no gather). No host sync. The Triton kernel lives
    with the other expert kernels in `kernels/fused.py` (imported here lazily: the CPU service never needs
    triton)."""
    from .fused import indexed_linear as kernel
    return kernel(x, w, idx)


def indexed_linear_reference(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """fp64 einsum of the gathered experts, rounded once to fp32 (for tests)."""
    return torch.einsum("pk,pnk->pn", x.double(), w[idx].double()).float()


def kernels_for(mode: str, dense: str = "triton") -> ops.Kernels:
    """The kernels of `mode`, to hand to a drafter: "exact" (`ops.EXACT`: tree-sum matmuls, op chains), "fast"
    (these matmuls and the fused kernels of `kernels/fused.py`; pins determinism first, a setting of the process),
    "auto" (fast with CUDA, else exact). `dense` picks the fast path's dense kernel on a GPU ("triton" or "cublas",
    `dense_for`), bound into its dense linears. A start-up choice."""
    if dense not in DENSE_KERNELS:
        raise ValueError(f"dense kernel must be triton or cublas, not {dense!r}")
    if mode == "auto":
        mode = "fast" if torch.cuda.is_available() else "exact"
    if mode == "exact":
        return ops.EXACT
    if mode != "fast":
        raise ValueError(f"matmul mode must be exact, fast or auto, not {mode!r}")
    pin_determinism()
    from . import fused             # imports triton: only the fast path needs it
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
    pdl = "off"                 # programmatic dependent launch of the graphs' fused kernels (Hopper and later)
    if kernels.mode == "fast" and torch.cuda.is_available():
        from .fused_ops import pdl_active
        pdl = "graphs" if pdl_active() else "off"
    return (f"matmul mode={kernels.mode} pad_rows={PAD_ROWS} dense={kernels.dense or 'none'} triton(BLOCK_N={BLOCK_N},"
            f"BLOCK_K={BLOCK_K},num_warps={NUM_WARPS}) fused[{fused}] pinned[{pinned}] pdl={pdl}")
