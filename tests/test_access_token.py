"""A token on the STEP endpoint (issue 63, item 1), against the fake front-end of test_tcp.py: a HELLO without the
deployment's token (none, a wrong one, another deployment's, one sent after the first frame) is answered UNAUTHORIZED
and closed, without a session, a slot or a step, and no token reaches a log; a healthy client's drafts are unchanged
meanwhile. Over shared memory likewise (HELLO is on TCP), and the rings and doorbells are their owner's alone."""
from __future__ import annotations

import logging
import os
import stat

import pytest

from dspark_ray.protocol import access_token
from dspark_ray.protocol import contract as C
from dspark_ray.protocol import wire
from dspark_ray.client import ClientError, DrafterClient
from dspark_ray.transport.ring import StepRing, ring_owner_pid
from dspark_ray.transport.tcp import TcpServer

from test_tcp import LIMITS, WAIT_S, FakeFrontEnd, assert_closed_by_server, assert_served, entry, raw

TOKEN = access_token.new_token()
OTHER_DEPLOYMENTS = access_token.new_token()


@pytest.fixture
def front():
    return FakeFrontEnd()


@pytest.fixture
def server(front):
    srv = TcpServer(front, max_frame_bytes=LIMITS.max_frame_bytes, stall_timeout_s=0.5, token=TOKEN).start()
    yield srv
    srv.stop(timeout_s=WAIT_S)


def holder(server, **kw) -> DrafterClient:
    c = DrafterClient("127.0.0.1", server.port, timeout_s=WAIT_S, token=TOKEN, **kw)
    c.hello(client="holder")
    return c


def refused_raw(server, *frames: bytes) -> C.HelloReply:
    """Send `frames` at once on a fresh connection: the server's one answer, then it closes the connection."""
    s = raw(server)
    s.sendall(b"".join(frames))
    got = wire.FrameReader(s.recv_into).read()
    assert_closed_by_server(s)
    return got.msg


@pytest.mark.parametrize("given,why", [(None, "the HELLO carries none"),
                                       ("x" * 43, "the HELLO's is not this deployment's"),
                                       (OTHER_DEPLOYMENTS, "the HELLO's is not this deployment's")],
                         ids=["none", "wrong", "another-deployments"])
def test_a_hello_without_the_deployments_token_is_refused_unauthorized_and_costs_no_session(server, front, given,
                                                                                            why, caplog):
    good = holder(server)
    [g] = good.acquire(1)
    with caplog.at_level(logging.DEBUG):
        stranger = DrafterClient("127.0.0.1", server.port, timeout_s=WAIT_S, token=given)
        with pytest.raises(ClientError, match=f"UNAUTHORIZED: token: {why}") as e:
            stranger.hello(client="stranger")
        assert e.value.code == C.Code.UNAUTHORIZED
        with pytest.raises(ClientError):          # the server closed the connection (and so did the client)
            stranger.acquire(1)
        assert_served(good, g.slot)
    assert front.sessions == 1 and front.steps == 1 and len(front.free) == LIMITS.slot_capacity - 1
    assert server.counts["unauthorized"] == 1
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert TOKEN not in text and OTHER_DEPLOYMENTS not in text
    good.close()


def test_a_refused_hello_says_nothing_of_what_is_served(server):
    reply = refused_raw(server, wire.encode(C.Hello(client="stranger"), 1))
    assert (reply.ok, reply.code, reply.limits, reply.model_digest, reply.config_digest, reply.tp) == \
        (False, C.Code.UNAUTHORIZED, None, None, None, None)


def test_a_token_sent_after_the_first_frame_is_never_read(server, front):
    """The first HELLO without the token closes the connection: a second, with it, is not read. A first frame of
    another type closes it unanswered, the token behind it unread too."""
    reply = refused_raw(server, wire.encode(C.Hello(client="late"), 1), wire.encode(C.Hello(token=TOKEN), 2))
    assert reply.code == C.Code.UNAUTHORIZED
    s = raw(server)
    s.sendall(wire.encode(C.Acquire(n=1), 1) + wire.encode(C.Hello(token=TOKEN), 2))
    assert s.recv(65536) == b""
    s.close()
    assert front.sessions == 0


def test_the_holders_drafts_are_unchanged_while_strangers_knock(server, front):
    good = holder(server)
    [g] = good.acquire(1)
    want = [good.step([entry(g.slot, seed=s, n_out=5)], deadline_ms=50)[0].drafts for s in range(5)]
    for k in range(20):
        stranger = DrafterClient("127.0.0.1", server.port, timeout_s=WAIT_S, token=(None, "y" * 20)[k % 2])
        with pytest.raises(ClientError, match="UNAUTHORIZED"):
            stranger.hello()
        assert good.step([entry(g.slot, seed=k % 5, n_out=5)], deadline_ms=50)[0].drafts == want[k % 5]
    assert front.sessions == 1
    good.close()


def test_an_insecure_endpoint_takes_any_hello(front):
    with TcpServer(front, max_frame_bytes=LIMITS.max_frame_bytes).start() as srv:
        with DrafterClient("127.0.0.1", srv.port, timeout_s=WAIT_S, token="anything-at-all-1234") as c:
            assert c.hello().ok


def test_tokens_are_compared_in_constant_time(monkeypatch):
    seen = []
    monkeypatch.setattr(access_token.hmac, "compare_digest", lambda a, b: seen.append((a, b)) or a == b)
    assert access_token.token_refusal(TOKEN, TOKEN, "the HELLO") is None
    assert access_token.token_refusal(TOKEN, TOKEN[:-1] + "?", "the HELLO")
    assert seen == [(TOKEN.encode(), TOKEN.encode()), (TOKEN.encode(), (TOKEN[:-1] + "?").encode())]


def test_a_hello_shows_no_token_when_printed():
    h = C.Hello(client="x", token=TOKEN)
    assert TOKEN not in repr(h) and TOKEN not in str(h) and "token=<set>" in repr(h)


def test_a_token_file_must_hold_a_token_and_a_new_one_is_private(tmp_path):
    path = access_token.write_token_file(tmp_path / "sub" / "token", TOKEN)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert access_token.read_token_file(path) == TOKEN and access_token.readable_by_others(path) is None
    os.chmod(path, 0o644)
    assert "mode 0644: other users may read it" in access_token.readable_by_others(path)
    for text, why in (("", "empty"), ("hunter2", "7 characters is too short"), ("two words-xxxxxxxxxx", "one word")):
        path.write_text(text)
        with pytest.raises(ValueError, match=f"token file {path}: .*{why}"):
            access_token.read_token_file(path)


# ---- shared memory: HELLO is on TCP; the rings are private ----------------------------------------------------------
def shm_names() -> set[str]:
    """The client rings this process made (another test session on the host makes its own)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(C.SHM_RING_PREFIX) and ring_owner_pid(n) == os.getpid()}


def test_a_shm_client_without_the_token_is_refused_before_any_ring_is_made(server, front):
    before = shm_names()
    stranger = DrafterClient("127.0.0.1", server.port, timeout_s=WAIT_S, shm=True, token=OTHER_DEPLOYMENTS)
    with pytest.raises(ClientError, match="UNAUTHORIZED"):
        stranger.hello()
    assert shm_names() == before and front.sessions == 0
    with holder(server, shm=True) as good:
        [g] = good.acquire(1)
        assert good._ring is not None
        assert_served(good, g.slot)


def test_rings_spills_and_doorbells_are_their_owners_alone():
    """Segment and spill 0600, doorbell folder 0700, doorbells 0600: another user cannot read or write a STEP."""
    ring = StepRing.create("dspark-shm", 1, slot_bytes=256, n_slots=2)
    reader = StepRing.attach(ring.handle, 0)
    try:
        h = ring.handle
        seq = ring.publish(b"x" * 1000, WAIT_S)            # larger than a slot: a spill segment of its own
        spills = [n for n in os.listdir("/dev/shm") if n.startswith(f"{h.name}-x")]
        assert spills
        for name in [h.name, *spills]:
            assert stat.S_IMODE(os.stat(f"/dev/shm/{name}").st_mode) == 0o600, name
        assert stat.S_IMODE(os.stat(h.bell_dir).st_mode) == 0o700
        for bell in [h.writer_bell, h.reader_bell(0)]:
            assert stat.S_IMODE(os.stat(bell).st_mode) == 0o600, bell
        assert reader.next(timeout_s=WAIT_S)[0] == seq
        reader.complete(seq)
    finally:
        reader.close()
        ring.unlink()
