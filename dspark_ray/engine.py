"""One rank's step engine: its slots, the eager step through the `Collectives`, and a health latch.

A plain class, testable without Ray; `RankActor` is a thin shell around it. Both ranks of a pair receive the same
batch and hold the same replicated slot state, so every decision here (which entry is refused, how the batch is
drafted) comes out the same on both and their collectives stay paired.

The health latch: once a step fails in a way that may have left the pair out of step (a collective failed, or an
error struck between the first and the last collective of the step), the engine refuses every later step until
the process is replaced. A failure before the first or after the last collective leaves the pair in step: the
step fails, the latch stays open.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from .comm.base import CollectiveError, Collectives
from .graphs import MAX_REQUESTS, GraphSet, HostDraft
from .model.drafter import Drafter
from .model.state import SlotState
from .stamps import now

log = logging.getLogger("dspark_ray.engine")

OK, BAD_ENTRY = 0, 1


class EngineBroken(RuntimeError):
    """The engine's health latch is closed: the rank must be restarted."""


class StepFailed(RuntimeError):
    """This step failed; the pair is still in step (the latch stays open)."""


@dataclass
class StepEntry:
    slot: int
    seed: int
    n_out: int
    start: int = 0
    token_ids: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    taps: torch.Tensor | None = None               # (rows, n_taps * hidden) fp16
    rollback_to: int = -1
    want_margins: bool = False


@dataclass
class EntryOut:
    """One entry's answer: host arrays in the contract's dtypes (the service sends their bytes)."""
    code: int
    reason: str = ""
    drafts: np.ndarray | None = None               # (n_out,) int32
    confidences: np.ndarray | None = None          # (n_out,) fp32
    margins: np.ndarray | None = None              # (n_out,) fp32 or None
    confident_len: int = 0


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
        # A graph's collectives run inside the replay: the fault hook fires before it (a rank held here leaves its
        # peer waiting on the device), and the count says whether the sequence had started when a failure struck.
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
    """`graphs=True` builds the rank's graph set (`graphs.GraphSet`: captured as CUDA graphs on a GPU, run uncaptured
    on a CPU) for batches of up to `max_batch` requests and runs every step through it; the eager path
    (`graphs=False`) gives the same bits and serves batches the set does not cover.

    `values_checked=True`: the entries' values (finite taps, token ids in the vocab) were scanned upstream (the
    service's front-end scans every entry before it reaches the ring), so the step checks only what guards the
    slots' state (slot, seed, n_out, shapes, positions). Scanning 3 rows of full-size taps again cost ~45 us of each
    rank's step on the GPU host."""

    def __init__(self, drafter: Drafter, n_slots: int, rank: int = 0, graphs: bool = False,
                 progress=None, values_checked: bool = False, max_batch: int = MAX_REQUESTS):
        self.drafter, self.rank = drafter, rank
        self.values_checked = values_checked
        self.coll = _CountingCollectives(drafter.coll)
        drafter.use_collectives(self.coll)
        self.graphs = None
        if graphs:
            self.graphs = GraphSet(drafter, n_slots, max_batch)
            self.graphs.capture(progress)
            self.slots: list[SlotState] = self.graphs.slots     # the rings live in the graph set's pool
        else:
            self.slots = [drafter.new_slot() for _ in range(n_slots)]
        self.broken: str | None = None
        self.steps = 0
        # Where the last step's time went (stamps.now): entered, entries checked, work done (inserts + draft),
        # finished (answers and the collectives' fail-closed check); with graphs also the graph set's own stamps.
        self.last_stamps: dict[str, int] = {}
        self.failed_steps = 0
        self.last_error = ""
        self.fault_hook = None          # callable(phase: str) -> None, set by the fault injector (off by default)

    # -- slots -----------------------------------------------------------------------------------------------------
    def reset_slots(self, slots: list[int], generation: int | None = None) -> None:
        """Forget the context of these slots (acquire, release, resync)."""
        for s in slots:
            self.slots[s].reset()
            if generation is not None:
                self.slots[s].generation = generation

    def slot_info(self, s: int) -> dict:
        st = self.slots[s]
        return {"position": st.position, "base": st.base, "generation": st.generation}

    # -- the step --------------------------------------------------------------------------------------------------
    def _taps(self, e: StepEntry) -> torch.Tensor:
        c = self.drafter.cfg
        return e.taps if e.taps is not None else torch.zeros(0, c.n_taps * c.hidden_size, dtype=torch.float16)

    def check(self, e: StepEntry) -> str | None:
        d = self.drafter
        if not 0 <= e.slot < len(self.slots):
            return f"slot {e.slot} outside [0, {len(self.slots)})"
        why = d.check_draft(e.seed, e.n_out)
        if why:
            return why
        return d.check_insert(self.slots[e.slot], e.start, e.token_ids, self._taps(e), e.rollback_to,
                              scan_values=not self.values_checked)

    def step(self, entries: list[StepEntry]) -> list[EntryOut]:
        """Run one batch: refuse bad entries alone, apply rollbacks and inserts, draft the rest in one batch."""
        if self.broken:
            raise EngineBroken(f"rank {self.rank} refuses steps: {self.broken}")
        self.steps += 1
        t0 = now()
        self.coll.count = 0
        outs: list[EntryOut | None] = [None] * len(entries)
        seen: set[int] = set()
        good = []
        for i, e in enumerate(entries):
            why = self.check(e)
            if why is None and e.slot in seen:
                why = f"slot {e.slot} appears twice in one batch"
            if why:
                outs[i] = EntryOut(BAD_ENTRY, f"slot {e.slot}: {why}")
            else:
                seen.add(e.slot)
                good.append(i)
        done = False       # every collective of the step has completed
        try:
            self._hook("start")
            t1 = now()
            if good:
                res = self._run(entries, good)
            t2 = now()
            if good:
                for j, i in enumerate(good):
                    e, k = entries[i], entries[i].n_out
                    # the all-confident prefix of the first k of the batch's n_out drafts (the loop never looks
                    # ahead): the batch's prefix, cut at k
                    outs[i] = EntryOut(OK, "", res.drafts[j, :k], res.confidences[j, :k],
                                       res.margins[j, :k] if e.want_margins else None, min(res.confident_len[j], k))
            # a device-side collective failure surfaces here, before any answer leaves (from the control words the
            # draft graph downloaded with its outputs when it has them)
            status = self.graphs.fresh_status() if self.graphs is not None and good else None
            if status is not None:
                self.coll.check_status(status)
            else:
                self.coll.check()
            done = True
            self._hook("end")
            self.last_stamps = {"engine_in": t0, "checked": t1, "ran": t2, "engine_out": now()}
            if self.graphs is not None and good:
                self.last_stamps.update(self.graphs.last_stamps)
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
        return outs  # type: ignore[return-value]

    def rehearse(self, entries: list[StepEntry]) -> None:
        """The host side of `step(entries)` without running it or changing a slot (keep_warm.py): the entry checks,
        and the graph set's staging and output reading. Each entry is taken at its slot's current position (the
        last step's entries, rehearsed, have moved on)."""
        if self.broken or self.graphs is None:
            return
        good: list[StepEntry] = []
        for e in entries:
            if 0 <= e.slot < len(self.slots):
                e = replace(e, start=self.slots[e.slot].position, rollback_to=-1)
                if self.check(e) is None:
                    good.append(e)
        if good and len(good) <= self.graphs.max_requests:
            self.graphs.rehearse(*self._batch_args(good))

    def _run(self, entries: list[StepEntry], good: list[int]):
        """Rollbacks and inserts of the checked entries, then one batched draft. The graph engine takes every
        insert and the draft in back-to-back replays (no host work between them); the eager path inserts entry by
        entry. A batch wider than the graph set drafts eagerly over the same slots."""
        es = [entries[i] for i in good]
        inserts, states, seeds, n_out, margins = self._batch_args(es)
        if self.graphs is None:
            for e in es:
                self.drafter.insert(self.slots[e.slot], e.start, e.token_ids, self._taps(e), e.rollback_to)
            return HostDraft.of(self.drafter.draft(states, seeds, n_out, margins))
        for e in es:
            if e.rollback_to >= 0:
                self.slots[e.slot].rollback(e.rollback_to)
        if len(good) <= self.graphs.max_requests:
            return self.graphs.run(inserts, states, seeds, n_out, margins, host=True)
        self.graphs.run(inserts, [], [], n_out, margins)
        return HostDraft.of(self.drafter.draft(states, seeds, n_out, margins))

    def _batch_args(self, es: list[StepEntry]):
        """A checked batch as the graph set takes it: (inserts (slot, start, taps) of the entries with rows, the
        drafting slots, seeds, the batch's n_out, whether it wants margins)."""
        inserts = [(self.slots[e.slot], e.start, t) for e in es if (t := self._taps(e)).shape[0]]
        return (inserts, [self.slots[e.slot] for e in es], [e.seed for e in es], max(e.n_out for e in es),
                any(e.want_margins for e in es))

    def _hook(self, phase: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(phase)

    def status(self) -> dict:
        st = {"rank": self.rank, "steps": self.steps, "failed_steps": self.failed_steps,
              "broken": self.broken, "last_error": self.last_error, "collectives": self.coll.describe(),
              "time": time.time()}
        if self.graphs:
            st["graphs"] = {"count": self.graphs.n_graphs, "capture_s": round(self.graphs.capture_seconds, 3),
                            "bytes": self.graphs.graph_bytes, "request_buckets": self.graphs.request_buckets}
        return st
