"""Where a step crosses a seam, the recorders look in: wrappers installed from outside, once, when a party is built
with a recorder (recorders.py), so the step path's functions read as the algorithm. A party built without one runs
its own objects, unwrapped: no call, no allocation per step.

- The front-end's ring (`RingOut`, over the ring driver's writer): the batch handed over (before its encoding), the
  copy into the ring slot, the ring step, the completions collected (and the keep-warm hook for that wait).
- The rank's ring (`RingIn`, over its reader): a ring step got (and the wait's sleeps, its keep-warm hook), the
  answer encoded and the completion posted.
- The engine (`observe_engine`, over a `RankEngine`'s step and its phases): in, the resets done, the slots run, out.

Each stamp is taken at the point of the sequence it was taken at when the parties stamped inline: before a hand-off
(a stamp taken after one can trail the reader's), after a call that returns.
The step service's (its per-STEP view, `ServiceObserver.step`), the graph set's and the STEP server's stay inline
(docs/layout.md, "Measurement").
"""
from __future__ import annotations

from ..protocol import records as M

_OK = M.STATUS_OK


class RingOut:
    """The front-end's writer of the step ring, as the ring driver's recorder sees it (`DriverRecorder.seam`)."""

    def __init__(self, ring, rec):
        self.inner, self.rec, self.idle = ring, rec, rec.idle
        self.size = 0                                  # the batch in hand's payload bytes

    def publish(self, payload, timeout_s: float = 2.0) -> int:
        self.rec.posting()                             # the batch is encoded: the copy into the slot begins
        seq = self.inner.publish(payload, timeout_s=timeout_s)
        self.rec.published(seq)
        self.size = len(payload)
        return seq

    def wait_completions(self, seq: int, timeout_s: float = 2.0, spin_us: float | None = None, idle=None):
        # The recorder's keep-warm hook runs between the spin's checks; a late batch's wait (spin_us 0) never spins.
        comps = self.inner.wait_completions(seq, timeout_s=timeout_s, spin_us=spin_us, idle=self.idle)
        if all(s == _OK for s, _ in comps):            # a failed batch is not recorded (the driver raises)
            self.rec.collected(self.batch, self.size, comps[0][1])
        return comps

    def __getattr__(self, name):                       # the rest of the ring (dead_readers, completed_so_far, ...)
        return getattr(self.inner, name)


def observe_driver_run(driver, rec, out: RingOut) -> None:
    """The batch handed to the ring: stamped as the driver's `run` begins, before its encoding."""
    run = driver.run

    def observed_run(batch, deadline_ns=None):
        rec.publishing()
        out.batch = batch
        return run(batch, deadline_ns)
    driver.run = observed_run


class RingIn:
    """A rank's reader of the step ring, as its recorder sees it (`RankRecorder.seam_ring`)."""

    def __init__(self, reader, rec):
        self.inner, self.rec, self.idle = reader, rec, rec.idle
        self.size = 0                                  # the step in hand's payload bytes

    def next(self, timeout_s: float, spin_us: float | None = None, idle=None):
        # The recorder's keep-warm hook runs between the spin's checks (a look without a spin never calls it).
        seq, view = self.inner.next(timeout_s=timeout_s, spin_us=spin_us, idle=self.idle)
        self.rec.got(seq, self.inner.sleeps)
        self.size = len(view)
        return seq, view

    def complete(self, seq: int, status: int = 0, payload=b"") -> None:
        rec = self.rec
        # before the hand-off: the front-end may see the completion at once; the batch still views the ring's slot
        rec.answered(rec.batch, rec.results if status == _OK else None, self.size)
        self.inner.complete(seq, status, payload)
        rec.completed()

    def __getattr__(self, name):                       # the rest of the reader (sleeps, close, ...)
        return getattr(self.inner, name)


def observe_engine(engine, rec) -> None:
    """A `RankEngine`'s step as its recorder sees it: `_step` (the step past the latch's check) stamps engine_in and,
    when it returns, engine_out (the CPU time beside both), and hands the recorder the batch and its results (the
    rehearsal's sample); its phases `reset_slots` and `_run` stamp started and ran as they return."""
    step, reset_slots, run = engine._step, engine.reset_slots, engine._run
    stamp = rec.stamp

    def observed_step(batch):
        stamp("engine_in", cpu=True)
        rec.batch = batch
        results = step(batch)
        stamp("engine_out", cpu=True)
        rec.results = results
        return results

    def observed_reset_slots(slots):
        reset_slots(slots)
        stamp("started")

    def observed_run(batch):
        out = run(batch)
        stamp("ran")
        return out
    engine._step, engine.reset_slots, engine._run = observed_step, observed_reset_slots, observed_run
