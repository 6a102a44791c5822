"""EXL3 Linears and expert banks multiplied on exllamav3 1.6.5's own kernels (`exl3_gemm`, `exl3_mgemm`), with the
kernel fixed per shape from a committed table (seed 000, "forced kernels").

A GPU rank that loads an EXL3 checkpoint keeps each EXL3 Linear as stored (trellis, suh, svh, codebook: about a
third of the bf16 bytes at seed 000's mix) instead of decoding it to fp16, and the model's `ops.linear` /
`ops.linear_indexed` hand the product to the weight (`Exl3Weight.matmul`, `Exl3Bank.matmul_indexed`). The model
stays quantization-unaware: these objects answer the few tensor calls the model makes on a weight (`.shape`, a row
slice, `torch.cat` of row blocks, `torch.stack` of experts) and nothing else.

Why the table and not exllamav3's defaults: with `force_shape_idx <= 0` exllamav3 picks a GEMV by a heuristic or
times candidate kernels in the process (`CoopKernelAutotuner`) and keeps the fastest. Timings differ between
processes and cards, so two ranks (or two restarts of one) could run different kernels for one shape and round
differently. `exl3_shapes.json` (made once per card kind by `tools/exl3_kernel_table.py`, committed) names one
tile shape per (op, compute capability, bitrate, codebook, k, n); the launch then depends on the shape alone:
the same kernels on both ranks and in every process, and capturable in our CUDA graphs (no timing, no host
sync). A shape the table lacks takes a fixed rule (the widest compatible tile of shapes 1..4, all 16-row tiles)
and says so once in the log.

Batch invariance: a forced `exl3_gemm`'s grid depends on (k, n) alone, and its rows run in 16-row slabs; a slab of
fewer than 16 rows takes another reduction path, so calls are padded to whole slabs (`SLAB`): a row's bits never
depend on the other rows of the call. `exl3_mgemm` sizes its grid by the number of slots (rows x
top-k), so a routed expert's bits depend on how many (row, expert) pairs the call holds: exact per batch size, not
across batch sizes (measured and reported by `tests/test_exl3_gpu.py`).

exllamav3's kernels share one lock array per card for their split-K reduction: two of them in flight at once on
two streams could corrupt each other's partial sums. `serialize_branches` (called by the loader once it hands out
EXL3 weights) makes `ops.branch` run in line, so every EXL3 launch is on the one stream.
"""
from __future__ import annotations

import json
import logging
from functools import lru_cache
from pathlib import Path

import torch

from ..model import ops
from ..weights.exl3 import HAD, TILE, Exl3Linear, bits_of

log = logging.getLogger(__name__)

TABLE_PATH = Path(__file__).with_name("exl3_shapes.json")
SHAPES = (1, 2, 3, 4)           # exllamav3's 16-row tile shapes (tile n 128, 128, 256, 512); 5..7 are 32..64-row
_TILE_N = {1: 128, 2: 128, 3: 256, 4: 512}
# exl3_gemm runs its rows in slabs of 16, and a slab of fewer rows takes another reduction path (measured on the
# H200: a row's bits equal at 1 and 2 rows, differ at 8 and 16; tools/exl3_invariance_probe.py). Every call is
# padded to whole slabs, so every row runs the full-slab path whatever the batch.
SLAB = 16


def ext():
    """exllamav3's compiled extension (import on first use: the CPU path never needs it)."""
    from exllamav3.ext import exllamav3_ext
    return exllamav3_ext


def available() -> bool:
    """True when this process can run the EXL3 kernels: CUDA and exllamav3 with its extension."""
    if not torch.cuda.is_available():
        return False
    try:
        ext()
    except Exception:           # noqa: BLE001 - any import failure means "decode instead"
        return False
    return True


def on_kernels(ckpt, name: str) -> bool:
    """Whether a GPU rank multiplies tensor `name` of `ckpt` on these kernels: every EXL3 Linear but wo_a (its
    group slices are decoded to fp16 for the grouped output GEMM)."""
    return ckpt.storage(name) == "exl3" and not name.endswith(".wo_a.weight")


# ==== the committed kernel table =====================================================================================
def shape_key(op: str, cc: str, K, codebook: str, k: int, n: int) -> str:
    return f"{op} sm{cc} K{K} {codebook} k{k} n{n}"


@lru_cache
def _table() -> dict[str, int]:
    if not TABLE_PATH.is_file():
        return {}
    return {k: int(v) for k, v in json.loads(TABLE_PATH.read_text())["shapes"].items()}


def _cc(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}"


def compatible(K, k: int, n: int, device: torch.device) -> list[int]:
    """The 16-row shapes exllamav3 accepts for (K, k, n) on this card (tile divides k and n, shared memory fits)."""
    bits, half = int(K), not float(K).is_integer()
    with torch.cuda.device(device):
        return [s for s in SHAPES if ext().exl3_gemm_shape_compat(s, 16, k, n, bits, half)]


_warned: set[str] = set()


def forced_shape(op: str, K, codebook: str, k: int, n: int, device: torch.device) -> int:
    """The tile shape `op` ("gemm" | "mgemm") runs for this weight shape: the committed table's, else the widest
    compatible one (logged once per shape)."""
    key = shape_key(op, _cc(device), K, codebook, k, n)
    shape = _table().get(key)
    if shape is not None:
        return shape
    ok = compatible(K, k, n, device)
    if not ok:
        raise ValueError(f"EXL3 {op} k={k} n={n} at {K} bpw: no exllamav3 kernel shape fits on this card")
    shape = max(ok, key=lambda s: (_TILE_N[s], -s))
    if key not in _warned:
        _warned.add(key)
        log.warning("exl3: no committed kernel for %r; using shape %d (tools/exl3_kernel_table.py adds it)", key,
                    shape)
    return shape


# ==== one Linear =====================================================================================================
class Exl3Weight:
    """An EXL3 Linear on the GPU, shaped like the (out, in) weight it stands for; `matmul` runs `exl3_gemm`."""

    def __init__(self, rec: Exl3Linear):
        t = rec.trellis
        if not t.is_cuda:
            raise ValueError("Exl3Weight needs its trellis on a CUDA device")
        self.trellis, self.suh, self.svh = t.contiguous(), rec.suh.contiguous(), rec.svh.contiguous()
        self.codebook, self.K = rec.codebook, bits_of(t.shape[-1])
        self.mcg, self.mul1 = rec.codebook == "mcg", rec.codebook == "mul1"
        self.k, self.n = t.shape[0] * TILE, t.shape[1] * TILE
        self.device = t.device
        self.shape_idx = forced_shape("gemm", self.K, self.codebook, self.k, self.n, self.device)

    # -- what the model asks of a weight ---------------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n, self.k))

    dtype = torch.float16           # what it multiplies like (fp16 operands, fp32 accumulation)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.trellis, self.suh, self.svh))

    def contiguous(self) -> "Exl3Weight":
        return self

    def __getitem__(self, rows) -> "Exl3Weight":
        """Output features [start, stop) (multiples of 128: the output Hadamard's block), as a weight of its own."""
        start, stop = _rows(rows, self.n)
        if start == 0 and stop == self.n:
            return self
        if start % HAD or stop % HAD:
            raise ValueError(f"EXL3 row slice [{start}, {stop}): must fall on {HAD}-channel boundaries")
        t = self.trellis[:, start // TILE:stop // TILE]
        return Exl3Weight(Exl3Linear(t, self.suh, self.svh[start:stop], self.codebook))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _torch_function(func, args, kwargs or {})

    # -- the product -----------------------------------------------------------------------------------------------
    def matmul(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """x (..., k) fp16 -> x @ W.T (..., n) in out_dtype (fp16 or fp32), fp32 accumulation."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k).to(torch.float16)
        m = x2.shape[0]
        mp = -(-m // SLAB) * SLAB
        if mp != m:                 # whole slabs: a row's bits then never depend on the call's row count
            xp = torch.zeros((mp, self.k), dtype=torch.float16, device=x.device)
            xp[:m] = x2
            x2 = xp
        else:
            x2 = x2.contiguous()
        c = torch.empty((mp, self.n), dtype=out_dtype, device=x.device)
        a_had = torch.empty_like(x2)        # the input Hadamard's scratch (the kernel writes it first)
        ext().exl3_gemm(x2, self.trellis, c, self.suh, a_had, self.svh, self.shape_idx, self.mcg, self.mul1, 0)
        return c[:m].reshape(*lead, self.n)

    def __repr__(self) -> str:
        return f"Exl3Weight({self.n}x{self.k}, {self.K} bpw {self.codebook}, shape {self.shape_idx})"


def _rows(rows, n: int) -> tuple[int, int]:
    if not isinstance(rows, slice) or rows.step not in (None, 1):
        raise TypeError(f"an EXL3 weight takes a plain row slice, not {rows!r}")
    start, stop, _ = rows.indices(n)
    return start, stop


# ==== row blocks of different Linears (wq_a ; wkv, shared w1 ; w3) =====================================================
class RowBlocks:
    """torch.cat of weights along their rows: one product per block, outputs side by side. EXL3 Linears have their
    own input sign vector each, so two of them are never one trellis; a plain block runs the installed matmul."""

    def __init__(self, parts: list):
        self.parts = list(parts)
        self.k = parts[0].shape[1]
        if any(p.shape[1] != self.k for p in parts):
            raise ValueError("torch.cat of weights with different input widths")
        self.bounds = [0]
        for p in parts:
            self.bounds.append(self.bounds[-1] + p.shape[0])

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.bounds[-1], self.k))

    dtype = torch.float16

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def contiguous(self) -> "RowBlocks":
        return self

    def __getitem__(self, rows):
        start, stop = _rows(rows, self.bounds[-1])
        if start not in self.bounds or stop not in self.bounds:
            raise ValueError(f"row slice [{start}, {stop}) of concatenated weights must fall on a block boundary "
                             f"({self.bounds})")
        parts = self.parts[self.bounds.index(start):self.bounds.index(stop)]
        return parts[0] if len(parts) == 1 else RowBlocks(parts)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _torch_function(func, args, kwargs or {})

    def matmul(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([ops.linear(x, p, out_dtype=out_dtype) for p in self.parts], dim=-1)


# ==== a bank of routed experts =======================================================================================
class Exl3Bank:
    """torch.stack of one block's E experts (each an Exl3Weight of one shape and bitrate): (E, n, k). The indexed
    product runs one `exl3_mgemm` over pointer tables, every (row, expert) pair its own slot."""

    def __init__(self, experts: list[Exl3Weight]):
        e0 = experts[0]
        if any((e.k, e.n, e.K, e.codebook) != (e0.k, e0.n, e0.K, e0.codebook) for e in experts):
            raise ValueError("an EXL3 expert bank needs one shape, bitrate and codebook for every expert")
        self.experts = experts                # keeps the tensors the pointer tables address alive
        dev = e0.device
        self.ptr_trellis, self.ptr_suh, self.ptr_svh = (
            torch.tensor([getattr(e, a).data_ptr() for e in experts], dtype=torch.int64, device=dev)
            for a in ("trellis", "suh", "svh"))
        self.k, self.n, self.K, self.codebook = e0.k, e0.n, e0.K, e0.codebook
        self.mcg, self.mul1 = e0.mcg, e0.mul1
        self.shape_idx = forced_shape("mgemm", self.K, self.codebook, self.k, self.n, dev)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.experts), self.n, self.k))

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.experts) + 3 * self.ptr_svh.nbytes

    def matmul_indexed(self, x: torch.Tensor, idx: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """x (P, k) fp16, idx (P,) int64: out[p] = x[p] @ W[idx[p]].T (P, n) in out_dtype."""
        p = x.shape[0]
        a = x.to(torch.float16).reshape(p, 1, self.k).contiguous()
        c = torch.empty((p, 1, self.n), dtype=out_dtype, device=x.device)
        a_had = torch.empty_like(a)          # one Hadamard slab per slot
        ext().exl3_mgemm(a, self.ptr_trellis, c, self.ptr_suh, a_had, self.ptr_svh,
                         idx.to(torch.int64).reshape(1, p).contiguous(), None, float(self.K), self.shape_idx,
                         self.mcg, self.mul1, -1, -1, 0, 1, None, None, None, None, 0)
        return c.reshape(p, self.n)


def _torch_function(func, args, kwargs):
    if func is torch.cat:
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        if dim != 0:
            raise TypeError("EXL3 weights concatenate along their rows (dim 0) only")
        return RowBlocks(args[0])
    if func is torch.stack:
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        if dim != 0 or not all(isinstance(e, Exl3Weight) for e in args[0]):
            raise TypeError("torch.stack of EXL3 weights: experts of one kind along dim 0 only")
        return Exl3Bank(list(args[0]))
    raise TypeError(f"{getattr(func, '__name__', func)} is not defined for EXL3 weights (only their product, a row "
                    f"slice, torch.cat of row blocks and torch.stack of experts are)")


def serialize_branches() -> None:
    """Run `ops.branch` in line from now on (see the module docstring: one stream for every EXL3 launch)."""
    ops.drop_fused("branch", "branch_parts")


def load(rec: Exl3Linear) -> Exl3Weight:
    """The loader's entry: one EXL3 record on a CUDA device -> the weight the model multiplies by."""
    serialize_branches()
    return Exl3Weight(rec)
