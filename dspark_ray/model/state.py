"""Per-slot drafter state: the main-kv history of every drafter block, the slot's position and generation.

History is a ring of `capacity` rows per block indexed by absolute position (row of position t at t % capacity).
The draft reads the last min(W, rows held) rows before p0. We write exactly the rows a client sends, and capacity
is W + the insert limit (128), which is >= W + B + 1, so the ring hazard of spec 3a (a row written at q >= p0
overwriting q - W, still inside the window) cannot occur, and a whole insert can always be rolled back.
"""
from __future__ import annotations

import torch


class SlotCursor:
    """Where a slot stands (base, position) and the rules for inserts and rollbacks, without the rows. In the service
    the front-end's cursor is the one account of a slot: it refuses a bad entry before it reaches a rank and hands
    the ranks each entry's placement (`after`), which their `SlotState`s take as given (`place`). The reference
    drafter, used on its own, applies the rules to its `SlotState` itself (`rollback`, `advance`)."""

    def __init__(self, window: int, max_rows: int):
        self.window, self.max_rows = window, max_rows
        self.capacity = window + max_rows
        self.generation = 0
        self.reset()

    def reset(self) -> None:
        """Forget the context (a fresh slot). The generation is the owner's business (bumped on resync)."""
        self.base = -1          # first position held (-1: fresh, the next insert may start anywhere)
        self.position = 0       # p0: the number of positions with rows = where the next insert starts

    @property
    def fresh(self) -> bool:
        return self.base < 0

    def hist_len(self) -> int:
        """History rows the draft reads: the last W before p0, fewer when the slot holds fewer (partial window)."""
        return 0 if self.fresh else min(self.window, self.position - self.base)

    def window_valid(self, device="cpu") -> torch.Tensor:
        """Which of the W window rows (positions p0-W .. p0-1) the slot holds: the newest hist_len."""
        return torch.arange(self.window, device=device) >= self.window - self.hist_len()

    # -- checks first, so a refused request leaves the state untouched -------------------------------------------
    def check_rollback(self, q: int) -> str | None:
        if q > self.position:
            return f"rollback_to {q} > slot position {self.position}"
        if self.fresh:
            return None if q == 0 else f"rollback_to {q} on a fresh slot (no rows)"
        lowest = max(self.base, self.position - self.capacity + self.window)
        if q < lowest and q != self.base:
            return (f"rollback_to {q} < {lowest}: rows below it are no longer held "
                    f"(the slot keeps W + {self.max_rows} rows)")
        return None

    def check_insert(self, start: int, n: int, rollback_to: int = -1) -> str | None:
        """Checks of an insert of n rows at `start`, after the optional rollback (already checked)."""
        fresh_after = self.fresh or (rollback_to >= 0 and rollback_to == self.base)
        pos_after = rollback_to if rollback_to >= 0 else self.position
        if n > self.max_rows:
            return f"{n} rows > insert limit {self.max_rows}"
        if start < 0:
            return f"start position {start} < 0"
        if n > 0 and not fresh_after and start != pos_after:
            return f"position gap: insert starts at {start}, slot position is {pos_after}"
        return None

    def check_entry(self, start: int, n: int, rollback_to: int = -1) -> str | None:
        """Every cursor rule of one entry: its optional rollback, then its insert of n rows at `start`."""
        if rollback_to >= 0:
            why = self.check_rollback(rollback_to)
            if why:
                return why
        return self.check_insert(start, n, rollback_to)

    def after(self, start: int, n: int, rollback_to: int = -1) -> tuple[int, int]:
        """(base, position) after an entry's rollback and insert of n rows at `start` (checked before), the state
        untouched: the front-end hands this placement to the ranks with the entry, and takes it itself once the entry
        ran; position is where the entry's seed sits."""
        base, pos = self.base, self.position
        if rollback_to >= 0:
            if base < 0 or rollback_to == base:       # as `rollback` does: back to the first row held is a fresh slot
                base, pos = -1, 0
            else:
                pos = rollback_to
        if n:
            base = start if base < 0 else base
            pos = start + n
        return base, pos

    # -- mutations -----------------------------------------------------------------------------------------------
    def place(self, base: int, position: int) -> None:
        """Take a placement `after` computed (the front-end's cursor, the one account of where a slot stands)."""
        self.base, self.position = base, position

    def rollback(self, q: int) -> None:
        if self.fresh or q == self.base:
            self.reset()
        else:
            self.position = q

    def advance(self, start: int, n: int) -> None:
        """Record n rows inserted at `start` (checked before)."""
        if n == 0:
            return
        if self.fresh:
            self.base = start
        self.position = start + n


class SlotState(SlotCursor):
    """A slot on a rank: the cursor plus the main-kv ring of every drafter block. `kv` may be handed in: the graph
    engine keeps every slot's ring in one pool tensor (`graphs.GraphSet`), so a captured step can read and write
    any slot by index; `index` is then the slot's row in that pool."""

    def __init__(self, n_blocks: int, window: int, max_rows: int, head_dim: int, device="cpu",
                 kv: torch.Tensor | None = None, index: int = -1):
        super().__init__(window, max_rows)
        shape = (n_blocks, self.capacity, head_dim)
        if kv is None:
            kv = torch.zeros(shape, dtype=torch.float16, device=device)
        elif tuple(kv.shape) != shape or kv.dtype != torch.float16:
            raise ValueError(f"slot kv {tuple(kv.shape)} {kv.dtype} != {shape} float16")
        self.kv, self.index = kv, index

    def window_rows(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed-size window the draft attends over: rows of positions p0-W .. p0-1 (W, D), and which of them
        the slot holds (W,) bool. Rows not held are masked (their contents are whatever the ring has)."""
        t = torch.arange(self.position - self.window, self.position, device=self.kv.device)
        return self.kv[block, t % self.capacity], self.window_valid(self.kv.device)

    def write(self, start: int, rows_per_block: list[torch.Tensor]) -> None:
        n = rows_per_block[0].shape[0]
        if n == 0:
            return
        idx = torch.arange(start, start + n, device=self.kv.device) % self.capacity
        for b, rows in enumerate(rows_per_block):
            self.kv[b, idx] = rows
        self.advance(start, n)
