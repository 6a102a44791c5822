"""The worker's slots as the front-end keeps them: who holds each, where its context stands (its `SlotCursor` is the
one account; the ranks take its placements as given), whether an entry of it is in flight, and the resets the ranks
still owe (the next batch carries them). The step service's lock guards it: every method expects it held.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..protocol.slot_cursor import SlotCursor


@dataclass
class Slot:
    cursor: SlotCursor
    owner: int | None = None        # the session holding it
    busy: bool = False              # an entry of it is admitted and not yet answered


class SlotTable:
    def __init__(self, capacity: int, window: int, max_rows: int):
        self.slots = [Slot(SlotCursor(window, max_rows)) for _ in range(capacity)]
        self.pending_resets: set[int] = set()

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, i: int) -> Slot:
        return self.slots[i]

    def free(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s.owner is None]

    def held_by(self, owner: int) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s.owner == owner]

    def held(self) -> int:
        return sum(s.owner is not None for s in self.slots)

    def grant(self, i: int, owner: int) -> int:
        """Slot i to `owner`, its context forgotten; returns its generation."""
        self.resync(i)
        self.slots[i].owner = owner
        return self.slots[i].cursor.generation

    def release(self, i: int) -> None:
        self.slots[i].owner = None
        self.resync(i)

    def resync(self, i: int) -> None:
        """Forget slot i's context here now and on the ranks with the next batch."""
        c = self.slots[i].cursor
        c.reset()
        c.generation += 1
        self.pending_resets.add(i)

    def resync_all(self) -> None:
        for i in range(len(self.slots)):
            self.resync(i)

    def take_resets(self) -> list[int]:
        """The resets the next batch carries (the table then owes none)."""
        resets = sorted(self.pending_resets)
        self.pending_resets.clear()
        return resets

    def owe_resets(self, resets: list[int]) -> None:
        """Resets a failed batch may not have applied: the next batch carries them again."""
        self.pending_resets.update(resets)
