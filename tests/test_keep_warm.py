"""Keeping the step path's host code warm between steps (keep_warm.py): the rehearsals run when a waiter polls, at
most once a period, never fail a step, and never change an answer or a slot."""
from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import torch

from dspark_ray.testing import workload
from dspark_ray.testing.batches import Driver
from dspark_ray.transport.ring import RingTimeout, StepRing
from dspark_ray.rank.engine import RankEngine
from dspark_ray.observe.keep_warm import KeepWarm, launch_rehearsal_period_us, rehearse_engine
from dspark_ray.rank.modes import make_drafter
from dspark_ray.protocol.records import RingBatch, RingEntry
from dspark_ray.protocol.wire import spinning_recv_into
from dspark_ray import settings
from dspark_ray.protocol import wire

from test_graph_set import N_SLOTS, _same_rings, _same_step


def test_pieces_run_at_most_once_a_period_and_a_failing_one_is_dropped_alone(caplog):
    kw = KeepWarm("test", every_us=50_000, enabled=True)
    calls = []
    kw()                                              # nothing set: nothing to do
    kw.set("a", lambda: calls.append("a"))
    kw.set("bad", lambda: 1 / 0)
    kw()
    kw()                                              # within the period: no second run
    assert calls == ["a"] and kw.runs == 1
    assert "bad" not in kw.pieces and kw.dropped["bad"].startswith("ZeroDivisionError")
    assert "keep-warm piece 'bad' dropped" in caplog.text
    kw.set("bad", lambda: None)                      # a dropped piece stays dropped
    assert "bad" not in kw.pieces
    time.sleep(0.06)
    kw.set("a", lambda: calls.append("a2"))          # the newest piece of a name replaces the last
    kw()
    assert calls == ["a", "a2"]
    kw.ran()                                          # the real path just ran: the next rehearsal waits a period
    kw()
    assert calls == ["a", "a2"]


def test_after_a_real_step_the_first_rehearsal_waits_the_hold():
    """A STEP back to back comes 100-200 us after a party's last step: a rehearsal that starts then only delays it."""
    kw = KeepWarm("test", every_us=0, enabled=True, hold_us=40_000)
    calls = []
    kw.set("a", lambda: calls.append("a"))
    kw()
    assert calls == ["a"]                             # no step yet: every poll (period 0)
    kw.ran()
    kw()
    time.sleep(0.01)
    kw()
    assert calls == ["a"]                             # within the hold
    time.sleep(0.04)
    kw()
    kw()
    assert calls == ["a", "a", "a"]                   # past it: every poll again
    assert kw.status()["hold_us"] == 40_000


def test_a_piece_with_a_period_of_its_own_runs_at_most_that_often():
    kw = KeepWarm("test", every_us=0, enabled=True)
    calls = []
    kw.set("often", lambda: calls.append("often"))
    kw.set("rare", lambda: calls.append("rare"), every_us=50_000)
    kw()
    kw()
    assert calls == ["often", "rare", "often"]
    time.sleep(0.06)
    kw()
    assert calls[3:] == ["often", "rare"]
    kw.set("rare", lambda: calls.append("rare2"))    # set again without a period: every run
    kw()
    assert calls[5:] == ["often", "rare2"]


def test_a_rehearsal_stops_between_pieces_once_the_wait_is_over_and_resumes_there():
    kw = KeepWarm("test", every_us=0, enabled=True)
    calls = []
    for name in "abc":
        kw.set(name, lambda name=name: calls.append(name))
    arrived = iter([False, True])                    # the awaited message comes while "a" runs
    kw(lambda: next(arrived))
    assert calls == ["a"] and kw.runs == 0
    kw(lambda: False)                                # the next wait starts at "b": "a" cannot starve the rest
    assert calls == ["a", "b", "c", "a"] and kw.runs == 1
    kw(lambda: True)                                 # nothing runs once the wait is over
    assert calls == ["a", "b", "c", "a"]


def test_a_party_samples_its_inputs_once_per_size_and_at_most_every_so_often():
    """A sample is a copy of a step's inputs on the step's path: the first step's, then a new size's, but never
    twice within `every_s` (a serving engine's batches change size every step)."""
    kw = KeepWarm("test", enabled=True)
    assert kw.wants_sample("batch", 100, every_s=0.05)
    assert not kw.wants_sample("batch", 100, every_s=0.05)        # the same size: the sample stands
    assert not kw.wants_sample("batch", 200, every_s=0.05)        # a new size, too soon
    assert kw.wants_sample("frame", 200, every_s=0.05)            # each source on its own
    time.sleep(0.06)
    assert not kw.wants_sample("batch", 100, every_s=0.05)
    assert kw.wants_sample("batch", 300, every_s=0.05)
    assert not KeepWarm("off", enabled=False).wants_sample("batch", 1)


def test_keep_warm_off_takes_no_pieces(monkeypatch):
    monkeypatch.setenv("DSPARK_KEEP_WARM", "0")
    settings.reread()
    kw = KeepWarm("off")
    kw.set("a", lambda: pytest.fail("rehearsed while off"))
    kw()
    assert not kw.enabled and not kw.pieces and kw.status()["runs"] == 0


def test_a_gpu_ranks_launch_rehearsal_runs_every_millisecond_unless_turned_off(monkeypatch):
    monkeypatch.delenv("DSPARK_KEEP_WARM_LAUNCH_US", raising=False)
    settings.reread()
    assert launch_rehearsal_period_us() == 1000.0
    monkeypatch.setenv("DSPARK_KEEP_WARM_LAUNCH_US", "2500")
    settings.reread()
    assert launch_rehearsal_period_us() == 2500.0
    monkeypatch.setenv("DSPARK_KEEP_WARM_LAUNCH_US", "0")
    settings.reread()
    assert launch_rehearsal_period_us() is None


def test_a_rehearsing_graph_engine_answers_and_writes_the_bits_of_one_that_does_not(cfg, ckpt):
    """Before every step, the engine rehearses the step before it (whose entries have moved on) and the one to
    come: the answers and every slot's ring are those of an engine that never rehearses, bit for bit. The
    rehearsal does stage into the pinned buffer, and does not while an upload may read it."""
    plain = Driver(RankEngine(make_drafter(cfg, "tp1", ckpt=ckpt), N_SLOTS, graphs=True))
    warm = Driver(RankEngine(make_drafter(cfg, "tp1", ckpt=ckpt), N_SLOTS, graphs=True))
    staged = warm.graphs.inp.host_np
    last = RingBatch([], [])
    n_staged = 0
    for batch in workload.rounds(cfg, n_requests=3, n_rounds=10, far_start=900_000):
        unplaced = RingBatch([], [RingEntry.of(e, (-1, 0)) for e in batch])     # (a rehearsal reads no placement)
        for rehearsed in (last, unplaced):
            before = staged.copy()
            rehearse_engine(warm, rehearsed)
            n_staged += not np.array_equal(before, staged)
        _same_step(plain, warm, batch)
        last = unplaced
    _same_rings(plain, warm)
    assert n_staged >= 10
    warm.graphs.inp.in_use = True                    # as while a GPU upload is in flight
    before = staged.copy()
    rehearse_engine(warm, last)
    assert np.array_equal(before, staged)
    warm.graphs.inp.in_use = False


def test_the_ring_and_socket_waiters_run_their_idle_hook_while_they_spin():
    calls = []
    w = StepRing.create("dsr-warm", n_readers=1, spin_us=20_000)
    try:
        r = StepRing.attach(w.handle, 0)
        with pytest.raises(RingTimeout):
            r.next(timeout_s=0.01, idle=lambda ready: calls.append(("ring", ready())))
        r.close()
    finally:
        w.unlink()
    assert len(calls) > 1 and set(calls) == {("ring", False)}      # its readiness check comes along
    calls.clear()
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(None)
        recv = spinning_recv_into(a, 200_000.0, idle=lambda ready: calls.append(("socket", ready())))
        late = threading.Timer(0.01, lambda: b.sendall(b"abcd"))      # arrives while the receive polls
        late.start()
        buf = bytearray(4)
        assert recv(memoryview(buf)) == 4 and bytes(buf) == b"abcd"
        late.join()
    assert calls.count(("socket", False)) > 1


def test_the_socket_waiters_readiness_check_sees_a_frame_that_came_during_a_rehearsal():
    """A STEP that arrives while the connection thread rehearses stops the rehearsal at the next piece."""
    a, b = socket.socketpair()
    ran = []
    kw = KeepWarm("t", every_us=0, enabled=True)
    kw.set("first", lambda: (ran.append("first"), b.sendall(b"abcd")))     # the frame comes during this piece
    kw.set("second", lambda: ran.append("second"))
    with a, b:
        a.settimeout(None)
        recv = spinning_recv_into(a, 200_000.0, idle=kw)
        buf = bytearray(4)
        assert recv(memoryview(buf)) == 4 and bytes(buf) == b"abcd"
    assert ran == ["first"]                     # the second piece waits for the next wait
    assert kw._start == 1                       # ... and runs first then


def test_the_gpu_wait_polls_its_event_and_runs_the_hook_with_the_events_own_check():
    """`StepInputs.synchronize(idle)` (the rank's wait for the draft): polls the event, runs `idle(event.query)`
    until it has completed, then synchronizes; a CPU stand-in for the CUDA event."""
    from dspark_ray.rank.graphs.inputs import StepInputs

    class Event:
        def __init__(self):
            self.polls, self.synced = 0, False

        def query(self):
            self.polls += 1
            return self.polls > 3

        def synchronize(self):
            self.synced = True
    inp = StepInputs(1, 4, 8, 1, 16, torch.device("cpu"))
    inp.uploaded, inp.in_use = Event(), True
    seen = []
    inp.synchronize(lambda ready: seen.append(ready.__self__ is inp.uploaded))
    assert seen == [True] * 3 and inp.uploaded.synced and not inp.in_use



def test_waits_that_outlast_their_spin_are_counted_and_a_mostly_asleep_party_says_so_once(caplog):
    """The ring's and the socket's waits count the ones that slept; `WakeUps` reports the STEPs that found a party
    asleep and logs one hint when most of a window did (wake_ups.py)."""
    import logging

    from dspark_ray.observe.wake_ups import WINDOW, WakeUps
    w = StepRing.create("dsr-wake", n_readers=1, spin_us=20_000)
    try:
        r = StepRing.attach(w.handle, 0)
        w.publish(b"x")
        r.next(timeout_s=1.0)                                  # there already: no sleep
        threading.Timer(0.05, w.publish, args=(b"y",)).start()
        r.next(timeout_s=1.0, spin_us=1_000)                   # came after the 1 ms spin: slept
        threading.Timer(0.01, w.publish, args=(b"z",)).start()
        r.next(timeout_s=1.0, spin_us=200_000)                 # came within the spin
        assert r.sleeps == 1
        r.close()
    finally:
        w.unlink()
    a, b = socket.socketpair()
    with a, b:
        recv = spinning_recv_into(a, 1_000.0)
        threading.Timer(0.05, b.sendall, args=(b"ab",)).start()
        assert recv(memoryview(bytearray(2))) == 2 and recv.blocked == 1
        b.sendall(b"cd")
        assert recv(memoryview(bytearray(2))) == 2 and recv.blocked == 1
        time.sleep(0.005)                                      # the spin has run out ...
        b.sendall(b"ef")
        assert recv(memoryview(bytearray(2))) == 2 and recv.blocked == 1    # ... but the bytes were there
    wu = WakeUps("rank 9", 2_000.0)
    with caplog.at_level(logging.INFO, logger="dspark_ray.wake_ups"):
        for k in range(3 * WINDOW):
            wu.add(k % 4 != 0)                                 # 75 % asleep
    assert wu.status() == {"steps": 3 * WINDOW, "after_sleep": 3 * WINDOW * 3 // 4, "spin_ms": 2.0}
    hints = [m for m in caplog.messages if "found it asleep" in m]
    assert len(hints) == 1 and hints[0].startswith("rank 9: 75% of the last 100 STEPs found it asleep")


def test_a_wide_batch_is_rehearsed_by_its_first_entries(cfg, monkeypatch):
    """Every entry runs the same code, so the rank and the STEP server rehearse a wide batch's first
    REHEARSAL_ENTRIES entries: a piece's cost stays bounded (a STEP arriving during it waits for it)."""
    from dspark_ray.protocol import contract as C
    from dspark_ray.protocol import records as M
    from dspark_ray.observe import keep_warm
    from dspark_ray.observe.keep_warm import REHEARSAL_ENTRIES
    from dspark_ray.observe.recorders import RankRecorder, ServerRecorder
    from dspark_ray.protocol.wire import FrameReader
    n = 9
    taps = workload.make_taps(cfg, 2, torch.Generator().manual_seed(1)).numpy()
    seen = []

    class Engine:
        graphs = None
    monkeypatch.setattr(keep_warm, "rehearse_engine",
                        lambda engine, batch: seen.append(("rank", [e.slot for e in batch.entries])))
    rank = RankRecorder(0, 0.0, KeepWarm("rank", every_us=0, enabled=True))
    rank.serving(Engine())
    batch = M.RingBatch([3], [M.RingEntry.of(C.make_entry(slot=s, generation=1, seed_token=5, token_ids=[1, 2],
                                                          taps=taps), (0, 2)) for s in range(n)])
    out = C.ok_result(generation=0, drafts=np.arange(5), confidences=np.full(5, 0.5), confident_len=2)
    wire_batch = M.encode(batch)
    rank.got(1, 0)
    rank.answered(M.decode_batch(wire_batch), [out] * n, len(wire_batch))     # as the step loop decoded it
    rank.completed()
    rank.idle()
    assert seen == [("rank", list(range(REHEARSAL_ENTRIES)))]
    assert set(rank.idle.pieces) == {"decode", "engine", "reply"} and not rank.idle.dropped

    step = C.Step(entries=[C.make_entry(slot=s, generation=1, seed_token=5, token_ids=[1, 2], taps=taps)
                           for s in range(n)], deadline_ms=50.0)
    a, b = socket.socketpair()
    with a, b:
        b.sendall(wire.encode(step, 7))
        recv = spinning_recv_into(a, 1_000.0)
        reader = FrameReader(recv)
        server = ServerRecorder("server", 1_000.0, KeepWarm("server", every_us=0, enabled=True),
                                checks=lambda step: seen.append(("server", [e.slot for e in step.entries])))
        session = server.session(recv, reader)
        _, msg, received_ns = reader.read()
        session.read(received_ns)
        session.answered(msg, C.StepReply(results=[C.EntryResult(generation=1) for _ in range(n)]))
    server.idle()
    assert seen[-1] == ("server", list(range(REHEARSAL_ENTRIES))) and not server.idle.dropped
    assert [r["recv"] for r in server.stamps.recent()] == [received_ns]
    assert server.wake_ups.status()["steps"] == 1
