"""What travels through the shared-memory step ring: one batch to every rank, one reply back from each.

The records are the contract's own: a batch carries the `contract.Entry`s the front-end checked and admitted, a
reply the `contract.EntryResult`s, encoded as on the wire (msgspec msgpack, raw little-endian bytes for arrays). A
rank decodes an entry's arrays as memoryviews of the ring's slot (msgspec decodes `bin` into a view of its input),
so it reads the taps in place, valid until it completes the step.

The front-end is the one account of where each slot stands (`model.state.SlotCursor`): a batch hands the ranks
each entry's placement, the slot's (base, position) once the entry has run, and they take it as given.
"""
from __future__ import annotations

import msgspec

from .contract import Entry, EntryResult

# Completion status words (the ring's per-rank status).
STATUS_OK = 0
STATUS_STEP_FAILED = 1      # the step failed, the pair is still in step (latch open)
STATUS_BROKEN = 2           # the engine's health latch is closed: restart the rank

# A decode round's entry carries its seed and accepted drafts: at most this many rows of taps (the ranks' graphs
# size their insert buffers by it, the front-end its ring slots).
STEP_INSERT_ROWS = 8


def ring_slot_bytes(limits) -> int:
    """A ring slot that holds a decode round of the widest batch in place; a larger batch spills to a segment of
    its own, created and faulted in per message."""
    round_bytes = limits.max_entries_per_replay * (STEP_INSERT_ROWS * (2 * limits.taps_width + 4) + 256)
    return max(1 << 20, -(-(round_bytes + 4096) // 4096) * 4096)


class RingBatch(msgspec.Struct, array_like=True, gc=False):
    resets: list[int]                   # slots whose context is forgotten before the entries run (acquire, resync)
    entries: list[Entry]                # checked by the front-end: a rank runs them as they are
    placed: list[tuple[int, int]]       # per entry: its slot's (base, position) after it (SlotCursor.after)

    def head(self, n: int) -> "RingBatch":
        """The batch's first n entries (keep_warm.py rehearses a sample)."""
        return RingBatch(self.resets, self.entries[:n], self.placed[:n])


class RingReply(msgspec.Struct, array_like=True, gc=False):
    results: list[EntryResult]          # one per entry, in order (generation is the front-end's to fill in)
    error: str = ""                     # why the step failed (results then empty)


_enc = msgspec.msgpack.Encoder()
_batch_dec = msgspec.msgpack.Decoder(RingBatch)
_reply_dec = msgspec.msgpack.Decoder(RingReply)


def encode(msg: RingBatch | RingReply) -> bytes:
    return _enc.encode(msg)


def decode_batch(buf) -> RingBatch:
    return _batch_dec.decode(buf)


def decode_reply(buf) -> RingReply:
    return _reply_dec.decode(buf)
