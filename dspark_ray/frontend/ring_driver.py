"""`RingDriver`: the `Pair` the step service drives. One publish into the step ring, one wait for every rank's
completion record, bounded by the watchdog; no Ray call. A step that fails, hangs or finds a rank dead fails closed:
`on_fail` (the launcher's kill) runs before the failure is raised, so a stuck rank can never answer later.
"""
from __future__ import annotations

import collections
import contextlib
import time
from typing import Callable

from ..protocol import records as M
from ..protocol.contract import EntryResult
from ..observe.stamps import now
from .step_service import PairFailure, PairLate
from ..transport.ring import RingError, RingTimeout, StepRing


class RingDriver:
    def __init__(self, ring: StepRing, step_bound_s: float, on_fail: Callable[[], None]):
        """A recorder looks in from outside (`DriverRecorder.seam`: it wraps `ring` and `run`, seams.py)."""
        self.ring, self.step_bound_s, self.on_fail = ring, step_bound_s, on_fail
        self.last_seq: int | None = None
        # The last batches' shapes: what a restarted one-card rank captures first.
        self.shapes: collections.deque = collections.deque(maxlen=256)

    def recent_shapes(self) -> list[tuple[int, int, bool]] | None:
        return sorted(set(self.shapes)) or None

    def run(self, batch: M.RingBatch, deadline_ns: int | None = None) -> list[EntryResult]:
        """One step through the ring. Still running at `deadline_ns`: PairLate, whose resume() waits on (the same
        bound, counted from the publish)."""
        with self._failing_closed("ring slot"):
            seq = self.ring.publish(M.encode(batch), timeout_s=self.step_bound_s)
        self.shapes.append(batch.shape())
        bound = time.monotonic() + self.step_bound_s
        return self._collect(seq, bound, deadline_ns)

    @contextlib.contextmanager
    def _failing_closed(self, waited_for: str):
        try:
            yield
        except RingTimeout as e:
            self.on_fail()
            raise PairFailure("hung", f"no {waited_for} within the {self.step_bound_s:g} s watchdog: {e}") from None
        except RingError as e:
            self.on_fail()
            raise PairFailure("broken", str(e)) from None

    def _collect(self, seq: int, bound: float, deadline_ns: int | None, late: bool = False) -> list[EntryResult]:
        # A batch past its deadline (the reaper's wait) is waited for asleep: spinning and rehearsing there would
        # hold the GIL against the connection threads that answer the next STEPs by their deadlines.
        spin_us = 0.0 if late else None
        with self._failing_closed("completion"):
            while True:
                # Slices of the bound, so a dead or failed rank is noticed within ~0.1 s instead of at the bound,
                # and the caller gets its turn back at its deadline.
                left = bound - time.monotonic()
                if deadline_ns is not None:
                    left = min(left, (deadline_ns - now()) / 1e9)
                try:
                    comps = self.ring.wait_completions(seq, timeout_s=min(0.1, max(0.0, left)), spin_us=spin_us)
                    break
                except RingTimeout:
                    dead = self.ring.dead_readers()
                    if dead:
                        self.on_fail()
                        raise PairFailure("dead", f"rank(s) {dead} died during step {seq}") from None
                    broken = [r for r, st in self.ring.completed_so_far(seq).items() if st == M.STATUS_BROKEN]
                    if broken:
                        # A rank's latch closed (its collective timed out: the peer is gone, frozen or slow) while
                        # the other is still on the step: the pair is known bad now, not at the watchdog. (A rank
                        # that failed the step with its latch open is waited for: its peer fails alike.)
                        self.on_fail()
                        raise PairFailure("broken", f"rank(s) {broken} broke on step {seq} while the others "
                                                    f"still ran it") from None
                    if time.monotonic() >= bound:
                        raise
                    if deadline_ns is not None and now() >= deadline_ns:
                        raise PairLate(lambda: self._collect(seq, bound, None, late=True)) from None
        statuses = [s for s, _ in comps]
        if any(s == M.STATUS_BROKEN for s in statuses) or any(s == M.STATUS_STEP_FAILED for s in statuses):
            kind = "broken" if M.STATUS_BROKEN in statuses else "step"
            errs = "; ".join(f"rank {r}: {M.decode_reply(p).error}" for r, (s, p) in enumerate(comps) if s)
            raise PairFailure(kind, errs)
        self.last_seq = seq
        return M.decode_reply(comps[0][1]).results
