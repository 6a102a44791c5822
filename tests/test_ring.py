"""The shared-memory step ring between real, unrelated processes (multiprocessing "spawn", as Ray actors are)."""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import time

import pytest

from dspark_ray.transport.ring import RingClosed, RingError, RingTimeout, StepRing

CTX = mp.get_context("spawn")
T = 5.0                                       # bound for waits that should succeed; failures take far less


def _digest(b) -> bytes:
    return hashlib.sha256(b).digest()[:16]


def reader_proc(handle, idx, q, n, complete=True, delay_s=0.0, timeout_s=T):
    """Attach as reader `idx`, take `n` messages (each: seq and digest), complete each with status 0x10 + idx and
    the payload's digest; report ("ok", got) or the exception that stopped it, with the time it blocked."""
    r = StepRing.attach(handle, idx)
    got = []
    t0 = time.monotonic()
    try:
        for _ in range(n):
            t0 = time.monotonic()
            seq, view = r.next(timeout_s)
            got.append((seq, _digest(view)))
            del view
            if delay_s:
                time.sleep(delay_s)
            if complete:
                r.complete(seq, 0x10 + idx, _digest(got[-1][1]) + bytes([idx]))
        q.put((idx, "ok", got, time.monotonic() - t0))
    except Exception as e:                    # reported to the test, which asserts on it
        q.put((idx, type(e).__name__, str(e), time.monotonic() - t0))
    finally:
        r.close()


def _start(handle, idx, q, n, **kw):
    p = CTX.Process(target=reader_proc, args=(handle, idx, q, n), kwargs=kw, daemon=True)
    p.start()
    return p


def _results(q, k, timeout=10.0):
    return dict((r[0], r[1:]) for r in (q.get(timeout=timeout) for _ in range(k)))


def _names(ring_name):
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(ring_name))


@pytest.fixture
def ring():
    made = []

    def make(**kw):
        kw.setdefault("n_readers", 2)
        w = StepRing.create("dsr-test", **kw)
        made.append(w)
        return w

    yield make
    for w in made:
        w.unlink()


def test_messages_arrive_in_order_at_both_readers_and_completions_carry_status_and_payload(ring):
    w = ring(slot_bytes=256, n_slots=2, completion_bytes=64)
    q = CTX.Queue()
    procs = [_start(w.handle, i, q, 20) for i in range(2)]
    msgs = [os.urandom(1 + 12 * k) for k in range(20)]
    for k, m in enumerate(msgs):
        seq = w.publish(m, timeout_s=T)
        assert seq == k + 1
        comps = w.wait_completions(seq, timeout_s=T)
        assert comps == [(0x10 + i, _digest(_digest(m)) + bytes([i])) for i in range(2)]
    res = _results(q, 2)
    for i in range(2):
        assert res[i][0] == "ok"
        assert res[i][1] == [(k + 1, _digest(m)) for k, m in enumerate(msgs)]
    for p in procs:
        p.join(T)


def test_payload_larger_than_a_slot_spills_and_the_spill_is_freed_once_acked(ring):
    w = ring(slot_bytes=4096, n_slots=2)
    name = w.handle.name
    q = CTX.Queue()
    procs = [_start(w.handle, i, q, 2) for i in range(2)]
    big = os.urandom(3 << 20)
    seq = w.publish(big, timeout_s=T)
    assert f"{name}-x{seq}" in _names(name)                 # the spill segment exists while unacked
    assert w.wait_completions(seq, T) == [(0x10 + i, _digest(_digest(big)) + bytes([i])) for i in range(2)]
    assert _names(name) == [name]                           # freed after both acked
    small = b"after the spill"
    assert w.wait_completions(w.publish(small, timeout_s=T), T)[0][1][:16] == _digest(_digest(small))
    res = _results(q, 2)
    assert [d for _, d in res[0][1]] == [_digest(big), _digest(small)] == [d for _, d in res[1][1]]
    for p in procs:
        p.join(T)


def test_writer_blocks_while_a_reader_lags_and_times_out_naming_a_dead_reader(ring):
    w = ring(slot_bytes=64, n_slots=2)
    q = CTX.Queue()
    fast = _start(w.handle, 0, q, 6)
    slow = _start(w.handle, 1, q, 6, complete=False, delay_s=0.05)
    t0 = time.monotonic()
    for k in range(6):
        w.publish(b"m%d" % k, timeout_s=T)
    # 6 messages through 2 slots: the writer had to wait for the slow reader's acks (50 ms per message).
    assert time.monotonic() - t0 >= 3 * 0.05
    res = _results(q, 2)
    assert [s for s, _ in res[1][1]] == [1, 2, 3, 4, 5, 6] == [s for s, _ in res[0][1]]
    slow.join(T)
    fast.join(T)
    # Both readers are gone. Reader 0 completed (acked) all 6; reader 1 acks a message only when it takes the
    # next one, so its ack stopped at 5.
    w.publish(b"m6", timeout_s=T)                           # reuses the slot of seq 5: acked by both
    t0 = time.monotonic()
    with pytest.raises(RingTimeout) as e:
        w.publish(b"m7", timeout_s=0.3)                     # reuses the slot of seq 6: reader 1 never acked it
    assert 0.3 <= time.monotonic() - t0 < 2.0
    msg = str(e.value)
    assert "space: publishing seq 8 needs every reader's ack >= 6" in msg
    assert "reader 1 (ack 5, not attached)" in msg and "reader 0" not in msg


def test_writer_timeout_says_the_reader_process_is_not_running_when_it_was_killed(ring):
    w = ring(slot_bytes=64, n_slots=1, n_readers=1)
    q = CTX.Queue()
    p = _start(w.handle, 0, q, 100, timeout_s=30.0)
    w.wait_completions(w.publish(b"one", timeout_s=T), T)
    p.kill()                                                # no close(): its pid word stays
    p.join(T)
    w.publish(b"two", timeout_s=T)                          # the slot was acked by the complete() above
    with pytest.raises(RingTimeout, match=rf"reader 0 \(ack 1, pid {p.pid} is not running\)"):
        w.publish(b"three", timeout_s=0.2)


def test_reader_that_never_completes_makes_wait_completions_time_out_naming_it(ring):
    w = ring(slot_bytes=64, n_slots=4)
    q = CTX.Queue()
    procs = [_start(w.handle, 0, q, 1), _start(w.handle, 1, q, 1, complete=False)]
    seq = w.publish(b"step", timeout_s=T)
    _results(q, 2)
    t0 = time.monotonic()
    with pytest.raises(RingTimeout) as e:
        w.wait_completions(seq, timeout_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 2.0
    msg = str(e.value)
    assert f"completions of seq {seq}" in msg and "reader 1" in msg and "last completed seq 0" in msg
    assert "reader 0" not in msg                            # reader 0 did complete
    for p in procs:
        p.join(T)


def test_close_wakes_a_reader_blocked_in_its_sleep(ring):
    w = ring(slot_bytes=64, nap_s=5.0)                      # a long nap: only the doorbell can wake it in time
    q = CTX.Queue()
    procs = [_start(w.handle, i, q, 1, timeout_s=30.0) for i in range(2)]
    deadline = time.monotonic() + T
    while not all(w._w[k] for k in w._sleep_words):        # both asleep on their FIFOs (their sleeping flags)
        assert time.monotonic() < deadline, "readers never went to sleep"
        time.sleep(0.01)
    time.sleep(0.05)
    w.close()
    res = _results(q, 2)
    for i in range(2):
        kind, msg, blocked_s = res[i]
        assert kind == "RingClosed" and "closed by the writer" in msg
        assert blocked_s < 2.0                              # woken by the bell, not by the 5 s nap or 30 s bound
    for p in procs:
        p.join(T)


def test_no_shared_memory_or_doorbell_is_left_after_close(ring):
    w = ring(slot_bytes=1024, n_slots=2)
    name, bells = w.handle.name, w.handle.bell_dir
    q = CTX.Queue()
    procs = [_start(w.handle, i, q, 3, complete=(i == 0)) for i in range(2)]
    for m in (os.urandom(10), os.urandom(5000), os.urandom(7000)):   # two spills, the second never completed
        w.publish(m, timeout_s=T)
    _results(q, 2)
    for p in procs:
        p.join(T)
    assert len(_names(name)) >= 2                           # the ring and at least one live spill
    w.unlink()
    assert _names(name) == []
    assert not os.path.exists(bells)
    with pytest.raises(RingClosed):
        w.publish(b"late")


def test_restarted_reader_reattaches_after_reset_and_starts_at_the_next_message(ring):
    w = ring(slot_bytes=64, n_slots=2)
    q = CTX.Queue()
    r0 = _start(w.handle, 0, q, 5)
    r1 = _start(w.handle, 1, q, 100, timeout_s=30.0)
    for k in range(2):
        w.wait_completions(w.publish(b"old%d" % k, timeout_s=T), T)
    r1.kill()                                               # the rank died; the pair is recreated
    r1.join(T)
    w.publish(b"unseen", timeout_s=T)                       # published before the reset: the new reader skips it
    with pytest.raises(RingError, match=r"reset_reader\(1\)"):
        StepRing.attach(w.handle, 1)                        # reattaching without a reset is refused
    w.reset_reader(1)
    r1b = _start(w.handle, 1, q, 2)
    seqs = [w.publish(b"new%d" % k, timeout_s=T) for k in range(2)]
    assert w.wait_completions(seqs[-1], T)[1][0] == 0x11
    res = _results(q, 2)
    assert [s for s, _ in res[1][1]] == seqs == [4, 5]
    assert [s for s, _ in res[0][1]] == [1, 2, 3, 4, 5]
    for p in (r0, r1b):
        p.join(T)


def test_misuse_is_refused_naming_the_rule(ring):
    w = ring(n_readers=1, slot_bytes=64, completion_bytes=8)
    r = StepRing.attach(w.handle, 0)
    try:
        with pytest.raises(RingError, match="already attached by live pid"):
            StepRing.attach(w.handle, 0)
        with pytest.raises(RingError, match=r"reader index 1 not in \[0, 1\)"):
            StepRing.attach(w.handle, 1)
        with pytest.raises(RingError, match="none yet"):
            r.complete(1)
        seq = w.publish(b"abc")
        assert bytes(r.next(T)[1]) == b"abc"
        with pytest.raises(RingError, match="status 4294967296 is not a uint32"):
            r.complete(seq, 1 << 32)
        with pytest.raises(RingError, match="completion payload of 9 bytes > completion_bytes 8"):
            r.complete(seq, 0, b"123456789")
        with pytest.raises(RingError, match="complete\\(seq 2\\) but the message in hand is seq 1"):
            r.complete(2)
        r.complete(seq, 7, b"12345678")
        assert w.wait_completions(seq, T) == [(7, b"12345678")]
        with pytest.raises(RingTimeout, match=r"message seq 2 \(writer published up to 1\)"):
            r.next(0.05)
    finally:
        r.close()


# ---- leftovers (issue 51, item 1) ----------------------------------------------------------------------------------
def writer_dies_holding(q) -> None:
    """Create a ring, publish a message too large for a slot (its spill segment lives until the readers ack it),
    report the names, and die without unlinking anything (as kill -9 would)."""
    w = StepRing.create("dspark-orphan-test", n_readers=1, slot_bytes=256)
    w.publish(os.urandom(4096), timeout_s=T)
    q.put((w.handle.name, w.handle.bell_dir))
    q.close()
    q.join_thread()
    os._exit(0)


def test_a_ring_whose_owner_died_is_removed_and_a_live_owners_ring_is_kept(ring):
    """remove_orphans finds a dead writer's segment, spill and doorbells by the ring's name and removes them all; a
    ring whose owner runs is left alone. A name of the same pattern made without the writer's lock (an older
    version's ring) is judged by its pid: removed once that pid belongs to a process started after the name was made
    (the pid was reused), kept while it is under a minute old (its writer may not have locked it yet)."""
    from dspark_ray.transport.ring import remove_orphans
    q = CTX.Queue()
    p = CTX.Process(target=writer_dies_holding, args=(q,))
    p.start()
    name, bells = q.get(timeout=30)
    p.join(30)
    assert _names(name) == [name, f"{name}-x1"] and os.path.isdir(bells)
    live = StepRing.create("dspark-live-test", n_readers=1)
    reused = f"/dev/shm/dspark-reused-{os.getpid()}-0badf00d"     # our pid, but made before we started
    open(reused, "wb").close()
    os.utime(reused, (time.time() - 10 * 86400,) * 2)
    young = f"/dev/shm/dspark-young-{p.pid}-0badf00d"             # a dead pid, but made just now
    open(young, "wb").close()
    try:
        gone = remove_orphans()
        assert name in gone and f"dspark-reused-{os.getpid()}-0badf00d" in gone
        assert live.handle.name not in gone and f"dspark-young-{p.pid}-0badf00d" not in gone
        assert _names(name) == [] and not os.path.exists(bells) and not os.path.exists(reused)
        assert _names(live.handle.name) == [live.handle.name] and os.path.isdir(live.handle.bell_dir)
    finally:
        live.unlink()
        for path in (reused, young):
            if os.path.exists(path):
                os.unlink(path)


# A ring's writer in a child process, its name carrying a pid that means nothing to this process: the child's own in
# another PID namespace, or (argv[1] non-zero) a pid faked to one of a process that has exited. It dies when its
# stdin closes, removing nothing, as a kill -9 of its process group would (its resource tracker, which would unlink
# the segment after it, is told to leave it).
OWNER = """
import contextlib, os, sys
from multiprocessing import resource_tracker
from unittest import mock
from dspark_ray.transport.ring import StepRing
fake = int(sys.argv[1])
with mock.patch("os.getpid", lambda: fake) if fake else contextlib.nullcontext():
    w = StepRing.create("dspark-owner-test", n_readers=1, slot_bytes=256)
resource_tracker.unregister("/" + w.handle.name, "shared_memory")
print(w.handle.name, w.handle.bell_dir, flush=True)
sys.stdin.read()
os._exit(0)
"""


def pid_namespace_prefix() -> list[str] | None:
    """The command prefix that runs a command in a PID namespace of its own, or None where this host allows none."""
    import shutil
    import subprocess
    if shutil.which("unshare") is None:
        return None
    cmd = ["unshare", "--pid", "--fork"] if os.geteuid() == 0 else \
        ["unshare", "--user", "--map-root-user", "--pid", "--fork"]
    return cmd if subprocess.run(cmd + ["true"], capture_output=True).returncode == 0 else None


@pytest.mark.parametrize("where", ["another PID namespace", "a pid that names no process here"])
def test_a_live_owners_ring_survives_remove_orphans_whatever_its_pid_says(where):
    """The writer holds its ring's lock while it runs, in any PID namespace: remove_orphans leaves the ring of a live
    owner whose pid means nothing here (tests/test_readme.py serves in a namespace of its own; a ring there once
    vanished to a sweep outside), and removes the same ring once the owner died."""
    import subprocess
    import sys
    import re
    from dspark_ray.transport.ring import remove_orphans, remove_rings
    if where == "another PID namespace":
        prefix, fake = pid_namespace_prefix(), 0
        if prefix is None:
            pytest.skip("no PID namespace of its own here (unshare)")
    else:
        exited = subprocess.Popen([sys.executable, "-c", ""])
        exited.wait()
        prefix, fake = [], exited.pid
    owner = subprocess.Popen(prefix + [sys.executable, "-c", OWNER, str(fake)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(__file__)),
                             env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__))))
    try:
        name, bells = owner.stdout.readline().split()
        pid = int(name.rsplit("-", 2)[1])
        assert pid != owner.pid and (fake == 0 or pid == fake)       # its name's pid is not its pid here
        assert remove_orphans(f"dspark-owner-test-{pid}-") == []
        # a deployment's teardown whose cluster is gone takes its name's rings so too (cli.cluster_gone)
        gone, held = remove_rings(re.compile("dspark-owner-test"))
        assert name in held and name not in gone
        assert _names(name) == [name] and os.path.isdir(bells)
    finally:
        owner.stdin.close()
        owner.wait(30)
    if where == "another PID namespace":
        assert remove_orphans(f"dspark-owner-test-{pid}-") == [name]
    else:
        assert name in remove_rings(re.compile("dspark-owner-test"))[0]
    assert _names(name) == [] and not os.path.exists(bells)
