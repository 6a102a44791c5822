"""What travels through the shared-memory step ring: one batch to every rank, one result record back from each.

msgspec msgpack with raw little-endian bytes for arrays (the same encoding as the wire contract). A rank decodes the
arrays as memoryviews of the ring's slot (msgspec decodes `bin` into a view of its input), so its entries read the
taps in place: no copy until the staging into the pinned upload buffer. They are valid until the rank completes
the step.
"""
from __future__ import annotations

import warnings

import msgspec
import numpy as np
import torch

from .engine import EntryOut, StepEntry

# Completion status words (the ring's per-rank status).
STATUS_OK = 0
STATUS_STEP_FAILED = 1      # the step failed, the pair is still in step (latch open)
STATUS_BROKEN = 2           # the engine's health latch is closed: restart the rank


class RankEntry(msgspec.Struct, array_like=True, gc=False):
    slot: int
    seed: int
    n_out: int
    start: int
    token_ids: memoryview       # int32 LE (encodes from bytes too)
    taps: memoryview            # fp16 LE, rows x taps_width
    rollback_to: int
    want_margins: bool


class RankBatch(msgspec.Struct, array_like=True, gc=False):
    resets: list[int]           # slots whose context is forgotten before the entries run (acquire, release, resync)
    entries: list[RankEntry]


class RankResult(msgspec.Struct, array_like=True, gc=False):
    code: int                   # engine.OK / engine.BAD_ENTRY
    reason: str
    drafts: bytes               # int32 x n_out
    confidences: bytes          # fp32 x n_out
    margins: bytes              # fp32 x n_out, or empty
    confident_len: int


class RankReply(msgspec.Struct, array_like=True, gc=False):
    results: list[RankResult]
    error: str = ""


# The rank's taps are read-only views on purpose (see to_step_entries); torch's warning about them is noise. (A
# catch_warnings block per step would cost ~4 us.)
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

_enc = msgspec.msgpack.Encoder()
_batch_dec = msgspec.msgpack.Decoder(RankBatch)
_reply_dec = msgspec.msgpack.Decoder(RankReply)


def encode(msg) -> bytes:
    return _enc.encode(msg)


def decode_batch(buf) -> RankBatch:
    return _batch_dec.decode(buf)


def decode_reply(buf) -> RankReply:
    return _reply_dec.decode(buf)


_NO_IDS = torch.zeros(0, dtype=torch.int32)


def to_step_entries(batch: RankBatch, taps_width: int) -> list[StepEntry]:
    """The batch's entries as the engine takes them: the token ids (int32) and the taps are read-only views of the
    batch's buffer (the engine only reads them). Few torch calls: this runs on every step's critical path, with the
    caches cold from the wait before it (each call costs several times its hot-loop time there)."""
    out = []
    for e in batch.entries:
        # (torch.frombuffer refuses an empty buffer; a count that does not match the taps is the engine's check)
        ids = torch.frombuffer(e.token_ids, dtype=torch.int32) if len(e.token_ids) else _NO_IDS
        taps = torch.frombuffer(e.taps, dtype=torch.float16).view(-1, taps_width) if len(e.taps) else \
            torch.zeros(0, taps_width, dtype=torch.float16)
        out.append(StepEntry(e.slot, e.seed, e.n_out, e.start, ids, taps, e.rollback_to, e.want_margins))
    return out


def _bytes(a: np.ndarray, dtype: str) -> bytes:
    # The engine's answers are host arrays in the contract's dtypes already (engine.EntryOut): one copy.
    return a.astype(dtype, copy=False).tobytes()


def to_rank_results(outs: list[EntryOut]) -> list[RankResult]:
    res = []
    for o in outs:
        if o.drafts is None:
            res.append(RankResult(o.code, o.reason, b"", b"", b"", 0))
            continue
        res.append(RankResult(o.code, o.reason, _bytes(o.drafts, "<i4"), _bytes(o.confidences, "<f4"),
                              _bytes(o.margins, "<f4") if o.margins is not None else b"", o.confident_len))
    return res
