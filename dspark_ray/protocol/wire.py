"""Length-prefixed frames: a 24-byte header (docs/contract.md, "The frame"), then one msgpack contract message.
A reader checks the whole header (and whether such a frame may come now) before it reads a byte of payload, and its
buffer grows with the bytes that arrive, not with the length a header claims: a hostile length costs nothing.
"""
from __future__ import annotations

import select
import socket
import struct
import time
from typing import Callable, NamedTuple

import msgspec

from .contract import MAX_HELLO_FRAME_BYTES, MESSAGE_TYPES, PROTOCOL_VERSION, Message, MsgType

MAGIC = b"DSPK"
HEADER = struct.Struct("<4sHHHHQI")
HEADER_SIZE = HEADER.size
DEFAULT_MAX_FRAME_BYTES = 64 << 20
# A new reader's and writer's buffer: a HELLO fits; each grows as larger frames come (and never shrinks).
FIRST_BUFFER_BYTES = MAX_HELLO_FRAME_BYTES


class FrameError(Exception):
    """A frame that cannot be read (bad header, oversized, truncated, stalled): the connection must be closed."""


class PayloadError(FrameError):
    """A frame read whole whose payload does not decode as its header's message: the stream is still in step, so
    the server answers it (BAD_ENTRY, with `request_id`) instead of closing."""

    def __init__(self, mtype: MsgType, reason: str):
        super().__init__(reason)
        self.mtype = mtype
        self.request_id = 0


class VersionMismatch(FrameError):
    """The frame header names another protocol version (the header layout itself is the same in every version)."""


class ConnectionClosed(EOFError):
    """The peer closed the connection cleanly, between two frames."""


class IdleTimeout(Exception):
    """No frame began within the reader's idle bound (`FrameReader(idle_timeout_s=...)`): the session is idle."""


class Frame(NamedTuple):
    request_id: int
    msg: object
    received_ns: int       # time.monotonic_ns() when the header had arrived


# One decoder over the union makes the `type` tag required (decode_payload checks it); as cheap as Step's alone.
_DECODER = msgspec.msgpack.Decoder(Message)
_PAYLOAD_ENCODER = msgspec.msgpack.Encoder()
_TYPE_OF = {cls: t for t, cls in MESSAGE_TYPES.items()}
_MSG_TYPE = {int(t): t for t in MESSAGE_TYPES}


def parse_header(header: bytes | memoryview, max_frame_bytes: int) -> tuple[MsgType, int, int]:
    """(message type, request id, payload length) of a header, or FrameError naming what is wrong."""
    magic, version, mtype, flags, reserved, request_id, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r} (want {MAGIC!r}): not a dspark-ray stream")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(f"protocol version {version} in frame header, this side speaks {PROTOCOL_VERSION}")
    known = _MSG_TYPE.get(mtype)
    if known is None:
        raise FrameError(f"unknown message type {mtype}")
    if flags:
        raise FrameError(f"unknown flags 0x{flags:04x} (version {PROTOCOL_VERSION} defines none)")
    if reserved:
        raise FrameError(f"reserved header field is {reserved}, must be 0")
    if HEADER_SIZE + length > max_frame_bytes:
        raise FrameError(f"frame of {HEADER_SIZE + length} bytes > limit {max_frame_bytes}")
    return known, request_id, length


def decode_payload(mtype: MsgType, payload: bytes | memoryview) -> object:
    """The message in `payload`, which must be the header's type `mtype`; PayloadError naming what is wrong."""
    try:
        msg = _DECODER.decode(payload)
    except msgspec.DecodeError as e:     # ValidationError is a DecodeError
        raise PayloadError(mtype, f"undecodable {mtype.name} payload ({len(payload)} bytes): {e}") from None
    if type(msg) is not MESSAGE_TYPES[mtype]:
        got = _TYPE_OF[type(msg)]
        raise PayloadError(mtype, f"undecodable {mtype.name} payload ({len(payload)} bytes): its `type` is "
                                  f"{int(got)} ({got.name}), the header's is {int(mtype)}")
    return msg


def decode_frame(buf: bytes | memoryview, max_frame_bytes: int) -> tuple[int, object]:
    """(request id, message) of `buf`, exactly one frame (a ring's message or completion); FrameError otherwise."""
    if len(buf) < HEADER_SIZE:
        raise FrameError(f"message of {len(buf)} bytes: shorter than a frame header")
    mtype, request_id, length = parse_header(buf[:HEADER_SIZE], max_frame_bytes)
    if HEADER_SIZE + length != len(buf):
        raise FrameError(f"message of {len(buf)} bytes holds a frame of {HEADER_SIZE + length}")
    try:
        return request_id, decode_payload(mtype, memoryview(buf)[HEADER_SIZE:])
    except PayloadError as e:
        e.request_id = request_id
        raise


class FrameWriter:
    """Encodes messages into one reused buffer: header and payload contiguous, so a frame is one send."""

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES):
        self.max_frame_bytes = max_frame_bytes
        self._enc = msgspec.msgpack.Encoder()
        self._buf = bytearray(FIRST_BUFFER_BYTES)

    def pack(self, msg: object, request_id: int) -> int:
        mtype = _TYPE_OF.get(type(msg))
        if mtype is None:
            raise TypeError(f"{type(msg).__name__} is not a contract message")
        self._enc.encode_into(msg, self._buf, HEADER_SIZE)   # leaves room for the header, resizes as needed
        n = len(self._buf)
        if n > self.max_frame_bytes:
            raise FrameError(f"{mtype.name} frame of {n} bytes > limit {self.max_frame_bytes}")
        HEADER.pack_into(self._buf, 0, MAGIC, PROTOCOL_VERSION, mtype, 0, 0, request_id, n - HEADER_SIZE)
        return n

    def send(self, sendall: Callable[[memoryview], None], msg: object, request_id: int) -> int:
        """Encode `msg` and hand the frame to `sendall` (e.g. socket.sendall) in one call; returns its size."""
        n = self.pack(msg, request_id)
        # The view must be released before the next encode resizes the buffer (a live export forbids a resize).
        with memoryview(self._buf) as whole, whole[:n] as frame:
            sendall(frame)
        return n

    def encode(self, msg: object, request_id: int) -> bytes:
        """The frame as a copy (tests, tools); `send` avoids the copy."""
        n = self.pack(msg, request_id)
        return bytes(self._buf[:n])


def encode_payload(msg: object) -> bytes:
    return _PAYLOAD_ENCODER.encode(msg)


def encode(msg: object, request_id: int = 0, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """One frame as bytes (tests, tools); hot paths keep a FrameWriter."""
    return FrameWriter(max_frame_bytes).encode(msg, request_id)


class FrameReader:
    """Reads one header, then its payload, into reused buffers; `recv_into` has socket.recv_into's contract.
    A recv without progress within the socket's timeout is a FrameError mid-frame, and so is a frame not whole within
    `frame_timeout_s` of its first bytes (None: no bound). `admit(type, frame bytes)` judges each header before any
    payload is read: a reason it returns is a FrameError. Between frames the reader passes a timeout through, or with
    `wait_between_frames` waits on, up to `idle_timeout_s` (IdleTimeout; None: for ever). `idle_wait(left)`, called
    before each read at a frame boundary with the idle bound's seconds left, may wait for bytes itself and return
    False when none came within them: the bound then holds to the poll's precision, not to the socket's timeout.
    """

    def __init__(self, recv_into: Callable[[memoryview], int], max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 wait_between_frames: bool = False, idle_timeout_s: float | None = None,
                 frame_timeout_s: float | None = None,
                 admit: Callable[[MsgType, int], str | None] | None = None,
                 idle_wait: Callable[[float], bool] | None = None):
        self.max_frame_bytes = max_frame_bytes
        self.idle_wait = idle_wait
        self._recv_into = recv_into
        self._restart = getattr(recv_into, "restart", None)
        self._wait_between_frames = wait_between_frames
        self.idle_timeout_s = idle_timeout_s
        self.frame_timeout_s = frame_timeout_s
        self.admit = admit
        self._waiting_since = 0.0
        self._deadline: float | None = None        # monotonic s by which the frame being read must be whole
        self._header = memoryview(bytearray(HEADER_SIZE))
        self._payload = bytearray(FIRST_BUFFER_BYTES)     # grows with what arrived, never shrinks
        self.last_length = 0

    def read(self) -> Frame:
        """The next frame; ConnectionClosed at a clean end, PayloadError or FrameError (the stream out of step)."""
        if self._restart is not None:        # a polling recv spins from here (spinning_recv_into)
            self._restart()
        self._waiting_since = time.monotonic()
        self._deadline = None
        self._fill(self._header, "header")
        received_ns = time.monotonic_ns()
        mtype, request_id, length = parse_header(self._header, self.max_frame_bytes)
        if self.admit is not None:
            why = self.admit(mtype, HEADER_SIZE + length)
            if why:
                raise FrameError(why)
        if self._deadline is None and self.frame_timeout_s is not None:
            self._deadline = received_ns / 1e9 + self.frame_timeout_s
        payload = self._read_payload(length)
        self.last_length = length
        try:
            return Frame(request_id, decode_payload(mtype, payload), received_ns)
        except PayloadError as e:
            e.request_id = request_id
            raise

    def last_payload(self) -> memoryview:
        """The last frame's payload, in the reader's buffer (the next `read` overwrites it)."""
        return memoryview(self._payload)[:self.last_length]

    def _read_payload(self, length: int) -> memoryview:
        buf = self._payload
        if length <= len(buf):
            view = memoryview(buf)[:length]
            self._fill(view, "payload")
            return view
        # A header's length is a claim: the buffer doubles only as arriving bytes fill it. A new buffer each time,
        # as the last frame's decoded message may still view the old one.
        got = 0
        while got < length:
            if got == len(buf):
                grown = bytearray(min(length, 2 * len(buf)))
                grown[:got] = buf
                buf = grown
            got += self._fill(memoryview(buf)[got:min(length, len(buf))], "payload", got, length)
        self._payload = buf
        return memoryview(buf)[:length]

    def _fill(self, view: memoryview, part: str, done: int = 0, total: int | None = None) -> int:
        """Fill `view` whole: bytes `done` .. `done + len(view)` of the frame's `total`-byte `part`."""
        got = 0
        total = len(view) if total is None else total
        at_boundary = part == "header"
        while got < len(view):
            if at_boundary and got == 0 and self._wait_between_frames and self.idle_wait is not None and \
                    self.idle_timeout_s is not None:
                if not self.idle_wait(self.idle_timeout_s - (time.monotonic() - self._waiting_since)):
                    raise IdleTimeout(f"no request for {self.idle_timeout_s:g} s")
            try:
                n = self._recv_into(view[got:])
            except (TimeoutError, BlockingIOError):
                if at_boundary and got == 0:
                    if not self._wait_between_frames:
                        raise
                    idle = self.idle_timeout_s
                    if idle is not None and time.monotonic() - self._waiting_since >= idle:
                        raise IdleTimeout(f"no request for {idle:g} s") from None
                    continue
                raise FrameError(f"stalled frame: no progress after {done + got} of {total} {part} bytes") from None
            if n == 0:
                if at_boundary and got == 0:
                    raise ConnectionClosed("peer closed the connection")
                raise FrameError(f"truncated frame: stream ended after {done + got} of {total} {part} bytes")
            got += n
            if got < len(view) and self.frame_timeout_s is not None:     # a part of a frame: its clock runs
                now = time.monotonic()
                if self._deadline is None:
                    self._deadline = now + self.frame_timeout_s
                elif now > self._deadline:
                    raise FrameError(f"slow frame: {done + got} of {total} {part} bytes after the frame's bound of "
                                     f"{self.frame_timeout_s:g} s")
        return got


def bound_blocking_io(sock: socket.socket, timeout_s: float | None) -> None:
    """Bound each recv and send on blocking `sock` by `timeout_s` without progress (SO_RCVTIMEO: BlockingIOError).
    Unlike a Python socket timeout, no poll per call, and MSG_DONTWAIT still works per call."""
    sock.settimeout(None)
    if timeout_s is None:
        return
    tv = struct.pack("ll", int(timeout_s), int(timeout_s % 1 * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def spinning_recv_into(sock: socket.socket, spin_us: float, gate=None,
                       idle: Callable[[Callable[[], bool]], None] | None = None) -> Callable[[memoryview], int]:
    """`sock.recv_into` that polls for `spin_us` before it blocks (waking a blocked thread costs tens of us:
    docs/engine.md, "Measurements behind the step path"). The spin counts from the last bytes or `recv.restart()`,
    so an idle connection blocks at once. `gate` (a semaphore) bounds the threads that poll at once; `idle(ready)`
    runs between polls (keep_warm.py), `ready()` saying whether bytes came."""
    if spin_us <= 0:
        return sock.recv_into
    spin_ns = int(spin_us * 1e3)
    recv_into, dontwait, clock = sock.recv_into, socket.MSG_DONTWAIT, time.monotonic_ns
    ready = None
    if idle is not None:
        poller = select.poll()
        poller.register(sock, select.POLLIN)

        def ready() -> bool:
            return bool(poller.poll(0))

    last = [clock()]

    def recv(view: memoryview) -> int:
        deadline = last[0] + spin_ns
        if clock() < deadline and (gate is None or gate.acquire(blocking=False)):
            try:
                while True:
                    try:
                        n = recv_into(view, 0, dontwait)
                        last[0] = clock()
                        return n
                    except BlockingIOError:
                        if clock() > deadline:
                            break
                        if idle is not None:
                            idle(ready)
            finally:
                if gate is not None:
                    gate.release()
        try:                                  # bytes already waiting: not a read that slept
            n = recv_into(view, 0, dontwait)
        except BlockingIOError:
            recv.blocked += 1
            recv.slept = True
            n = recv_into(view)
        last[0] = clock()
        return n

    def restart() -> None:
        last[0] = clock()
        recv.slept = False
    recv.restart = restart
    recv.blocked = 0          # reads that outlasted the spin (or found the gate taken) and blocked
    recv.slept = False        # whether one did since the last restart() (the frame being read)
    return recv
