"""The contract's messages, its stateless checks and the framing (no sockets here; see test_tcp.py)."""
from __future__ import annotations

import io
import re
import struct
import typing
from pathlib import Path

import msgspec
import numpy as np
import pytest

from dspark_ray.protocol import contract as C
from dspark_ray.protocol import wire

LIMITS = C.Limits(vocab_size=4096, hidden_size=256, n_taps=3, slot_capacity=8, sliding_window=8,
                  max_frame_bytes=1 << 20)
W = LIMITS.taps_width   # 768, the tiny preset


def taps(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, W)).astype(np.float16)


def good_entry(**kw) -> C.Entry:
    args = dict(slot=3, generation=1, seed_token=17, start_pos=10, token_ids=np.arange(6) + 100, taps=taps(6),
                n_out=5)
    args.update(kw)
    return C.make_entry(**args)


def reader_over(data: bytes, chunk: int | None = None, max_frame_bytes: int = 1 << 20) -> wire.FrameReader:
    bio = io.BytesIO(data)
    return wire.FrameReader(lambda view: bio.readinto(view[:chunk] if chunk else view), max_frame_bytes)


EVERY_MESSAGE = [
    C.Hello(model_digest="abc", config_digest="def", tp=2, max_model_len=4096, client="test"),
    C.Hello(),
    C.HelloReply(ok=True, model_digest="abc", config_digest="def", tp=2, max_model_len=1 << 20, worker_generation=3,
                 limits=LIMITS, session_id=9),
    C.HelloReply(ok=False, code=C.Code.CONFIG_MISMATCH, reason="tp: client expects 1, server serves 2"),
    C.Acquire(n=4),
    C.AcquireReply(slots=[C.SlotGrant(slot=0, generation=1), C.SlotGrant(slot=5, generation=7)]),
    C.Release(slots=[0, 5]),
    C.ReleaseReply(released=[0, 5]),
    C.Step(entries=[good_entry(), good_entry(slot=4, token_ids=[], taps=None, rollback_to=12, want_margins=True)],
           deadline_ms=2.5),
    C.StepReply(results=[C.ok_result(generation=1, drafts=[1, 2, 3], confidences=[0.9, 0.8, 0.1],
                                     margins=[1.0, 2.0, 0.5], confident_len=2),
                         C.error_result(C.Code.STALE_GENERATION, "slot 4: generation 1, current 2", 2)]),
    C.ErrorReply(code=C.Code.OVERLOADED, reason="3 slots wanted, 1 free"),
]


@pytest.mark.parametrize("msg", EVERY_MESSAGE, ids=lambda m: type(m).__name__)
def test_every_message_survives_a_frame_round_trip(msg):
    frame = wire.encode(msg, request_id=42)
    got = reader_over(frame, chunk=7).read()      # 7-byte reads: the reader must reassemble header and payload
    assert got.request_id == 42
    assert type(got.msg) is type(msg) and got.msg == msg


def test_entry_arrays_are_views_of_the_bytes_as_sent():
    t = taps(6)
    e = good_entry(taps=t)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(e), type=C.Entry)
    assert back.rows == 6
    assert np.array_equal(back.token_array(), np.arange(6) + 100)
    assert back.taps_array(W).tobytes() == t.tobytes()       # bits, not values: fp16 survives untouched


def test_make_entry_takes_torch_tensors():
    torch = pytest.importorskip("torch")
    t = torch.randn(6, W).half()
    e = C.make_entry(slot=1, generation=0, seed_token=5, token_ids=torch.arange(6), taps=t)
    assert e.taps == t.numpy().tobytes() and np.array_equal(e.token_array(), np.arange(6))


def test_make_entry_refuses_token_ids_that_do_not_fit_int32():
    """A cast to int32 would wrap them into other, valid-looking ids (2**32 + 5 into 5)."""
    for ids, bad in (([1, (1 << 32) + 5], (1 << 32) + 5), ([-(1 << 31) - 1], -(1 << 31) - 1), ([1 << 80], 1 << 80)):
        with pytest.raises(ValueError, match=f"token id {bad} does not fit int32"):
            C.make_entry(slot=1, generation=0, seed_token=5, token_ids=ids, taps=np.zeros((len(ids), W), np.float16))
    e = C.make_entry(slot=1, generation=0, seed_token=5, token_ids=np.array([(1 << 31) - 1, -(1 << 31)], np.int64),
                     taps=np.zeros((2, W), np.float16))
    assert e.token_array().tolist() == [(1 << 31) - 1, -(1 << 31)]


def test_make_entry_refuses_taps_that_are_not_fp16():
    with pytest.raises(TypeError, match="taps must be float16, got float32"):
        C.make_entry(slot=1, generation=0, seed_token=5, token_ids=[1], taps=np.zeros((1, W), np.float32))


def test_result_arrays_view_the_answer():
    r = C.ok_result(generation=2, drafts=np.array([7, 8, 9]), confidences=np.array([0.75, 0.5, 0.25]),
                    confident_len=2)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(r), type=C.EntryResult)
    assert back.drafts_array().tolist() == [7, 8, 9] and back.drafts_array().dtype == np.int32
    assert back.confidences_array().tolist() == [0.75, 0.5, 0.25]
    assert back.margins_array().size == 0 and back.confident_len == 2


# ---- validate_entry: one case per rule, with the reason it must give ------------------------------------------------
def _nonfinite_taps(value: float) -> np.ndarray:
    t = taps(6)
    t[4, 100] = value
    return t


BAD_ENTRIES = [
    (dict(slot=8), "slot 8: slot id outside [0, 8)"),
    (dict(slot=-1), "slot -1: slot id outside [0, 8)"),
    (dict(generation=-1), "slot 3: generation -1 < 0"),
    (dict(n_out=0), "slot 3: n_out 0 outside 1..5"),
    (dict(n_out=6), "slot 3: n_out 6 outside 1..5"),
    (dict(seed_token=4096), "slot 3: seed token 4096 outside [0, vocab 4096)"),
    (dict(seed_token=-2), "slot 3: seed token -2 outside [0, vocab 4096)"),
    (dict(start_pos=-1), "slot 3: start_pos -1 < 0"),
    (dict(rollback_to=-2), "slot 3: rollback_to -2 < -1 (-1 means no rollback)"),
    (dict(token_ids=np.arange(129), taps=taps(129)), "slot 3: 129 rows > max_rows_per_entry 128"),
    (dict(start_pos=(1 << 20) - 5), "slot 3: rows at positions 1048571..1048576 reach past max_model_len 1048576 "
                                    "(the last position served is 1048575)"),
    # the drafts sit at p0+1 .. p0+n_out, p0 = start_pos + rows: the last must be < max_model_len (issue 40, item 3)
    (dict(start_pos=(1 << 20) - 1, token_ids=[5], taps=taps(1)),
     "slot 3: drafts at positions 1048577..1048581 reach past max_model_len 1048576 (the last position served is "
     "1048575; the seed sits at 1048576)"),
    (dict(start_pos=(1 << 20) - 11), "slot 3: drafts at positions 1048572..1048576 reach past max_model_len 1048576 "
                                     "(the last position served is 1048575; the seed sits at 1048571)"),
    (dict(start_pos=(1 << 20) - 7, n_out=1), "slot 3: drafts at positions 1048576..1048576 reach past max_model_len "
                                             "1048576 (the last position served is 1048575; the seed sits at 1048575)"),
    (dict(taps=taps(5)), "slot 3: taps holds 7680 bytes, want 9216 (6 rows x 3 taps x 256 hidden x 2 bytes fp16)"),
    (dict(token_ids=[1, 2, 131000, 4, 5, 6]), "slot 3: token id 131000 >= vocab 4096"),
    (dict(token_ids=[1, 2, -7, 4, 5, 6]), "slot 3: token id -7 < 0"),
    # past 64 rows the id scan is numpy's, not Python's (contract._max_u32): the same answers
    (dict(token_ids=[5] * 99 + [4096], taps=taps(100)), "slot 3: token id 4096 >= vocab 4096"),
    (dict(token_ids=[-1] + [5] * 99, taps=taps(100)), "slot 3: token id -1 < 0"),
    (dict(taps=_nonfinite_taps(np.inf)), "slot 3: taps row 4 holds inf or nan (fp16 taps must be finite)"),
    (dict(taps=_nonfinite_taps(-np.inf)), "slot 3: taps row 4 holds inf or nan (fp16 taps must be finite)"),
    (dict(taps=_nonfinite_taps(np.nan)), "slot 3: taps row 4 holds inf or nan (fp16 taps must be finite)"),
]


@pytest.mark.parametrize("change,reason", BAD_ENTRIES, ids=[r for _, r in BAD_ENTRIES])
def test_validate_entry_names_the_slot_field_value_and_rule(change, reason):
    assert C.validate_entry(good_entry(**change), LIMITS) == reason


def test_the_finite_scan_refuses_exactly_the_fp16_infs_and_nans_of_every_bit_pattern():
    """first_nonfinite_row against np.isfinite on all 65536 fp16 values, each alone in a row between finite rows."""
    from dspark_ray.protocol.finite import first_nonfinite_row
    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    rows = np.zeros((every.size, 3, 2), np.float16)
    rows[:, 1, 1] = every
    found = [first_nonfinite_row(r.tobytes(), 2) for r in rows]
    assert found == [None if np.isfinite(v) else 1 for v in every]


def test_validate_entry_refuses_token_bytes_that_are_not_int32():
    e = good_entry()
    e.token_ids = e.token_ids[:-1]
    assert C.validate_entry(e, LIMITS) == "slot 3: token_ids holds 23 bytes, not a multiple of 4 (int32)"


def test_validate_entry_accepts_good_entries_at_the_edges():
    for change in ({}, dict(token_ids=[], taps=None), dict(n_out=1), dict(slot=7, seed_token=4095),
                   dict(token_ids=np.arange(128), taps=taps(128)), dict(rollback_to=0, start_pos=0),
                   dict(taps=np.full((6, W), 65504, np.float16)),      # the largest finite fp16
                   dict(start_pos=(1 << 20) - 12),                     # the 5th draft at the last position served
                   dict(start_pos=(1 << 20) - 8, n_out=1),
                   dict(start_pos=(1 << 20) - 1, token_ids=[], taps=None)):   # no rows: the front-end's check
        assert C.validate_entry(good_entry(**change), LIMITS) is None, change


def test_validate_step_limits_entries_and_deadline():
    e = good_entry()
    assert C.validate_step(C.Step(entries=[e] * 64, deadline_ms=1.0), LIMITS) is None
    assert C.validate_step(C.Step(entries=[e] * 65, deadline_ms=1.0), LIMITS) == \
        "STEP holds 65 entries > max_entries_per_step 64"
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        assert C.validate_step(C.Step(entries=[e], deadline_ms=bad), LIMITS) == \
            f"deadline_ms {bad} must be finite and > 0"


def test_validate_entries_refuses_a_slot_named_twice_after_its_first():
    step = C.Step(entries=[good_entry(slot=1), good_entry(slot=2), good_entry(slot=1), good_entry(n_out=9)],
                  deadline_ms=1.0)
    assert C.validate_entries(step, LIMITS) == [None, None, "slot 1: named by entries 0 and 2 of one STEP",
                                                "slot 3: n_out 9 outside 1..5"]


# ---- HELLO ---------------------------------------------------------------------------------------------------------
SERVED = dict(model_digest="m1", config_digest="c1", tp=2, max_model_len=8192)


@pytest.mark.parametrize("hello,reason", [
    (C.Hello(), None),
    (C.Hello(model_digest="m1", config_digest="c1", tp=2, max_model_len=8192), None),
    (C.Hello(protocol_version=1), "protocol_version: client speaks 1, server speaks 2"),
    (C.Hello(model_digest="m2"), "model_digest: client expects 'm2', server serves 'm1'"),
    (C.Hello(config_digest="c2"), "config_digest: client expects 'c2', server serves 'c1'"),
    (C.Hello(tp=1), "tp: client expects 1, server serves 2"),
    (C.Hello(max_model_len=8193), "max_model_len: client needs 8193, server serves at most 8192"),
])
def test_hello_mismatch_names_the_field_and_both_values(hello, reason):
    assert C.hello_mismatch(hello, **SERVED) == reason


def test_limits_for_config_reads_the_tiny_preset():
    from dspark_ray.config import tiny
    lim = C.Limits.for_config(tiny(), slot_capacity=16)
    assert (lim.vocab_size, lim.taps_width, lim.max_n_out, lim.slot_capacity) == (4096, 768, 5, 16)
    assert lim.sliding_window == tiny().sliding_window == 8       # HELLO reports the window (issue 40, item 6)


# ---- ACQUIRE -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,reason", [
    (-1, "acquire: n -1 < 1 (ask for at least one slot)"),
    (0, "acquire: n 0 < 1 (ask for at least one slot)"),
    (9, "acquire: n 9 > slot_capacity 8: can never be granted"),
    ((1 << 63), "acquire: n 9223372036854775808 > slot_capacity 8: can never be granted"),
    ((1 << 64) - 1, "acquire: n 18446744073709551615 > slot_capacity 8: can never be granted"),
    (1, None), (8, None),
])
def test_validate_acquire_refuses_what_can_never_be_granted(n, reason):
    assert C.validate_acquire(C.Acquire(n=n), LIMITS) == reason


# ---- strict decoding: refused, never guessed at (issue 40, item 5) -------------------------------------------------
def _payload(msg, drop: tuple = (), add: dict | None = None, entry_drop: tuple = (), entry_add: dict | None = None):
    """msg's msgpack payload as a map, with fields dropped / added at the top level or in its first entry."""
    d = msgspec.msgpack.decode(msgspec.msgpack.encode(msg))
    for k in drop:
        del d[k]
    d.update(add or {})
    if entry_drop or entry_add:
        e = d["entries"][0]
        for k in entry_drop:
            del e[k]
        e.update(entry_add or {})
    return msgspec.msgpack.encode(d)


STEP = C.Step(entries=[good_entry()], deadline_ms=5.0)
HELLO_REPLY = C.HelloReply(ok=True, limits=LIMITS)


SCHEMA_BREAKS = [
    (C.MsgType.STEP, _payload(STEP, entry_drop=("n_out",)),
     "Object missing required field `n_out` - at `$.entries[0]`"),
    (C.MsgType.STEP, _payload(STEP, entry_drop=("start_pos",)),
     "Object missing required field `start_pos` - at `$.entries[0]`"),
    (C.MsgType.STEP, _payload(STEP, entry_drop=("slot",)), "Object missing required field `slot` - at `$.entries[0]`"),
    (C.MsgType.STEP, _payload(STEP, drop=("deadline_ms",)), "Object missing required field `deadline_ms`"),
    (C.MsgType.STEP, _payload(STEP, drop=("type",)), "Object missing required field `type`"),
    (C.MsgType.STEP, _payload(STEP, add={"priority": 1}), "Object contains unknown field `priority`"),
    (C.MsgType.STEP, _payload(STEP, entry_add={"n_outs": 3}),
     "Object contains unknown field `n_outs` - at `$.entries[0]`"),
    (C.MsgType.STEP, _payload(STEP, entry_add={"n_out": 5.0}), "Expected `int`, got `float` - at `$.entries[0].n_out`"),
    (C.MsgType.STEP, _payload(STEP, entry_add={"want_margins": 1}),
     "Expected `bool`, got `int` - at `$.entries[0].want_margins`"),
    (C.MsgType.STEP, _payload(STEP, entry_add={"token_ids": [1, 2]}),
     "Expected `bytes`, got `array` - at `$.entries[0].token_ids`"),
    (C.MsgType.STEP, _payload(C.Acquire(n=1)), "its `type` is 3 (ACQUIRE), the header's is 7"),
    (C.MsgType.ACQUIRE, _payload(C.Acquire(n=1), drop=("n",)), "Object missing required field `n`"),
    (C.MsgType.ACQUIRE, _payload(C.Acquire(n=1), drop=("type",)), "Object missing required field `type`"),
    (C.MsgType.HELLO, _payload(C.Hello(), add={"tp_size": 2}), "Object contains unknown field `tp_size`"),
    (C.MsgType.HELLO, _payload(C.Hello(), drop=("type",)), "Object missing required field `type`"),
    (C.MsgType.RELEASE, _payload(C.Release(slots=[1]), add={"slots": [1.5]}), "Expected `int`, got `float`"),
    (C.MsgType.HELLO_REPLY, _payload(HELLO_REPLY, add={"limits": {**msgspec.to_builtins(LIMITS), "window": 8}}),
     "Object contains unknown field `window` - at `$.limits`"),
]


@pytest.mark.parametrize("mtype,payload,message", SCHEMA_BREAKS, ids=[f"{t.name}: {m}" for t, _, m in SCHEMA_BREAKS])
def test_a_payload_that_breaks_the_schema_is_refused_naming_the_field(mtype, payload, message):
    with pytest.raises(wire.PayloadError) as e:
        wire.decode_payload(mtype, payload)
    assert str(e.value).startswith(f"undecodable {mtype.name} payload ({len(payload)} bytes): ")
    assert message in str(e.value) and e.value.mtype == mtype


def test_the_optional_fields_take_their_documented_defaults():
    """What may be left out, and what it means: no rows, no rollback, no margins; HELLO checks nothing."""
    e = msgspec.msgpack.encode({"type": int(C.MsgType.STEP), "deadline_ms": 5, "entries": [
        {"slot": 1, "generation": 2, "seed_token": 3, "start_pos": 4, "n_out": 2}]})
    step = wire.decode_payload(C.MsgType.STEP, e)
    assert step.deadline_ms == 5.0 and isinstance(step.deadline_ms, float)
    (got,) = step.entries
    assert (got.rows, bytes(got.taps), got.rollback_to, got.want_margins) == (0, b"", -1, False)
    hello = wire.decode_payload(C.MsgType.HELLO, msgspec.msgpack.encode({"type": int(C.MsgType.HELLO)}))
    assert hello == C.Hello(protocol_version=2, model_digest=None, config_digest=None, tp=None, max_model_len=None,
                            client="", token="")


# ---- framing: every way a frame can be wrong ------------------------------------------------------------------------
def _frame(msg=C.Acquire(n=1), **header) -> bytes:
    f = bytearray(wire.encode(msg, request_id=1))
    fields = dict(zip(("magic", "version", "mtype", "flags", "reserved", "request_id", "length"),
                      wire.HEADER.unpack_from(f)))
    fields.update(header)
    wire.HEADER.pack_into(f, 0, *fields.values())
    return bytes(f)


@pytest.mark.parametrize("data,message", [
    (_frame(magic=b"HTTP"), "bad magic b'HTTP'"),
    (_frame(version=1), "protocol version 1 in frame header, this side speaks 2"),
    (_frame(mtype=99), "unknown message type 99"),
    (_frame(flags=1), "unknown flags 0x0001"),
    (_frame(reserved=3), "reserved header field is 3, must be 0"),
    (_frame(length=(1 << 20)), "frame of 1048600 bytes > limit 1048576"),
    (_frame(length=(1 << 32) - 1), "frame of 4294967319 bytes > limit 1048576"),
    (_frame()[:10], "truncated frame: stream ended after 10 of 24 header bytes"),
    (_frame(C.Release(slots=[1, 2, 3]))[:-2], "truncated frame: stream ended after 15 of 17 payload bytes"),
    (_frame(mtype=int(C.MsgType.STEP)), "undecodable STEP payload"),
    (wire.HEADER.pack(wire.MAGIC, C.PROTOCOL_VERSION, int(C.MsgType.ACQUIRE), 0, 0, 1, 3) + b"\xc1\xc1\xc1",
     "undecodable ACQUIRE payload"),
], ids=["magic", "version", "type", "flags", "reserved", "oversize", "oversize-4GiB", "truncated-header", "truncated-payload",
        "wrong-payload-type", "garbage-payload"])
def test_reader_refuses_bad_frames_with_a_clear_reason(data, message):
    with pytest.raises(wire.FrameError, match=message.replace("(", r"\(").replace(")", r"\)")):
        reader_over(data).read()


def test_reader_checks_the_length_before_allocating():
    r = reader_over(_frame(length=(1 << 32) - 1))
    with pytest.raises(wire.FrameError):
        r.read()
    assert len(r._payload) <= 64 << 10       # nothing was allocated for the claimed 4 GiB


def test_reader_reports_a_clean_end_between_frames():
    r = reader_over(wire.encode(C.Acquire(n=2), 1) + wire.encode(C.Release(slots=[1]), 2))
    assert r.read().msg == C.Acquire(n=2) and r.read().msg == C.Release(slots=[1])
    with pytest.raises(wire.ConnectionClosed):
        r.read()


def test_writer_refuses_an_oversized_frame_before_sending():
    w = wire.FrameWriter(max_frame_bytes=1000)
    sent = []
    with pytest.raises(wire.FrameError, match="STEP frame of .* bytes > limit 1000"):
        w.send(lambda view: sent.append(bytes(view)), C.Step(entries=[good_entry()], deadline_ms=1.0), 1)
    assert sent == []
    w.send(lambda view: sent.append(bytes(view)), C.Acquire(n=1), 2)      # the writer is still usable
    assert reader_over(sent[0]).read().msg == C.Acquire(n=1)


def test_header_is_24_bytes_little_endian():
    f = wire.encode(C.Acquire(n=1), request_id=0x0102030405060708)
    assert len(f) - wire.HEADER_SIZE == struct.unpack_from("<I", f, 20)[0]
    assert f[:4] == b"DSPK" and f[12:20] == bytes([8, 7, 6, 5, 4, 3, 2, 1])


# ---- docs/contract.md against the code: the tables cannot drift (issue 40, item 6) ---------------------------------
DOC = Path(__file__).resolve().parents[1] / "docs" / "contract.md"
DOCUMENTED = [*C.Message.__args__, C.Entry, C.EntryResult, C.SlotGrant, C.Limits]


def _doc_tables() -> list[tuple[str, list[list[str]]]]:
    """(the heading above it, its rows of cells without the separator row) for every table of the doc."""
    tables, heading, rows = [], "", None
    for line in DOC.read_text().splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if rows is None:
                rows = []
                tables.append((heading, rows))
            if not all(set(c) <= set("-: ") for c in cells):
                rows.append(cells)
            continue
        rows = None
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
    return tables


def _table(first_cell: str) -> list[list[str]]:
    (rows,) = [rows for _, rows in _doc_tables() if rows[0][0] == first_cell]
    return rows[1:]


def _struct_tables() -> dict[str, list[list[str]]]:
    out = {}
    for heading, rows in _doc_tables():
        m = re.fullmatch(r"`(\w+)`", heading)
        if m and rows[0] == ["field", "type", "required", "default", "meaning"]:
            assert m.group(1) not in out, f"{m.group(1)} documented twice"
            out[m.group(1)] = rows[1:]
    return out


def _doc_type(t) -> str:
    if t in (int, float, bool, str):
        return t.__name__
    if t in (bytes, memoryview):
        return "bin"
    if t is C.Code:
        return "int (Code)"
    if isinstance(t, type) and issubclass(t, msgspec.Struct):
        return f"map ({t.__name__})"
    args = typing.get_args(t)
    if typing.get_origin(t) is list:
        return f"array of {_doc_type(args[0])}"
    if type(None) in args and len(args) == 2:
        return f"{_doc_type(next(a for a in args if a is not type(None)))} or nil"
    raise AssertionError(f"no documented name for the type {t!r}")


def _doc_default(f) -> str:
    if f.default is msgspec.NODEFAULT and f.default_factory is msgspec.NODEFAULT:
        return "—"
    v = f.default
    if v is None:
        return "nil"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (bytes, str)) and not v:
        return '""'
    return str(int(v)) if isinstance(v, int) else repr(v)


def _cell(c: str) -> str:
    """A cell's first word without its code marks: `""` -> "", `0` -> 0."""
    return c.replace("`", "").split()[0] if c.strip("`") else c


def test_the_doc_documents_every_field_of_every_message_with_its_type_requirement_and_default():
    tables = _struct_tables()
    assert sorted(tables) == sorted(cls.__name__ for cls in DOCUMENTED)
    for cls in DOCUMENTED:
        rows = {r[0].strip("`"): r for r in tables[cls.__name__]}
        tag = cls.__struct_config__.tag
        if tag is not None:        # the tag: a required int holding the type id
            t = rows.pop("type")
            assert t[1:4] == ["int", "yes", "—"] and _cell(t[4]) == str(tag), (cls.__name__, t)
        fields = {f.name: f for f in msgspec.structs.fields(cls)}
        assert sorted(rows) == sorted(fields), f"{cls.__name__}: the doc's fields are not the struct's"
        for name, f in fields.items():
            _, typ, required, default, meaning = rows[name]
            where = f"{cls.__name__}.{name}"
            assert typ == _doc_type(f.type), where
            assert required == ("yes" if _doc_default(f) == "—" else "no"), where
            assert _cell(default) == _doc_default(f), where
            assert meaning, f"{where} has no meaning"


def test_the_doc_code_table_is_the_code_enum():
    assert {int(r[0]): r[1].strip("`") for r in _table("number")} == {int(c): c.name for c in C.Code}


def test_the_doc_message_type_table_is_the_wire_type_ids():
    rows = _table("type id")
    assert {int(r[0]): r[1] for r in rows} == {
        int(t): f"`{cls.__name__}` ({t.name})" for t, cls in C.MESSAGE_TYPES.items()}


def test_the_doc_header_table_is_the_wire_header():
    rows = _table("offset")
    names = {"4s": ("bytes", 4), "H": ("u16", 2), "Q": ("u64", 8), "I": ("u32", 4)}
    want = [names[f] for f in re.findall(r"\d*[a-zA-Z]", wire.HEADER.format.lstrip("<"))]
    assert [(r[2], int(r[1])) for r in rows] == want
    assert [int(r[0]) for r in rows] == [sum(s for _, s in want[:i]) for i in range(len(want))]
    assert sum(int(r[1]) for r in rows) == wire.HEADER_SIZE


def test_the_doc_quotes_the_codes_reasons():
    """The refusals the doc shows as examples are the code's, word for word."""
    from dspark_ray.frontend.step_service import Identity, StepService
    text = DOC.read_text()
    lim16 = msgspec.structs.replace(LIMITS, slot_capacity=16)
    assert C.validate_acquire(C.Acquire(n=17), lim16) in text.replace("\n  ", " ")
    svc = StepService(Identity("m", "c", 2, 1 << 20), lim16, None, window=8)
    sid = svc.open_session("doc")
    svc.hello(sid, C.Hello())
    svc.acquire(sid, C.Acquire(n=11))
    assert svc.acquire(sid, C.Acquire(n=6)).reason in text
    assert C.draft_reach(0, 1048571, 5, 1 << 20) in text.replace("\n   ", " ")
