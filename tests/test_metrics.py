"""The front-end's metrics exporter (`metrics.Exporter`) without Ray: a `StepService` in front of an in-process pair,
STEPs from several threads while the exporter runs, and fake metric classes that record every call (and refuse a
non-positive Counter.inc as Ray's do). tests/test_deploy.py scrapes the real thing from Ray's Prometheus endpoint."""
from __future__ import annotations

import collections
import threading
import time
import types

import pytest

from dspark_ray.protocol import contract as C
from dspark_ray.protocol.records import RingBatch
from dspark_ray.frontend.step_service import Identity, PairFailure, StepService
from dspark_ray.observe.metrics import ANSWER_CODES, Exporter
from dspark_ray.observe.wake_ups import WakeUps


class _Metric:
    def __init__(self, name, description="", boundaries=None, tag_keys=()):
        self.name, self.tag_keys, self.default = name, tag_keys, {}
        self.calls: list[tuple[float, dict]] = []

    def set_default_tags(self, tags):
        self.default = dict(tags)

    def _record(self, value, tags):
        tags = {**self.default, **(tags or {})}
        assert set(tags) == set(self.tag_keys), (self.name, tags)
        self.calls.append((value, tags))


class _Counter(_Metric):
    def inc(self, value=1.0, tags=None):
        if value <= 0:
            raise ValueError(f"{self.name}: value must be >0, got {value}")
        self._record(value, tags)

    def total(self, **tags):
        return sum(v for v, t in self.calls if tags.items() <= t.items())


class _Gauge(_Metric):
    def set(self, value, tags=None):
        self._record(value, tags)

    @property
    def value(self):
        return self.calls[-1][0]


class _Histogram(_Metric):
    def observe(self, value, tags=None):
        self._record(value, tags)


FAKE = types.SimpleNamespace(Counter=_Counter, Gauge=_Gauge, Histogram=_Histogram)


class _Pair:
    """Answers OK after `delay_s`, or fails the step (`fail`: a PairFailure, so the entries answer INTERNAL)."""

    def __init__(self, delay_s=0.0):
        self.delay_s, self.fail = delay_s, False

    def run(self, batch: RingBatch, deadline_ns=None) -> list[C.EntryResult]:
        time.sleep(self.delay_s)
        if self.fail:
            raise PairFailure("step", "planted")
        return [C.EntryResult(drafts=b"\0" * 4 * e.n_out, confidences=b"\0" * 4 * e.n_out) for e in batch.entries]


class _Sup:
    def __init__(self):
        self.restart_seconds: list[float] = []


class _Server:
    def __init__(self):
        self.counts = {"connections": 0, "bad_frames": 0, "connections_refused": 0, "idle_sessions_closed": 0,
                       "unauthorized": 0}
        self.wake_ups = WakeUps("test", 0.0)


@pytest.fixture
def deployed():
    pair = _Pair(delay_s=0.0005)
    limits = C.Limits(vocab_size=100, hidden_size=4, n_taps=1, slot_capacity=8, sliding_window=8)
    svc = StepService(Identity("m", "c", 1, 1 << 20), limits, pair, window=8)
    sup, server = _Sup(), _Server()
    exp = Exporter("p0", svc, sup, server, interval_s=0.005, metrics=FAKE)
    yield svc, pair, sup, server, exp
    exp.stop()


def _session(svc, n):
    sid = svc.open_session("test")
    assert svc.hello(sid, C.Hello()).ok
    return sid, [g.slot for g in svc.acquire(sid, C.Acquire(n=n)).slots]


def _entry(svc, slot, **over):
    kw = dict(slot=slot, generation=svc.slots[slot].cursor.generation, seed_token=1, n_out=2)
    kw.update(over)
    return C.make_entry(**kw)


def test_exported_counts_equal_the_answers_given_and_every_step_is_observed_once(deployed):
    """STEPs from four threads while the exporter runs every 5 ms: after its last export each counter grew by exactly
    what the step path counted, `dspark_answers_total` by exactly the answers the callers got (every code), and the
    latency histogram holds one observation per STEP, none lost or counted twice between exports."""
    svc, pair, sup, server, exp = deployed
    exp.start()
    got = collections.Counter()
    lock = threading.Lock()
    steps = [0]

    def step(sid, entries, received_ns=None):
        r = svc.step(sid, C.Step(entries=entries, deadline_ms=10_000.0), received_ns or time.monotonic_ns())
        with lock:
            steps[0] += 1
            for res in getattr(r, "results", None) or [r]:
                got[res.code] += 1
        return r

    def client(k):
        sid, (a, b) = _session(svc, 2)
        for _ in range(40):
            step(sid, [_entry(svc, a), _entry(svc, b)])
        step(sid, [_entry(svc, a), _entry(svc, b, seed_token=1000)])                  # a bad entry beside an ok
        step(sid, [_entry(svc, a, generation=svc.slots[a].cursor.generation + 1)])     # stale
        svc.close_session(sid)

    ts = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    sid, (c,) = _session(svc, 1)
    assert isinstance(svc.acquire(sid, C.Acquire(n=8)), C.ErrorReply)                # overloaded
    got[C.Code.OVERLOADED] += 1
    step(sid, [_entry(svc, c)], received_ns=time.monotonic_ns() - 20 * 10 ** 9)       # deadline
    pair.fail = True
    step(sid, [_entry(svc, c)])                                                       # internal
    pair.fail = False
    svc.unavailable = "restarting (test)"
    step(sid, [_entry(svc, c)])                                                       # unavailable
    exp.stop()                                    # one last export of everything counted
    names = {"ok": C.Code.OK, "bad_entry": C.Code.BAD_ENTRY, "stale": C.Code.STALE_GENERATION,
             "internal": C.Code.INTERNAL, "unavailable": C.Code.UNAVAILABLE, "deadline": C.Code.DEADLINE,
             "overloaded": C.Code.OVERLOADED}
    assert set(names) == set(ANSWER_CODES)
    assert {k: exp.answers.total(code=k) for k in names} == {k: got[c] for k, c in names.items()}
    assert all(got[c] > 0 for c in names.values()), got
    assert exp.counters["steps"].total() == svc.stats["steps"] == steps[0]
    for k in ("entries", "batches"):
        assert exp.counters[k].total() == svc.stats[k] > 0, k
    assert svc.stats["batches"] < svc.stats["entries"]            # the threads' entries were batched together
    assert len(exp.step_seconds.calls) == steps[0] and not svc.step_ns
    assert all(0 < v < 60 for v, _ in exp.step_seconds.calls)
    assert exp.exports > 2, "the exporter ran only at the end: nothing tested the exports in between"
    assert all(t["pair"] == "p0" for m in (exp.answers, exp.step_seconds) for _, t in m.calls)


def test_levels_follow_the_service_and_restarts_are_counted_once(deployed):
    svc, pair, sup, server, exp = deployed
    g = exp.gauges
    exp.export()
    assert (g["slots_held"].value, g["sessions"].value, g["unavailable"].value) == (0, 0, 0)
    _session(svc, 3)
    svc.unavailable, svc.worker_generation = "restarting (test)", 4
    sup.restart_seconds += [2.5, 7.0]
    server.counts["bad_frames"] += 1
    server.counts["unauthorized"] += 2
    exp.export()
    exp.export()                                  # nothing new: no counter moves, no duration is observed again
    assert (g["slots_held"].value, g["sessions"].value, g["unavailable"].value) == (3, 1, 1)
    assert g["worker_generation"].value == 4 and g["queue_depth"].value == 0
    assert exp.counters["restarts"].total() == 2
    assert [v for v, _ in exp.restart_seconds.calls] == [2.5, 7.0]
    assert exp.counters["bad_frames"].total() == 1 and exp.counters["connections"].calls == []
    assert exp.counters["unauthorized"].total() == 2
    svc.unavailable = None
    sup.restart_seconds.append(1.5)
    exp.export()
    assert g["unavailable"].value == 0 and exp.counters["restarts"].total() == 3
    assert [v for v, _ in exp.restart_seconds.calls] == [2.5, 7.0, 1.5]


def test_a_failing_export_is_logged_and_the_exports_go_on(deployed, caplog):
    svc, pair, sup, server, exp = deployed
    sup.restart_seconds = None                    # planted: the restart read raises
    exp.interval_s = 0.002
    exp.start()
    time.sleep(0.1)
    sup.restart_seconds = [3.0]
    deadline = time.monotonic() + 10
    while exp.counters["restarts"].total() < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    exp.stop()
    assert exp.counters["restarts"].total() == 1
    failures = [r for r in caplog.records if "metrics export failed" in r.getMessage()]
    assert len(failures) == 1, "one line, not one per failed export"
