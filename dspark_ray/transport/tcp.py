"""STEP over TCP: one accept thread, one blocking thread per connection (why not asyncio: docs/engine.md,
"Measurements behind the step path"). A connection is a session, its requests read and answered one at a time; what
is answered, what closes a connection and the bounds per client: docs/contract.md, section 1. Before its HELLO is
accepted a connection is a stranger: it may send one HELLO-sized frame within a bound, its token is checked before
the front-end hears of it, and it costs no session. A session logs two lines, when it opens and when it closes,
never one per frame; strangers and refused connections are logged in summary (their count per window).
"""
from __future__ import annotations

import logging
import math
import select
import socket
import threading
import time

from ..protocol.access_token import token_refusal
from ..protocol.contract import (MAX_HELLO_FRAME_BYTES, MESSAGE_TYPES, Acquire, Code, ErrorReply, Hello, HelloReply, MsgType,
                        ShmAttach, ShmAttachReply, Step, StepHandler)
from ..observe.observers import ServerObserver
from ..protocol.wire import (DEFAULT_MAX_FRAME_BYTES, ConnectionClosed, FrameError, FrameReader, FrameWriter, IdleTimeout,
                    PayloadError, VersionMismatch, bound_blocking_io, spinning_recv_into)
from .shm import attach_ring, serve_ring

log = logging.getLogger(__name__)

__all__ = ["TcpServer", "StepHandler"]

REQUESTS = (MsgType.HELLO, MsgType.ACQUIRE, MsgType.RELEASE, MsgType.STEP, MsgType.SHM_ATTACH)
# A connection costs a thread: 256 hold several engines' pools and HTTP sessions against a worker's 16 slots.
MAX_CONNECTIONS = 256
# Connections still to send an accepted HELLO, at once: strangers cannot take the places of token holders.
MAX_UNGREETED = 32
# An engine's live session steps every decode round; one back from a longer pause reconnects and re-inserts.
IDLE_TIMEOUT_S = 600.0
# A frame must be whole this long after its first bytes, and a HELLO must come this long after connecting: a 64 MiB
# STEP needs 54 Mbit/s, a trickling peer holds a thread no longer.
FRAME_TIMEOUT_S = 10.0
REFUSAL_LOG_S = 10.0
_TYPE_OF = {cls: t for t, cls in MESSAGE_TYPES.items()}


class Unauthorized(Exception):
    """A HELLO without this deployment's token: answered UNAUTHORIZED, then the connection closes."""


class _Summary:
    """A kind of event that a flood repeats (a stranger, a full endpoint), logged as one line per window of
    `window_s` that had any, with its count: the window opens at its first event and its line comes when it ends
    (or at `close`), so a flood of thousands costs a line, and so does a lone event."""

    def __init__(self, what: str, window_s: float = REFUSAL_LOG_S):
        self.what, self.window_s = what, window_s
        self.count, self.last = 0, ""
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()          # connection threads note concurrently

    def note(self, detail: str) -> None:
        with self._lock:
            self.count += 1
            self.last = detail
            if self._timer is None:
                self._timer = threading.Timer(self.window_s, self._flush)
                self._timer.name, self._timer.daemon = "dspark-refusal-log", True      # not a tcp- endpoint thread
                self._timer.start()

    def close(self) -> None:
        """Log what the open window holds now, and open no other (the server stops)."""
        with self._lock:
            timer = self._timer
        if timer is not None:
            timer.cancel()
        self._flush()

    def _flush(self) -> None:
        with self._lock:
            n, detail, self.count, self._timer = self.count, self.last, 0, None
        if n:
            log.warning("%s %d connection(s) within %g s (the last %s)", self.what, n, self.window_s, detail)


def out_of_place(mtype: MsgType, greeted: bool, ring: bool = False) -> str | None:
    """Why a request of type `mtype` may not come now (closing the connection), or None; the header's type alone."""
    if mtype not in REQUESTS:
        return f"{mtype.name} is a reply, not a request"
    if ring and mtype in (MsgType.HELLO, MsgType.SHM_ATTACH):
        return f"{mtype.name} through a ring"
    if not greeted and mtype != MsgType.HELLO:
        return f"{mtype.name} before an accepted HELLO"
    if greeted and mtype == MsgType.HELLO:
        return "second HELLO on an accepted session"
    return None


def refuse_payload(e: PayloadError, greeted: bool, ring: bool = False) -> ErrorReply:
    """BAD_ENTRY naming the field for a payload that did not decode, or FrameError when it is out of place."""
    why = out_of_place(e.mtype, greeted, ring)
    if why:
        raise FrameError(f"{why} (and its payload does not decode: {e})")
    return ErrorReply(code=Code.BAD_ENTRY, reason=str(e))


class _Conn:
    def __init__(self, sock: socket.socket, peer: str):
        self.sock = sock
        self.peer = peer
        self.session: int | None = None
        self.thread: threading.Thread | None = None
        self.opened = time.monotonic()
        self.client = ""
        self.greeted = False
        self.transport = "tcp"
        self.counts = {"requests": 0, "steps": 0, "entries": 0, "refused": 0}

    def summary(self, why: str, freed) -> str:
        c = self.counts
        return (f"session {self.session} closed ({why}): {self.peer}, client {self.client!r} over {self.transport}, "
                f"{time.monotonic() - self.opened:.1f} s, {c['requests']} requests ({c['steps']} STEPs, "
                f"{c['entries']} entries, {c['refused']} refused whole)"
                + (f", {freed} slots freed" if isinstance(freed, int) else ""))


WILDCARD_HOSTS = ("0.0.0.0", "", "::")     # listen on every interface; not an address a client can use


class TcpServer:
    """Serves `handler` on host:port (port 0: an ephemeral port, read `server.port` after `start`)."""

    def __init__(self, handler: StepHandler, host: str = "127.0.0.1", port: int = 0,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, stall_timeout_s: float = 5.0, spin_us: float = 0.0,
                 max_pollers: int = 2, on_thread_start=None, observer: ServerObserver | None = None,
                 advertise: str | None = None, max_connections: int = MAX_CONNECTIONS,
                 idle_timeout_s: float | None = IDLE_TIMEOUT_S, token: str | None = None,
                 frame_timeout_s: float = FRAME_TIMEOUT_S, max_ungreeted: int = MAX_UNGREETED,
                 refusal_log_s: float = REFUSAL_LOG_S):
        """`spin_us`: how long a connection thread polls for its next frame before it blocks; at most `max_pollers`
        poll at once (every poll takes the interpreter lock). `on_thread_start`: run first in the accept thread
        (connection threads inherit its affinity). `observer` sees every connection's frames. `advertise`: the
        address `endpoint` names for a wildcard `host`. `max_connections`, `idle_timeout_s` (None: none). `token`:
        the deployment's, which every HELLO must carry (None: anyone may HELLO). `frame_timeout_s`: a frame's
        bound, and a HELLO's after connecting; at most `max_ungreeted` connections wait for theirs at once.
        `refusal_log_s`: the window over which refused connections and strangers are counted into one log line."""
        if max_connections < 1 or max_ungreeted < 1:
            raise ValueError(f"max_connections {max_connections}, max_ungreeted {max_ungreeted}: at least 1")
        self.max_connections, self.idle_timeout_s = max_connections, idle_timeout_s
        self.max_ungreeted, self.frame_timeout_s = max_ungreeted, frame_timeout_s
        self.token = token
        self._at_limit = _Summary("refused at the connection limit:", refusal_log_s)
        self._strangers = _Summary("closed before an accepted HELLO:", refusal_log_s)
        self._ungreeted = 0
        self.observer = observer or ServerObserver()
        self.advertise = advertise if host in WILDCARD_HOSTS else None
        self.handler = handler
        self.spin_us = spin_us
        self.on_thread_start = on_thread_start
        self._pollers = threading.BoundedSemaphore(max_pollers)
        self.host = host
        self.max_frame_bytes = max_frame_bytes
        self.stall_timeout_s = stall_timeout_s
        self._listener = socket.create_server((host, port), reuse_port=False)
        # accept() wakes every 0.2 s to notice stop(): closing a listener does not wake it on Linux.
        self._listener.settimeout(0.2)
        self._port = self._listener.getsockname()[1]
        self._stopping = threading.Event()
        self._conns: set[_Conn] = set()
        self._lock = threading.Lock()
        self._accept_thread: threading.Thread | None = None
        self.counts = {"connections": 0, "bad_frames": 0, "connections_refused": 0, "idle_sessions_closed": 0,
                       "unauthorized": 0}

    @property
    def wake_ups(self):
        """The observer's count of STEPs whose read slept (metrics.py exports it; a recorders.ServerRecorder's)."""
        return self.observer.wake_ups

    @property
    def port(self) -> int:
        return self._port

    @property
    def endpoint(self) -> str:
        return f"{self.advertise or self.host}:{self.port}"

    def start(self) -> "TcpServer":
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"tcp-accept:{self.port}", daemon=True)
        self._accept_thread.start()
        log.info("tcp server listening on %s", self.endpoint)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close the listener and every connection; join the threads, waiting at most `timeout_s` in all."""
        self._stopping.set()
        deadline = time.monotonic() + timeout_s
        _shutdown(self._listener)
        if self._accept_thread is not None:
            self._accept_thread.join(timeout_s)
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            _shutdown(c.sock)         # wakes its thread's recv with end of stream
        for c in conns:
            if c.thread is not None:
                c.thread.join(max(0.0, deadline - time.monotonic()))
        alive = [c.peer for c in conns if c.thread is not None and c.thread.is_alive()]
        self._at_limit.close()
        self._strangers.close()
        if alive:
            log.warning("tcp server stop: %d connection thread(s) still in the handler after %.1f s: %s",
                        len(alive), timeout_s, ", ".join(alive))

    def __enter__(self) -> "TcpServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _accept_loop(self) -> None:
        if self.on_thread_start is not None:
            self.on_thread_start()
        while not self._stopping.is_set():
            try:
                sock, addr = self._listener.accept()
            except socket.timeout:
                continue
            except OSError as e:
                if not self._stopping.is_set():
                    log.error("tcp accept failed, listener stops: %s", e)
                return
            # A peer stalling mid-frame, or not reading its replies, cannot hold its thread for ever.
            bound_blocking_io(sock, self.stall_timeout_s)
            with self._lock:
                full = len(self._conns) >= self.max_connections
                crowded = self._ungreeted >= self.max_ungreeted
                if not (full or crowded):
                    self._ungreeted += 1
            if full or crowded:
                self._refuse(sock, f"{addr[0]}:{addr[1]}", full)
                continue
            # A STEP reply is one small write answered by the next request: Nagle would hold it for an ACK.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, f"{addr[0]}:{addr[1]}")
            conn.thread = threading.Thread(target=self._serve, args=(conn,), name=f"tcp-conn:{conn.peer}",
                                           daemon=True)
            with self._lock:
                if self._stopping.is_set():
                    sock.close()
                    return
                self._conns.add(conn)
            self.counts["connections"] += 1
            conn.thread.start()

    def _refuse(self, sock: socket.socket, peer: str, full: bool) -> None:
        """Tell a connection over a limit why, close it; a flood is logged as one event (_Summary)."""
        self.counts["connections_refused"] += 1
        why = (f"this STEP endpoint holds its limit of {self.max_connections} connections (serve --max-connections)"
               if full else f"{self.max_ungreeted} connections to this STEP endpoint are waiting to HELLO")
        _try_send(FrameWriter(MAX_HELLO_FRAME_BYTES), sock,
                  ErrorReply(code=Code.OVERLOADED, reason=f"{why}: retry later or use another worker"))
        _shutdown(sock)
        sock.close()
        self._at_limit.note(f"from {peer}: {why}")

    def _admit(self, conn: _Conn):
        """The header check of docs/contract.md section 1: before an accepted HELLO, one HELLO-sized HELLO."""
        def admit(mtype: MsgType, size: int) -> str | None:
            why = out_of_place(mtype, conn.greeted)
            if why is None and not conn.greeted and size > MAX_HELLO_FRAME_BYTES:
                why = f"a frame of {size} bytes before an accepted HELLO > {MAX_HELLO_FRAME_BYTES} (a HELLO's limit)"
            return why
        return admit

    def _greet(self, conn: _Conn, msg: Hello, request_id: int, writer: FrameWriter) -> None:
        """Check a stranger's token (Unauthorized, after answering it), then open its session with the front-end."""
        why = token_refusal(self.token, msg.token, "the HELLO")
        if why:
            self.counts["unauthorized"] += 1
            _try_send(writer, conn.sock, HelloReply(ok=False, code=Code.UNAUTHORIZED, reason=why), request_id)
            raise Unauthorized(why)
        if conn.session is None:
            conn.session = self.handler.open_session(conn.peer)
            log.info("session %d open: %s", conn.session, conn.peer)

    def _idle_wait(self, sock: socket.socket):
        """FrameReader's idle_wait: the socket's stall timeout ticks while more than one tick of the idle bound is
        left (no poll on the step path); within the last tick, a poll for the time left, so an idle session closes
        at its bound (`--idle-timeout 7`: at 7 s, not at the 5 s tick after it)."""
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        tick = self.stall_timeout_s

        def wait(left: float) -> bool:
            if tick is not None and left >= tick:
                return True
            return bool(poller.poll(max(0, math.ceil(left * 1e3))))
        return wait

    def _greeted(self, conn: _Conn, reader: FrameReader) -> None:
        conn.greeted = True
        reader.idle_timeout_s = self.idle_timeout_s
        with self._lock:
            self._ungreeted -= 1

    def _serve(self, conn: _Conn) -> None:
        sock = conn.sock
        recv = spinning_recv_into(sock, self.spin_us, self._pollers, self.observer.idle)
        # Until its HELLO is accepted: HELLO-sized HELLOs (the reader's first buffer), within frame_timeout_s.
        reader = FrameReader(recv, self.max_frame_bytes, wait_between_frames=True,
                             frame_timeout_s=self.frame_timeout_s, admit=self._admit(conn),
                             idle_wait=self._idle_wait(sock))
        writer = FrameWriter(self.max_frame_bytes)
        observer = self.observer.session(recv, reader)
        why = "closed by peer"
        try:
            while True:
                if not conn.greeted:       # the HELLO's bound counts from the connection's start, not per frame
                    left = conn.opened + self.frame_timeout_s - time.monotonic()
                    if left <= 0:
                        raise IdleTimeout("no accepted HELLO")
                    reader.idle_timeout_s = left
                try:
                    request_id, msg, received_ns = reader.read()
                except PayloadError as e:
                    writer.send(sock.sendall, self._refused(conn, refuse_payload(e, conn.greeted)), e.request_id)
                    continue
                observer.read(received_ns)
                if isinstance(msg, ShmAttach) and conn.greeted:
                    self._serve_shm(conn, msg, request_id, writer, observer)   # returns only when the ring refused
                    continue
                if not conn.greeted:
                    self._greet(conn, msg, request_id, writer)
                reply = self._dispatch(conn, msg, received_ns, conn.greeted)
                if isinstance(reply, HelloReply):
                    conn.client = msg.client
                    if reply.ok and not conn.greeted:
                        self._greeted(conn, reader)
                try:
                    writer.send(sock.sendall, reply, request_id)
                except (FrameError, TypeError) as e:    # the front-end answered something unsendable: our bug
                    raise RuntimeError(f"cannot send the reply to {type(msg).__name__}: {e}") from e
                observer.answered(msg, reply)
        except ConnectionClosed:
            if self._stopping.is_set():
                why = "closed by server (stopping)"
        except IdleTimeout as e:
            if conn.greeted:
                why = f"idle: {e}"
                self.counts["idle_sessions_closed"] += 1
                _try_send(writer, sock, ErrorReply(code=Code.UNAVAILABLE, reason=f"session {conn.session} closed: "
                                                                                 f"{e} (serve --idle-timeout)"))
            else:
                why = f"bad frame: no HELLO within {self.frame_timeout_s:g} s of connecting"
        except Unauthorized as e:
            why = f"unauthorized: {e}"
        except VersionMismatch as e:
            why = f"bad frame: {e}"
            _try_send(writer, sock, ErrorReply(code=Code.CONFIG_MISMATCH, reason=str(e)))
        except FrameError as e:
            why = f"bad frame: {e}"
        except OSError as e:
            why = "closed by server" if self._stopping.is_set() else f"socket error: {e}"
        except Exception as e:    # open_session failed or a reply could not be sent: a server-side bug
            log.exception("connection %s session %s: server error", conn.peer, conn.session)
            why = f"server error: {e!r}"
        finally:
            self._close(conn, why)

    def _close(self, conn: _Conn, why: str) -> None:
        _shutdown(conn.sock)
        conn.sock.close()
        with self._lock:
            self._conns.discard(conn)
            if not conn.greeted:
                self._ungreeted -= 1
        freed = None
        if conn.session is not None:
            try:
                freed = self.handler.close_session(conn.session)
            except Exception:
                log.exception("close_session(%d) failed", conn.session)
        # A bad frame is a client bug or a stranger on the port.
        if why.startswith("bad frame"):
            self.counts["bad_frames"] += 1
        if conn.session is None:
            self._strangers.note(f"from {conn.peer}: {why}")
        else:
            log.log(logging.WARNING if why.startswith("bad frame") else logging.INFO, "%s", conn.summary(why, freed))

    def _serve_shm(self, conn: _Conn, msg: ShmAttach, request_id: int, writer: FrameWriter,
                   observer: ServerObserver) -> None:
        """Serve the session through the client's ring (transport/shm.py); a refused ring leaves it on TCP."""
        ring = attach_ring(msg)
        conn.counts["requests"] += 1
        if isinstance(ring, str):
            conn.counts["refused"] += 1
            writer.send(conn.sock.sendall, ShmAttachReply(ok=False, reason=ring), request_id)
            return
        writer.send(conn.sock.sendall, ShmAttachReply(ok=True), request_id)
        conn.transport = f"shared memory ({msg.name})"
        try:
            serve_ring(ring, conn.sock, lambda m, t: self._dispatch(conn, m, t, True, ring=True),
                       self.max_frame_bytes, self.spin_us, on_reply=observer.ring_answered, gate=self._pollers,
                       refuse=lambda e: self._refused(conn, refuse_payload(e, True, ring=True)),
                       idle_timeout_s=self.idle_timeout_s)
        finally:
            ring.close()

    @staticmethod
    def _refused(conn: _Conn, reply: ErrorReply) -> ErrorReply:
        """A request refused before the handler saw it (its payload did not decode), counted for the log line."""
        conn.counts["requests"] += 1
        conn.counts["refused"] += 1
        return reply

    def _dispatch(self, conn: _Conn, msg: object, received_ns: int, greeted: bool, ring: bool = False) -> object:
        reply = self._handle(conn.session, msg, received_ns, greeted, ring)
        c = conn.counts
        c["requests"] += 1
        if isinstance(msg, Step):
            c["steps"] += 1
            c["entries"] += len(msg.entries)
        if isinstance(reply, ErrorReply) or (isinstance(reply, HelloReply) and not reply.ok):
            c["refused"] += 1
        return reply

    def _handle(self, session: int, msg: object, received_ns: int, greeted: bool, ring: bool) -> object:
        why = out_of_place(_TYPE_OF[type(msg)], greeted, ring)
        if why:
            raise FrameError(why)
        try:
            if isinstance(msg, Step):
                return self.handler.step(session, msg, received_ns)
            if isinstance(msg, Hello):
                return self.handler.hello(session, msg)
            if isinstance(msg, Acquire):
                return self.handler.acquire(session, msg)
            return self.handler.release(session, msg)
        except Exception as e:
            # A front-end bug answers this request and keeps the connection: the client's stream is still in step.
            log.exception("session %d: handler failed on %s", session, type(msg).__name__)
            return ErrorReply(code=Code.INTERNAL, reason=f"front-end error on {type(msg).__name__}: {e!r}")


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _try_send(writer: FrameWriter, sock: socket.socket, msg: object, request_id: int = 0) -> None:
    try:
        writer.send(sock.sendall, msg, request_id)
    except OSError:
        pass
