"""The front-end's batching on the STEP threads (`frontend.StepService`), without Ray: a pair here is an in-process
object that answers every entry OK and records who ran each batch, so the tests see the scheduling itself. The
deployed pair (Ray actors, the ring, real ranks) runs the same service in tests/test_deploy.py."""
from __future__ import annotations

import threading
import time

import pytest

from dspark_ray.protocol import contract as C
from dspark_ray.protocol.records import RingBatch
from dspark_ray.frontend.step_service import Identity, PairLate, StepService

WINDOW = 8


class _Pair:
    """Answers OK; records (thread id, slots) per batch; `gate` (when set) holds a batch until released;
    `fail` raises a plain exception (a front-end bug, not a pair failure)."""

    def __init__(self):
        self.batches: list[tuple[int, list[int]]] = []
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        self.fail = False
        self.short = False          # answer one entry fewer than the batch holds
        self.resets: list[list[int]] = []
        self.honour_deadline = False    # as RingDriver: PairLate at the deadline, resume() waits for the gate

    def run(self, batch: RingBatch, deadline_ns=None) -> list[C.EntryResult]:
        self.batches.append((threading.get_ident(), [e.slot for e in batch.entries]))
        self.resets.append(list(batch.resets))
        self.entered.set()
        if self.gate is not None:
            if self.honour_deadline and deadline_ns is not None:
                if not self.gate.wait(max(0.0, (deadline_ns - time.monotonic_ns()) / 1e9)):
                    raise PairLate(lambda: self._finish(batch))
            assert self.gate.wait(10)
        return self._finish(batch)

    def _finish(self, batch: RingBatch) -> list[C.EntryResult]:
        assert self.gate is None or self.gate.wait(10)
        if self.fail:
            raise ValueError("boom")
        res = [C.EntryResult(drafts=b"\0" * 4 * e.n_out, confidences=b"\0" * 4 * e.n_out) for e in batch.entries]
        return res[:-1] if self.short else res


@pytest.fixture
def service():
    pair = _Pair()
    limits = C.Limits(vocab_size=100, hidden_size=4, n_taps=1, slot_capacity=8, sliding_window=WINDOW)
    svc = StepService(Identity("m", "c", 1, 1 << 20), limits, pair, window=WINDOW)
    sid = svc.open_session("test")
    assert svc.hello(sid, C.Hello()).ok
    slots = [g.slot for g in svc.acquire(sid, C.Acquire(n=8)).slots]
    yield svc, pair, sid, slots


def _step(svc, sid, slot, deadline_ms=10_000.0):
    e = C.make_entry(slot=slot, generation=svc.slots[slot].cursor.generation, seed_token=1, n_out=2)
    return svc.step(sid, C.Step(entries=[e], deadline_ms=deadline_ms), time.monotonic_ns()).results[0]


def test_an_idle_pair_runs_the_step_on_its_own_thread(service):
    svc, pair, sid, slots = service
    assert _step(svc, sid, slots[0]).code == C.Code.OK
    assert pair.batches == [(threading.get_ident(), [slots[0]])]


def test_steps_that_arrive_while_a_batch_runs_are_merged_into_the_next(service):
    svc, pair, sid, slots = service
    pair.gate = threading.Event()
    out: dict[int, C.EntryResult] = {}
    first = threading.Thread(target=lambda: out.__setitem__(0, _step(svc, sid, slots[0])))
    first.start()
    assert pair.entered.wait(10)
    later = [threading.Thread(target=lambda s=s: out.__setitem__(s, _step(svc, sid, slots[s]))) for s in (1, 2, 3)]
    for t in later:
        t.start()
    while len(svc.queue) < 3:           # all three queued behind the running batch
        time.sleep(0.001)
    pair.gate.set()
    for t in [first] + later:
        t.join(10)
    assert {k: r.code for k, r in out.items()} == {0: C.Code.OK, 1: C.Code.OK, 2: C.Code.OK, 3: C.Code.OK}
    assert [sorted(b[1]) for b in pair.batches] == [[slots[0]], sorted(slots[1:4])]


def test_an_entry_queued_past_its_deadline_answers_deadline_and_never_runs(service):
    svc, pair, sid, slots = service
    pair.gate = threading.Event()
    first = threading.Thread(target=lambda: _step(svc, sid, slots[0]))
    first.start()
    assert pair.entered.wait(10)
    late: list[C.EntryResult] = []
    t = threading.Thread(target=lambda: late.append(_step(svc, sid, slots[1], deadline_ms=5.0)))
    t.start()
    time.sleep(0.05)                    # past its 5 ms budget while the first batch still runs
    pair.gate.set()
    first.join(10)
    t.join(10)
    assert late[0].code == C.Code.DEADLINE
    assert all(slots[1] not in b[1] for b in pair.batches)
    assert svc.slots[slots[1]].cursor.position == 0 and not svc.slots[slots[1]].busy


def test_a_batch_stuck_on_the_pair_answers_deadline_on_time_and_resyncs_its_slot(service):
    """A pair that does not finish: the STEP running on it answers DEADLINE at its deadline (its slot resynced: the
    ranks may still apply it), a STEP queued behind it answers DEADLINE at its own (slot unchanged, never run),
    and once the pair finishes, the next batch resets the resynced slot before anything else runs on it."""
    svc, pair, sid, slots = service
    pair.gate, pair.honour_deadline = threading.Event(), True
    a, b = slots[0], slots[1]
    gen_a, gen_b = (svc.slots[s].cursor.generation for s in (a, b))
    out: dict[str, tuple[C.EntryResult, float]] = {}

    def timed(key, slot):
        t0 = time.monotonic()
        r = _step(svc, sid, slot, deadline_ms=100.0)
        out[key] = (r, (time.monotonic() - t0) * 1e3)

    ta = threading.Thread(target=timed, args=("a", a))
    ta.start()
    assert pair.entered.wait(10)
    tb = threading.Thread(target=timed, args=("b", b))
    tb.start()
    ta.join(5)
    tb.join(5)
    (ra, ms_a), (rb, ms_b) = out["a"], out["b"]
    assert ra.code == C.Code.DEADLINE and "resynced" in ra.reason and ra.generation == gen_a + 1, ra
    assert rb.code == C.Code.DEADLINE and "before the entry could run" in rb.reason and rb.generation == gen_b, rb
    assert ms_a < 150 and ms_b < 150, (ms_a, ms_b)
    assert svc.batcher.running and all(b not in slots_ for _, slots_ in pair.batches)     # the pair is still held
    assert _step(svc, sid, b, deadline_ms=50.0).code == C.Code.DEADLINE            # ... and refuses nothing else
    pair.gate.set()
    t0 = time.monotonic()
    while svc.batcher.running and time.monotonic() - t0 < 5:
        time.sleep(0.001)
    assert _step(svc, sid, a).code == C.Code.OK               # the new generation, a fresh first insert
    assert a in pair.resets[-1] and pair.batches[-1][1] == [a]     # its reset rides the batch after the late one
    assert svc.slots[b].cursor.position == 0 and not svc.slots[b].busy


def test_a_front_end_bug_in_a_batch_answers_internal_and_the_next_step_runs(service):
    svc, pair, sid, slots = service
    pair.fail = True
    gen = svc.slots[slots[0]].cursor.generation
    r = _step(svc, sid, slots[0])
    assert r.code == C.Code.INTERNAL and "ValueError: boom" in r.reason
    assert r.generation == gen + 1 and slots[0] in svc.pending_resets     # resynced: the ranks may have run it
    pair.fail = False
    assert _step(svc, sid, slots[0]).code == C.Code.OK        # not left busy, not left running


def test_a_short_answer_from_the_pair_fails_the_batch_closed_instead_of_hanging(service):
    """Answers are matched to entries by position: a pair answering fewer entries than it was given fails the
    whole batch (INTERNAL, slots resynced), and the STEP returns."""
    svc, pair, sid, slots = service
    pair.short = True
    gen = svc.slots[slots[0]].cursor.generation
    entries = [C.make_entry(slot=s, generation=svc.slots[s].cursor.generation, seed_token=1, n_out=2)
               for s in slots[:2]]
    done = []
    step = C.Step(entries=entries, deadline_ms=10_000.0)
    t = threading.Thread(target=lambda: done.append(svc.step(sid, step, time.monotonic_ns())))
    t.start()
    t.join(10)
    assert done, "the STEP hung"
    assert [r.code for r in done[0].results] == [C.Code.INTERNAL, C.Code.INTERNAL]
    assert svc.slots[slots[0]].cursor.generation > gen
