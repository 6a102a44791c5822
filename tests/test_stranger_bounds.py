"""Nothing allocated for a stranger, and no frame held open for ever (issue 63, item 2), on a TcpServer in front of
the fake front-end of test_tcp.py: before an accepted HELLO only a HELLO-sized HELLO may come, judged on its header;
after it a frame's buffer grows with the bytes that arrived and a frame must be whole within its bound; a HELLO must
come within that bound of connecting, and strangers waiting to HELLO are capped. Every wait is bounded."""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from dspark_ray.protocol import access_token
from dspark_ray.protocol import contract as C
from dspark_ray.protocol import wire
from dspark_ray.client import ClientError, DrafterClient
from dspark_ray.transport.tcp import TcpServer

from test_tcp import WAIT_S, FakeFrontEnd, assert_served, conn_threads, raw

TOKEN = access_token.new_token()
CLAIM = (64 << 20) - wire.HEADER_SIZE             # a payload length that makes a 64 MiB frame


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def header(mtype: C.MsgType, length: int, request_id: int = 1) -> bytes:
    return wire.HEADER.pack(wire.MAGIC, C.PROTOCOL_VERSION, int(mtype), 0, 0, request_id, length)


def closed_within(sock: socket.socket, bound_s: float) -> float:
    """Seconds until the server closed `sock` (its replies read and dropped); fails past `bound_s`."""
    t0 = time.monotonic()
    sock.settimeout(bound_s)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    sock.close()
    return time.monotonic() - t0


def wait_until(cond, what: str, bound_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + bound_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.fixture
def front():
    return FakeFrontEnd()


def server_of(front, **kw) -> TcpServer:
    kw.setdefault("stall_timeout_s", 2.0)
    return TcpServer(front, token=TOKEN, **kw).start()


def greeted_socket(srv) -> socket.socket:
    """A raw connection whose HELLO (with the token) was accepted."""
    s = raw(srv)
    s.sendall(wire.encode(C.Hello(client="raw holder", token=TOKEN), 1))
    assert wire.FrameReader(s.recv_into).read().msg.ok
    return s


@pytest.mark.parametrize("first", [header(C.MsgType.HELLO, CLAIM), header(C.MsgType.STEP, 100),
                                   wire.encode(C.Hello(client="x" * 5000, token=TOKEN), 1)],
                         ids=["64MiB-hello-header", "step-header", "5000-byte-hello"])
def test_before_hello_anything_but_a_hello_sized_hello_closes_at_once_on_its_header(front, first):
    """Closed as soon as the header is read (well inside the 2 s stall bound the payload would have had), the
    front-end never told; a 5000-byte HELLO, token and all, is over the limit too."""
    with server_of(front) as srv:
        s = raw(srv)
        s.sendall(first[:wire.HEADER_SIZE])
        assert closed_within(s, WAIT_S) < 1.5
        wait_until(lambda: srv.counts["bad_frames"] == 1, "the close counted")
        assert front.sessions == 0


def test_trickling_64_mib_headers_leave_the_servers_memory_where_it_was(front):
    """16 strangers announce 64 MiB HELLOs, 16 token holders 64 MiB STEPs, and send a byte every 0.1 s: the
    strangers are closed on their headers, the holders' buffers grow only with what arrived (the process's RSS moves
    by less than 8 MiB where 16 x 64 MiB would be 1 GiB), and each holder is closed by the frame's 2 s bound."""
    srv = server_of(front, frame_timeout_s=2.0, stall_timeout_s=1.0)
    try:
        holders = [greeted_socket(srv) for _ in range(16)]
        strangers = [raw(srv) for _ in range(16)]
        wait_until(lambda: conn_threads() == 32, "32 connection threads")
        before = rss_bytes()
        t0 = time.monotonic()
        for s in strangers:
            s.sendall(header(C.MsgType.HELLO, CLAIM))
        for s in holders:
            s.sendall(header(C.MsgType.STEP, CLAIM, 2))
        peak = before
        stop = threading.Event()

        def trickle():
            while not stop.wait(0.1):
                for s in holders:
                    try:
                        s.send(b"\x00")
                    except OSError:
                        pass
        t = threading.Thread(target=trickle)
        t.start()
        try:
            while time.monotonic() - t0 < 1.5:          # mid-frame for every holder: inside the 2 s bound
                peak = max(peak, rss_bytes())
                time.sleep(0.05)
            assert conn_threads() == 16               # the strangers are gone, the holders still trickling
            wait_until(lambda: conn_threads() == 0, "every trickling holder closed by the frame bound", 5.0)
        finally:
            stop.set()
            t.join()
        assert peak - before < 8 << 20, (before, peak)
        assert srv.counts["bad_frames"] == 32
    finally:
        for s in holders + strangers:
            s.close()
        srv.stop(timeout_s=WAIT_S)


def test_a_frame_must_arrive_whole_within_its_bound_however_it_trickles(front):
    """One byte of a STEP every 0.2 s never stalls (stall bound 1 s), yet the frame is cut at its 1 s bound; the
    holder next to it is served throughout."""
    with server_of(front, frame_timeout_s=1.0, stall_timeout_s=1.0) as srv:
        good = DrafterClient("127.0.0.1", srv.port, timeout_s=WAIT_S, token=TOKEN)
        good.hello()
        [g] = good.acquire(1)
        s = greeted_socket(srv)
        frame = wire.encode(C.Step(entries=[], deadline_ms=50.0), 2)
        t0 = time.monotonic()
        sent = 0
        try:
            for b in frame:
                s.send(bytes([b]))
                sent += 1
                assert_served(good, g.slot)
                time.sleep(0.2)
        except OSError:               # the server closed it
            pass
        took = time.monotonic() - t0
        assert 0.9 < took < 3.0 and sent < len(frame), (took, sent)
        wait_until(lambda: srv.counts["bad_frames"] == 1, "the slow frame counted")
        good.close()


def test_a_connection_must_hello_within_the_bound_of_connecting(front):
    """Silent, or answering every refusal with another undecodable HELLO: closed at the bound from the connection's
    start (0.6 s; checked at each wake-up of the 0.3 s stall bound), the front-end never told."""
    with server_of(front, frame_timeout_s=0.6, stall_timeout_s=0.3) as srv:
        silent = raw(srv)
        assert 0.5 < closed_within(silent, WAIT_S) < 2.0
        chatty = raw(srv)
        reader = wire.FrameReader(chatty.recv_into)
        t0 = time.monotonic()
        with pytest.raises((wire.ConnectionClosed, OSError)):
            while time.monotonic() - t0 < WAIT_S:
                chatty.sendall(header(C.MsgType.HELLO, 4) + b"\xc1\xc1\xc1\xc1")
                assert reader.read().msg.code == C.Code.BAD_ENTRY
                time.sleep(0.1)
        assert time.monotonic() - t0 < 2.0
        chatty.close()
        assert front.sessions == 0


def test_strangers_waiting_to_hello_are_capped_and_holders_go_on(front):
    with server_of(front, max_ungreeted=2, frame_timeout_s=WAIT_S) as srv:
        good = DrafterClient("127.0.0.1", srv.port, timeout_s=WAIT_S, token=TOKEN)
        good.hello()
        [g] = good.acquire(1)
        a, b = raw(srv), raw(srv)
        wait_until(lambda: conn_threads() == 3, "two strangers accepted")
        with pytest.raises(ClientError, match="closed the connection: OVERLOADED: 2 connections to this STEP endpoint "
                                              "are waiting to HELLO"):
            DrafterClient("127.0.0.1", srv.port, timeout_s=WAIT_S, token=TOKEN).hello()
        assert_served(good, g.slot)
        a.close()
        wait_until(lambda: conn_threads() == 2, "a stranger gone")
        with DrafterClient("127.0.0.1", srv.port, timeout_s=WAIT_S, token=TOKEN) as again:
            assert again.hello().ok
        b.close()
        good.close()
