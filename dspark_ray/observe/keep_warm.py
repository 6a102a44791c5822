"""Keeping a step path's host code warm while its thread waits: on the GPU host the same Python runs several
times slower after a 1 ms spin than back to back (docs/engine.md, "Keeping the host path warm").

A party registers rehearsals of its next step's pieces, built from a recent step's inputs, and its waiters call the
`KeepWarm` on every poll. A rehearsal must not change anything a step reads (pure functions, or buffers the next
step rewrites before reading); one that raises is dropped with one log line and never fails a step.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from ..protocol import records as M
from ..protocol.contract import Limits, MsgType, Step, StepReply, validate_entries, validate_step
from ..settings import current as settings
from ..protocol.wire import FrameWriter, decode_payload, encode_payload

log = logging.getLogger("dspark_ray.keep_warm")

REHEARSAL_ENTRIES = 4       # a few entries keep the code warm; a whole batch's piece would hold a STEP that comes


def keep_warm_enabled() -> bool:
    return settings().keep_warm


def keep_warm_period_us() -> float:
    return settings().keep_warm_us


def keep_warm_hold_us() -> float:
    return settings().keep_warm_hold_us


def launch_rehearsal_period_us() -> float | None:
    """How often a GPU rank rehearses a graph launch between steps (None: never); docs/engine.md has why 1 ms."""
    us = settings().keep_warm_launch_us
    return us if us > 0 else None


class KeepWarm:
    """A party's rehearsals, run by its waiters between steps. Callable with no arguments (a waiter's idle hook);
    several threads may call it, one rehearses at a time (the others go back to polling at once)."""

    def __init__(self, name: str, every_us: float | None = None, enabled: bool | None = None,
                 hold_us: float | None = None):
        self.name = name
        self.every_ns = int((keep_warm_period_us() if every_us is None else every_us) * 1e3)
        self.hold_ns = max(self.every_ns, int((keep_warm_hold_us() if hold_us is None else hold_us) * 1e3))
        self.enabled = keep_warm_enabled() if enabled is None else enabled
        self.pieces: dict[str, Callable[[], object]] = {}
        self._own_every: dict[str, int] = {}         # pieces with a period of their own (ns) ...
        self._own_next: dict[str, int] = {}          # ... and when each may run next
        self.runs = 0
        self.dropped: dict[str, str] = {}
        self._next_ns = 0
        self._start = 0                   # where the next run starts (a run stopped by `ready` resumes there)
        self._samples: dict[str, tuple[int, int]] = {}     # per source: (size, time) of the last sample taken
        self._lock = threading.Lock()

    def set(self, name: str, fn: Callable[[], object], every_us: float | None = None) -> None:
        """Rehearse `fn` from now on in place of the last piece of that name (a dropped piece stays dropped).
        `every_us`: a longer period of its own for this piece (it runs with a run of the others once that much
        has passed since it last ran); None: every run."""
        if self.enabled and name not in self.dropped:
            self.pieces[name] = fn
            if every_us is None:
                self._own_every.pop(name, None)
                self._own_next.pop(name, None)
            else:
                self._own_every[name] = int(every_us * 1e3)

    def wants_sample(self, source: str, size: int, every_s: float = 0.5) -> bool:
        """Whether to build `source`'s rehearsal from the step just run (its inputs are `size` bytes): yes for the
        first, then only for a new size and at most every `every_s`. A sample costs a copy of the inputs on the
        step's path; batches of changing sizes (a serving engine's) would otherwise copy at every step."""
        if not self.enabled:
            return False
        t = time.monotonic_ns()
        last = self._samples.get(source)
        if last is not None and (last[0] == size or t - last[1] < every_s * 1e9):
            return False
        self._samples[source] = (size, t)
        return True

    def ran(self) -> None:
        """The real path has just run (it is warm): the next rehearsal waits the hold (at least a period) from now."""
        self._next_ns = time.monotonic_ns() + self.hold_ns

    def __call__(self, ready: Callable[[], bool] | None = None) -> None:
        """Run the pieces if a period has passed. `ready` (the waiter's own check, optional) is asked before each
        piece: once what the thread waits for has come, the rest waits for the next wait, and that run starts
        where this one stopped (so an early piece cannot starve a later one)."""
        if not self.pieces or time.monotonic_ns() < self._next_ns or not self._lock.acquire(blocking=False):
            return
        try:
            names = list(self.pieces)
            for k in range(len(names)):
                name = names[(self._start + k) % len(names)]
                if ready is not None and ready():
                    self._start = (self._start + k) % len(names)
                    return
                fn = self.pieces.get(name)
                own = self._own_every.get(name)
                if own is not None:
                    t = time.monotonic_ns()
                    if t < self._own_next.get(name, 0):
                        continue
                    self._own_next[name] = t + own
                try:
                    if fn is not None:
                        fn()
                except Exception as e:        # a rehearsal is never worth a step: drop it, say so once
                    self.pieces.pop(name, None)
                    self.dropped[name] = f"{type(e).__name__}: {e}"
                    log.warning("%s: keep-warm piece %r dropped: %s", self.name, name, self.dropped[name])
            self._start = 0
            self.runs += 1
        finally:
            self._next_ns = time.monotonic_ns() + self.every_ns
            self._lock.release()

    def status(self) -> dict:
        return {"enabled": self.enabled, "every_us": self.every_ns / 1e3, "hold_us": self.hold_ns / 1e3,
                "pieces": sorted(self.pieces), "runs": self.runs,
                "dropped": dict(self.dropped)}                      # copies: status is read from other threads


# -- what each party rehearses, from a sample of its last step (its recorder takes the samples: recorders.py) ---------
def step_checks(limits: Limits) -> Callable[[Step], None]:
    """The step service's stateless checks of a STEP, without admitting it (`rehearse_frame`'s `checks`)."""
    def checks(msg: Step) -> None:
        validate_step(msg, limits)
        validate_entries(msg, limits)
    return checks


def rehearse_frame(warm: KeepWarm, payload, reply: StepReply, checks: Callable[[Step], object] | None) -> None:
    """A STEP server's connection threads: the STEP's decode, the service's checks (`checks`: `step_checks`) and
    the reply's encoding, from the frame's `payload` (the reader's buffer: its first entries are copied out). Three
    pieces, so a frame that arrives during a rehearsal waits for one of them at most; the reply is encoded into a
    writer of its own, since any connection's thread may run it."""
    step = decode_payload(MsgType.STEP, payload)
    sample = encode_payload(Step(entries=step.entries[:REHEARSAL_ENTRIES], deadline_ms=step.deadline_ms))
    reply = StepReply(results=reply.results[:REHEARSAL_ENTRIES])
    scratch = FrameWriter()
    decoded = [decode_payload(MsgType.STEP, sample)]        # the checks' input, renewed by each decode piece

    def decode():
        decoded[0] = decode_payload(MsgType.STEP, sample)
    warm.set("frame_decode", decode)
    if checks is not None:
        warm.set("frame_checks", lambda: checks(decoded[0]))
    warm.set("frame_reply", lambda: scratch.pack(reply, 0))


def rehearse_ring_coding(warm: KeepWarm, batch: M.RingBatch, reply: bytes) -> None:
    """The front-end's ring driver: a batch's encoding and its reply's decoding."""
    sample = batch.head(REHEARSAL_ENTRIES)
    warm.set("batch", lambda: M.encode(sample))
    warm.set("reply", lambda: M.decode_reply(reply))


def rehearse_rank_step(warm: KeepWarm, engine, batch: M.RingBatch, results: list | None) -> None:
    """A rank's step loop: the batch's decode, the engine's host work (`rehearse_engine`), a graph launch on a GPU
    (at its own period, `launch_rehearsal_period_us`), and with `results` (rank 0's) the answer's encoding. From
    the batch's first entries, encoded into bytes of their own (the decoded batch views the ring's slot, which is
    the ring's again once the step is complete)."""
    sample, decoded = M.encode(batch.head(REHEARSAL_ENTRIES)), []

    def decode():
        decoded[:] = [M.decode_batch(sample)]
    warm.set("decode", decode)
    warm.set("engine", lambda: decoded and rehearse_engine(engine, decoded[0]))
    launch_every = launch_rehearsal_period_us()
    if engine.graphs is not None and engine.graphs.cuda and launch_every is not None:
        graphs = engine.graphs
        warm.set("launch", lambda: rehearse_launch(graphs), launch_every)
    if results is not None:
        results = results[:REHEARSAL_ENTRIES]
        warm.set("reply", lambda: M.encode(M.RingReply(results)))


def rehearse_engine(engine, batch: M.RingBatch) -> None:
    """The host side of `engine.step(batch)` (a `RankEngine` on graphs) without running it or changing a slot."""
    gs = engine.graphs
    if engine.broken or gs is None or not batch.entries or len(batch.entries) > gs.max_requests:
        return
    es, slots = batch.entries, engine.slots
    inserts = [(slots[e.slot], slots[e.slot].position, t) for e in es if len(t := e.taps_array(engine.width))]
    _, n_out, margins = batch.shape()
    rehearse_graphs(gs, inserts, [slots[e.slot] for e in es], [e.seed_token for e in es], n_out, margins)


def rehearse_graphs(gs, inserts: list, states: list, seeds: list[int], n_out: int, want_margins: bool) -> None:
    """`GraphSet.run`'s host work without a replay, a stamp or a change to a slot. It writes the pinned buffer only
    while no upload can read it: every step stages all it uploads before it launches."""
    from ..rank.graphs.outputs import packed_size, read_outputs     # (a rank's: the front-end never imports torch)
    if not gs.inp.in_use:
        chunks = list(gs.chunks(inserts))
        if chunks:
            gs.stage_insert(chunks[-1], gs.beside_rows(chunks, len(states)))
        if states:
            gs.stage_draft(states, seeds)
    if states:
        b, drafted, _ = gs.buckets.key(len(states), n_out, want_margins)
        read_outputs(gs.copies.out_np, packed_size(b, drafted, want_margins), len(states), n_out, drafted,
                     want_margins, True)


def rehearse_launch(gs) -> None:
    """Launch a graph set's one-kernel graph between steps to keep the driver's launch path warm (docs/engine.md).
    Through the collectives' guard: a poisoned rank launches nothing."""
    if gs.noop is not None and not gs.inp.in_use:
        gs.coll.replay(gs.noop, 0)
