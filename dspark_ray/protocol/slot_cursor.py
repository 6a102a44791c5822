"""Where a slot stands and the rules for its inserts and rollbacks, without its rows (torch-free: the front-end
never imports torch)."""
from __future__ import annotations


class SlotCursor:
    """(base, position) of a slot. In the service the front-end's cursor is the one account: ranks take its
    placement (`after`) as given (`place`); the reference drafter on its own applies `rollback` and `advance`."""

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
        """(base, position) after an entry's rollback and insert (checked before), the state untouched."""
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
        """Take a placement `after` computed."""
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
