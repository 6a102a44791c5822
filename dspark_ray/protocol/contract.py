"""The STEP / HELLO contract: messages, limits, codes and the stateless checks (normative: docs/contract.md).
Tensors travel as raw little-endian bytes a receiver views with `np.frombuffer`. Only msgspec and numpy are imported,
so an engine can vendor the client. `StepHandler` is the seam between a transport and the front-end.
"""
from __future__ import annotations

import enum
import sys
from typing import Any, Protocol, Union

import msgspec
import numpy as np

from .finite import first_nonfinite_row

PROTOCOL_VERSION = 2
# Before an accepted HELLO a connection may send one frame of at most this many bytes, header included: a stranger
# costs no buffer larger than a HELLO (docs/contract.md, section 1). A HELLO is a few hundred bytes.
MAX_HELLO_FRAME_BYTES = 4096

TOKEN_DTYPE = np.dtype("<i4")
TAP_DTYPE = np.dtype("<f2")
FLOAT_DTYPE = np.dtype("<f4")


class Code(enum.IntEnum):
    """Answer codes. Per entry in `EntryResult.code`, per request in `ErrorReply.code` / `HelloReply.code`."""
    OK = 0
    BAD_ENTRY = 1          # a field breaks a rule (reason names it): that entry fails alone (ErrorReply: the request)
    STALE_GENERATION = 2   # the slot was resynced since the client last saw it: re-insert its context
    CONFIG_MISMATCH = 3    # HELLO: the worker serves another model / config / tp / shorter max_model_len
    INTERNAL = 4           # a collective or rank failed: the batch failed closed, its slots were resynced
    UNAVAILABLE = 5        # the pair is restarting or known bad: retry later (then expect STALE_GENERATION)
    OVERLOADED = 6         # ACQUIRE: n <= slot_capacity, but fewer than n slots are free now
    DEADLINE = 7           # the answer could not be given before the STEP's deadline: verify without drafts
    UNAUTHORIZED = 8       # HELLO: no token, or not this deployment's; the connection is closed after the answer


class MsgType(enum.IntEnum):
    HELLO = 1
    HELLO_REPLY = 2
    ACQUIRE = 3
    ACQUIRE_REPLY = 4
    RELEASE = 5
    RELEASE_REPLY = 6
    STEP = 7
    STEP_REPLY = 8
    ERROR_REPLY = 9
    SHM_ATTACH = 10
    SHM_ATTACH_REPLY = 11


class _Strict(msgspec.Struct, forbid_unknown_fields=True):
    """Strict: an unknown field, a missing one or another type is refused (subclasses repeat kw_only: not inherited)."""


class Limits(_Strict, kw_only=True, frozen=True):
    """What a worker accepts; sent in HELLO_REPLY. The client keeps its STEPs inside these."""
    vocab_size: int
    hidden_size: int
    n_taps: int
    slot_capacity: int
    sliding_window: int                 # history rows the draft reads (a fresh slot's insert needs no more)
    max_entries_per_step: int = 64      # per STEP message; the front-end splits a STEP into replays ...
    max_entries_per_replay: int = 16    # ... of at most this many entries (the ranks' widest graph bucket)
    max_rows_per_entry: int = 128
    max_n_out: int = 5
    max_model_len: int = 1 << 20        # positions >= this are refused, rows and drafts
    max_frame_bytes: int = 64 << 20     # a STEP larger than this is split by the client into several STEPs

    @property
    def taps_width(self) -> int:
        """fp16 values per context row: the taps of every tapped trunk layer, concatenated in trunk order."""
        return self.n_taps * self.hidden_size

    @classmethod
    def for_config(cls, cfg: Any, *, slot_capacity: int, **kw: Any) -> "Limits":
        """Limits of a worker serving `cfg` (a `DrafterConfig`; duck-typed so the client need not import config)."""
        kw.setdefault("max_n_out", cfg.block_size)
        kw.setdefault("max_model_len", cfg.max_model_len)
        return cls(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, n_taps=cfg.n_taps,
                   slot_capacity=slot_capacity, sliding_window=cfg.sliding_window, **kw)


class Hello(_Strict, tag=int(MsgType.HELLO), kw_only=True):
    """The first message of a session. A None field is not checked (the client takes whatever is served)."""
    protocol_version: int = PROTOCOL_VERSION
    model_digest: str | None = None
    config_digest: str | None = None
    tp: int | None = None
    max_model_len: int | None = None     # the longest position the client will send; refused if > served
    client: str = ""
    token: str = ""                      # the deployment's token; checked first, never logged

    def __repr__(self) -> str:           # a HELLO in a log line or a test failure shows no token
        shown = ", ".join(f"{f}={getattr(self, f)!r}" for f in self.__struct_fields__ if f != "token")
        return f"Hello({shown}, token={'<set>' if self.token else '<none>'})"


class HelloReply(_Strict, tag=int(MsgType.HELLO_REPLY), kw_only=True):
    ok: bool
    code: Code = Code.OK                 # UNAUTHORIZED or CONFIG_MISMATCH when refused
    reason: str = ""
    protocol_version: int = PROTOCOL_VERSION
    model_digest: str | None = None
    config_digest: str | None = None
    tp: int | None = None
    max_model_len: int | None = None
    worker_generation: int = 0           # bumped on every pair restart
    limits: Limits | None = None         # always set when ok
    session_id: int = 0


def hello_mismatch(msg: Hello, *, model_digest: str | None, config_digest: str | None, tp: int | None,
                   max_model_len: int) -> str | None:
    """The reason to refuse `msg` against what is served (naming the field and both values), or None to accept."""
    if msg.protocol_version != PROTOCOL_VERSION:
        return f"protocol_version: client speaks {msg.protocol_version}, server speaks {PROTOCOL_VERSION}"
    for name, served in (("model_digest", model_digest), ("config_digest", config_digest), ("tp", tp)):
        wanted = getattr(msg, name)
        if wanted is not None and wanted != served:
            return f"{name}: client expects {wanted!r}, server serves {served!r}"
    if msg.max_model_len is not None and msg.max_model_len > max_model_len:
        return f"max_model_len: client needs {msg.max_model_len}, server serves at most {max_model_len}"
    return None


class Acquire(_Strict, tag=int(MsgType.ACQUIRE), kw_only=True):
    n: int                # 1..slot_capacity; more than are free: OVERLOADED


class SlotGrant(_Strict, kw_only=True, frozen=True):
    slot: int
    generation: int       # quote it in every Entry for this slot; STALE_GENERATION once it moves on


class AcquireReply(_Strict, tag=int(MsgType.ACQUIRE_REPLY), kw_only=True):
    slots: list[SlotGrant]


class Release(_Strict, tag=int(MsgType.RELEASE), kw_only=True):
    slots: list[int]


class ReleaseReply(_Strict, tag=int(MsgType.RELEASE_REPLY), kw_only=True):
    released: list[int]


class ErrorReply(_Strict, tag=int(MsgType.ERROR_REPLY), kw_only=True):
    """A request-level refusal: nothing of the request ran."""
    code: Code
    reason: str


class ShmAttach(_Strict, tag=int(MsgType.SHM_ATTACH), kw_only=True):
    """After HELLO: the client's request ring on this host (transport/ring.py; docs/contract.md, section 9)."""
    name: str
    n_slots: int
    slot_bytes: int
    completion_bytes: int
    bell_dir: str
    spin_us: float
    nap_s: float
    max_message_bytes: int


class ShmAttachReply(_Strict, tag=int(MsgType.SHM_ATTACH_REPLY), kw_only=True):
    ok: bool
    reason: str = ""


SHM_RING_PREFIX = "dspark-shm"


class Entry(_Strict, kw_only=True, gc=False):
    """One request's part of a STEP, applied in order: rollback, insert rows, draft (gc=False: holds no cycles)."""
    slot: int
    generation: int
    seed_token: int
    start_pos: int                # position of the first inserted row (not used when no rows are inserted)
    # Decoded as memoryviews of the frame (no copy of the taps); a sender may give bytes or any buffer.
    token_ids: memoryview = b""   # int32 LE, one per inserted row
    taps: memoryview = b""        # fp16 LE, rows x taps_width, row-major
    rollback_to: int = -1         # -1: none; else drop the slot's rows at positions >= rollback_to first
    n_out: int                    # 1..max_n_out drafts wanted (required: the contract does not guess it)
    want_margins: bool = False

    @property
    def rows(self) -> int:
        return len(self.token_ids) // TOKEN_DTYPE.itemsize

    def token_array(self) -> np.ndarray:
        return np.frombuffer(self.token_ids, TOKEN_DTYPE)

    def taps_array(self, taps_width: int) -> np.ndarray:
        return np.frombuffer(self.taps, TAP_DTYPE).reshape(-1, taps_width)


def _as_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):                 # a torch tensor, without importing torch
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def make_entry(*, slot: int, generation: int, seed_token: int, start_pos: int = 0, token_ids: Any = (),
               taps: Any = None, rollback_to: int = -1, n_out: int = 5, want_margins: bool = False,
               copy: bool = True) -> Entry:
    """An Entry from numpy arrays or torch tensors: token_ids (rows,) integers, taps (rows, taps_width) float16
    (never cast here: a cast could round or overflow what the trunk produced); the other fields as in Entry.
    `copy` False: the entry views contiguous little-endian arrays in place (a window's 4 MB at full width is not
    copied twice): leave them unchanged until the entry is sent."""
    ids = _as_numpy(token_ids)
    if ids.size:
        if ids.dtype == object and all(isinstance(t, int) for t in ids.flat):      # Python ints beyond 64 bits
            raise ValueError(f"token id {max(ids.flat, key=abs)} does not fit int32")
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"token_ids must be integers, got {ids.dtype}")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < -(1 << 31) or hi >= 1 << 31:     # a cast would wrap it into some other, valid-looking id
            raise ValueError(f"token id {lo if lo < -(1 << 31) else hi} does not fit int32")

    def as_bytes(a: np.ndarray):
        return a.tobytes() if copy or not a.size else memoryview(a).cast("B")

    tap_bytes = b""
    if taps is not None:
        t = _as_numpy(taps)
        if t.dtype != np.float16:
            raise TypeError(f"taps must be float16, got {t.dtype} (convert on the trunk side, e.g. .half())")
        tap_bytes = as_bytes(np.ascontiguousarray(t, TAP_DTYPE))
    return Entry(slot=int(slot), generation=int(generation), seed_token=int(seed_token), start_pos=int(start_pos),
                 token_ids=as_bytes(np.ascontiguousarray(ids, TOKEN_DTYPE)), taps=tap_bytes,
                 rollback_to=int(rollback_to), n_out=int(n_out), want_margins=bool(want_margins))


class Step(_Strict, tag=int(MsgType.STEP), kw_only=True):
    entries: list[Entry]
    deadline_ms: float            # budget counted from the server's receipt of the frame (required)


class EntryResult(_Strict, kw_only=True, gc=False):
    """The answer to one Entry, in order. Arrays (LE bytes; the *_array views) are empty unless code is OK."""
    code: Code = Code.OK
    reason: str = ""
    generation: int = 0           # the slot's generation now (after a resync: the new one to quote)
    drafts: bytes = b""           # int32 x n_out
    confidences: bytes = b""      # fp32 x n_out: sigmoid of the confidence head
    margins: bytes = b""          # fp32 x n_out (top1 - top2 logit) when asked, else empty
    confident_len: int = 0        # longest prefix of drafts with confidence >= 0.5 (0..n_out)

    def drafts_array(self) -> np.ndarray:
        return np.frombuffer(self.drafts, TOKEN_DTYPE)

    def confidences_array(self) -> np.ndarray:
        return np.frombuffer(self.confidences, FLOAT_DTYPE)

    def margins_array(self) -> np.ndarray:
        return np.frombuffer(self.margins, FLOAT_DTYPE)


def ok_result(*, generation: int, drafts: Any, confidences: Any, margins: Any = None,
              confident_len: int) -> EntryResult:
    """An OK EntryResult from arrays (numpy or torch) of n_out values."""
    return EntryResult(
        generation=generation, confident_len=int(confident_len),
        drafts=np.ascontiguousarray(_as_numpy(drafts), TOKEN_DTYPE).tobytes(),
        confidences=np.ascontiguousarray(_as_numpy(confidences), FLOAT_DTYPE).tobytes(),
        margins=b"" if margins is None else np.ascontiguousarray(_as_numpy(margins), FLOAT_DTYPE).tobytes())


def error_result(code: Code, reason: str, generation: int = 0) -> EntryResult:
    return EntryResult(code=code, reason=reason, generation=generation)


class StepReply(_Strict, tag=int(MsgType.STEP_REPLY), kw_only=True):
    results: list[EntryResult]


Message = Union[Hello, HelloReply, Acquire, AcquireReply, Release, ReleaseReply, Step, StepReply, ErrorReply,
                ShmAttach, ShmAttachReply]
MESSAGE_TYPES: dict[MsgType, type] = {MsgType(t.__struct_config__.tag): t for t in Message.__args__}


_NATIVE_U32 = sys.byteorder == "little" and memoryview(b"\0" * 4).cast("I").itemsize == 4


def _max_u32(buf) -> int:
    """The largest LE uint32 in buf; a Python max up to 64 of them beats numpy (docs/engine.md, "The host path")."""
    if _NATIVE_U32 and len(buf) <= 64 * 4:
        return max(memoryview(buf).cast("B").cast("I"))
    return int(np.frombuffer(buf, np.dtype("<u4")).max())


def draft_reach(slot: int, p0: int, n_out: int, max_model_len: int) -> str | None:
    """Why drafts at p0+1 .. p0+n_out reach past max_model_len, or None; the stateless and the front-end's rule."""
    if p0 + n_out >= max_model_len:
        return (f"slot {slot}: drafts at positions {p0 + 1}..{p0 + n_out} reach past max_model_len {max_model_len} "
                f"(the last position served is {max_model_len - 1}; the seed sits at {p0})")
    return None


def validate_acquire(msg: Acquire, limits: Limits) -> str | None:
    if msg.n < 1:
        return f"acquire: n {msg.n} < 1 (ask for at least one slot)"
    if msg.n > limits.slot_capacity:
        return f"acquire: n {msg.n} > slot_capacity {limits.slot_capacity}: can never be granted"
    return None


def validate_entry(entry: Entry, limits: Limits) -> str | None:
    """Why `entry` breaks a stateless rule, or None (the stateful ones: docs/contract.md, "Entry checks")."""
    s = entry.slot
    if not 0 <= s < limits.slot_capacity:
        return f"slot {s}: slot id outside [0, {limits.slot_capacity})"
    if entry.generation < 0:
        return f"slot {s}: generation {entry.generation} < 0"
    if not 1 <= entry.n_out <= limits.max_n_out:
        return f"slot {s}: n_out {entry.n_out} outside 1..{limits.max_n_out}"
    if not 0 <= entry.seed_token < limits.vocab_size:
        return f"slot {s}: seed token {entry.seed_token} outside [0, vocab {limits.vocab_size})"
    if entry.start_pos < 0:
        return f"slot {s}: start_pos {entry.start_pos} < 0"
    if entry.rollback_to < -1:
        return f"slot {s}: rollback_to {entry.rollback_to} < -1 (-1 means no rollback)"
    if len(entry.token_ids) % TOKEN_DTYPE.itemsize:
        return f"slot {s}: token_ids holds {len(entry.token_ids)} bytes, not a multiple of 4 (int32)"
    rows = entry.rows
    if rows > limits.max_rows_per_entry:
        return f"slot {s}: {rows} rows > max_rows_per_entry {limits.max_rows_per_entry}"
    if entry.start_pos + rows > limits.max_model_len:
        return (f"slot {s}: rows at positions {entry.start_pos}..{entry.start_pos + rows - 1} reach past "
                f"max_model_len {limits.max_model_len} (the last position served is {limits.max_model_len - 1})")
    if rows:      # the seed then sits at p0 = start_pos + rows, whatever the slot held (the insert checks agree)
        why = draft_reach(s, entry.start_pos + rows, entry.n_out, limits.max_model_len)
        if why:
            return why
    want = rows * limits.taps_width * TAP_DTYPE.itemsize
    if len(entry.taps) != want:
        return (f"slot {s}: taps holds {len(entry.taps)} bytes, want {want} "
                f"({rows} rows x {limits.n_taps} taps x {limits.hidden_size} hidden x 2 bytes fp16)")
    if rows:
        # One unsigned max catches both ends (a negative int32 reads as >= 2**31); the culprit is named after.
        if _max_u32(entry.token_ids) >= limits.vocab_size:
            ids = entry.token_array()
            bad = int(ids[(ids < 0) | (ids >= limits.vocab_size)][0])
            return (f"slot {s}: token id {bad} < 0" if bad < 0
                    else f"slot {s}: token id {bad} >= vocab {limits.vocab_size}")
        bad_row = first_nonfinite_row(entry.taps, limits.taps_width)
        if bad_row is not None:
            return f"slot {s}: taps row {bad_row} holds inf or nan (fp16 taps must be finite)"
    return None


def validate_step(step: Step, limits: Limits) -> str | None:
    """Request-level checks of a STEP (answered with ErrorReply BAD_ENTRY; nothing runs)."""
    n = len(step.entries)
    if n > limits.max_entries_per_step:
        return f"STEP holds {n} entries > max_entries_per_step {limits.max_entries_per_step}"
    if not step.deadline_ms > 0 or step.deadline_ms == float("inf"):
        return f"deadline_ms {step.deadline_ms} must be finite and > 0"
    return None


def validate_entries(step: Step, limits: Limits) -> list[str | None]:
    """validate_entry for each entry, plus: a slot named by two entries of one STEP is refused after its first."""
    reasons: list[str | None] = []
    first_at: dict[int, int] = {}
    for i, e in enumerate(step.entries):
        reason = validate_entry(e, limits)
        if reason is None and e.slot in first_at:
            reason = f"slot {e.slot}: named by entries {first_at[e.slot]} and {i} of one STEP"
        first_at.setdefault(e.slot, i)
        reasons.append(reason)
    return reasons


class StepHandler(Protocol):
    """What a transport calls; the front-end implements it. `step` blocks and is called concurrently from the
    transport's connection threads. A session is one client connection: `close_session` frees its slots."""

    def open_session(self, peer: str) -> int: ...
    def hello(self, session: int, msg: Hello) -> HelloReply: ...
    def acquire(self, session: int, msg: Acquire) -> AcquireReply | ErrorReply: ...
    def release(self, session: int, msg: Release) -> ReleaseReply | ErrorReply: ...
    def step(self, session: int, msg: Step, received_ns: int) -> StepReply | ErrorReply: ...
    def close_session(self, session: int) -> int | None: ...       # the slots it freed, if counted
