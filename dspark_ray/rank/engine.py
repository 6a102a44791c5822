"""One rank's step engine: its slots, the step (graphs, or eager through the `Collectives`) and a health latch.
Both ranks get the same checked, placed batch and hold the same slot rows, so their collectives stay paired. A step
that fails between its first and last collective may leave the pair out of step: the latch closes and every later
step is refused until the process is replaced; a failure outside that span fails only its step.
"""
from __future__ import annotations

import logging
import time
import warnings

import numpy as np
import torch

from ..model.collectives import CollectiveError, Collectives
from ..protocol.contract import EntryResult
from .graphs import MAX_REQUESTS, GraphSet, HostDraft
from ..model.drafter import Drafter
from ..model.state import SlotState
from ..observe.observers import RankObserver
from ..protocol.records import RingBatch, RingEntry

log = logging.getLogger("dspark_ray.engine")


class EngineBroken(RuntimeError):
    """The engine's health latch is closed: the rank must be restarted."""


class StepFailed(RuntimeError):
    """This step failed; the pair is still in step (the latch stays open)."""


# Taps are a read-only view of the ring's slot; torch's non-writable-array warning is noise (filtered once: a
# catch_warnings block would cost every step).
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)


class _CountingCollectives(Collectives):
    """Wraps the real collectives to know whether a failure struck mid-sequence (pair possibly out of step)."""

    def __init__(self, inner: Collectives):
        self.inner, self.name = inner, inner.name
        self.world_size, self.local_ranks = inner.world_size, inner.local_ranks
        self.count = 0
        self.fault = None                          # callable(count) -> None: the fault injector's hook

    def _call(self, op, parts):
        if self.fault is not None:
            self.fault(self.count)
        out = op(parts)
        self.count += 1
        return out

    def all_reduce(self, parts):
        return self._call(self.inner.all_reduce, parts)

    def max_exchange(self, parts):
        return self._call(self.inner.max_exchange, parts)

    def top2_exchange(self, parts):
        return self._call(self.inner.top2_exchange, parts)

    def check(self):
        self.inner.check()

    def close(self):
        self.inner.close()

    @property
    def capturable(self):
        return self.inner.capturable

    def graph_capture(self):
        return self.inner.graph_capture()

    def replay(self, graph, n_collectives):
        # A graph's collectives run inside the replay: the fault hook fires before it, and the count says whether the
        # sequence had started when a failure struck.
        if self.fault is not None and n_collectives:
            self.fault(self.count)
        self.inner.replay(graph, n_collectives)
        self.count += n_collectives

    def status_region(self):
        return self.inner.status_region()

    def check_status(self, words):
        self.inner.check_status(words)

    def describe(self):
        return self.inner.describe()

    def max_rows(self, width):
        return self.inner.max_rows(width)


class RankEngine:
    """`graphs=True` runs steps of up to `max_batch` requests through a `graphs.GraphSet` (CUDA graphs on a GPU);
    the eager path gives the same bits and serves wider batches. A step checks nothing: the front-end alone checks
    and places, so the ranks cannot disagree about what to refuse or where a slot stands."""

    def __init__(self, drafter: Drafter, n_slots: int, rank: int = 0, graphs: bool = False,
                 progress=None, max_batch: int = MAX_REQUESTS, first: list[tuple[int, int, bool]] | None = None,
                 observer: RankObserver | None = None):
        self.drafter, self.rank = drafter, rank
        observer = observer or RankObserver()      # the graph set's (a recorder looks in on the step from outside)
        c = drafter.cfg
        self.width = c.n_taps * c.hidden_size
        self.coll = _CountingCollectives(drafter.coll)
        drafter.use_collectives(self.coll)
        self.graphs = None
        if graphs:
            self.graphs = GraphSet(drafter, n_slots, max_batch, observer=observer)
            self.graphs.capture(progress, first=first)     # `first`: only what those batches need, the rest later
            self.slots: list[SlotState] = self.graphs.slots     # the rings live in the graph set's pool
        else:
            self.slots = [drafter.new_slot() for _ in range(n_slots)]
        self.broken: str | None = None
        self.steps = 0
        self.failed_steps = 0
        self.last_error = ""
        self.fault_hook = None          # callable(phase: str) -> None, set by the fault injector (off by default)

    # -- slots -----------------------------------------------------------------------------------------------------
    def reset_slots(self, slots: list[int]) -> None:
        """Forget the context of these slots (acquire, release, resync)."""
        for s in slots:
            self.slots[s].reset()

    # -- the step --------------------------------------------------------------------------------------------------
    def step(self, batch: RingBatch) -> list[EntryResult]:
        """Run one batch: forget its reset slots, place each entry's slot, insert the rows, draft in one batch."""
        if self.broken:
            raise EngineBroken(f"rank {self.rank} refuses steps: {self.broken}")
        self.steps += 1
        return self._step(batch)

    def _step(self, batch: RingBatch) -> list[EntryResult]:
        """The step past the latch's check: the engine's seam, where a recorder looks in (seams.observe_engine)."""
        self.coll.count = 0
        entries = batch.entries
        done = False       # every collective of the step has completed
        try:
            self._hook("start")
            self.reset_slots(batch.resets)
            results = []
            res = self._run(batch)
            if entries:
                for j, e in enumerate(entries):
                    # the all-confident prefix of the first k of the batch's n_out drafts (the loop never looks
                    # ahead): the batch's prefix, cut at k
                    k = e.n_out
                    results.append(EntryResult(
                        drafts=_le(res.drafts[j, :k], "<i4"), confidences=_le(res.confidences[j, :k], "<f4"),
                        margins=_le(res.margins[j, :k], "<f4") if e.want_margins else b"",
                        confident_len=min(res.confident_len[j], k)))
            # a device-side collective failure surfaces here, before any answer leaves (from the control words the
            # draft graph downloaded with its outputs when it has them)
            status = self.graphs.fresh_status() if self.graphs is not None and entries else None
            if status is not None:
                self.coll.check_status(status)
            else:
                self.coll.check()
            done = True
            self._hook("end")
        except Exception as e:
            self.failed_steps += 1
            self.last_error = f"{type(e).__name__}: {e}"
            # Mid-sequence (some but maybe not all collectives issued) or a collective's own failure: the peer may
            # be parked in, or past, a collective we will never match. Latch.
            if isinstance(e, CollectiveError) or (self.coll.count > 0 and not done):
                self.broken = self.last_error
                log.error("rank %d: step failed, engine latched broken: %s", self.rank, self.last_error)
                raise EngineBroken(self.broken) from e
            log.warning("rank %d: step failed (pair still in step): %s", self.rank, self.last_error)
            raise StepFailed(self.last_error) from e
        return results

    def _run(self, batch: RingBatch):
        """Place the slots, then the inserts and one batched draft (eager for a batch wider than the graph set);
        None for a batch of resets alone."""
        es = batch.entries
        if not es:
            return None
        states = [self.slots[e.slot] for e in es]
        for e, st in zip(es, states):
            # A rollback is the placement: rows past the new position are simply not read (and overwritten later).
            st.place(e.base, e.position)
        inserts = [(st, e.start_pos, t) for e, st in zip(es, states) if len(t := self._taps(e))]
        seeds = [e.seed_token for e in es]
        _, n_out, margins = batch.shape()
        if self.graphs is None:
            for st, start, taps in inserts:
                self._insert(st, start, taps)
            return HostDraft.of(self.drafter.draft(states, seeds, n_out, margins))
        if len(es) <= self.graphs.max_requests:
            return self.graphs.run(inserts, states, seeds, n_out, margins, host=True)
        self.graphs.run(inserts, [], [], n_out, margins)
        return HostDraft.of(self.drafter.draft(states, seeds, n_out, margins))

    def _taps(self, e: RingEntry) -> np.ndarray:
        """The entry's taps (rows, width) fp16: a read-only view of the ring's slot, staged from there."""
        return e.taps_array(self.width)

    def _insert(self, st: SlotState, start: int, taps: np.ndarray) -> None:
        """The eager insert: the rows' main-kv written into the slot's ring (the slot is placed already)."""
        d = self.drafter
        st.write_rows(start, d.context_rows(torch.from_numpy(taps).to(d.device),
                                            torch.arange(start, start + len(taps), device=d.device)))

    def _hook(self, phase: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(phase)

    def status(self) -> dict:
        st = {"rank": self.rank, "steps": self.steps, "failed_steps": self.failed_steps,
              "broken": self.broken, "last_error": self.last_error, "collectives": self.coll.describe(),
              "time": time.time()}
        if self.graphs:
            st["graphs"] = {"count": self.graphs.n_graphs, "pending": len(self.graphs.pending),
                            "captured_first": self.graphs.captured_first,
                            "capture_s": round(self.graphs.capture_seconds, 3),
                            "bytes": self.graphs.graph_bytes, "request_buckets": self.graphs.request_buckets}
        return st


def _le(a: np.ndarray, dtype: str) -> bytes:
    """An answer's array as the contract's little-endian bytes (the host arrays are in its dtypes already)."""
    return a.astype(dtype, copy=False).tobytes()
