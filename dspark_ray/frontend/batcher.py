"""Turns on the pair: one batch on it at a time. A STEP finding the pair idle and nobody queued runs its entries on
its own thread (a hand-off to another costs a wake-up); otherwise they queue, and whichever waiter finds the pair
free next runs the oldest queued entries, up to the replay limit. Every wait is bounded by the entry's deadline.
"""
from __future__ import annotations

import collections
import threading
from typing import Callable, Protocol

from ..observe.stamps import now


class Waiting(Protocol):
    """An entry as the batcher sees it (the step service's pending entry)."""
    deadline_ns: int
    done: bool                      # a plain flag, waited on through the turn: an Event per entry cost every STEP
    taken: bool                     # in a batch (no longer in the queue)


class Batcher:
    def __init__(self, max_batch: int, run: Callable[[list], bool], expire: Callable[[Waiting], None]):
        """`run(batch)` runs a batch on the pair and returns True when it handed the batch to a reaper (which then
        ends the turn); `expire(p)` answers an entry past its deadline (called holding the turn)."""
        self.max_batch, self.run, self.expire = max_batch, run, expire
        self.queue: collections.deque = collections.deque()
        self._turn = threading.Condition()         # guards the queue and `running`; notified when a batch ends
        self.running = False                       # a batch is on the pair

    def submit(self, pend: list[Waiting]) -> None:
        """Run `pend` now on this thread if the pair is free and nobody queued, else queue it."""
        with self._turn:
            alone = 0 < len(pend) <= self.max_batch and not self.running and not self.queue
            if alone:
                self.running = True
                for p in pend:
                    p.taken = True
            else:
                self.queue.extend(pend)
        if alone:
            self._take_turn(pend)

    def wait(self, p: Waiting) -> None:
        """Return once `p` is answered, by its deadline; run a batch on this thread whenever the pair is free."""
        while not p.done:
            with self._turn:
                while self.running and not p.done:
                    left_ns = p.deadline_ns - now()
                    if left_ns <= 0:
                        self.expire(p)
                        return
                    self._turn.wait(min(left_ns / 1e9, 1.0))
                if p.done:
                    return
                self.running = True
                batch = self._take_batch()
            self._take_turn(batch)

    def dequeue(self, p: Waiting) -> None:
        """Take a queued entry out (caller holds the turn: `expire`)."""
        self.queue.remove(p)

    def expire_due(self, batch: list[Waiting]) -> None:
        """Answer the entries of a late batch that are past their deadline now, and wake their waiters."""
        with self._turn:
            t = now()
            for p in batch:
                if p.deadline_ns <= t:
                    self.expire(p)
            self._turn.notify_all()

    def end_turn(self) -> None:
        with self._turn:
            self.running = False
            self._turn.notify_all()

    def _take_turn(self, batch: list[Waiting]) -> None:
        """Run `batch` (caller set `running`); free the pair after, unless a reaper now holds it."""
        handed_off = False
        try:
            handed_off = self.run(batch)
        finally:
            if not handed_off:
                self.end_turn()

    def _take_batch(self) -> list[Waiting]:
        """Oldest queued entries first (caller holds the turn); admission keeps one entry per slot in flight."""
        n = min(len(self.queue), self.max_batch)
        batch = [self.queue.popleft() for _ in range(n)]
        for p in batch:
            p.taken = True
        return batch
