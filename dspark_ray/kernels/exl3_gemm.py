"""EXL3 Linears and expert banks multiplied on exllamav3 1.6.5's own kernels (`exl3_gemm`, `exl3_mgemm`,
`exl3_moe`), each kernel fixed per shape by the committed `exl3_shapes.json` (never by exllamav3's timing), calls
padded to whole row tiles, so a row's bits never depend on the batch or the process. The model stays
quantization-unaware: these objects answer the few tensor calls it makes on a weight. Design: docs/exl3.md.
"""
from __future__ import annotations

import json
import logging
from functools import cached_property, lru_cache
from pathlib import Path

import torch

from ..model import ops
from ..weights.exl3 import HAD, TILE, Exl3Linear, bits_of

log = logging.getLogger(__name__)

TABLE_PATH = Path(__file__).with_name("exl3_shapes.json")
SHAPES = (1, 2, 3, 4)           # exllamav3's 16-row tile shapes
_TILE_N = {1: 128, 2: 128, 3: 256, 4: 512}
# A part-filled tile takes another reduction path, so calls are padded to whole tiles (docs/exl3.md).
SLAB = 16
# The row-tile family: rows per tile -> exllamav3 shape; all four give a row the same bits.
ROW_TILES = {16: 2, 32: 5, 48: 6, 64: 7}
ROWS = "rows"                   # the table's name for "pick the family's tile by the row count"


def ext():
    from exllamav3.ext import exllamav3_ext
    return exllamav3_ext


def available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        ext()
    except Exception:           # noqa: BLE001 - any import failure means "decode instead"
        return False
    return True


def on_kernels(ckpt, name: str) -> bool:
    """Every EXL3 Linear but wo_a, whose group slices are decoded for the grouped output GEMM."""
    return ckpt.storage(name) == "exl3" and not name.endswith(".wo_a.weight")


# ==== the committed kernel table =====================================================================================
def shape_key(op: str, cc: str, K, codebook: str, k: int, n: int) -> str:
    return f"{op} sm{cc} K{K} {codebook} k{k} n{n}"


@lru_cache
def _table() -> dict[str, int | str]:
    if not TABLE_PATH.is_file():
        return {}
    return {k: v if v == ROWS else int(v) for k, v in json.loads(TABLE_PATH.read_text())["shapes"].items()}


def _cc(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}"


def compatible(K, k: int, n: int, device: torch.device) -> list[int]:
    """The 16-row shapes exllamav3 accepts for (K, k, n) on this card."""
    bits, half = int(K), not float(K).is_integer()
    with torch.cuda.device(device):
        return [s for s in SHAPES if ext().exl3_gemm_shape_compat(s, 16, k, n, bits, half)]


def rows_compatible(K, k: int, n: int, device: torch.device) -> bool:
    bits, half = int(K), not float(K).is_integer()
    with torch.cuda.device(device):
        return all(ext().exl3_gemm_shape_compat(s, m, k, n, bits, half) for m, s in ROW_TILES.items())


def tile_for(shape, m: int) -> tuple[int, int]:
    """(rows the call is padded to, exllamav3 shape) for m rows through a weight of table entry `shape`."""
    if shape != ROWS:
        return -(-m // SLAB) * SLAB, shape
    if m > 64:
        return -(-m // 64) * 64, ROW_TILES[64]
    mp = -(-m // SLAB) * SLAB
    return mp, ROW_TILES[mp]


_warned: set[str] = set()


def forced_shape(op: str, K, codebook: str, k: int, n: int, device: torch.device) -> int | str:
    """The tile shape `op` ("gemm" | "mgemm") runs: the committed table's, else a fixed rule, logged once."""
    key = shape_key(op, _cc(device), K, codebook, k, n)
    shape = _table().get(key)
    if shape is not None:
        return shape
    ok = compatible(K, k, n, device)
    if op == "gemm" and rows_compatible(K, k, n, device):
        shape = ROWS
    elif not ok:
        raise ValueError(f"EXL3 {op} k={k} n={n} at {K} bpw: no exllamav3 kernel shape fits on this card")
    else:
        shape = max(ok, key=lambda s: (_TILE_N[s], -s))
    if key not in _warned:
        _warned.add(key)
        log.warning("exl3: no committed kernel for %r; using shape %s (tools/exl3_kernel_table.py adds it)", key,
                    shape)
    return shape


# ==== one Linear =====================================================================================================
class Exl3Weight:
    """An EXL3 Linear on the GPU, shaped like the (out, in) weight it stands for; `matmul` runs `exl3_gemm`."""

    serial_launches = True          # exllamav3's split-K shares one lock array per card: one stream only

    def __init__(self, rec: Exl3Linear):
        t = rec.trellis
        if not t.is_cuda:
            raise ValueError("Exl3Weight needs its trellis on a CUDA device")
        self.trellis, self.suh, self.svh = t.contiguous(), rec.suh.contiguous(), rec.svh.contiguous()
        self.codebook, self.K = rec.codebook, bits_of(t.shape[-1])
        self.mcg, self.mul1 = rec.codebook == "mcg", rec.codebook == "mul1"
        self.k, self.n = t.shape[0] * TILE, t.shape[1] * TILE
        self.device = t.device

    @cached_property
    def shape_idx(self) -> int | str:
        """Looked up on first use: an expert stacked into a bank never runs this gemm and has no table entry."""
        return forced_shape("gemm", self.K, self.codebook, self.k, self.n, self.device)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n, self.k))

    dtype = torch.float16           # what it multiplies like

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.trellis, self.suh, self.svh))

    def contiguous(self) -> "Exl3Weight":
        return self

    def __getitem__(self, rows) -> "Exl3Weight":
        """Output features [start, stop) on the output Hadamard's 128-blocks, as a weight of its own."""
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

    def matmul(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """x (..., k) fp16 -> x @ W.T (..., n) in out_dtype, fp32 accumulation."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k).to(torch.float16)
        m = x2.shape[0]
        mp, shape = tile_for(self.shape_idx, m)
        if mp != m:                 # whole tiles: a row's bits never depend on the call's row count
            xp = torch.zeros((mp, self.k), dtype=torch.float16, device=x.device)
            xp[:m] = x2
            x2 = xp
        else:
            x2 = x2.contiguous()
        c = torch.empty((mp, self.n), dtype=out_dtype, device=x.device)
        a_had = torch.empty_like(x2)        # the input Hadamard's scratch
        ext().exl3_gemm(x2, self.trellis, c, self.suh, a_had, self.svh, shape, self.mcg, self.mul1, 0)
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
    """torch.cat of weights along their rows: one product per block (each EXL3 Linear has its own input signs)."""

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
    """torch.stack of one block's E experts: (E, n, k). `exl3_mgemm`'s bits depend on the slot count, so a block's
    three banks run the fused MoE kernel where it takes them (`swiglu_experts`)."""

    def __init__(self, experts: list[Exl3Weight]):
        e0 = experts[0]
        if any((e.k, e.n, e.K, e.codebook) != (e0.k, e0.n, e0.K, e0.codebook) for e in experts):
            raise ValueError("an EXL3 expert bank needs one shape, bitrate and codebook for every expert")
        self.experts = experts                # keeps the pointer tables' tensors alive
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

    def swiglu_experts(self, up: "Exl3Bank", down: "Exl3Bank", limit: float) -> "Exl3Experts | None":
        """This bank as the gate of the block's experts on the fused MoE kernel, or None where it does not fit."""
        return Exl3Experts(self, up, down, limit) if fused_moe_takes(self, up, down) else None

    def matmul_indexed(self, x: torch.Tensor, idx: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """out[p] = x[p] @ W[idx[p]].T (P, n) in out_dtype."""
        p = x.shape[0]
        a = x.to(torch.float16).reshape(p, 1, self.k).contiguous()
        c = torch.empty((p, 1, self.n), dtype=out_dtype, device=x.device)
        a_had = torch.empty_like(a)
        ext().exl3_mgemm(a, self.ptr_trellis, c, self.ptr_suh, a_had, self.ptr_svh,
                         idx.to(torch.int64).reshape(1, p).contiguous(), None, float(self.K), self.shape_idx,
                         self.mcg, self.mul1, -1, -1, 0, 1, None, None, None, None, 0)
        return c.reshape(p, self.n)


# ==== a block's routed experts on the fused MoE kernel ===============================================================
MOE_ACT_SILU = 0                # exllamav3_ext/quant/exl3_moe_common.cuh
M_TILE = 16


def fused_moe_takes(w1: Exl3Bank, w3: Exl3Bank, w2: Exl3Bank) -> bool:
    books = {w1.codebook, w3.codebook, w2.codebook}
    return (len(books) == 1 and books <= {"mcg", "mul1"} and w1.n == w3.n == w2.k and w1.k == w3.k == w2.n
            and w1.k % 128 == 0 and w1.n % 128 == 0)


class _Temps:
    """The kernel's staging buffers, shared by a card's blocks (one stream). Outgrown ones stay alive: a captured
    graph keeps their addresses."""

    def __init__(self):
        self.sets: dict[tuple, list] = {}

    def get(self, device: torch.device, rows: int, h: int, i: int) -> tuple[torch.Tensor, ...]:
        key = (device, h, i)
        have = self.sets.setdefault(key, [])
        if not have or have[-1][0].shape[1] < rows:
            groups = ext().exl3_moe_max_concurrency(device.index if device.index is not None else 0)
            cap = max(64, 1 << (rows - 1).bit_length())
            have.append(tuple(torch.empty((groups, cap, d), dtype=torch.float16, device=device)
                              for d in (h, h, i, i)))
        return have[-1]


_temps = _Temps()


class Exl3Experts:
    """The routed experts of one block, (gate, up, down) banks of E experts: `__call__` is `Experts.routed`'s sum."""

    def __init__(self, w1: Exl3Bank, w3: Exl3Bank, w2: Exl3Bank, limit: float):
        if not fused_moe_takes(w1, w3, w2):
            raise ValueError("exl3_moe needs one mcg / mul1 codebook and 128-aligned dims for gate, up and down")
        self.banks = (w1, w3, w2)
        self.E, self.h, self.i = len(w1.experts), w1.k, w1.n
        self.limit = float(limit)

    def __call__(self, f: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                 init: torch.Tensor) -> torch.Tensor:
        """f (n, h) fp16, experts / weights (n, k) in selection order, init (n, h) fp32 (the shared expert's
        output) -> init + sum_k w_k d_{e_k}, fp32 (n, h). No host sync."""
        n, k = experts.shape
        dev = f.device
        order = torch.argsort(experts, dim=1, stable=True)                     # ascending expert id per row
        flat_e = torch.gather(experts, 1, order).flatten()
        flat_w = torch.gather(weights, 1, order).to(torch.float16).flatten()
        rows = torch.arange(n, device=dev).repeat_interleave(k)
        by_expert = torch.argsort(flat_e, stable=True)
        token_sorted, weight_sorted = rows[by_expert], flat_w[by_expert]
        # Not bincount (a host sync). The kernel reads bin E as "outside this bank" (none here).
        count = torch.zeros(self.E + 1, dtype=torch.int64, device=dev).scatter_add_(0, flat_e, torch.ones_like(flat_e))
        start = torch.cumsum(count, 0) - count
        inv_order = torch.empty_like(by_expert).scatter_(0, by_expert, torch.arange(n * k, device=dev))
        kind = (count > 0).to(torch.int64)
        scratch = torch.empty((n * k, self.h), dtype=torch.float32, device=dev)
        out = init.to(torch.float32).contiguous().clone()
        tg, tu, ig, iu = _temps.get(dev, n, self.h, self.i)
        g, u, d = self.banks
        x = f.to(torch.float16).contiguous()
        ext().exl3_moe(x, out, count, token_sorted, weight_sorted, tg, tu, ig, iu, MOE_ACT_SILU,
                       float(g.K), float(u.K), float(d.K),
                       g.ptr_trellis, g.ptr_suh, g.ptr_svh, u.ptr_trellis, u.ptr_suh, u.ptr_svh,
                       d.ptr_trellis, d.ptr_suh, d.ptr_svh,
                       g.mcg, g.mul1, u.mcg, u.mul1, d.mcg, d.mul1,
                       self.limit, -1, scratch, start, 1, tg.shape[1], M_TILE)
        ext().exl3_moe_gather(out, scratch, flat_e, inv_order, start[:self.E], start[:self.E], kind[:self.E],
                              weight_sorted)
        return out


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


def load(rec: Exl3Linear) -> Exl3Weight:
    return Exl3Weight(rec)
