"""The drafter client a serving engine embeds: one blocking TCP connection, one request at a time (the protocol:
docs/contract.md). It needs msgspec and numpy only, so an engine can vendor it.

    with DrafterClient(host, port, token=TOKEN) as c:      # TOKEN: the deployment's (docs/operations.md, "Security")
        c.hello(config_digest=..., tp=2)
        grants = c.acquire(4)
        results = c.step([make_entry(slot=g.slot, generation=g.generation, ...) for g in grants], deadline_ms=5)
        drafts = results[0].drafts_array()

Per-entry codes come back in the results; a refused request or a lost connection raises `ClientError`. After a
timeout or a broken frame the connection is closed: a late reply could be read as the next request's answer.
"""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import msgspec

from ..protocol.contract import (MAX_HELLO_FRAME_BYTES, SHM_RING_PREFIX, Acquire, AcquireReply, Code, Entry, EntryResult,
                       ErrorReply, Hello, HelloReply, Limits, Release, ReleaseReply, ShmAttach, ShmAttachReply,
                       SlotGrant, Step, StepReply, make_entry)
from ..protocol.wire import (HEADER_SIZE, ConnectionClosed, FrameError, FrameReader, FrameWriter, bound_blocking_io,
                   decode_frame, spinning_recv_into)

__all__ = ["DrafterClient", "ClientError", "PendingStep", "RequestSlot", "make_entry"]

# msgpack overhead of one Entry beyond its two byte strings (field names, ints): generous, used to split STEPs.
_ENTRY_OVERHEAD = 160


class ClientError(RuntimeError):
    """A refused request (`code` says why) or a lost / broken connection (`code` is None). `reason`: the refusal's
    own words, as the server sent them (the message adds who refused); the message itself where this side refused."""

    def __init__(self, message: str, code: Code | None = None, reason: str | None = None):
        super().__init__(message)
        self.code = code
        self.reason = message if reason is None else reason


class DrafterClient:
    def __init__(self, host: str, port: int, timeout_s: float = 5.0, spin_us: float = 0.0, shm: bool = False,
                 token: str | None = None):
        """`timeout_s`: the bound on each send and receive without progress. `spin_us`: how long to poll for a reply
        before blocking (waking a blocked thread costs tens of us; polling costs a core); ~3000 covers a GPU pair's
        step, 0 blocks at once. `shm`: after HELLO, send requests through a shared-memory ring (the drafter on this
        host; HELLO raises ClientError when the server cannot attach it). `token`: the deployment's, sent in HELLO
        (None: none, for a deployment served --insecure)."""
        self.endpoint = f"{host}:{port}"
        self._token = token or ""
        self.timeout_s = timeout_s
        self.spin_us = spin_us
        self._want_shm = shm
        self._ring = None
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as e:
            raise ClientError(f"cannot connect to drafter at {self.endpoint}: {e}") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        bound_blocking_io(self._sock, timeout_s)
        self._reader = FrameReader(spinning_recv_into(self._sock, spin_us))
        self._writer = FrameWriter(MAX_HELLO_FRAME_BYTES)      # a larger frame before HELLO closes the connection
        self._lock = threading.Lock()      # one request in flight: replies are matched by order and request id
        self._next_id = 1
        self._ring_seq = 0
        self.last_sent_ns = 0
        self.hello_reply: HelloReply | None = None

    @property
    def limits(self) -> Limits:
        if self.hello_reply is None or self.hello_reply.limits is None:
            raise ClientError("no limits yet: call hello() first")
        return self.hello_reply.limits

    def hello(self, *, model_digest: str | None = None, config_digest: str | None = None, tp: int | None = None,
              max_model_len: int | None = None, client: str = "dspark-ray-client") -> HelloReply:
        """Open the session; raises ClientError(UNAUTHORIZED / CONFIG_MISMATCH) when the worker refuses (after
        UNAUTHORIZED the connection is closed)."""
        reply = self._call(Hello(model_digest=model_digest, config_digest=config_digest, tp=tp,
                                 max_model_len=max_model_len, client=client, token=self._token), HelloReply)
        if not reply.ok:
            if reply.code == Code.UNAUTHORIZED:
                self.close()
            raise ClientError(f"HELLO refused by {self.endpoint}: {reply.code.name}: {reply.reason}", reply.code,
                              reply.reason)
        self.hello_reply = reply
        self._reader.max_frame_bytes = self._writer.max_frame_bytes = reply.limits.max_frame_bytes
        if self._want_shm and self._ring is None:
            self._attach_shm()
        return reply

    def _attach_shm(self) -> None:
        from ..transport.ring import StepRing
        # A slot holds a decode round's STEP (a larger one spills); a completion the largest STEP_REPLY.
        ring = StepRing.create(SHM_RING_PREFIX, 1, slot_bytes=1 << 20, n_slots=2, completion_bytes=256 << 10,
                               spin_us=max(self.spin_us, 50.0), max_message_bytes=self.limits.max_frame_bytes)
        h = ring.handle
        try:
            reply = self._call(ShmAttach(name=h.name, n_slots=h.n_slots, slot_bytes=h.slot_bytes,
                                         completion_bytes=h.completion_bytes, bell_dir=h.bell_dir, spin_us=h.spin_us,
                                         nap_s=h.nap_s, max_message_bytes=h.max_message_bytes), ShmAttachReply)
        except BaseException:
            ring.unlink()
            raise
        if not reply.ok:
            ring.unlink()
            raise ClientError(f"SHM_ATTACH refused by {self.endpoint}: {reply.reason}")
        self._ring = ring

    def acquire(self, n: int = 1) -> list[SlotGrant]:
        """n fresh slots with their generations; ClientError(OVERLOADED) when fewer are free, ClientError(BAD_ENTRY)
        when n is outside 1..slot_capacity (it can never be granted)."""
        return self._call(Acquire(n=n), AcquireReply).slots

    def release(self, slots: Sequence[int]) -> list[int]:
        return self._call(Release(slots=[int(s) for s in slots]), ReleaseReply).released

    def step(self, entries: Sequence[Entry], deadline_ms: float = 100.0) -> list[EntryResult]:
        """One `EntryResult` per entry, in order. Entries beyond the worker's limits go as several STEPs, which
        changes no answer (batch invariance)."""
        return self.step_end(self.step_begin(entries, deadline_ms))

    def step_begin(self, entries: Sequence[Entry], deadline_ms: float = 100.0) -> "PendingStep":
        """Send the STEP without waiting for its answer (one thread can so drive several workers); `step_end` reads
        it. Until then this client takes no other request."""
        chunks = self._chunks(entries)
        self._lock.acquire()
        try:
            request_id = self._send(Step(entries=chunks[0], deadline_ms=deadline_ms))
        except BaseException:
            self._lock.release()
            raise
        # The chunks sent later must not see their caller's arrays change meanwhile (entries may view them).
        rest = [[msgspec.structs.replace(e, token_ids=bytes(e.token_ids), taps=bytes(e.taps)) for e in c]
                for c in chunks[1:]]
        return PendingStep(request_id, rest, deadline_ms)

    def step_end(self, pending: "PendingStep") -> list[EntryResult]:
        """The answers to a `step_begin`'s STEP (and to the STEPs its entries were split into beyond the limits)."""
        try:
            results = list(self._receive(pending.request_id, "Step", StepReply).results)
        finally:
            self._lock.release()
        for chunk in pending.rest:
            results.extend(self._call(Step(entries=chunk, deadline_ms=pending.deadline_ms), StepReply).results)
        return results

    def request(self, n_out: int = 5, deadline_ms: float = 100.0) -> "RequestSlot":
        """A slot for one live request, kept in step with its context (`RequestSlot`); acquired now."""
        return RequestSlot(self, n_out, deadline_ms)

    def close(self) -> None:
        if self._ring is not None:
            ring, self._ring = self._ring, None
            ring.unlink()
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> "DrafterClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _chunks(self, entries: Sequence[Entry]) -> list[list[Entry]]:
        if self.hello_reply is None:
            return [list(entries)]
        lim = self.limits
        budget = lim.max_frame_bytes - HEADER_SIZE - 64
        chunks: list[list[Entry]] = [[]]
        size = 0
        for e in entries:
            n = len(e.token_ids) + len(e.taps) + _ENTRY_OVERHEAD
            if chunks[-1] and (len(chunks[-1]) >= lim.max_entries_per_step or size + n > budget):
                chunks.append([])
                size = 0
            chunks[-1].append(e)
            size += n
        return chunks

    def _call(self, msg: object, reply_type: type):
        with self._lock:
            return self._receive(self._send(msg), type(msg).__name__, reply_type)

    def _send(self, msg: object) -> int:
        request_id = self._next_id
        self._next_id += 1
        (self._send_tcp if self._ring is None else self._send_ring)(msg, request_id, type(msg).__name__)
        return request_id

    def _receive(self, request_id: int, name: str, reply_type: type):
        got_id, reply = self._receive_tcp(name) if self._ring is None else self._receive_ring(name)
        if got_id == 0 and isinstance(reply, ErrorReply):
            # The server's last word before it closes the connection (limit, idle, version): lost, with a reason.
            self.close()
            raise ClientError(f"{name} to {self.endpoint}: the server closed the connection: {reply.code.name}: "
                              f"{reply.reason}")
        if got_id != request_id:
            self.close()
            raise ClientError(f"{name} to {self.endpoint}: reply to request {got_id}, expected {request_id}")
        if isinstance(reply, ErrorReply):
            raise ClientError(f"{name} refused by {self.endpoint}: {reply.code.name}: {reply.reason}", reply.code,
                              reply.reason)
        if not isinstance(reply, reply_type):
            self.close()
            raise ClientError(f"{name} to {self.endpoint}: got {type(reply).__name__}, expected {reply_type.__name__}")
        return reply

    def _send_tcp(self, msg: object, request_id: int, name: str) -> None:
        try:
            self._writer.send(self._sock.sendall, msg, request_id)
            self.last_sent_ns = time.monotonic_ns()
        except FrameError as e:      # refused by the encoder before a byte was sent: the stream is intact
            raise ClientError(f"{name} not sent to {self.endpoint}: {e}") from None
        except OSError as e:
            self.close()
            raise ClientError(f"{name} to {self.endpoint}: connection lost while sending: {e}") from None

    def _receive_tcp(self, name: str) -> tuple[int, object]:
        try:
            got_id, reply, _ = self._reader.read()
        except FrameError as e:
            self.close()
            raise ClientError(f"{name} to {self.endpoint}: bad reply frame: {e}") from None
        except (socket.timeout, BlockingIOError):     # SO_RCVTIMEO ran out: no progress within timeout_s
            self.close()
            raise ClientError(f"{name} to {self.endpoint}: no answer within {self.timeout_s} s") from None
        except (ConnectionClosed, OSError) as e:
            self.close()
            raise ClientError(f"{name} to {self.endpoint}: connection lost: {e}") from None
        return got_id, reply

    def _send_ring(self, msg: object, request_id: int, name: str) -> None:
        from ..transport.ring import RingError
        try:
            seqs: list[int] = []        # the frame is a view of the writer's buffer: published (copied) at once
            self._writer.send(lambda frame: seqs.append(self._ring.publish(frame, self.timeout_s)), msg, request_id)
            self.last_sent_ns = time.monotonic_ns()
        except FrameError as e:
            raise ClientError(f"{name} not sent to {self.endpoint}: {e}") from None
        except RingError as e:
            self.close()
            raise ClientError(f"{name} to {self.endpoint} through shared memory: {e}") from None
        self._ring_seq = seqs[0]

    def _receive_ring(self, name: str) -> tuple[int, object]:
        from ..transport.ring import RingError
        from ..transport.shm import STATUS_BAD_FRAME
        try:
            ((status, payload),) = self._ring.wait_completions(self._ring_seq, self.timeout_s, self.spin_us or None)
        except RingError as e:
            self.close()
            raise ClientError(f"{name} to {self.endpoint} through shared memory: {e}") from None
        if status == STATUS_BAD_FRAME:
            self.close()
            raise ClientError(f"{name} to {self.endpoint}: the server refused the frame and ended the session")
        try:
            return decode_frame(payload, self._reader.max_frame_bytes)
        except FrameError as e:
            self.close()
            raise ClientError(f"{name} to {self.endpoint}: bad reply frame: {e}") from None


@dataclass
class PendingStep:
    """A STEP sent by `DrafterClient.step_begin`, its answer not read yet."""
    request_id: int
    rest: list[list[Entry]]         # the chunks beyond the first (sent one after the other by step_end)
    deadline_ms: float


class RequestSlot:
    """One live request's slot, kept in step with its context: the contract's re-insert rules in one place.
    `step(ids, taps, seed)` takes the whole context (token ids and their taps) and sends only what the slot lacks; a
    resync re-inserts the last window, a slot too far behind is swapped for a fresh one. It returns the EntryResult
    (no drafts unless OK). To batch requests into one STEP: `entry(...)` each, one `client.step`, `answer(r)` each.
    """

    def __init__(self, client: DrafterClient, n_out: int = 5, deadline_ms: float = 100.0,
                 grant: SlotGrant | None = None, want_margins: bool = False):
        self.client, self.n_out, self.deadline_ms, self.want_margins = client, n_out, deadline_ms, want_margins
        (self.grant,) = (grant,) if grant is not None else client.acquire(1)
        self.held = 0               # the first context row the slot lacks
        self.fresh = True           # the slot holds nothing (acquired or resynced): it takes the last window
        self._end = 0               # the context's end that the entry in flight brings the slot to

    def entry(self, ids, taps, seed: int, first: int = 0) -> Entry:
        """The entry that brings the slot up to the context (`ids[0]` at position `first`) and drafts from `seed`."""
        lim = self.client.limits
        self._end = end = first + len(ids)
        if not self.fresh and (end - self.held > lim.max_rows_per_entry or self.held < first):
            self.client.release([self.grant.slot])
            (self.grant,), self.fresh = self.client.acquire(1), True
        start = max(first, end - lim.sliding_window) if self.fresh else self.held    # the drafter reads no further
        return make_entry(slot=self.grant.slot, generation=self.grant.generation, seed_token=seed, start_pos=start,
                          token_ids=ids[start - first:], taps=taps[start - first:], n_out=self.n_out,
                          want_margins=self.want_margins, copy=False)

    def answer(self, r: EntryResult) -> EntryResult:
        """Take the answer to `entry`'s entry: the slot holds the context when OK; a new generation empties it."""
        if r.code == Code.OK:
            self.held, self.fresh = self._end, False
        elif r.generation != self.grant.generation:      # resynced: quote the new generation, re-insert
            self.grant, self.fresh = SlotGrant(slot=self.grant.slot, generation=r.generation), True
        return r

    def step(self, ids, taps, seed: int) -> EntryResult:
        (r,) = self.client.step([self.entry(ids, taps, seed)], deadline_ms=self.deadline_ms)
        return self.answer(r)

    def release(self) -> None:
        self.client.release([self.grant.slot])

    def __enter__(self) -> "RequestSlot":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
