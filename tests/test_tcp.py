"""The TCP transport and the client against a fake front-end on 127.0.0.1: a bad connection is closed alone while
the others keep being served, and a closed connection's session is closed. Every wait is bounded."""
from __future__ import annotations

import random
import socket
import threading
import time

import msgspec
import numpy as np
import pytest

from dspark_ray.protocol import contract as C
from dspark_ray.protocol import wire
from dspark_ray.client import ClientError, DrafterClient
from dspark_ray.transport.tcp import TcpServer
from dspark_ray.protocol.wire import bound_blocking_io, spinning_recv_into

LIMITS = C.Limits(vocab_size=4096, hidden_size=256, n_taps=3, slot_capacity=8, sliding_window=8,
                  max_entries_per_step=4, max_frame_bytes=1 << 20)
SERVED = dict(model_digest="model-1", config_digest="config-1", tp=2, max_model_len=1 << 20)
WAIT_S = 5.0


class FakeFrontEnd:
    """The StepHandler seam with slots and generations, drafting seed+1, seed+2, ... (a deterministic stand-in)."""

    def __init__(self, step_delay_s: float = 0.0):
        self.step_delay_s = step_delay_s
        self.lock = threading.Lock()
        self.free = list(range(LIMITS.slot_capacity))
        self.owner: dict[int, int] = {}
        self.sessions = 0
        self.closed: list[int] = []
        self.closed_event = threading.Event()
        self.steps = 0

    def open_session(self, peer):
        with self.lock:
            self.sessions += 1
            return self.sessions

    def hello(self, session, msg):
        reason = C.hello_mismatch(msg, **SERVED)
        if reason:
            return C.HelloReply(ok=False, code=C.Code.CONFIG_MISMATCH, reason=reason, **SERVED)
        return C.HelloReply(ok=True, limits=LIMITS, session_id=session, worker_generation=1, **SERVED)

    def acquire(self, session, msg):
        with self.lock:
            if msg.n > len(self.free):
                return C.ErrorReply(code=C.Code.OVERLOADED, reason=f"{msg.n} slots wanted, {len(self.free)} free")
            got = [self.free.pop(0) for _ in range(msg.n)]
            self.owner.update({s: session for s in got})
        return C.AcquireReply(slots=[C.SlotGrant(slot=s, generation=1) for s in got])

    def release(self, session, msg):
        with self.lock:
            mine = [s for s in msg.slots if self.owner.get(s) == session]
            for s in mine:
                del self.owner[s]
                self.free.append(s)
        return C.ReleaseReply(released=mine)

    def step(self, session, msg, received_ns):
        if msg.entries and msg.entries[0].seed_token == 666:
            raise RuntimeError("front-end bug")
        time.sleep(self.step_delay_s)
        with self.lock:
            self.steps += 1
        results = []
        for e, reason in zip(msg.entries, C.validate_entries(msg, LIMITS)):
            if reason is None and self.owner.get(e.slot) != session:
                reason = f"slot {e.slot}: not held by session {session}"
            if reason:
                results.append(C.error_result(C.Code.BAD_ENTRY, reason))
                continue
            drafts = (e.seed_token + 1 + np.arange(e.n_out)) % LIMITS.vocab_size
            results.append(C.ok_result(generation=e.generation, drafts=drafts, confidences=np.full(e.n_out, 0.75),
                                       margins=np.ones(e.n_out) if e.want_margins else None, confident_len=e.n_out))
        return C.StepReply(results=results)

    def close_session(self, session):
        with self.lock:
            for s in [s for s, o in self.owner.items() if o == session]:
                del self.owner[s]
                self.free.append(s)
            self.closed.append(session)
        self.closed_event.set()


@pytest.fixture
def front():
    return FakeFrontEnd()


@pytest.fixture
def server(front):
    srv = TcpServer(front, "127.0.0.1", 0, max_frame_bytes=LIMITS.max_frame_bytes, stall_timeout_s=0.5).start()
    yield srv
    srv.stop(timeout_s=WAIT_S)


def connect(server, **hello) -> DrafterClient:
    c = DrafterClient("127.0.0.1", server.port, timeout_s=WAIT_S)
    c.hello(client="test", **hello)
    return c


def entry(slot, generation=1, seed=10, rows=6, **kw):
    taps = np.random.default_rng(slot).standard_normal((rows, LIMITS.taps_width)).astype(np.float16)
    return C.make_entry(slot=slot, generation=generation, seed_token=seed, start_pos=0, token_ids=np.arange(rows),
                        taps=taps, **kw)


def assert_served(client, slot):
    """The client still gets correct answers."""
    [r] = client.step([entry(slot, seed=41, n_out=3)], deadline_ms=50)
    assert r.code == C.Code.OK and r.drafts_array().tolist() == [42, 43, 44]


def raw(server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)
    return s


def assert_closed_by_server(sock):
    """The server closed this connection: recv sees end of stream (or a reset) within WAIT_S."""
    try:
        while sock.recv(65536):     # a CONFIG_MISMATCH reply may precede the close
            pass
    except ConnectionResetError:
        pass
    sock.close()


def hello_frame() -> bytes:
    return wire.encode(C.Hello(client="raw"), request_id=1)


# ---- HELLO ---------------------------------------------------------------------------------------------------------
def test_hello_accepted_reports_identity_limits_and_session(server):
    with DrafterClient("127.0.0.1", server.port, timeout_s=WAIT_S) as c:
        reply = c.hello(model_digest="model-1", config_digest="config-1", tp=2, max_model_len=4096)
        assert reply.ok and reply.session_id == 1 and reply.worker_generation == 1
        assert (reply.model_digest, reply.config_digest, reply.tp) == ("model-1", "config-1", 2)
        assert c.limits == LIMITS


def test_hello_refused_names_the_field_and_both_values(server):
    with DrafterClient("127.0.0.1", server.port, timeout_s=WAIT_S) as c:
        with pytest.raises(ClientError, match="CONFIG_MISMATCH: tp: client expects 1, server serves 2") as e:
            c.hello(tp=1)
        assert e.value.code == C.Code.CONFIG_MISMATCH
        c.hello(tp=2)          # the refused session may try again on the same connection


def test_a_frame_of_another_protocol_version_gets_config_mismatch_then_close(server):
    s = raw(server)
    f = bytearray(hello_frame())
    f[4] = C.PROTOCOL_VERSION + 1
    s.sendall(f)
    r = wire.FrameReader(s.recv_into)
    msg = r.read().msg
    assert msg.code == C.Code.CONFIG_MISMATCH and f"protocol version {C.PROTOCOL_VERSION + 1}" in msg.reason
    with pytest.raises(wire.ConnectionClosed):
        r.read()


# ---- the slot lifecycle and STEP over the wire ---------------------------------------------------------------------
def test_acquire_step_release_round_trip(server, front):
    with connect(server) as c:
        grants = c.acquire(2)
        assert [g.slot for g in grants] == [0, 1]
        results = c.step([entry(0, seed=5, n_out=5, want_margins=True), entry(1, seed=9, n_out=2),
                          entry(1, seed=9, n_out=9)], deadline_ms=10)
        assert results[0].drafts_array().tolist() == [6, 7, 8, 9, 10]
        assert results[0].margins_array().tolist() == [1.0] * 5
        assert results[1].drafts_array().tolist() == [10, 11] and results[1].margins_array().size == 0
        assert results[2].code == C.Code.BAD_ENTRY and results[2].reason == "slot 1: n_out 9 outside 1..5"
        with pytest.raises(ClientError, match="OVERLOADED: 7 slots wanted, 6 free") as e:
            c.acquire(7)
        assert e.value.code == C.Code.OVERLOADED
        assert c.release([0, 1]) == [0, 1]
        assert len(front.free) == LIMITS.slot_capacity


def test_client_splits_a_step_beyond_the_entry_limit(server, front):
    with connect(server) as c:
        c.acquire(8)
        results = c.step([entry(s % 8, seed=s) for s in range(10)], deadline_ms=10)   # limit: 4 per STEP
        assert front.steps == 3
        assert [r.drafts_array()[0] for r in results] == [s + 1 for s in range(10)]


def test_a_handler_error_answers_internal_and_keeps_the_connection(server):
    with connect(server) as c:
        c.acquire(1)
        with pytest.raises(ClientError, match="INTERNAL: front-end error on Step") as e:
            c.step([entry(0, seed=666)])
        assert e.value.code == C.Code.INTERNAL
        assert_served(c, 0)


@pytest.mark.parametrize("spin_us", [0.0, 50_000.0])
def test_client_times_out_instead_of_hanging(front, spin_us):
    """Also when both ends poll before they block: the bound still holds (the poll is part of it)."""
    front.step_delay_s = 0.6
    with TcpServer(front, max_frame_bytes=LIMITS.max_frame_bytes, spin_us=spin_us).start() as srv:
        c = DrafterClient("127.0.0.1", srv.port, timeout_s=0.2, spin_us=spin_us)
        c.hello()
        c.acquire(1)
        t0 = time.monotonic()
        with pytest.raises(ClientError, match="no answer within 0.2 s"):
            c.step([entry(0)])
        assert time.monotonic() - t0 < 0.9


def test_a_polling_receive_gets_bytes_sent_while_it_polls_and_after_it_blocked():
    a, b = socket.socketpair()
    try:
        bound_blocking_io(a, 2.0)
        buf = memoryview(bytearray(8))

        def timed_read(spin_us, delay_s, gate=None):
            threading.Timer(delay_s, b.sendall, args=(b"abcd",)).start()
            t0, c0 = time.monotonic(), time.thread_time()
            assert spinning_recv_into(a, spin_us, gate)(buf) == 4 and bytes(buf[:4]) == b"abcd"
            return time.monotonic() - t0, time.thread_time() - c0       # wall, this thread's CPU

        wall, cpu = timed_read(500_000.0, 0.06)          # caught while polling: the thread was on the CPU
        assert 0.05 < wall < 1.0 and cpu > 0.015
        wall, cpu = timed_read(1_000.0, 0.06)            # polled 1 ms, then blocked
        assert 0.05 < wall < 1.0 and cpu < 0.015
        gate = threading.BoundedSemaphore(1)
        gate.acquire()                                   # another thread polls: this read blocks at once
        wall, cpu = timed_read(500_000.0, 0.06, gate)
        assert 0.05 < wall < 1.0 and cpu < 0.015
        gate.release()
        b.close()
        assert spinning_recv_into(a, 1_000.0, gate)(buf) == 0      # end of stream still reads as 0
        assert gate.acquire(blocking=False)                         # the poll gave the gate back
    finally:
        a.close()


def test_a_polling_receive_counts_its_spin_from_the_last_bytes_received_or_its_restart():
    """An idle connection does not spin again each time its read wakes: the spin window starts at the last bytes
    received, or where a frame's read began (serving spins through the trunk's forward between STEPs, then
    sleeps; a client spins for the reply to what it just sent). Whether a read polled or blocked is the receive's
    own count (`blocked`), not CPU time, which a loaded host hands out in slices."""
    window_s = 0.5               # wide, so a timer a loaded host runs late still fires inside it
    a, b = socket.socketpair()
    try:
        bound_blocking_io(a, 5.0)
        buf = memoryview(bytearray(8))
        recv = spinning_recv_into(a, window_s * 1e6)
        b.sendall(b"ab")
        assert recv(buf) == 2                             # bytes at once: the window restarts now
        time.sleep(window_s + 0.1)                        # past the window, idle
        threading.Timer(0.1, b.sendall, args=(b"cd",)).start()
        c0 = time.thread_time()
        assert recv(buf) == 2 and bytes(buf[:2]) == b"cd"
        assert time.thread_time() - c0 < 0.03             # blocked at once, no spin through the window
        blocked = recv.blocked
        threading.Timer(0.06, b.sendall, args=(b"ef",)).start()
        assert recv(buf) == 2 and recv.blocked == blocked  # within the window of "cd": polled for it
        time.sleep(window_s + 0.1)
        recv.restart()                                    # a frame's read begins: a new window
        threading.Timer(0.06, b.sendall, args=(b"gh",)).start()
        assert recv(buf) == 2 and recv.blocked == blocked and not recv.slept
        time.sleep(window_s + 0.1)                        # past the window again
        reader = wire.FrameReader(recv)                   # read() restarts the window itself
        threading.Timer(0.06, b.sendall, args=(wire.encode(C.Hello(client="y"), 8),)).start()
        assert reader.read().request_id == 8 and recv.blocked == blocked and not recv.slept
    finally:
        a.close()
        b.close()


# ---- a bad connection is closed alone ------------------------------------------------------------------------------
def _bad_magic():
    return b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


def _oversized():
    return wire.HEADER.pack(wire.MAGIC, C.PROTOCOL_VERSION, int(C.MsgType.STEP), 0, 0, 2, 1 << 30)


def _truncated():
    return wire.encode(C.Step(entries=[entry(0)], deadline_ms=50.0), 2)[:500]




def _reply_type():
    return wire.encode(C.StepReply(results=[]), 2)


BAD_STREAMS = {"malformed": _bad_magic, "oversized": _oversized, "truncated": _truncated,
               "reply-as-request": _reply_type}


@pytest.mark.parametrize("kind", BAD_STREAMS)
def test_a_bad_frame_closes_only_its_own_connection(server, front, kind):
    good = connect(server)
    good.acquire(1)
    bad = raw(server)
    bad.sendall(hello_frame())
    assert isinstance(wire.FrameReader(bad.recv_into).read().msg, C.HelloReply)
    bad.sendall(BAD_STREAMS[kind]())
    if kind == "truncated":
        bad.shutdown(socket.SHUT_WR)            # the stream ends mid-frame
    assert_closed_by_server(bad)
    assert front.closed_event.wait(WAIT_S) and front.closed == [2]
    assert_served(good, 0)
    good.close()


# ---- a request that does not decode is answered, and nothing else changes (issue 40, item 5) -------------------------
def _raw_payload(mtype: C.MsgType, fields: dict, request_id: int) -> bytes:
    payload = msgspec.msgpack.encode(fields)
    return wire.HEADER.pack(wire.MAGIC, C.PROTOCOL_VERSION, int(mtype), 0, 0, request_id, len(payload)) + payload


def _step_fields(slot: int, **entry) -> dict:
    """A STEP's payload as a map, its one entry changed by `entry` (a None value drops that field)."""
    d = msgspec.msgpack.decode(msgspec.msgpack.encode(C.Step(entries=[entry_of(slot)], deadline_ms=50.0)))
    d["entries"][0].update(entry)
    d["entries"][0] = {k: v for k, v in d["entries"][0].items() if v is not None}
    return d


def entry_of(slot):
    return entry(slot, seed=41, n_out=3)


UNDECODABLE = {
    "no-n_out": (C.MsgType.STEP, lambda: _step_fields(0, n_out=None), "missing required field `n_out`"),
    "no-start_pos": (C.MsgType.STEP, lambda: _step_fields(0, start_pos=None), "missing required field `start_pos`"),
    "unknown-entry-field": (C.MsgType.STEP, lambda: _step_fields(0, temperature=0.5),
                            "unknown field `temperature` - at `$.entries[0]`"),
    "no-type": (C.MsgType.STEP, lambda: {k: v for k, v in _step_fields(0).items() if k != "type"},
                "missing required field `type`"),
    "no-deadline": (C.MsgType.STEP, lambda: {k: v for k, v in _step_fields(0).items() if k != "deadline_ms"},
                    "missing required field `deadline_ms`"),
    "acquire-no-n": (C.MsgType.ACQUIRE, lambda: {"type": int(C.MsgType.ACQUIRE)}, "missing required field `n`"),
    "acquire-unknown-field": (C.MsgType.ACQUIRE, lambda: {"type": int(C.MsgType.ACQUIRE), "n": 1, "pool": "a"},
                              "unknown field `pool`"),
    "not-msgpack": (C.MsgType.STEP, None, "undecodable STEP payload (4 bytes)"),
}


@pytest.mark.parametrize("kind", UNDECODABLE)
def test_a_request_that_does_not_decode_is_answered_bad_entry_and_changes_nothing(server, front, kind):
    """The frame was read whole, so the stream is in step: the request is answered ErrorReply BAD_ENTRY naming the
    field (with its request id), nothing of it runs, and the session, its slots and the other sessions go on."""
    other = connect(server)
    [o] = other.acquire(1)
    s = raw(server)
    s.sendall(hello_frame() + wire.encode(C.Acquire(n=2), 2))
    reader = wire.FrameReader(s.recv_into)
    assert reader.read().msg.ok and [g.slot for g in reader.read().msg.slots] == [1, 2]
    steps = front.steps
    mtype, fields, message = UNDECODABLE[kind]
    frame = (_raw_payload(mtype, fields(), 77) if fields else
             wire.HEADER.pack(wire.MAGIC, C.PROTOCOL_VERSION, int(mtype), 0, 0, 77, 4) + b"\xc1\xc1\xc1\xc1")
    s.sendall(frame)
    got = reader.read()
    assert got.request_id == 77 and isinstance(got.msg, C.ErrorReply), got
    assert got.msg.code == C.Code.BAD_ENTRY and message in got.msg.reason, got.msg.reason
    assert front.steps == steps and sorted(front.owner) == [o.slot, 1, 2]     # nothing ran, no slot moved
    s.sendall(wire.encode(C.Step(entries=[entry_of(1)], deadline_ms=50.0), 78))   # the session goes on
    got = reader.read()
    assert got.request_id == 78 and got.msg.results[0].drafts_array().tolist() == [42, 43, 44]
    assert_served(other, o.slot)
    s.close()
    other.close()


def test_a_request_that_does_not_decode_before_hello_closes_the_connection(server, front):
    """Out of place is judged on the header's type: a STEP before HELLO closes, decodable or not; a HELLO that does
    not decode is answered, and a good HELLO may follow."""
    s = raw(server)
    s.sendall(_raw_payload(C.MsgType.HELLO, {"type": int(C.MsgType.HELLO), "tp_size": 2}, 5))
    reader = wire.FrameReader(s.recv_into)
    got = reader.read()
    assert got.request_id == 5 and got.msg.code == C.Code.BAD_ENTRY and "unknown field `tp_size`" in got.msg.reason
    s.sendall(hello_frame())
    assert reader.read().msg.ok
    s.close()
    bad = raw(server)
    bad.sendall(_raw_payload(C.MsgType.STEP, _step_fields(0, n_out=None), 1))
    assert_closed_by_server(bad)


# ---- the connection rules docs/contract.md states -------------------------------------------------------------------
def test_pipelined_requests_are_answered_one_at_a_time_in_order(server, front):
    """A client may send requests before reading the replies: each is answered once, in order, with its own id."""
    s = raw(server)
    frames = [hello_frame(), wire.encode(C.Acquire(n=2), 2)]
    frames += [wire.encode(C.Step(entries=[entry(k % 2, seed=k, n_out=1)], deadline_ms=50.0), 10 + k)
               for k in range(6)]
    frames.append(wire.encode(C.Release(slots=[0, 1, 5]), 99))
    s.sendall(b"".join(frames))
    reader = wire.FrameReader(s.recv_into)
    got = [reader.read() for _ in frames]
    assert [g.request_id for g in got] == [1, 2] + [10 + k for k in range(6)] + [99]
    assert [g.msg.results[0].drafts_array().tolist() for g in got[2:8]] == [[k + 1] for k in range(6)]
    assert got[-1].msg.released == [0, 1]          # a slot the session does not hold is left out
    s.close()


def test_an_idle_connection_is_kept_with_its_slots(server, front):
    """No timeout between frames: a session idle for longer than the stall timeout (0.5 s here) keeps its slots."""
    c = connect(server)
    [g] = c.acquire(1)
    time.sleep(1.2)
    assert_served(c, g.slot)
    c.close()


# ---- ACQUIRE against the real front-end logic, over TCP (issue 40, item 4) -----------------------------------------
@pytest.mark.parametrize("n", [-1, 0, LIMITS.slot_capacity + 1, 1 << 63, (1 << 64) - 1])
def test_an_acquire_that_can_never_be_granted_is_a_bad_request(n):
    """n < 1 or n > slot_capacity can never succeed: BAD_ENTRY naming n and the rule, not OVERLOADED (which says:
    try again later), and no slot is granted. Also at the ends of what a msgpack int holds (2**63, 2**64-1)."""
    from dspark_ray.frontend.step_service import Identity, StepService
    svc = StepService(Identity(**SERVED), LIMITS, None, window=LIMITS.sliding_window)
    with TcpServer(svc, max_frame_bytes=LIMITS.max_frame_bytes).start() as srv:
        with connect(srv) as c:
            with pytest.raises(ClientError, match=f"BAD_ENTRY: acquire: n {n} ") as e:
                c.acquire(n)
            assert e.value.code == C.Code.BAD_ENTRY
            assert svc.status()["slots"]["held"] == 0
            held = c.acquire(3)
            with pytest.raises(ClientError, match="OVERLOADED: asked for 6 slots, 5 of 8 free") as e:
                c.acquire(6)             # within the capacity, but not free now: OVERLOADED
            assert e.value.code == C.Code.OVERLOADED and svc.status()["slots"]["held"] == 3
            assert len(c.acquire(5)) == 5 and len(held) == 3


def _mutated_session(rng, k: int) -> list[bytes]:
    """A session's frames (HELLO, ACQUIRE, STEP, RELEASE) with one of them damaged at random: bytes overwritten,
    cut short, bytes slipped in, or its header naming another message type."""
    frames = [hello_frame(), wire.encode(C.Acquire(n=1 + k % 3), 2),
              wire.encode(C.Step(entries=[entry(k % LIMITS.slot_capacity, rows=k % 4)], deadline_ms=50.0), 3),
              wire.encode(C.Release(slots=[k % LIMITS.slot_capacity]), 4)]
    i = rng.randrange(len(frames))
    b = bytearray(frames[i])
    how = k % 4
    if how == 0:
        for _ in range(rng.randint(1, 6)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif how == 1:
        del b[rng.randrange(len(b)):]
    elif how == 2:
        at = rng.randrange(wire.HEADER_SIZE, len(b) + 1)
        b[at:at] = rng.randbytes(rng.randint(1, 8))
    else:
        b[6] = rng.randrange(16)            # the message type field
    frames[i] = bytes(b)
    return frames


def test_randomly_damaged_sessions_close_alone_and_leak_no_slot(server, front, caplog):
    """120 sessions, each with one frame damaged at random: each ends with its connection closed by the server (or
    answered, when the damage left a valid frame), no handler or server error is logged, every session's slots come
    back, and a healthy client is served throughout."""
    rng = random.Random(7)
    good = connect(server)
    [held] = good.acquire(1)
    n = 120
    for k in range(n):
        s = raw(server)
        try:
            for f in _mutated_session(rng, k):
                s.sendall(f)
            s.shutdown(socket.SHUT_WR)
        except OSError:         # the server closed it already (a bad frame early in the session)
            pass
        assert_closed_by_server(s)
        if k % 20 == 0:
            assert_served(good, held.slot)
    deadline = time.monotonic() + WAIT_S
    while (conn_threads() > 1 or len(front.closed) < front.sessions - 1) and time.monotonic() < deadline:
        time.sleep(0.01)
    # every damaged connection was closed; each that opened a session (a damaged HELLO opens none) closed it
    assert conn_threads() == 1 and sorted(front.closed) == list(range(2, front.sessions + 1))
    assert sorted(front.free + [held.slot]) == list(range(LIMITS.slot_capacity))    # and gave its slots back
    assert not [r for r in caplog.records if r.levelname == "ERROR" or "handler failed" in r.getMessage()]
    assert_served(good, held.slot)
    good.close()


def test_a_step_before_hello_closes_the_connection_and_the_front_end_never_hears_of_it(server, front):
    good = connect(server)
    good.acquire(1)
    bad = raw(server)
    bad.sendall(wire.encode(C.Step(entries=[entry(0)], deadline_ms=50.0), 1))
    assert_closed_by_server(bad)
    deadline = time.monotonic() + WAIT_S
    while server.counts["bad_frames"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert front.sessions == 1 and front.closed == []         # no session was opened for the stranger
    assert_served(good, 0)
    good.close()


def test_a_peer_stalling_mid_frame_is_closed_after_the_stall_timeout(server, front):
    good = connect(server)
    good.acquire(1)
    bad = raw(server)
    bad.sendall(hello_frame()[:10])       # and then nothing, with the connection left open
    t0 = time.monotonic()
    assert_closed_by_server(bad)
    assert 0.3 < time.monotonic() - t0 < WAIT_S      # the server's stall_timeout_s is 0.5
    assert_served(good, 0)
    good.close()


def test_closing_a_connection_closes_its_session_and_frees_its_slots(server, front):
    c = connect(server)
    c.acquire(5)
    assert len(front.free) == 3
    c.close()
    assert front.closed_event.wait(WAIT_S) and front.closed == [1]
    assert len(front.free) == LIMITS.slot_capacity
    with connect(server) as again:
        assert len(again.acquire(8)) == 8


# ---- concurrency and shutdown --------------------------------------------------------------------------------------
def each_client_gets_its_own_answers(make_client) -> None:
    """4 clients (make_client(k)) step at once, 50 STEPs each: every answer is its own."""
    errors: list[BaseException] = []

    def run(k):
        try:
            with make_client(k) as c:
                [g] = c.acquire(1)
                for i in range(50):
                    seed = (k * 1000 + i) % LIMITS.vocab_size
                    [r] = c.step([entry(g.slot, seed=seed, n_out=1 + i % 5)], deadline_ms=50)
                    assert r.drafts_array().tolist() == [seed + 1 + j for j in range(1 + i % 5)]
        except BaseException as e:       # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 2)
    assert not any(t.is_alive() for t in threads) and errors == []


def test_concurrent_clients_each_get_their_own_answers(server):
    each_client_gets_its_own_answers(lambda k: connect(server))


def test_stop_closes_connections_and_clients_see_a_clear_error(front):
    srv = TcpServer(front, max_frame_bytes=LIMITS.max_frame_bytes).start()
    c = connect(srv)
    t0 = time.monotonic()
    srv.stop(timeout_s=WAIT_S)
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(ClientError, match="connection lost"):
        c.acquire(1)
    with pytest.raises(ClientError, match="cannot connect"):
        DrafterClient("127.0.0.1", srv.port, timeout_s=1.0)


def test_a_server_on_every_interface_names_an_address_clients_can_use(front):
    """host 0.0.0.0 is no address to connect to: the endpoint names the advertised one (the front-end's node IP)."""
    srv = TcpServer(front, host="0.0.0.0", advertise="127.0.0.1").start()
    try:
        assert srv.endpoint == f"127.0.0.1:{srv.port}"
        host, port = srv.endpoint.rsplit(":", 1)
        with DrafterClient(host, int(port), timeout_s=WAIT_S) as c:
            assert c.hello().ok
    finally:
        srv.stop()
    srv = TcpServer(front, host="127.0.0.1", advertise="10.9.9.9")      # a concrete host is named as it is
    assert srv.endpoint == f"127.0.0.1:{srv.port}"
    srv.stop()


# ---- bounds per client and the session's log lines (issue 51, item 3) ----------------------------------------------
def conn_threads() -> int:
    return sum(t.name.startswith("tcp-conn:") for t in threading.enumerate())


def test_a_connection_over_the_limit_is_refused_with_a_clear_frame_and_costs_no_thread(front):
    """At `max_connections` open connections the next one is answered ErrorReply OVERLOADED naming the limit (the
    client raises it, code None: the connection is gone) and closed by the accept thread; the others keep being
    served, and once one closes a new connection is served again."""
    srv = TcpServer(front, max_frame_bytes=LIMITS.max_frame_bytes, max_connections=2).start()
    try:
        a, b = connect(srv), connect(srv)
        a.acquire(1)
        threads = conn_threads()
        for _ in range(3):
            with pytest.raises(ClientError, match="closed the connection: OVERLOADED: .*limit of 2 connections "
                                                  r"\(serve --max-connections\)") as e:
                connect(srv)
            assert e.value.code is None
        assert conn_threads() == threads and srv.counts["connections_refused"] == 3
        assert_served(a, 0)
        b.close()
        deadline = time.monotonic() + WAIT_S
        while conn_threads() >= threads:          # b's thread has ended: its place is free
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with connect(srv) as c:
            assert c.acquire(1)
        a.close()
    finally:
        srv.stop(timeout_s=WAIT_S)


def test_an_idle_session_is_closed_with_its_slots_freed_and_told_why(front):
    """No request for `idle_timeout_s`: the session is closed, its slots freed; the client's next request raises
    the server's reason. A session that keeps stepping is not idle."""
    srv = TcpServer(front, max_frame_bytes=LIMITS.max_frame_bytes, stall_timeout_s=0.2, idle_timeout_s=1.0).start()
    try:
        busy, idle = connect(srv), connect(srv)
        [g] = busy.acquire(1)
        idle.acquire(3)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.6:            # busy steps every 0.3 s: never idle for 1 s
            assert_served(busy, g.slot)
            time.sleep(0.3)
        assert front.closed == [2] and len(front.free) == LIMITS.slot_capacity - 1
        assert srv.counts["idle_sessions_closed"] == 1
        with pytest.raises(ClientError, match=r"UNAVAILABLE: session 2 closed: no request for 1 s \(serve "
                                              r"--idle-timeout\)"):
            idle.acquire(1)
        assert_served(busy, g.slot)
        busy.close()
    finally:
        srv.stop(timeout_s=WAIT_S)


def test_a_session_logs_one_line_when_it_opens_and_one_with_its_counts_when_it_closes(server, front, caplog):
    """Two lines a session, whatever it sends: the open, and the close with why and its counts (requests, STEPs,
    entries, those refused whole, slots freed); none per frame, refused or not."""
    import logging
    with caplog.at_level(logging.INFO):
        c = connect(server)
        c.acquire(2)
        for k in range(5):
            assert c.step([entry(0, seed=k), entry(1, seed=k)], deadline_ms=50)[0].code == C.Code.OK
        with pytest.raises(ClientError, match="OVERLOADED"):
            c.acquire(99)
        c.close()
        assert front.closed_event.wait(WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while not any("closed" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    lines = [r.getMessage() for r in caplog.records if "session 1" in r.getMessage()]
    assert len(lines) == 2, lines
    assert lines[0].startswith("session 1 open: 127.0.0.1:")
    assert lines[1].startswith("session 1 closed (closed by peer): 127.0.0.1:") and \
        "client 'test' over tcp" in lines[1] and \
        "8 requests (5 STEPs, 10 entries, 1 refused whole)" in lines[1], lines[1]
    assert len(caplog.records) == 2, [r.getMessage() for r in caplog.records]


# ---- refusal floods and the idle timer (issue 64, item 5) -----------------------------------------------------------
def wait_until(cond, what: str, bound_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + bound_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {bound_s:g} s: {what}"
        time.sleep(0.01)


def summary_lines(caplog, what: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(what)]


def test_a_refusal_flood_is_logged_as_its_count_once_per_window(caplog):
    """3,000 refusals from 4 threads in one window: one line, counting all 3,000; then 2 in the next window: one
    more line counting 2; closing with nothing pending adds none, closing with one pending logs it at once."""
    import logging
    from dspark_ray.transport.tcp import _Summary
    flood = _Summary("refused at the connection limit:", window_s=0.5)
    with caplog.at_level(logging.WARNING, logger="dspark_ray.transport.tcp"):
        workers = [threading.Thread(target=lambda k=k: [flood.note(f"from peer {k}") for _ in range(750)])
                   for k in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(WAIT_S)
        wait_until(lambda: summary_lines(caplog, "refused at"), "the first window's line")
        flood.note("from peer 5")
        flood.note("from peer 6")
        wait_until(lambda: len(summary_lines(caplog, "refused at")) == 2, "the second window's line")
        flood.close()
        flood.note("from peer 7")
        flood.close()
    lines = summary_lines(caplog, "refused at")
    assert len(lines) == 3 and len(caplog.records) == 3, lines
    assert lines[0].startswith("refused at the connection limit: 3000 connection(s) within 0.5 s (the last from "
                               "peer "), lines[0]
    assert lines[1] == "refused at the connection limit: 2 connection(s) within 0.5 s (the last from peer 6)"
    assert lines[2] == "refused at the connection limit: 1 connection(s) within 0.5 s (the last from peer 7)"


def test_four_connections_refused_at_the_limit_are_one_line_counting_four(front, caplog):
    """Each is answered OVERLOADED and closed; the log has one line for the four, none per connection."""
    import logging
    srv = TcpServer(front, max_frame_bytes=LIMITS.max_frame_bytes, max_connections=1, refusal_log_s=0.5).start()
    try:
        with caplog.at_level(logging.WARNING, logger="dspark_ray.transport.tcp"):
            holder = connect(srv)
            for _ in range(4):
                with pytest.raises(ClientError, match="OVERLOADED"):
                    connect(srv)
            wait_until(lambda: summary_lines(caplog, "refused at"), "the window's line")
            holder.close()
    finally:
        srv.stop(timeout_s=WAIT_S)
    assert srv.counts["connections_refused"] == 4
    lines = summary_lines(caplog, "refused at")
    assert len(lines) == 1 and lines[0].startswith("refused at the connection limit: 4 connection(s) within 0.5 s"), \
        [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("idle_s", [1.5, 7.0])
def test_the_idle_timeout_closes_a_session_within_a_second_of_its_value(front, idle_s):
    """An idle bound that is not a multiple of the 5 s stall tick (7 s: the tick would close at 10 s) closes the
    session between its value and a second later, measured from the session's last request."""
    srv = TcpServer(front, max_frame_bytes=LIMITS.max_frame_bytes, stall_timeout_s=5.0, idle_timeout_s=idle_s).start()
    try:
        c = connect(srv)
        c.acquire(1)
        t0 = time.monotonic()
        wait_until(lambda: front.closed == [1], "the idle session closed", idle_s + 5)
        took = time.monotonic() - t0
        assert idle_s <= took <= idle_s + 1.0, took
        with pytest.raises(ClientError, match=rf"UNAVAILABLE: session 1 closed: no request for {idle_s:g} s"):
            c.acquire(1)
        c.close()
    finally:
        srv.stop(timeout_s=WAIT_S)
