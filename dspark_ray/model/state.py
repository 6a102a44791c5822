"""Per-slot drafter state: the main-kv history of every drafter block, the slot's position and generation.

History is a ring of `capacity` rows per block indexed by absolute position (row of position t at t % capacity).
The draft reads the last min(W, rows held) rows before p0. We write exactly the rows a client sends, and capacity
is W + the insert limit (128), which is >= W + B + 1, so the ring hazard of spec 3a (a row written at q >= p0
overwriting q - W, still inside the window) cannot occur, and a whole insert can always be rolled back.
"""
from __future__ import annotations

import torch

from ..slot_cursor import SlotCursor


class SlotState(SlotCursor):
    """A slot on a rank: the cursor plus the main-kv ring of every drafter block. In the service the cursor is the
    front-end's placement, taken as given (`place`): the rank never recomputes where a slot stands. `kv` may be
    handed in: the graph engine keeps every slot's ring in one pool tensor (`graphs.GraphSet`), so a captured step
    can read and write any slot by index; `index` is then the slot's row in that pool."""

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
        """Which of the W window rows (positions p0-W .. p0-1) the slot holds: the newest hist_len."""
        return torch.arange(self.window, device=device) >= self.window - self.hist_len()

    def window_rows(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed-size window the draft attends over: rows of positions p0-W .. p0-1 (W, D), and which of them
        the slot holds (W,) bool. Rows not held are masked (their contents are whatever the ring has)."""
        t = torch.arange(self.position - self.window, self.position, device=self.kv.device)
        return self.kv[block, t % self.capacity], self.window_valid(self.kv.device)

    def write_rows(self, start: int, rows_per_block: list[torch.Tensor]) -> None:
        """Write the main-kv rows of positions start .. start+n-1 into the ring; where the slot stands is the
        caller's (a rank's slot is placed by the front-end's account: `place`)."""
        n = rows_per_block[0].shape[0]
        if n == 0:
            return
        idx = torch.arange(start, start + n, device=self.kv.device) % self.capacity
        for b, rows in enumerate(rows_per_block):
            self.kv[b, idx] = rows

    def write(self, start: int, rows_per_block: list[torch.Tensor]) -> None:
        """`write_rows`, and the slot advanced past them (the reference drafter applies the rules itself)."""
        self.write_rows(start, rows_per_block)
        self.advance(start, rows_per_block[0].shape[0])
