"""The front-end's share of a step, for tests and benches that drive a `RankEngine` directly.

In the service the front-end is the one account of where each slot stands: it checks an entry against its slot's
cursor and hands the ranks the slot's placement after it (`records.RingEntry`'s base and position). `Batcher` keeps
those cursors for a bare engine: it places each batch's entries and moves its cursors as the front-end does once a
batch ran. It checks nothing (the contract's checks run in the front-end; these drivers hand it entries that pass
them). `placed` does the same for a bare graph set's inserts.
"""
from __future__ import annotations

from dspark_ray.protocol import contract as C
from dspark_ray.protocol.records import RingBatch, RingEntry
from dspark_ray.protocol.slot_cursor import SlotCursor


def entry(*, slot: int, seed_token: int, n_out: int, **kw) -> C.Entry:
    """`contract.make_entry` at generation 0 (an engine knows no generations: the front-end checks them)."""
    return C.make_entry(slot=slot, generation=0, seed_token=seed_token, n_out=n_out, **kw)


class Batcher:
    """One cursor per slot of `slots` (the engine's `SlotState`s, for their window and insert limit)."""

    def __init__(self, slots):
        self.cursors = [SlotCursor(s.window, s.max_rows) for s in slots]

    def __call__(self, entries: list[C.Entry], resets=()) -> RingBatch:
        """The batch the front-end would put on the ring for `entries` after forgetting `resets`; the cursors move
        to the entries' placements."""
        for s in resets:
            self.cursors[s].reset()
        placed = [self.cursors[e.slot].after(e.start_pos, e.rows, e.rollback_to) for e in entries]
        for e, p in zip(entries, placed):
            self.cursors[e.slot].place(*p)
        return RingBatch(list(resets), [RingEntry.of(e, p) for e, p in zip(entries, placed)])

    def position(self, slot: int) -> int:
        return self.cursors[slot].position


class Driver:
    """A bare `RankEngine` driven as the front-end drives it: `step(entries, resets)` places the entries (a
    `Batcher`) and runs the batch. Everything else is the engine's."""

    def __init__(self, engine):
        self.engine, self.batcher = engine, Batcher(engine.slots)

    def step(self, entries: list[C.Entry], resets=()) -> list[C.EntryResult]:
        return self.engine.step(self.batcher(entries, resets))

    def __getattr__(self, name):
        return getattr(self.engine, name)


def placed(inserts):
    """A bare graph set's inserts [(slot, start, taps)], each slot first advanced past its rows by the cursor's
    rules (in the service the front-end's placement does that): `GraphSet.run` takes the slots where they stand."""
    for st, start, taps in inserts:
        st.advance(start, len(taps))
    return inserts
