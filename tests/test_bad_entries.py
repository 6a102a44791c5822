"""A bad entry fails alone and changes nothing else, over many random STEPs.

Two front-ends (`frontend.StepService`), each before its own engine (the split drafter, run as a rank runs it:
`conftest.EnginePair`), take the same rounds. The first gets each round's STEP with bad entries mixed in at random
places (every kind of input the contract refuses), the second the same STEP without them. Every bad entry must be
refused (BAD_ENTRY, or STALE_GENERATION for a stale generation), every good entry must get the twin's answer bit for
bit, and every slot must stand where the twin's stands: a refused entry leaves no trace, in the front-end's cursors
or in the ranks' rows. A STEP refused as a whole (its deadline) reaches neither. The messages go through the wire
encoding both ways, as a server reads them (the arrays are views of the frame). The second test does the same with
three sessions stepping at once, so that the good entries share batches (and a bad entry may name a slot another
session is stepping).
"""
from __future__ import annotations

import random
import threading
import time

import numpy as np

from dspark_ray.protocol import contract as C
from dspark_ray.protocol import wire
from dspark_ray.rank.engine import RankEngine
from dspark_ray.frontend.step_service import Identity, StepService
from dspark_ray.protocol.slot_cursor import SlotCursor
from dspark_ray.rank.modes import make_drafter

from conftest import EnginePair

N_SLOTS = 4
ROUNDS = 80


def _service(cfg, ckpt, n_slots: int = N_SLOTS, sessions: int = 1) -> tuple[StepService, list[int]]:
    """A front-end before its own engine; `sessions` sessions splitting the slots in order."""
    engine = RankEngine(make_drafter(cfg, "split", ckpt=ckpt), n_slots)
    svc = StepService(Identity("model", cfg.digest(), 2, cfg.max_model_len),
                      C.Limits.for_config(cfg, slot_capacity=n_slots),
                      EnginePair(engine), window=cfg.sliding_window)
    sids = []
    for k in range(sessions):
        sids.append(svc.open_session(f"test{k}"))
        assert svc.hello(sids[-1], C.Hello()).ok
        per = n_slots // sessions
        assert [g.slot for g in svc.acquire(sids[-1], C.Acquire(n=per)).slots] == list(range(k * per, (k + 1) * per))
    return svc, sids


def _through_the_wire(msg):
    frame = wire.encode(msg, request_id=1)
    mtype, _, n = wire.parse_header(frame[:wire.HEADER_SIZE], len(frame))
    return wire.decode_payload(mtype, memoryview(frame)[wire.HEADER_SIZE:wire.HEADER_SIZE + n])


def _good_entry(rng: random.Random, cfg, cursor, slot: int) -> C.Entry:
    """A valid entry for the slot as it stands: rows continuing its context (any start on a fresh slot), sometimes
    after a rollback to a position it still holds."""
    rows = rng.randint(0, 6)
    rollback, start = -1, cursor.position
    if cursor.fresh:
        start = rng.randrange(0, 4000)
        rows = max(rows, 1)
    elif rng.random() < 0.2:
        lowest = max(cursor.base, cursor.position - cursor.capacity + cursor.window)
        rollback = rng.randint(lowest, cursor.position)
        start = rollback if rollback != cursor.base else rng.randrange(0, 4000)
    taps = np.random.default_rng(rng.randrange(1 << 30)).standard_normal((rows, cfg.n_taps * cfg.hidden_size))
    return C.make_entry(slot=slot, generation=cursor.generation, seed_token=rng.randrange(cfg.vocab_size),
                        start_pos=start, token_ids=[rng.randrange(cfg.vocab_size) for _ in range(rows)],
                        taps=(0.5 * taps).astype(np.float16), rollback_to=rollback, n_out=rng.randint(1, 5),
                        want_margins=rng.random() < 0.3)


def _bad_entry(rng: random.Random, cfg, limits, cursor, slot: int, foreign: list[int] = (),
               kind: str | None = None) -> tuple[str, C.Entry]:
    """An entry for a slot no other entry of the STEP names, valid but for one defect the contract names (each
    sure to be refused whatever the slot's state); `kind` picks the defect, else one at random. "foreign": one of
    the `foreign` slots, held by another session."""
    good = _good_entry(rng, cfg, cursor, slot)
    kinds = ["slot", "n_out", "seed", "start", "rollback_low", "rollback_high", "ids_bytes", "generation",
             "negative_generation", "too_many_rows"]
    if good.rows:
        kinds += ["token_id", "taps_bytes", "taps_nonfinite"]
    if not cursor.fresh and good.rollback_to < 0 and good.rows:
        kinds.append("gap")
    if foreign:
        kinds.append("foreign")
    kind = kind or rng.choice(kinds)
    f = {k: getattr(good, k) for k in good.__struct_fields__}
    if kind == "slot":
        f["slot"] = rng.choice([-1, limits.slot_capacity, 1 << 20])
    elif kind == "foreign":                 # a slot another session holds (and may be stepping right now)
        f["slot"] = rng.choice(foreign)
    elif kind == "n_out":
        f["n_out"] = rng.choice([0, -1, limits.max_n_out + 1])
    elif kind == "seed":
        f["seed_token"] = rng.choice([-1, cfg.vocab_size, 1 << 40])
    elif kind == "start":
        f["start_pos"] = -1 - rng.randrange(10)
    elif kind == "rollback_low":
        f["rollback_to"] = -2
    elif kind == "rollback_high":
        f["rollback_to"] = cursor.position + 1 + rng.randrange(5)
    elif kind == "ids_bytes":
        f["token_ids"] = bytes(good.token_ids) + b"\x01"
    elif kind == "generation":
        f["generation"] = good.generation + rng.choice([1, 2])
    elif kind == "negative_generation":
        f["generation"] = -1
    elif kind == "too_many_rows":
        n = limits.max_rows_per_entry + 1
        f.update(token_ids=np.zeros(n, "<i4").tobytes(), taps=np.zeros((n, limits.taps_width), np.float16).tobytes())
    elif kind == "token_id":
        ids = np.frombuffer(good.token_ids, "<i4").copy()
        ids[rng.randrange(ids.size)] = rng.choice([-1, cfg.vocab_size, -(1 << 31)])
        f["token_ids"] = ids.tobytes()
    elif kind == "taps_bytes":
        f["taps"] = bytes(good.taps)[:-2] if rng.random() < 0.5 else bytes(good.taps) + b"\0\0"
    elif kind == "taps_nonfinite":
        taps = np.frombuffer(good.taps, np.float16).copy()
        taps[rng.randrange(taps.size)] = rng.choice([np.inf, -np.inf, np.nan])
        f["taps"] = taps.tobytes()
    elif kind == "gap":
        f["start_pos"] = cursor.position + rng.choice([1, 7] + ([-1] if cursor.position > cursor.base + 1 else []))
    return kind, C.Entry(**f)


def _round(rng: random.Random, cfg, limits, cursor, slots: list[int], owned: list[int], bad_counts: list[int],
           foreign: list[int] = ()) -> tuple[list[tuple[str | None, C.Entry]], list[C.Entry]]:
    """One round's STEP: a good entry for each of `slots` (cursor[s]: where slot s stands), with bad entries
    inserted at random places, rng.choice(bad_counts) of them: each with one defect on an `owned` slot the STEP
    names nowhere else, or when none is left, a second entry for a slot a good entry names (refused after its
    first) or an entry for a `foreign` slot. Returns ([(kind or None, entry)], the good entries)."""
    good = [_good_entry(rng, cfg, cursor[s], s) for s in slots]
    entries: list[tuple[str | None, C.Entry]] = [(None, e) for e in good]
    free = [s for s in owned if s not in slots]
    others = list(foreign)
    for _ in range(rng.choice(bad_counts)):
        if free and rng.random() < 0.8:
            s = free.pop(rng.randrange(len(free)))
            kind, bad = _bad_entry(rng, cfg, limits, cursor[s], s, others)
            entries.insert(rng.randint(0, len(entries)), (kind, bad))
        elif others and rng.random() < 0.5:
            kind, bad = _bad_entry(rng, cfg, limits, cursor[slots[0]], slots[0], others, kind="foreign")
            entries.insert(rng.randint(0, len(entries)), (kind, bad))
        else:
            k = rng.randrange(len(good))
            kind, bad = "duplicate", _good_entry(rng, cfg, cursor[good[k].slot], good[k].slot)
            entries.insert(rng.randint(entries.index((None, good[k])) + 1, len(entries)), (kind, bad))
        if kind == "foreign":       # named once in the STEP, so that it is refused for its owner alone
            others.remove(bad.slot)
    return entries, good


def _assert_answers(entries, got, want, where: str, kinds_seen: set[str]) -> None:
    """Every good entry's answer is its twin's (`want`, in order) bit for bit; every bad one is refused, for its
    own slot, with the code and the reason of its defect."""
    assert len(got) == len(entries)
    want = iter(want)
    for (kind, e), g in zip(entries, got):
        if kind is None:
            assert g == next(want), f"{where}: slot {e.slot}'s answer changed by the bad entries beside it"
            continue
        kinds_seen.add(kind)
        want_code = C.Code.STALE_GENERATION if kind == "generation" else C.Code.BAD_ENTRY
        assert g.code == want_code, f"{where}: a bad entry ({kind}) answered {g.code.name}: {g.reason}"
        assert g.reason.startswith(f"slot {e.slot}:") and not g.drafts, g.reason
        if kind == "duplicate":
            assert "named by entries" in g.reason
        if kind == "foreign":
            assert "not held by this session" in g.reason


def _cursors(svc):
    return [(s.cursor.generation, s.cursor.base, s.cursor.position, s.busy) for s in svc.slots]


def test_bad_entries_fail_alone_and_leave_no_trace(cfg, ckpt):
    rng = random.Random(0)     # (seeds 0-3 checked; each run ~25 s on the CI machine)
    mixed, [sid_m] = _service(cfg, ckpt)
    clean, [sid_c] = _service(cfg, ckpt)
    limits = mixed.limits
    kinds_seen: set[str] = set()
    oks = 0
    cursor = [s.cursor for s in clean.slots]
    for r in range(ROUNDS):
        slots = rng.sample(range(N_SLOTS), rng.randint(1, N_SLOTS))
        entries, good = _round(rng, cfg, limits, cursor, slots, list(range(N_SLOTS)), [0, 0, 1, 1, 2, 3])
        if rng.random() < 0.04:      # refused as a whole: reaches neither front-end, changes nothing
            whole = mixed.step(sid_m, _through_the_wire(C.Step(entries=[e for _, e in entries], deadline_ms=0.0)),
                               time.monotonic_ns())
            assert isinstance(whole, C.ErrorReply) and whole.code == C.Code.BAD_ENTRY and "deadline" in whole.reason
            assert _cursors(mixed) == _cursors(clean)
            continue
        got = mixed.step(sid_m, _through_the_wire(C.Step(entries=[e for _, e in entries], deadline_ms=60_000.0)),
                         time.monotonic_ns()).results
        want = clean.step(sid_c, _through_the_wire(C.Step(entries=good, deadline_ms=60_000.0)),
                          time.monotonic_ns()).results
        _assert_answers(entries, got, want, f"round {r}", kinds_seen)
        oks += sum(w.code == C.Code.OK for w in want)
        assert _cursors(mixed) == _cursors(clean), f"round {r}: a refused entry moved a slot"
    assert oks >= ROUNDS            # the good entries ran (their answers were compared, not just refused alike)
    assert len(kinds_seen) >= 13, sorted(kinds_seen)


def test_bad_entries_fail_alone_while_sessions_step_at_once(cfg, ckpt):
    """Three sessions step at once, their good entries merged into shared batches by the front-end's queue, with
    bad entries mixed in (among them entries naming another session's slots, which that session may be stepping
    at that moment). Every good entry gets the answer it gets when its session steps alone, on a front-end that
    never saw a bad entry (batch invariance makes the merge invisible), and every slot ends where it should."""
    sessions, per = 3, 2
    mixed, sids_m = _service(cfg, ckpt, sessions * per, sessions)
    clean, sids_c = _service(cfg, ckpt, sessions * per, sessions)
    limits = mixed.limits
    owned = [list(range(k * per, (k + 1) * per)) for k in range(sessions)]
    plans = []                     # per session: rounds of ([(kind, entry)], [good entries])
    for k in range(sessions):
        rng = random.Random(100 + k)
        shadow = {}
        for s in owned[k]:
            shadow[s] = SlotCursor(cfg.sliding_window, limits.max_rows_per_entry)
            shadow[s].generation = mixed.slots[s].cursor.generation
        foreign = [s for j in range(sessions) if j != k for s in owned[j]]
        rounds = []
        for _ in range(25):
            slots = rng.sample(owned[k], rng.randint(1, per))
            entries, good = _round(rng, cfg, limits, shadow, slots, owned[k], [0, 1, 1, 2], foreign)
            for e in good:             # where the slot stands after the good entry
                if e.rollback_to >= 0:
                    shadow[e.slot].rollback(e.rollback_to)
                shadow[e.slot].advance(e.start_pos, e.rows)
            rounds.append((entries, good))
        plans.append(rounds)

    got: list[list] = [[] for _ in range(sessions)]
    errors: list[BaseException] = []
    start = threading.Barrier(sessions)

    def run(k):
        try:
            start.wait(10)
            for entries, _ in plans[k]:
                msg = _through_the_wire(C.Step(entries=[e for _, e in entries], deadline_ms=120_000.0))
                got[k].append(mixed.step(sids_m[k], msg, time.monotonic_ns()).results)
        except BaseException as e:     # noqa: BLE001  (reported below)
            errors.append(e)
    threads = [threading.Thread(target=run, args=(k,)) for k in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors and not any(t.is_alive() for t in threads), errors

    steps = sum(1 for rounds in plans for _, good in rounds if good)
    assert mixed.stats["batches"] < steps, "no batch took entries of two STEPs: the test did not merge anything"
    kinds_seen = set()
    for k in range(sessions):
        for r, ((entries, good), results) in enumerate(zip(plans[k], got[k])):
            want = clean.step(sids_c[k], _through_the_wire(C.Step(entries=good, deadline_ms=60_000.0)),
                              time.monotonic_ns()).results
            assert all(w.code == C.Code.OK for w in want), [w.reason for w in want]
            _assert_answers(entries, results, want, f"session {k} round {r}", kinds_seen)
    assert _cursors(mixed) == _cursors(clean)
    assert "foreign" in kinds_seen and len(kinds_seen) >= 10, sorted(kinds_seen)


def test_drafts_past_max_model_len_are_refused_and_leave_no_trace(cfg, ckpt):
    """The drafts of an entry sit at p0+1 .. p0+n_out (p0: the slot's position after the entry's rollback and
    insert); the last must be below max_model_len (issue 40, item 3). An entry with rows is refused by the stateless
    check (p0 = start_pos + rows), one without rows by the front-end's (p0 = the slot's position): with the reason
    naming the positions, and no trace in the slot; the entries that stay inside get the answers of a twin that
    never saw the refused ones, bit for bit."""
    mixed, [sid_m] = _service(cfg, ckpt, n_slots=2)
    clean, [sid_c] = _service(cfg, ckpt, n_slots=2)
    L = mixed.limits.max_model_len
    rng = np.random.default_rng(5)

    def entry(start, rows, n_out, rollback_to=-1, slot=0):
        taps = (0.5 * rng.standard_normal((rows, cfg.n_taps * cfg.hidden_size))).astype(np.float16)
        return C.make_entry(slot=slot, generation=mixed.slots[slot].cursor.generation, seed_token=7,
                            start_pos=start, token_ids=np.arange(rows) + 3, taps=taps, rollback_to=rollback_to,
                            n_out=n_out)

    def reach(p0, n_out):
        return (f"slot 0: drafts at positions {p0 + 1}..{p0 + n_out} reach past max_model_len {L} (the last "
                f"position served is {L - 1}; the seed sits at {p0})")
    # (entry, the reason it is refused or None), in order; the slot starts fresh
    plan = [(entry(L - 1, 1, 5), reach(L, 5)),                 # the case: a fresh slot, 1 row at L-1
            (entry(L - 1, 1, 1), reach(L, 1)),
            (entry(L - 8, 2, 5), None),                         # p0 = L-6: drafts L-5 .. L-1
            (entry(L - 6, 1, 5), reach(L - 5, 5)),              # p0 would be L-5: the 5th draft at L
            (entry(L - 6, 1, 4), None),                         # p0 = L-5: drafts L-4 .. L-1
            (entry(0, 0, 5), reach(L - 5, 5)),                  # no rows: the front-end's check, from the cursor
            (entry(0, 0, 4), None),
            (entry(0, 0, 5, rollback_to=L - 6), None),          # rolled back to p0 = L-6: drafts L-5 .. L-1
            (entry(0, 0, 5), None)]
    for k, (e, why) in enumerate(plan):
        got = mixed.step(sid_m, _through_the_wire(C.Step(entries=[e], deadline_ms=60_000.0)),
                         time.monotonic_ns()).results[0]
        if why is not None:
            assert (got.code, got.reason, got.drafts) == (C.Code.BAD_ENTRY, why, b""), (k, got)
            assert got.generation == mixed.slots[0].cursor.generation
        else:
            want = clean.step(sid_c, _through_the_wire(C.Step(entries=[e], deadline_ms=60_000.0)),
                              time.monotonic_ns()).results[0]
            assert want.code == C.Code.OK and got == want, (k, got.reason, want.reason)
        assert _cursors(mixed) == _cursors(clean), f"entry {k} moved the slot"
    assert mixed.slots[0].cursor.position == L - 6


def test_the_front_end_and_the_cursor_agree_on_where_the_seed_sits():
    """SlotCursor.after (the placement the front-end hands the ranks, and its p0 for the max_model_len check) is
    where the cursor stands after it applies the entry's rules (rollback, advance), for every valid entry on every
    kind of slot: fresh, partial, rolled back to its base or below its window."""
    rng = random.Random(3)
    for _ in range(3000):
        c = SlotCursor(8, 16)
        for _ in range(rng.randint(0, 4)):               # a slot with some history (or none)
            start = c.position if not c.fresh else rng.randrange(0, 50)
            n = rng.randint(1, 16)
            c.advance(start, n)
        rows = rng.randint(0, 5)
        rollback = -1
        if rng.random() < 0.5:
            rollback = 0 if c.fresh else rng.randint(max(c.base, c.position - c.capacity + c.window), c.position)
        fresh_after = c.fresh or rollback == c.base
        start = rng.randrange(0, 100) if fresh_after else (rollback if rollback >= 0 else c.position)
        if c.check_entry(start, rows, rollback):
            continue
        placed = c.after(start, rows, rollback)
        if rollback >= 0:
            c.rollback(rollback)
        c.advance(start, rows)
        assert placed == (c.base, c.position)
