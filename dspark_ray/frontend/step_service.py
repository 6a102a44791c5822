"""The front-end's logic (the `FrontEnd` actor is a shell around it): sessions, the only contract checks (the
ranks run what the ring hands them), and the failure policy of docs/contract.md section 7, over two parts: the
slots (`slot_table.py`) and the turns on the pair (`batcher.py`).
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Protocol

from ..protocol import contract as C
from ..observe.observers import ServiceObserver
from ..protocol.records import RingBatch, RingEntry
from ..observe.stamps import now
from .batcher import Batcher
from .slot_table import SlotTable

log = logging.getLogger("dspark_ray.step_service")


class PairFailure(RuntimeError):
    """A batch did not complete on the pair; `kind` is docs/contract.md's "step", "broken", "hung" or "dead"."""

    def __init__(self, kind: str, reason: str):
        super().__init__(f"{kind}: {reason}")
        self.kind, self.reason = kind, reason


class PairLate(Exception):
    """The batch is still on the pair at `deadline_ns`: `resume()` waits on for it (its results, or a PairFailure)."""

    def __init__(self, resume: Callable[[], list[C.EntryResult]]):
        super().__init__("the batch outlived its deadline")
        self.resume = resume


class Pair(Protocol):
    """One batch in, rank 0's results out; PairFailure, or PairLate past `deadline_ns` (monotonic ns)."""

    def run(self, batch: RingBatch, deadline_ns: int | None = None) -> list[C.EntryResult]: ...


@dataclass
class Identity:
    model_digest: str
    config_digest: str
    tp: int
    max_model_len: int


@dataclass
class _Pending:
    index: int
    entry: C.Entry
    deadline_ns: int
    run: RingEntry                  # what the ranks run, with the placement computed at admission
    done: bool = False              # a plain flag, waited on through the batcher's turn
    result: C.EntryResult | None = None
    seq: int | None = None          # the pair's step (ring seq) it ran in
    taken: bool = False             # in a batch (no longer in the queue)


class StepService(C.StepHandler):
    def __init__(self, identity: Identity, limits: C.Limits, pair: Pair | None, *, window: int,
                 on_failure: Callable[[PairFailure, list[int]], None] | None = None,
                 observer: ServiceObserver | None = None):
        self.identity, self.limits, self.pair = identity, limits, pair
        self.observer = observer or ServiceObserver()
        self.table = SlotTable(limits.slot_capacity, window, limits.max_rows_per_entry)
        self.batcher = Batcher(limits.max_entries_per_replay, self._run_turn, self._expire)
        self.sessions: dict[int, dict] = {}
        self._ids = itertools.count(1)
        self.lock = threading.Lock()                # guards the sessions, the slot table and the stats
        self.worker_generation = 0
        self.unavailable: str | None = None if pair is not None else "starting"
        self.on_failure = on_failure
        # Plain ints that only grow, exported off the step path by metrics.py.
        self.stats = {"steps": 0, "entries": 0, "batches": 0, "ok": 0, "bad_entry": 0, "stale": 0, "internal": 0,
                      "unavailable": 0, "deadline": 0, "overloaded": 0,
                      "batch_sizes": [0] * (limits.max_entries_per_replay + 1)}
        # Arrival-to-reply ns per STEP; metrics.py drains it every second (the bound bites only if nothing drains).
        self.step_ns: collections.deque[int] = collections.deque(maxlen=1 << 16)
        self.last_errors: list[str] = []

    @property
    def slots(self):
        return self.table.slots

    @property
    def queue(self):
        return self.batcher.queue

    @property
    def pending_resets(self) -> set[int]:
        return self.table.pending_resets

    # -- sessions --------------------------------------------------------------------------------------------------
    def open_session(self, peer: str) -> int:
        with self.lock:
            sid = next(self._ids)
            self.sessions[sid] = {"peer": peer, "hello": False}
        return sid

    def hello(self, session: int, msg: C.Hello) -> C.HelloReply:
        idt = self.identity
        why = C.hello_mismatch(msg, model_digest=idt.model_digest, config_digest=idt.config_digest, tp=idt.tp,
                               max_model_len=idt.max_model_len)
        base = dict(model_digest=idt.model_digest, config_digest=idt.config_digest, tp=idt.tp,
                    max_model_len=idt.max_model_len, worker_generation=self.worker_generation, session_id=session)
        if why:
            return C.HelloReply(ok=False, code=C.Code.CONFIG_MISMATCH, reason=why, **base)
        with self.lock:
            self.sessions[session]["hello"] = True
        return C.HelloReply(ok=True, limits=self.limits, **base)

    def _need_hello(self, session: int) -> C.ErrorReply | None:
        s = self.sessions.get(session)
        if s is None or not s["hello"]:
            return C.ErrorReply(code=C.Code.BAD_ENTRY, reason="HELLO first")
        return None

    def acquire(self, session: int, msg: C.Acquire):
        err = self._need_hello(session)
        if err:
            return err
        why = C.validate_acquire(msg, self.limits)
        if why:
            return C.ErrorReply(code=C.Code.BAD_ENTRY, reason=why)
        with self.lock:
            free = self.table.free()
            if msg.n > len(free):
                self.stats["overloaded"] += 1
                return C.ErrorReply(code=C.Code.OVERLOADED,
                                    reason=f"asked for {msg.n} slots, {len(free)} of {len(self.table)} free")
            grants = [C.SlotGrant(slot=i, generation=self.table.grant(i, session)) for i in free[:msg.n]]
        return C.AcquireReply(slots=grants)

    def release(self, session: int, msg: C.Release):
        with self.lock:
            done = []
            for i in msg.slots:
                if 0 <= i < len(self.table) and self.table[i].owner == session:
                    self.table.release(i)
                    done.append(i)
        return C.ReleaseReply(released=done)

    def close_session(self, session: int) -> int:
        """Free the session's slots; returns how many."""
        with self.lock:
            held = self.table.held_by(session)
            for i in held:
                self.table.release(i)
            self.sessions.pop(session, None)
        return len(held)

    def resync_all(self) -> None:
        with self.lock:
            self.table.resync_all()

    # -- STEP ------------------------------------------------------------------------------------------------------
    def step(self, session: int, msg: C.Step, received_ns: int):
        observer = self.observer.step(received_ns)
        err = self._need_hello(session)
        if err:
            self.stats["bad_entry"] += 1
            return err
        why = C.validate_step(msg, self.limits)
        if why:
            self.stats["bad_entry"] += 1
            return C.ErrorReply(code=C.Code.BAD_ENTRY, reason=why)
        self.stats["steps"] += 1
        deadline = received_ns + int(msg.deadline_ms * 1e6)
        results: list[C.EntryResult | None] = [None] * len(msg.entries)
        pend: list[_Pending] = []
        reasons = C.validate_entries(msg, self.limits)
        with self.lock:
            for k, (e, why) in enumerate(zip(msg.entries, reasons)):
                run = self._admit(session, e, why)
                if isinstance(run, C.EntryResult):
                    results[k] = run
                else:
                    self.table[e.slot].busy = True
                    pend.append(_Pending(k, e, deadline, run))
        observer.admitted()
        self.batcher.submit(pend)
        for p in pend:
            self.batcher.wait(p)
            results[p.index] = p.result
        reply = C.StepReply(results=results)  # type: ignore[arg-type]
        observer.replied(pend[0].seq if pend else None)
        self.step_ns.append(now() - received_ns)
        return reply

    def _admit(self, session: int, e: C.Entry, why: str | None) -> C.EntryResult | RingEntry:
        """The stateful checks (caller holds the lock): the entry as the ranks run it, or its answer."""
        if why:
            self.stats["bad_entry"] += 1
            known = 0 <= e.slot < len(self.table)      # every answer for a real slot carries its generation
            return C.error_result(C.Code.BAD_ENTRY, why, self.table[e.slot].cursor.generation if known else 0)
        slot = self.table[e.slot]
        gen = slot.cursor.generation
        if self.unavailable:
            self.stats["unavailable"] += 1
            return C.error_result(C.Code.UNAVAILABLE, f"pair unavailable: {self.unavailable}", gen)
        if slot.owner != session:
            self.stats["bad_entry"] += 1
            return C.error_result(C.Code.BAD_ENTRY, f"slot {e.slot}: not held by this session", gen)
        if e.generation != gen:
            self.stats["stale"] += 1
            return C.error_result(C.Code.STALE_GENERATION,
                                  f"slot {e.slot}: generation {e.generation} is stale, the slot is at {gen}: "
                                  f"re-insert its context", gen)
        if slot.busy:
            self.stats["bad_entry"] += 1
            return C.error_result(C.Code.BAD_ENTRY, f"slot {e.slot}: an earlier entry is still running", gen)
        w = slot.cursor.check_entry(e.start_pos, e.rows, e.rollback_to)
        if w:
            self.stats["bad_entry"] += 1
            return C.error_result(C.Code.BAD_ENTRY, f"slot {e.slot}: {w}", gen)
        placed = slot.cursor.after(e.start_pos, e.rows, e.rollback_to)
        # With rows the seed's position is start_pos + rows, checked statelessly; without, the slot's placement says.
        w = None if e.rows else C.draft_reach(e.slot, placed[1], e.n_out, self.limits.max_model_len)
        if w:
            self.stats["bad_entry"] += 1
            return C.error_result(C.Code.BAD_ENTRY, w, gen)
        return RingEntry.of(e, placed)

    # -- batches (the batcher calls these on its turn) -------------------------------------------------------------
    def _expire(self, p: _Pending) -> None:
        """Past the deadline (the batcher holds its turn): in a batch its slot is resynced, as the ranks may still
        run it."""
        with self.lock:
            if p.done:
                return
            self.stats["deadline"] += 1
            slot = self.table[p.entry.slot]
            if not p.taken:
                self.batcher.dequeue(p)
                reason = "deadline passed before the entry could run"
            else:
                self.table.resync(p.entry.slot)
                reason = "deadline passed while the entry ran on the pair: its slot was resynced"
            slot.busy = False
            p.result = C.error_result(C.Code.DEADLINE, reason, slot.cursor.generation)
            p.done = True

    def _run_turn(self, batch: list[_Pending]) -> bool:
        """Run `batch` on the batcher's turn; True when a reaper now holds the pair (it ends the turn)."""
        try:
            return self._dispatch(batch)
        except Exception as e:          # a bug, not a pair failure (those answer INTERNAL in _run): still answer
            log.exception("batch of %d entries failed in the front-end", len(batch))
            self._answer_internal(batch, f"front-end error: {type(e).__name__}: {e}")
            return False

    def _dispatch(self, batch: list[_Pending]) -> bool:
        """True when the batch was handed to a reaper (it then ends the turn)."""
        t = now()
        live = []
        for p in batch:
            if t > p.deadline_ns:
                self._finish(p, "deadline", C.Code.DEADLINE, "deadline passed before the entry could run")
            elif self.unavailable:
                self._finish(p, "unavailable", C.Code.UNAVAILABLE, f"pair unavailable: {self.unavailable}")
            else:
                live.append(p)
        return self._run(live) if live else False

    def _run(self, live: list[_Pending]) -> bool:
        with self.lock:
            # Under the resync's lock, so a reset gathered here never precedes an expired entry of its slot.
            live = [p for p in live if not p.done and not self._resynced(p)]
            if not live:
                return False
            resets = self.table.take_resets()
        rb = RingBatch(resets, [p.run for p in live])
        self.stats["batches"] += 1
        self.stats["entries"] += len(live)
        self.stats["batch_sizes"][len(live)] += 1
        try:
            self._finish_batch(live, resets, self.pair.run(rb, deadline_ns=min(p.deadline_ns for p in live)))
        except PairLate as late:
            self._hand_off(live, resets, late.resume)
            return True
        except PairFailure as f:
            self._fail_batch(live, resets, f)
        return False

    def _resynced(self, p: _Pending) -> bool:
        """`p`'s slot was resynced since admission, voiding its placement: STALE_GENERATION (caller holds the lock)."""
        slot = self.table[p.entry.slot]
        if p.entry.generation == slot.cursor.generation:
            return False
        self.stats["stale"] += 1
        slot.busy = False
        p.result = C.error_result(C.Code.STALE_GENERATION, f"slot {p.entry.slot}: resynced while the entry waited "
                                  f"(generation {slot.cursor.generation} now): re-insert its context",
                                  slot.cursor.generation)
        p.done = True
        return True

    def _hand_off(self, live: list[_Pending], resets: list[int], resume: Callable[[], list[C.EntryResult]]) -> None:
        """A reaper thread waits on for the late batch and ends the turn; entries past their deadline answer now."""
        log.warning("a batch of %d entries is still on the pair at its deadline: answering DEADLINE, waiting on "
                    "for the ranks (watchdog)", len(live))
        self.batcher.expire_due(live)

        def reap() -> None:
            try:
                try:
                    self._finish_batch(live, resets, resume())
                except PairFailure as f:
                    self._fail_batch(live, resets, f)
            except Exception as e:
                log.exception("the reaper of a late batch failed")
                self._answer_internal(live, f"front-end error: {type(e).__name__}: {e}")
            finally:
                self.batcher.end_turn()
        threading.Thread(target=reap, name="dspark-late-batch", daemon=True).start()

    def _finish_batch(self, live: list[_Pending], resets: list[int], results: list[C.EntryResult]) -> None:
        if len(results) != len(live):       # answers are matched by position: never pair up a short list
            raise PairFailure("broken", f"rank 0 answered {len(results)} entries of a batch of {len(live)}")
        if self.on_failure:
            self.on_failure(None, [])      # a success: the supervisor resets its failure count
        seq = getattr(self.pair, "last_seq", None)
        with self.lock:
            for p, r in zip(live, results):
                if p.done:                 # its waiter answered DEADLINE and resynced the slot
                    continue
                slot = self.table[p.entry.slot]
                gen = slot.cursor.generation
                slot.busy = False
                if self._resynced(p):      # released or resynced while it ran: the reset rides the next batch
                    continue
                self.stats["ok"] += 1
                slot.cursor.place(p.run.base, p.run.position)
                r.generation = gen
                p.result = r
                p.seq = seq
                p.done = True

    def _fail_batch(self, live: list[_Pending], resets: list[int], f: PairFailure) -> None:
        msg = f"batch failed closed ({f.kind}): {f.reason}"
        self.last_errors = (self.last_errors + [msg])[-10:]
        log.warning("%s; its entries still waiting answer INTERNAL, their slots are resynced", msg)
        with self.lock:                      # before any answer wakes a client
            if f.kind != "step":             # a rank's state may differ from its peer's: resync everything
                self.table.resync_all()
            else:
                self.table.owe_resets(resets)        # the failed batch may not have applied its resets
        self._answer_internal(live, msg)
        if self.on_failure:
            self.on_failure(f, [p.entry.slot for p in live])

    def _answer_internal(self, entries: list[_Pending], msg: str) -> None:
        """INTERNAL and a resynced slot (the ranks may have run them), unless already answered DEADLINE."""
        with self.lock:
            for p in entries:
                if p.done:
                    continue
                self.stats["internal"] += 1
                self.table.resync(p.entry.slot)
                self.table[p.entry.slot].busy = False
                p.result = C.error_result(C.Code.INTERNAL, msg, self.table[p.entry.slot].cursor.generation)
                p.done = True

    def _finish(self, p: _Pending, stat: str, code: C.Code, reason: str) -> None:
        """Answer `p` without running it (its slot unchanged)."""
        with self.lock:
            if p.done:
                return
            self.stats[stat] += 1
            slot = self.table[p.entry.slot]
            slot.busy = False
            p.result = C.error_result(code, reason, slot.cursor.generation)
            p.done = True

    def status(self) -> dict:
        with self.lock:
            held = self.table.held()
        return {"worker_generation": self.worker_generation, "unavailable": self.unavailable,
                "slots": {"capacity": len(self.table), "held": held}, "sessions": len(self.sessions),
                "stats": dict(self.stats), "last_errors": list(self.last_errors)}
