"""What travels through the shared-memory step ring: one batch to every rank (only what the ranks read of each
checked entry, and its slot's placement from the front-end's `SlotCursor`), one reply back from each. Encoded as on
the wire; msgspec decodes `bin` into a view of its input, so a rank reads the taps in place until it completes.
"""
from __future__ import annotations

import msgspec
import numpy as np

from .contract import TAP_DTYPE, Entry, EntryResult

STATUS_OK = 0
STATUS_STEP_FAILED = 1      # the step failed, the pair is still in step (latch open)
STATUS_BROKEN = 2           # the engine's health latch is closed: restart the rank

# Rows of taps a decode round's entry carries at most (its seed and accepted drafts): sizes graphs and ring slots.
STEP_INSERT_ROWS = 8


def ring_slot_bytes(limits) -> int:
    """A ring slot that holds a decode round of the widest batch in place (a larger one spills to a segment)."""
    round_bytes = limits.max_entries_per_replay * (STEP_INSERT_ROWS * 2 * limits.taps_width + 256)
    return max(1 << 20, -(-(round_bytes + 4096) // 4096) * 4096)


class RingEntry(msgspec.Struct, array_like=True, gc=False):
    """Insert the taps' rows at start_pos, place the slot at (base, position), draft n_out from seed_token."""
    slot: int
    seed_token: int
    n_out: int
    want_margins: bool
    start_pos: int                      # position of the first inserted row
    taps: memoryview                    # fp16 LE, rows x taps_width (a view of the ring's slot on a rank)
    base: int                           # the slot's first position held after the entry (-1: fresh)
    position: int                       # the slot's position after the entry: where the seed sits

    @staticmethod
    def of(e: Entry, placed: tuple[int, int]) -> "RingEntry":
        """The ranks' part of a checked entry, its slot at `placed` (SlotCursor.after) once it ran."""
        return RingEntry(e.slot, e.seed_token, e.n_out, e.want_margins, e.start_pos, e.taps, *placed)

    def taps_array(self, taps_width: int) -> np.ndarray:
        """The inserted taps, a zero-copy read-only fp16 view (rows, taps_width)."""
        return np.frombuffer(self.taps, TAP_DTYPE).reshape(-1, taps_width)


class RingBatch(msgspec.Struct, array_like=True, gc=False):
    resets: list[int]                   # slots whose context is forgotten before the entries run (acquire, resync)
    entries: list[RingEntry]            # a slot at most once

    def shape(self) -> tuple[int, int, bool]:
        """The batch as the ranks' graphs key it: its requests, the widest n_out, whether any entry wants margins
        (the one definition: the front-end records it, a rank drafts by it)."""
        es = self.entries
        return len(es), max((e.n_out for e in es), default=0), any(e.want_margins for e in es)

    def head(self, n: int) -> "RingBatch":
        """The batch's first n entries (keep_warm.py rehearses a sample)."""
        return RingBatch(self.resets, self.entries[:n])


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
