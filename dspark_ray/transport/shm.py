"""STEP over same-host shared memory: a client's request ring, served by the thread of its TCP connection.

Why: a serving engine on the drafter's host pays two TCP hops per STEP (the request's ~92 KB of taps and the
reply through the loopback, each with a thread's wake-up and a socket read). Through shared memory the request is
one copy into a ring slot and the reply one copy back, with the same spinning waits as the ranks' ring.

How: after an accepted HELLO the client creates a ring (`transport/ring.py`; the client is its one writer, this server
its one reader) and names it in SHM_ATTACH on its TCP connection. Once the server has attached, every request of
the session is a frame (the TCP framing: header and payload) published into the ring, and its reply frame is the
message's completion record. The TCP connection carries nothing more; it stays open as the session's lifeline:
when the client closes it (or its process dies) the server ends the session and frees its slots. A request whose
payload does not decode is answered ErrorReply BAD_ENTRY, as on TCP; any other bad frame in the ring completes with
STATUS_BAD_FRAME and ends that session alone, as on TCP.
"""
from __future__ import annotations

import os
import socket
import tempfile
import time
from typing import Callable

from .ring import RingClosed, RingError, RingHandle, RingReader, RingTimeout, StepRing
from ..contract import SHM_RING_PREFIX, ShmAttach
from ..wire import ConnectionClosed, FrameError, FrameWriter, IdleTimeout, PayloadError, decode_frame

__all__ = ["attach_ring", "serve_ring", "handle_of", "STATUS_BAD_FRAME"]

STATUS_BAD_FRAME = 1            # a completion's status: the request frame was refused, the session ends
_LIFELINE_CHECK_S = 0.5         # how often a waiting server looks at the TCP connection


def handle_of(msg: ShmAttach) -> RingHandle:
    return RingHandle(msg.name, 1, msg.n_slots, msg.slot_bytes, msg.completion_bytes, msg.bell_dir, msg.spin_us,
                      msg.nap_s, msg.max_message_bytes)


def attach_ring(msg: ShmAttach) -> RingReader | str:
    """Attach to the client's ring as its reader, or the reason it cannot be: only rings named like a client's,
    with their doorbells where `StepRing.create` puts them, so a client cannot point the server elsewhere."""
    if not msg.name.startswith(SHM_RING_PREFIX + "-") or "/" in msg.name:
        return f"ring name {msg.name!r} does not start with {SHM_RING_PREFIX}-"
    if msg.bell_dir != os.path.join(tempfile.gettempdir(), f"{msg.name}.bells"):
        return f"ring doorbells {msg.bell_dir!r} are not where this host puts {msg.name}'s"
    try:
        return StepRing.attach(handle_of(msg), 0)
    except (OSError, RingError, ValueError) as e:
        return f"cannot attach ring {msg.name}: {e} (is the client on this host?)"


def _lifeline_closed(sock: socket.socket) -> bool:
    """Whether the client closed its TCP connection. Bytes on it are a protocol error: after SHM_ATTACH every
    request travels through the ring."""
    try:
        data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True
    if data:
        raise FrameError("bytes on the TCP connection after SHM_ATTACH (requests go through the ring)")
    return True


def serve_ring(ring: RingReader, sock: socket.socket, dispatch: Callable[[object, int], object],
               max_frame_bytes: int, spin_us: float, on_reply: Callable[[object, int, object], None] | None = None,
               gate=None, refuse: Callable[[PayloadError], object] | None = None,
               idle_timeout_s: float | None = None) -> None:
    """Serve the ring until the client closes it or its TCP connection (ConnectionClosed), or sends a bad frame
    (FrameError, after completing it with STATUS_BAD_FRAME). `dispatch(msg, received_ns)` answers a request;
    `refuse(e)` answers a frame whose payload did not decode (or raises FrameError; without it such a frame is a
    bad frame); `on_reply(msg, received_ns, reply)` runs after each completion (msg None for a refused payload;
    stamps). `gate` (a semaphore, optional): the
    wait spins `spin_us` only while it holds the gate, else it sleeps on the ring's doorbell at once; the TCP
    server shares its gate of polling threads (every spin takes the interpreter lock, and many spinning threads
    would slow the one that has a STEP to run). No request for `idle_timeout_s` (None: for ever) raises
    IdleTimeout, as a TCP session's reader does."""
    writer = FrameWriter(max_frame_bytes)
    last = time.monotonic()
    while True:
        held = gate is None or gate.acquire(blocking=False)
        try:
            seq, view = ring.next(timeout_s=_LIFELINE_CHECK_S, spin_us=spin_us if held else 0.0)
        except RingTimeout:
            if _lifeline_closed(sock):
                raise ConnectionClosed("the client closed its TCP connection") from None
            if idle_timeout_s is not None and time.monotonic() - last >= idle_timeout_s:
                raise IdleTimeout(f"no request for {idle_timeout_s:g} s") from None
            continue
        except RingClosed:
            raise ConnectionClosed("the client closed its ring") from None
        finally:
            if held and gate is not None:
                gate.release()
        received_ns = time.monotonic_ns()
        last = time.monotonic()
        try:
            try:
                request_id, msg = decode_frame(view, max_frame_bytes)
            except PayloadError as e:               # read whole: answered, as on TCP (or a FrameError)
                if refuse is None:
                    raise
                request_id, msg, reply = e.request_id, None, refuse(e)
            else:
                reply = dispatch(msg, received_ns)  # refuses what is not a request here (a HELLO, SHM_ATTACH)
        except FrameError:
            ring.complete(seq, STATUS_BAD_FRAME)    # the client learns it at once, not at its timeout
            raise
        try:
            writer.send(lambda frame: ring.complete(seq, 0, frame), reply, request_id)
        except RingError as e:          # e.g. a reply larger than the client's completion records
            ring.complete(seq, STATUS_BAD_FRAME)
            raise FrameError(f"reply cannot be completed: {e}") from None
        if on_reply is not None:
            on_reply(msg, received_ns, reply)
