"""Per-slot drafter state: a ring of `capacity` = W + the insert limit (128) >= W + B + 1 rows per block, row of
position t at t % capacity, so spec 3a's ring hazard cannot occur and a whole insert can be rolled back.
"""
from __future__ import annotations

import torch

from ..protocol.slot_cursor import SlotCursor


class SlotState(SlotCursor):
    """A slot on a rank: the front-end's cursor, taken as given (`place`), and the main-kv rings; `kv` / `index`: a
    row of the graph set's pool, so a captured step reaches any slot by index."""

    def __init__(self, n_blocks: int, window: int, max_rows: int, head_dim: int, device="cpu",
                 kv: torch.Tensor | None = None, index: int = -1):
        super().__init__(window, max_rows)
        shape = (n_blocks, self.capacity, head_dim)
        if kv is None:
            kv = torch.zeros(shape, dtype=torch.float16, device=device)
        elif tuple(kv.shape) != shape or kv.dtype != torch.float16:
            raise ValueError(f"slot kv {tuple(kv.shape)} {kv.dtype} != {shape} float16")
        self.kv, self.index = kv, index

    def window_valid(self, device="cpu") -> torch.Tensor:
        return torch.arange(self.window, device=device) >= self.window - self.hist_len()

    def window_rows(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of positions p0-W .. p0-1 (W, D) and which are held (the others masked, whatever they hold)."""
        t = torch.arange(self.position - self.window, self.position, device=self.kv.device)
        return self.kv[block, t % self.capacity], self.window_valid(self.kv.device)

    def write_rows(self, start: int, rows_per_block: list[torch.Tensor]) -> None:
        """Write the main-kv rows of positions start .. start+n-1; the cursor is the caller's."""
        n = rows_per_block[0].shape[0]
        if n == 0:
            return
        idx = torch.arange(start, start + n, device=self.kv.device) % self.capacity
        for b, rows in enumerate(rows_per_block):
            self.kv[b, idx] = rows

    def write(self, start: int, rows_per_block: list[torch.Tensor]) -> None:
        """`write_rows`, and the slot advanced past them."""
        self.write_rows(start, rows_per_block)
        self.advance(start, rows_per_block[0].shape[0])
