"""What a graph set's graphs run on the device: the insert writes its rows' main-kv into the slot pool, the draft
gathers the windows and runs `Drafter.forward`. A step graph runs a decode round's insert beside the draft on a
stream of its own, so the insert's GEMMs read weights while the draft's latency-bound kernels leave memory idle.
The kernels are the eager path's, and padded rows change no real row's bits (every dense layer is row-invariant).
"""
from __future__ import annotations

import torch

from ...model import ops
from ...model.drafter import Drafter
from .inputs import StepInputs


class StepFunctions:
    """The insert and draft functions over `pool` (every slot's main-kv ring, (slots, blocks, capacity, D)) and the
    device side of `inp`; W is the window, T the largest insert."""

    def __init__(self, drafter: Drafter, pool: torch.Tensor, inp: StepInputs, W: int, n_blocks: int, T: int):
        self.d, self.pool, self.inp = drafter, pool, inp
        self.W, self.n_blocks, self.T = W, n_blocks, T

    def draft(self, bsz: int, n_out: int, margins: bool, insert_rows: int = 0) -> torch.Tensor:
        """Gather the windows from the pool, draft, pack the outputs: (bsz, n_out * (2 or 3) + 1) fp64. With
        `insert_rows`, a step graph's: the insert of that many staged rows runs block by block beside the draft."""
        v = self.inp.dev_view
        if insert_rows:
            windows = ops.branch_parts(self._insert_by_block, self.pool, insert_rows, bsz)
            valid = self._valid(bsz)
        else:
            windows, valid = self.windows(bsz)
        out = self.d.forward(v("seeds")[:bsz], v("p0")[:bsz], windows, valid, n_out, margins)
        pack = self.d.kernels.fused("pack_outputs")
        if pack is not None:
            return pack(out.drafts, out.confidences, out.margins if margins else None, out.confident_len)
        parts = [out.drafts, out.confidences] + ([out.margins] if margins else []) + [out.confident_len[:, None]]
        return torch.cat([p.to(torch.float64) for p in parts], dim=1)

    def windows(self, bsz: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The staged requests' windows, per block (bsz, W, D), and their valid flags (bsz, W): what
        `Drafter.window_inputs` gives for the same slots."""
        rows = self._flat_pool().index_select(0, self._window_rows(bsz).flatten())
        return list(rows.view(self.n_blocks, bsz, self.W, -1).unbind(0)), self._valid(bsz)

    def insert(self, rows: int) -> None:
        """The main-kv of `rows` tap rows, scattered into the pool at (slot, block, ring row)."""
        for _ in self._scatter_by_block(rows):
            pass

    def _flat_pool(self) -> torch.Tensor:
        return self.pool.view(-1, self.pool.shape[-1])

    def _window_rows(self, bsz: int) -> torch.Tensor:
        """The staged pool rows of the windows, (blocks, bsz * W)."""
        return self.inp.dev_view("win_rows")[:self.n_blocks * bsz * self.W].view(self.n_blocks, bsz * self.W)

    def _valid(self, bsz: int) -> torch.Tensor:
        return self.inp.dev_view("valid")[:bsz * self.W].view(bsz, self.W)

    def _scatter_by_block(self, rows: int):
        """`insert` block by block: yields each block's index once its rows are in the pool."""
        v = self.inp.dev_view
        taps = v("taps")[:rows * self.inp.width].view(rows, self.inp.width)
        flat, dst = self._flat_pool(), v("ins_rows").view(self.n_blocks, self.T)
        for b, kv in enumerate(self.d.context_rows_by_block(taps, v("ins_pos")[:rows])):
            flat.index_copy_(0, dst[b, :rows], kv)      # pad rows all land on the scratch slot's row 0
            yield b

    def _insert_by_block(self, pool: torch.Tensor, rows: int, bsz: int):
        """`insert`, each block's rows followed by the gather of that block's windows as `windows` gathers them (a
        generator of the windows; `pool`, the set's own, names the device to `ops.branch_parts`)."""
        win = self._window_rows(bsz)
        for b in self._scatter_by_block(rows):
            yield self._flat_pool().index_select(0, win[b]).view(bsz, self.W, -1)
