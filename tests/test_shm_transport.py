"""STEP over same-host shared memory (transport/shm.py) against the fake front-end of test_tcp.py: after HELLO
the client's requests go through its ring, with the answers TCP gives; a closed client ends its session; a bad
frame in a ring ends that session alone; a ring the server cannot attach is refused and the session goes on over
TCP. Every wait is bounded."""
from __future__ import annotations

import os
import tempfile

import pytest

from dspark_ray.protocol import contract as C
from dspark_ray.protocol import wire
from dspark_ray.transport.ring import StepRing
from dspark_ray.client import ClientError, DrafterClient
from dspark_ray.transport.shm import STATUS_BAD_FRAME

from test_tcp import (LIMITS, WAIT_S, assert_served, connect, each_client_gets_its_own_answers, entry,  # noqa: F401
                      front, server)


def shm_client(server, **kw) -> DrafterClient:
    c = DrafterClient("127.0.0.1", server.port, timeout_s=WAIT_S, shm=True, **kw)
    c.hello(client="test shm")
    assert c._ring is not None
    return c


def test_requests_through_the_ring_get_the_answers_tcp_gets(server, front):
    with shm_client(server) as c, connect(server) as t:
        grants = c.acquire(2)
        [tg] = t.acquire(1)
        batch = [entry(grants[0].slot, seed=5, n_out=5, want_margins=True), entry(grants[1].slot, seed=9, n_out=2),
                 entry(grants[1].slot, seed=9, n_out=9)]
        got = c.step(batch, deadline_ms=50)
        want = t.step([entry(tg.slot, seed=5, n_out=5, want_margins=True)], deadline_ms=50)
        assert got[0].drafts_array().tolist() == want[0].drafts_array().tolist() == [6, 7, 8, 9, 10]
        assert got[0].margins_array().tolist() == [1.0] * 5
        assert got[1].drafts_array().tolist() == [10, 11]
        assert got[2].code == C.Code.BAD_ENTRY and got[2].reason == f"slot {grants[1].slot}: n_out 9 outside 1..5"
        big = [entry(s.slot, seed=3, rows=128) for s in grants]          # 128-row inserts
        assert [r.drafts_array()[0] for r in c.step(big, deadline_ms=50)] == [4, 4]
        with pytest.raises(ClientError, match="OVERLOADED") as e:
            c.acquire(7)
        assert e.value.code == C.Code.OVERLOADED
        assert c.release([g.slot for g in grants]) == [g.slot for g in grants]
        assert front.steps == 3


def test_closing_a_shm_client_ends_its_session_and_removes_its_ring(server, front):
    c = shm_client(server)
    c.acquire(5)
    name, bells = c._ring.handle.name, c._ring.handle.bell_dir
    c.close()
    assert front.closed_event.wait(WAIT_S) and front.closed == [1]
    assert len(front.free) == LIMITS.slot_capacity
    assert not os.path.exists(f"/dev/shm/{name}") and not os.path.exists(bells)


def test_a_bad_frame_in_a_ring_ends_that_session_alone(server, front):
    good = shm_client(server)
    good.acquire(1)
    bad = shm_client(server)
    bad.acquire(1)
    seq = bad._ring.publish(b"\x00" * 40, WAIT_S)           # not a frame
    ((status, payload),) = bad._ring.wait_completions(seq, WAIT_S)
    assert status == STATUS_BAD_FRAME and payload == b""
    assert front.closed_event.wait(WAIT_S) and front.closed == [2]
    with pytest.raises(ClientError):
        bad.step([entry(1)], deadline_ms=50)
    bad.close()
    assert_served(good, 0)
    with pytest.raises(ClientError, match="refused the frame"):      # a second HELLO through the ring
        good._call(C.Hello(client="again"), C.HelloReply)
    good.close()


def test_a_ring_the_server_cannot_attach_is_refused_and_tcp_goes_on(server, front):
    with connect(server) as c:
        for name, bells, why in (("elsewhere-1", None, "does not start with dspark-shm-"),
                                 ("dspark-shm-1-none", None, "cannot attach ring dspark-shm-1-none"),
                                 ("dspark-shm-2", "/tmp/x", "are not where this host puts")):
            msg = C.ShmAttach(name=name, n_slots=2, slot_bytes=1 << 20, completion_bytes=1 << 16,
                              bell_dir=bells or os.path.join(tempfile.gettempdir(), f"{name}.bells"), spin_us=50.0,
                              nap_s=0.02, max_message_bytes=1 << 20)
            reply = c._call(msg, C.ShmAttachReply)
            assert not reply.ok and why in reply.reason, reply.reason
        c.acquire(1)
        assert_served(c, 0)


def test_shm_attach_before_hello_closes_the_connection(server, front):
    import socket
    s = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)
    ring = StepRing.create(C.SHM_RING_PREFIX, 1)
    try:
        h = ring.handle
        s.sendall(wire.encode(C.ShmAttach(name=h.name, n_slots=h.n_slots, slot_bytes=h.slot_bytes,
                                          completion_bytes=h.completion_bytes, bell_dir=h.bell_dir,
                                          spin_us=h.spin_us, nap_s=h.nap_s, max_message_bytes=h.max_message_bytes)))
        assert s.recv(65536) == b""
    finally:
        s.close()
        ring.unlink()


def test_concurrent_shm_and_tcp_clients_each_get_their_own_answers(server):
    each_client_gets_its_own_answers(lambda k: shm_client(server) if k % 2 else connect(server))


def test_a_ring_whose_thread_may_not_spin_is_served_through_its_doorbell(front):  # noqa: F811 (fixture)
    """With no polling permit left (the TCP server's gate of spinning threads), the ring's thread sleeps on the
    doorbell at once and still answers every request."""
    from dspark_ray.transport.tcp import TcpServer
    srv = TcpServer(front, "127.0.0.1", 0, max_frame_bytes=LIMITS.max_frame_bytes, spin_us=100_000.0,
                    max_pollers=1).start()
    try:
        assert srv._pollers.acquire(blocking=False)      # the one permit, held: nobody may spin
        with shm_client(srv) as c:
            [g] = c.acquire(1)
            for seed in range(20):
                [r] = c.step([entry(g.slot, seed=seed, n_out=2)], deadline_ms=1000)
                assert r.drafts_array().tolist() == [seed + 1, seed + 2]
            assert c._ring.handle and srv._pollers.acquire(blocking=False) is False
    finally:
        srv.stop(timeout_s=WAIT_S)

