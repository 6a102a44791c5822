"""STEP over same-host shared memory: a client's request ring (ring.py; the client writes, this server reads),
served by the thread of its TCP connection, which stays open as the session's lifeline (docs/contract.md, section 9).
"""
from __future__ import annotations

import os
import socket
import tempfile
import time
from typing import Callable

from .ring import RingClosed, RingError, RingHandle, RingReader, RingTimeout, StepRing
from ..protocol.contract import SHM_RING_PREFIX, ShmAttach
from ..protocol.wire import ConnectionClosed, FrameError, FrameWriter, IdleTimeout, PayloadError, decode_frame

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
    """Whether the client closed its TCP connection; bytes on it are a FrameError (requests go through the ring)."""
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
    (FrameError). `dispatch(msg, received_ns)` answers a request, `refuse(e)` a payload that did not decode;
    `on_reply(msg, received_ns, reply)` runs after each completion. The wait spins only while it holds `gate` (the
    TCP server's poller semaphore). No request for `idle_timeout_s` raises IdleTimeout."""
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
            except PayloadError as e:
                if refuse is None:
                    raise
                request_id, msg, reply = e.request_id, None, refuse(e)
            else:
                reply = dispatch(msg, received_ns)
        except FrameError:
            ring.complete(seq, STATUS_BAD_FRAME)    # the client learns it at once, not at its timeout
            raise
        try:
            writer.send(lambda frame: ring.complete(seq, 0, frame), reply, request_id)
        except RingError as e:          # e.g. a reply larger than a completion record
            ring.complete(seq, STATUS_BAD_FRAME)
            raise FrameError(f"reply cannot be completed: {e}") from None
        if on_reply is not None:
            on_reply(msg, received_ns, reply)
