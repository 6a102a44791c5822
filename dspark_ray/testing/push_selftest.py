"""GPU self-test of the push collectives, in two modes:

* `single`: both ranks in one process on one card, each rank driven by its own thread on its own stream (the
  development mode of seed 000's test_p2p);
* `pair`: two processes, each seeing only its own card (`CUDA_VISIBLE_DEVICES`), meeting through CUDA IPC, with a
  gloo group for barriers, the handle exchange and the reference oracle's gathers (as the service's rank actors).

Each scenario is one SPMD function run by both ranks (`sc_*`, taking a `RankView`); it raises AssertionError on a
wrong result and returns a small dict of what it saw. Harnesses run in spawned processes, so the test process never
touches CUDA and a poisoned process is thrown away. tests/test_push_gpu.py drives them;
`python -m dspark_ray.testing.push_selftest single|pair [scenario ...]` runs them by hand.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback

SCENARIOS_IN_ORDER = ("exact", "delayed", "graph", "variants", "strict", "timeout", "flag_never_raised", "cancel",
                      "exhaustion", "bad_id", "poison")
RANK0_IDS = (0, 64768)          # the full preset's vocabulary split (rank 0 holds the lower ids)
RANK1_IDS = (64768, 129280)
H = 5120


# --- the view a scenario gets ----------------------------------------------------------------------------------

class RankView:
    def __init__(self, mode, rank, pc, ref, stream, barrier, share):
        self.mode, self.rank, self.pc, self.ref, self.stream = mode, rank, pc, ref, stream
        self.barrier = barrier          # both ranks
        self.share = share              # share(obj) -> [rank 0's, rank 1's] (picklable objects in pair mode)

    def reset_pair(self, pc=None):
        (pc or self.pc).reset(barrier=self.barrier)

    def make_pc(self, **kw):
        """A second connected pair (other variants): built and connected by both ranks."""
        from dspark_ray.comm.push import PushCollectives
        pc = PushCollectives(self.rank, **kw)
        if self.mode == "single":
            objs = self.share(pc)
            if self.rank == 0:
                pc.connect_local(objs[1])
            self.barrier()
        else:
            hs = self.share(pc.export_handle().to_dict())
            pc.connect(hs[1 - self.rank], barrier=self.barrier)
        return pc


# --- inputs ----------------------------------------------------------------------------------------------------

_SPECIAL_BITS = [0x7FC00001, -1, -2147483648, 0, 0x7F800000, -8388608, 1, 0x7FFFFFFF, -2147483647]
# odd NaN payload, 0xFFFFFFFF, -0.0, +0.0, +inf, -inf, smallest subnormal, canonical NaN, negative subnormal
_SNAN_BITS = [-4194305]     # 0xFFBFFFFF: the Lamport empty pattern, a signaling NaN (no arithmetic produces one)


def rand_partial(seed, rank, n, device, special=True, snan=True):
    import torch
    g = torch.Generator().manual_seed(seed * 7919 + rank * 104729 + n)
    x = torch.randn(n, generator=g) * 3
    if special and n >= 8:
        bits = x.view(torch.int32)
        pos = torch.randint(0, n, (min(n, 24),), generator=g)
        sb = torch.tensor(_SPECIAL_BITS + (_SNAN_BITS if snan else []), dtype=torch.int32)
        bits[pos] = sb[torch.randint(0, len(sb), (pos.numel(),), generator=g)]
    return x.to(device)


def nan_pair_partial(rank, n, device):
    """Rows where both ranks hold NaN (all four quiet / signaling combinations, and the 0xFFFFFFFF / 0x7FFFFFFF
    pair that the first run caught), -0 + denormal both ways, and numbers elsewhere."""
    import torch
    from dspark_ray.comm.push import NAN_CALIBRATION_P0, NAN_CALIBRATION_P1
    mine = list(NAN_CALIBRATION_P0 if rank == 0 else NAN_CALIBRATION_P1)
    mine += [0xFFFFFFFF, 0x80000000, 0x00000001] if rank == 0 else [0x7FFFFFFF, 0x00000001, 0x80000000]
    mine += [0x7FC12345 if rank == 0 else 0x7FC54321]
    bits = torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in mine], dtype=torch.int32)
    x = torch.randn(n, generator=torch.Generator().manual_seed(5 + rank))
    x.view(torch.int32)[:len(mine)] = bits
    x.view(torch.int32)[n - len(mine):] = bits          # also in the last block's part / the scalar tail
    return x.to(device)


def rand_exchange(seed, rank, n, device, top2):
    """Per-row partials of the split vocabulary: some rows tie across ranks (rank 0 must win), some hold NaN."""
    import torch
    shared = torch.Generator().manual_seed(seed * 31 + n)
    mine = torch.Generator().manual_seed(seed * 37 + n + 1000 * (rank + 1))
    base = torch.randn(n, generator=shared)
    v1 = base + torch.randn(n, generator=mine)
    tie = torch.rand(n, generator=shared) < 0.3
    v1 = torch.where(tie, base, v1)
    nan = torch.rand(n, generator=mine) < 0.1
    v1 = torch.where(nan, torch.full_like(v1, float("nan")), v1)
    lo, hi = RANK0_IDS if rank == 0 else RANK1_IDS
    idx = torch.randint(lo, hi, (n,), generator=mine, dtype=torch.int64)
    v2 = v1 - torch.rand(n, generator=mine)
    return v1.to(device), v2.to(device), idx.to(device)


def _check(name, got, want, errors):
    """Appends one line per output part whose bits differ: how many words (compared as bits, so equal NaNs are
    equal) and the first few (index, got, want) in hex."""
    from dspark_ray.comm.reference import same_bits
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for k, (a, b) in enumerate(zip(got, want)):
        if same_bits(a, b):
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            errors.append(f"{name} part {k}: shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
            continue
        ai, bi = (t.reshape(-1).view(torch_int_of(t)).cpu() for t in (a, b))
        bad = (ai != bi).nonzero().flatten()
        words = ", ".join(f"[{i}] {int(ai[i]) & 0xFFFFFFFF:08x} vs {int(bi[i]) & 0xFFFFFFFF:08x}"
                          for i in bad[:6].tolist())
        errors.append(f"{name} part {k}: {bad.numel()} words differ: {words}")


def torch_int_of(t):
    import torch
    return {torch.float32: torch.int32, torch.int64: torch.int64}.get(t.dtype, torch.int32)


def _set_ranges(v, pc=None):
    (pc or v.pc).set_peer_id_range(RANK1_IDS if v.rank == 0 else RANK0_IDS)


def _run_op(v, pc, kind, n, seed, nblocks=None):
    """One collective through push and through the oracle; returns (push output, oracle output)."""
    dev = pc.device
    if kind == "ar":
        # the Lamport variant sends a raw signaling-NaN input equal to its empty pattern as the quiet twin
        x = rand_partial(seed, v.rank, n, dev, snan=pc.allreduce_variant != "lamport")
        return pc.all_reduce([x], nblocks=nblocks), v.ref.all_reduce([x])
    v1, v2, idx = rand_exchange(seed, v.rank, n, dev, kind == "top2")
    if kind == "max":
        return pc.max_exchange([(v1, idx)]), v.ref.max_exchange([(v1, idx)])
    return pc.top2_exchange([(v1, v2, idx)]), v.ref.top2_exchange([(v1, v2, idx)])


def _exact_sequence(v, pc, seed, count):
    """A mixed random sequence (same on both ranks: drawn from a shared seed) compared bit for bit."""
    import random
    rnd = random.Random(seed)
    errors = []
    for k in range(count):
        kind = rnd.choice(["ar", "ar", "max", "top2"])
        if kind == "ar":
            n = rnd.choice([2, 4, 7, 1000, 5 * H, 10 * H, 20 * H, 3 * H + 3, min(64 * H, pc.layout.max_words),
                            min(80 * H, pc.layout.max_words), pc.layout.max_rows(H) * H])
            nb = rnd.choice([None, None, 1, 3, 8, 32, 128])
        else:
            n, nb = rnd.choice([1, 5, 20, 64, min(80, pc.layout.maxx), pc.layout.maxx]), None
        got, want = _run_op(v, pc, kind, n, seed * 1000 + k, nb)
        _check(f"#{k} {kind} n={n} blocks={nb}", got, want, errors)
    pc.check_error()
    return errors


# --- scenarios -------------------------------------------------------------------------------------------------

def sc_exact(v):
    """Push equals the plain-copy oracle bit for bit over sizes x block counts, exchanges with ties and NaN, and a
    mixed random sequence."""
    _set_ranges(v)
    errors = []
    # up to the layout's widest: 16 requests of 5 rows are 80, the default layout carries 128
    for n in (2, 4, 7, 1000, 5 * H, 20 * H, 3 * H + 3, 64 * H, min(80 * H, v.pc.layout.max_words),
              v.pc.layout.max_rows(H) * H):
        for nb in (None, 1, 3, 8, 32, 128):
            got, want = _run_op(v, v.pc, "ar", n, 11, nb)
            _check(f"ar n={n} blocks={nb}", got, want, errors)
    for kind in ("max", "top2"):
        for n in (1, 5, 20, 64, min(80, v.pc.layout.maxx), v.pc.layout.maxx):
            got, want = _run_op(v, v.pc, kind, n, 12)
            _check(f"{kind} n={n}", got, want, errors)
    for n, nb in ((16, None), (1003, 3), (5 * H, None)):
        x = nan_pair_partial(v.rank, n, v.pc.device)
        _check(f"NaN pairs n={n} blocks={nb}", v.pc.all_reduce([x], nblocks=nb), v.ref.all_reduce([x]), errors)
    v.pc.check_error()
    errors += _exact_sequence(v, v.pc, 13, 80)
    assert not errors, errors[:10]
    return {"epoch": v.pc.device_epoch(), "host_epoch": v.pc.guard.epoch, "nan_rule": hex(v.pc.nan_rule)}


def sc_delayed(v):
    """One rank's stream sleeps before each collective (alternating ranks): still exact, no error."""
    import torch
    _set_ranges(v)
    errors = []
    for k in range(12):
        if k % 2 == v.rank:
            torch.cuda._sleep(40_000_000)          # ~20 ms at ~2 GHz, far below the 2 s bound
        kind = ("ar", "max", "top2")[k % 3]
        got, want = _run_op(v, v.pc, kind, 20 * H if kind == "ar" else 20, 100 + k)
        _check(f"delayed #{k} {kind}", got, want, errors)
    v.pc.check_error()
    assert not errors, errors
    return {}


def _graph_case(v, pc, replays=40, check_at=(0, 1, 2, 10, 25, 39)):
    """20 back-to-back collectives of mixed kinds and sizes captured once, replayed many times with fresh inputs."""
    import torch
    _set_ranges(v, pc)
    dev = pc.device
    plan = []
    for k in range(20):
        kind = ("ar", "ar", "max", "ar", "top2")[k % 5]
        n = (2, 5 * H, 10 * H, 15 * H, 20 * H, min(80 * H, pc.layout.max_words))[k % 6] if kind == "ar" \
            else (1, 4, 20, min(80, pc.layout.maxx))[k % 4]
        plan.append((kind, n))
    static = []
    for k, (kind, n) in enumerate(plan):
        if kind == "ar":
            static.append((rand_partial(1, v.rank, n, dev, snan=pc.allreduce_variant != "lamport"),))
        else:
            static.append(rand_exchange(1, v.rank, n, dev, kind == "top2"))

    def op(kind, ins):
        if kind == "ar":
            return pc.all_reduce([ins[0]])
        if kind == "max":
            return pc.max_exchange([(ins[0], ins[2])])
        return pc.top2_exchange([ins])

    def oracle(kind, ins):
        if kind == "ar":
            return v.ref.all_reduce([ins[0]])
        if kind == "max":
            return v.ref.max_exchange([(ins[0], ins[2])])
        return v.ref.top2_exchange([ins])

    g = torch.cuda.CUDAGraph()
    v.barrier()
    for turn in (0, 1):                 # single-card: one capture at a time (both threads share the device)
        if turn == (0 if v.mode == "pair" else v.rank):
            with pc.graph_capture() as cap:
                with torch.cuda.graph(g, stream=v.stream, capture_error_mode="thread_local"):
                    outs = [op(kind, ins) for (kind, _), ins in zip(plan, static)]
        v.barrier()
    assert cap.n_collectives == 20, cap.n_collectives
    epoch0 = pc.guard.epoch
    errors = []
    for r in range(replays):
        for k, (kind, n) in enumerate(plan):
            fresh = (rand_partial(1000 + r * 20 + k, v.rank, n, dev, snan=pc.allreduce_variant != "lamport"),) \
                if kind == "ar" else \
                rand_exchange(1000 + r * 20 + k, v.rank, n, dev, kind == "top2")
            for dst, src in zip(static[k], fresh):
                dst.copy_(src)
        pc.replay(g, cap.n_collectives)
        if r in check_at:
            for k, (kind, _) in enumerate(plan):
                _check(f"replay {r} op {k} {kind}", outs[k], oracle(kind, static[k]), errors)
    pc.check_error()
    dev_epoch = pc.device_epoch()
    assert dev_epoch == pc.guard.epoch == epoch0 + 20 * replays, (dev_epoch, pc.guard.epoch, epoch0)
    assert not errors, errors[:10]
    return {"replays": replays, "collectives": 20 * replays, "device_epoch": dev_epoch}


def sc_graph(v):
    """Graph capture of 20 back-to-back collectives replayed 40 times equals the oracle; epochs advance on the
    device exactly as the host's book says."""
    return _graph_case(v, v.pc)


def sc_variants(v):
    """The Lamport all-reduce and the flag-published exchange: exact eagerly, in graphs, and after a reset."""
    pc = v.make_pc(allreduce="lamport", exchange="flag")
    try:
        _set_ranges(v, pc)
        errors = _exact_sequence(v, pc, 21, 60)
        assert not errors, errors[:10]
        g = _graph_case(v, pc, replays=20, check_at=(0, 7, 19))
        v.reset_pair(pc)
        errors = _exact_sequence(v, pc, 22, 20)
        assert not errors, errors[:10]
        return {"graph": g}
    finally:
        v.barrier()
        pc.close()


def sc_strict(v):
    """strict_acks: exact; and a refused id on rank 0 is in rank 1's error word when rank 1's own kernel ends
    (no barrier needed first: the same-round visibility of seed 000's RX-TP2SAFE)."""
    pc = v.make_pc(strict_acks=True)
    try:
        _set_ranges(v, pc)
        errors = _exact_sequence(v, pc, 31, 40)
        assert not errors, errors[:10]
        v1, _, idx = rand_exchange(9, v.rank, 5, pc.device, False)
        if v.rank == 1:
            idx = idx.clone()
            idx[2] = 5
        pc.max_exchange([(v1, idx)])
        msg, _ = _expect_failure(pc)
        w = pc.error_word()
        assert w & 4, (w, msg)
        v.reset_pair(pc)
        errors = _exact_sequence(v, pc, 32, 10)
        assert not errors, errors[:10]
        return {"error": w}
    finally:
        v.barrier()
        pc.close()


def _expect_failure(pc, timeout_s=None):
    from dspark_ray.model.collectives import CollectiveError
    t = time.monotonic()
    try:
        pc.check_error(timeout_s)
    except CollectiveError as e:
        return str(e), time.monotonic() - t
    raise AssertionError("check_error() passed where the collective must fail closed")


def _all_nan(t):
    return bool(t.isnan().all())


def _recover(v, seed):
    v.pc.set_timeout(2.0)
    v.reset_pair()
    assert v.pc.error_word() == 0
    errors = _exact_sequence(v, v.pc, seed, 12)
    assert not errors, errors


def sc_timeout(v):
    """Rank 1 never launches: rank 0 times out with bit 1 (bounded, ~0.2 s), bit 2 is mirrored into rank 1, the
    output is refused; a later launch on rank 1 fails at once (sticky); a drained reset restores exact service."""
    import torch
    v.pc.set_timeout(0.2)
    x = rand_partial(5, v.rank, 20 * H, v.pc.device)
    seen = {}
    if v.rank == 0:
        t = time.monotonic()
        out = v.pc.all_reduce([x])
        msg, _ = _expect_failure(v.pc)
        seen["waited_s"] = round(time.monotonic() - t, 3)
        seen["error"] = v.pc.error_word()
        assert seen["error"] & 1, seen
        assert _all_nan(out), "a timed-out all-reduce must leave NaN, not a partial sum"
        assert 0.15 < seen["waited_s"] < 1.5, seen
        seen["message"] = msg
    v.barrier()
    if v.rank == 1:
        seen["error_before_launch"] = v.pc.error_word()
        assert seen["error_before_launch"] & 2, seen
        t = time.monotonic()
        out = v.pc.all_reduce([x])
        _expect_failure(v.pc)
        seen["sticky_fail_s"] = round(time.monotonic() - t, 3)
        assert seen["sticky_fail_s"] < 0.15, seen
        assert _all_nan(out)
    v.barrier()
    _recover(v, 51)
    torch.cuda.synchronize()
    return seen


def sc_flag_never_raised(v):
    """Rank 1's block 0 never raises its flag: rank 0 times out (bit 1), rank 1 sees bit 2, no hang."""
    v.pc.set_timeout(0.2)
    x = rand_partial(6, v.rank, 20 * H, v.pc.device)
    if v.rank == 1:
        v.pc._debug_skip_flag_block = 0
    t = time.monotonic()
    v.pc.all_reduce([x], nblocks=4)
    v.pc._debug_skip_flag_block = -1
    seen = {}
    if v.rank == 0:         # rank 1's blocks all got their flags: it learns of the failure from rank 0's mirror
        seen["message"], _ = _expect_failure(v.pc)
        seen["waited_s"] = round(time.monotonic() - t, 3)
        assert seen["waited_s"] < 1.5, seen
    v.barrier()
    if v.rank == 1:
        seen["message"], _ = _expect_failure(v.pc)
    seen["error"] = v.pc.error_word()
    assert seen["error"] & (1 if v.rank == 0 else 2), seen
    v.barrier()
    _recover(v, 61)
    return seen


def sc_cancel(v):
    """A collective parked on rank 0 (peer absent, 10 s bound) is unblocked by cancel() from the independent
    stream within well under a second (bit 8, mirrored to rank 1)."""
    v.pc.set_timeout(10.0)
    x = rand_partial(7, v.rank, 5 * H, v.pc.device)
    seen = {}
    if v.rank == 0:
        out = v.pc.all_reduce([x])
        time.sleep(0.1)
        t = time.monotonic()
        v.pc.cancel()
        msg, _ = _expect_failure(v.pc, timeout_s=3.0)
        seen["unblocked_after_cancel_s"] = round(time.monotonic() - t, 3)
        seen["error"] = v.pc.error_word()
        seen["message"] = msg
        assert seen["error"] & 8, seen
        assert seen["unblocked_after_cancel_s"] < 1.0, seen
        assert _all_nan(out)
    v.barrier()
    if v.rank == 1:
        seen["error"] = v.pc.error_word()
        assert seen["error"] & 8, seen
    v.barrier()
    _recover(v, 71)
    return seen


def sc_exhaustion(v):
    """Forced near-exhaustion: epochs 0xFFFFFFFE and 0xFFFFFFFF are exact; the next launch fails closed with
    bit 16 on both ranks without touching the peer's receive buffer; the host refuses a replay past the end."""
    from dspark_ray.model.collectives import CollectiveError
    v.reset_pair()
    v.pc._debug_force_epoch(0xFFFFFFFD)
    v.barrier()
    errors = []
    for k in range(2):
        got, want = _run_op(v, v.pc, "ar", 5 * H, 80 + k)
        _check(f"near exhaustion #{k}", got, want, errors)
    v.pc.check_error()
    assert not errors, errors
    assert v.pc.device_epoch() == 0xFFFFFFFF
    off = v.pc.layout.off_recv                      # parity 0 (the would-be epoch 0's buffer)
    v.pc.state.fill(off, 4096, 0xAB)
    v.barrier()
    out = v.pc.all_reduce([rand_partial(82, v.rank, 5 * H, v.pc.device)])
    msg, _ = _expect_failure(v.pc)
    w = v.pc.error_word()
    assert w & 16, (w, msg)
    assert _all_nan(out)
    v.barrier()
    untouched = v.pc.state.read_u32(off, 16)
    assert all(u == 0xABABABAB for u in untouched), [hex(u) for u in untouched]
    assert v.pc.device_epoch() == 0xFFFFFFFF       # exhaustion is never published as epoch 0
    try:
        v.pc.replay(None, 1)
        raise AssertionError("replay past the last epoch was not refused")
    except CollectiveError as e:
        refused = str(e)
    v.barrier()
    _recover(v, 81)
    return {"error": w, "replay_refusal": refused}


def sc_bad_id(v):
    """Rank 1 sends an id outside its vocabulary slice: rank 0 refuses it (bit 4), mirrored into rank 1."""
    import torch
    _set_ranges(v)
    v1, _, idx = rand_exchange(9, v.rank, 5, v.pc.device, False)
    if v.rank == 1:
        idx = idx.clone()
        idx[2] = 5                                  # a rank-0 id coming from rank 1
    out = v.pc.max_exchange([(v1, idx)])
    msg = ""
    if v.rank == 0:         # the refusing rank; rank 1 learns of it through the mirrored bit
        msg, _ = _expect_failure(v.pc)
    v.barrier()
    if v.rank == 1:
        msg, _ = _expect_failure(v.pc)
    w = v.pc.error_word()
    assert w & 4, (w, msg)
    if v.rank == 0:
        assert bool((out[1] == -1).all()) and _all_nan(out[0])
    v.barrier()
    _recover(v, 91)
    torch.cuda.synchronize()
    return {"error": w, "message": msg}


def sc_poison(v):
    """A timed-out idle wait poisons: launches, graph replays, resets and new instances are refused; cancel still
    unblocks the parked collective. Poisons the process: run last."""
    import torch
    from dspark_ray.model.collectives import CollectiveError
    from dspark_ray.comm.push import PushCollectives
    x = rand_partial(10, v.rank, 5 * H, v.pc.device)
    g = torch.cuda.CUDAGraph()
    v.barrier()
    for turn in (0, 1):
        if turn == (0 if v.mode == "pair" else v.rank):
            with v.pc.graph_capture() as cap:
                with torch.cuda.graph(g, stream=v.stream, capture_error_mode="thread_local"):
                    v.pc.all_reduce([x])
        v.barrier()
    v.pc.replay(g, cap.n_collectives)
    v.pc.check_error()
    v.barrier()
    seen = {}
    if v.rank == 0:
        v.pc.set_timeout(5.0)
        v.pc.all_reduce([x])                        # parks: rank 1 never joins
        try:
            v.pc.drain(timeout_s=0.2)
            raise AssertionError("a timed-out drain did not poison")
        except CollectiveError as e:
            seen["poisoned_by"] = str(e)
        assert v.pc.poisoned
        for what, call in (("launch", lambda: v.pc.all_reduce([x])),
                           ("replay", lambda: v.pc.replay(g, cap.n_collectives)),
                           ("reset", lambda: v.pc.reset()),
                           ("new instance", lambda: PushCollectives(0))):
            try:
                call()
                raise AssertionError(f"poisoned rank accepted a {what}")
            except CollectiveError as e:
                seen[f"refused_{what}"] = str(e)[:160]
        t = time.monotonic()
        v.pc.cancel()
        torch.cuda.current_stream().synchronize()
        seen["cancel_unparked_s"] = round(time.monotonic() - t, 3)
    v.barrier()
    if v.rank == 1:
        if v.mode == "single":                      # same process: the latch is process-wide
            try:
                v.pc.all_reduce([x])
                raise AssertionError("rank 1 launched in a poisoned process")
            except CollectiveError as e:
                seen["refused_in_same_process"] = str(e)[:160]
        else:
            seen["error"] = v.pc.error_word()
            assert seen["error"] & 8, seen         # the cancel was mirrored
    return seen


SCENARIOS = {name: globals()[f"sc_{name}"] for name in SCENARIOS_IN_ORDER}


# --- harness processes -----------------------------------------------------------------------------------------

def _env_guard():
    # NVLink multicast stays off on the lent machines (a program that uses it can take the host's GPUs down)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def _serve(conn, run_one):
    while True:
        msg = conn.recv()
        if msg is None:
            return
        name = msg
        t = time.monotonic()
        try:
            out = run_one(name)
            conn.send({"ok": True, "out": out, "s": round(time.monotonic() - t, 2)})
        except BaseException as e:  # noqa: BLE001 - report everything to the parent
            conn.send({"ok": False, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()[-3000:],
                       "s": round(time.monotonic() - t, 2)})


def _warm_torch_ops(device):
    """Launch every torch kernel the scenarios use once, before any collective runs. With both ranks in one
    process, a kernel loaded lazily by one thread while the other thread's collective spins can stall the loader
    until that collective times out (seen in the first run: torch.cuda._sleep). The service must do the same for
    its whole step (or run with CUDA_MODULE_LOADING=EAGER)."""
    import torch
    torch.cuda._sleep(1)
    for dt in (torch.float32, torch.int64):
        a = torch.arange(70, dtype=dt).to(device)
        b = a.flip(0).clone()
        c = torch.where(a > b, a, b)
        c.copy_(a)
        _ = (a != b).sum().item(), torch.equal(a, b), torch.full_like(a, 1), torch.empty_like(a)
    f = torch.randn(70).to(device)
    _ = (torch.maximum(f, f + f), f.isnan().all().item(), f.view(torch.int32).view(-1) != 0,
         (torch.isnan(f) & ~torch.isnan(f)), f - 1, f.cpu())
    torch.cuda.synchronize()


def _single_worker(conn, allreduce):
    _env_guard()
    import torch
    from dspark_ray.comm.push import make_single_card_pair
    from dspark_ray.comm.reference import ReferenceCollectives
    torch.cuda.set_device(0)
    _warm_torch_ops(torch.device("cuda", 0))
    pcs = make_single_card_pair(0, allreduce=allreduce)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    bar = threading.Barrier(2, timeout=120)
    slots = [None, None]

    def share(rank):
        def f(obj):
            slots[rank] = obj
            bar.wait()
            got = list(slots)
            bar.wait()
            return got
        return f

    def gather(rank):
        sh = share(rank)

        def f(t):
            c = t.clone()
            torch.cuda.current_stream().synchronize()
            return sh(c)
        return f

    views = [RankView("single", r, pcs[r], ReferenceCollectives(r, gather(r)), streams[r], bar.wait, share(r))
             for r in (0, 1)]

    def run_one(name):
        res = [None, None]

        def body(r):
            try:
                torch.cuda.set_device(0)
                with torch.cuda.stream(streams[r]):
                    res[r] = {"ok": True, "out": SCENARIOS[name](views[r])}
            except BaseException as e:  # noqa: BLE001
                bar.abort()
                res[r] = {"ok": False, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()[-3000:]}
        ths = [threading.Thread(target=body, args=(r,)) for r in (0, 1)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        bar.reset()
        bad = [r for r in res if not r["ok"]]
        if bad:
            raise AssertionError(" / ".join(f"{b['error']}\n{b['tb']}" for b in bad))
        return [r["out"] for r in res]

    conn.send({"ok": True, "out": pcs[0].describe()})
    _serve(conn, run_one)


def _pair_worker(conn, rank, port, allreduce):
    _env_guard()
    import datetime
    import torch
    import torch.distributed as dist
    from dspark_ray.comm.push import PushCollectives
    from dspark_ray.comm.reference import ReferenceCollectives, gloo_gather
    torch.cuda.set_device(0)                        # CUDA_VISIBLE_DEVICES shows this rank its own card only
    _warm_torch_ops(torch.device("cuda", 0))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    pc = PushCollectives(rank, allreduce=allreduce)
    hs = [None, None]
    dist.all_gather_object(hs, pc.export_handle().to_dict())
    pc.connect(hs[1 - rank], barrier=dist.barrier)

    def share(obj):
        out = [None, None]
        dist.all_gather_object(out, obj)
        return out

    view = RankView("pair", rank, pc, ReferenceCollectives(rank, gloo_gather()), torch.cuda.Stream(),
                    dist.barrier, share)

    def run_one(name):
        with torch.cuda.stream(view.stream):
            return SCENARIOS[name](view)

    conn.send({"ok": True, "out": pc.describe() + f" [{torch.cuda.get_device_name(0)}, "
                                                   f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}]"})
    _serve(conn, run_one)


class Harness:
    """Spawned worker process(es) that run scenarios on request. mode: 'single' (one process, one card) or 'pair'
    (two processes, cards 0 and 1); allreduce: the variant under test ('flag' or 'lamport'). After a failed scenario the workers are killed and respawned before the next
    one, so one failure cannot leave the ranks out of step (or a rank parked at a barrier) for the rest."""

    def __init__(self, mode: str, allreduce: str = "flag", start_timeout_s: float = 180.0):
        self.mode = mode
        self.allreduce = allreduce
        self.start_timeout_s = start_timeout_s
        self.procs, self.conns = [], []
        self.broken = False
        self._start()

    def _start(self):
        import multiprocessing as mp
        import socket
        ctx = mp.get_context("spawn")
        _env_guard()
        if self.mode == "single":
            targets = [(_single_worker, (self.allreduce,), None)]
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            targets = [(_pair_worker, (r, port, self.allreduce), str(r)) for r in (0, 1)]
        for fn, args, cvd in targets:
            parent, child = ctx.Pipe()
            old = os.environ.get("CUDA_VISIBLE_DEVICES")
            if cvd is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = cvd     # inherited by the spawned process at start
            try:
                p = ctx.Process(target=fn, args=(child, *args), daemon=True)
                p.start()
                child.close()             # so a worker that dies shows as EOF at once, not as a start-up timeout
            finally:
                if cvd is not None:
                    if old is None:
                        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                    else:
                        os.environ["CUDA_VISIBLE_DEVICES"] = old
            self.procs.append(p)
            self.conns.append(parent)
        self.describe = self._collect(self.start_timeout_s, "start-up")
        self.broken = False

    def _collect(self, timeout_s, what):
        """Every worker's answer; after the first failure the others get a short grace, then all are killed."""
        from multiprocessing.connection import wait
        pending = list(self.conns)
        got, errors = {}, []
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for i, p in enumerate(self.procs):
                if self.conns[i] in pending and not p.is_alive() and not self.conns[i].poll():
                    pending.remove(self.conns[i])
                    got[i] = {"ok": False, "error": f"worker exited with code {p.exitcode}", "tb": ""}
                    errors.append(f"worker {i}: exited with code {p.exitcode} (see its stderr above)")
                    deadline = min(deadline, time.monotonic() + 15.0)
            for c in wait(pending, timeout=min(left, 1.0)):
                try:
                    msg = c.recv()
                except EOFError:
                    msg = {"ok": False, "error": "worker died", "tb": ""}
                pending.remove(c)
                got[self.conns.index(c)] = msg
                if not msg["ok"]:
                    errors.append(f"worker {self.conns.index(c)}: {msg['error']}\n{msg.get('tb', '')}")
                    deadline = min(deadline, time.monotonic() + 15.0)
        if pending:
            errors.append(f"{what}: no answer from worker(s) {[self.conns.index(c) for c in pending]} in time")
        if errors:
            self.broken = True
            self._kill()
            raise AssertionError(f"selftest {self.mode} {what}: " + "\n".join(errors))
        return [got[i]["out"] for i in range(len(self.conns))]

    def run(self, name: str, timeout_s: float = 90.0):
        if self.broken:
            self._start()
        for c in self.conns:
            c.send(name)
        outs = self._collect(timeout_s, name)
        return outs[0] if self.mode == "single" else outs

    def _kill(self):
        for p in self.procs:
            if p.is_alive():
                p.kill()                  # our own child, by its handle
            p.join(timeout=10)
        self.procs, self.conns = [], []

    def close(self):
        for c in self.conns:
            try:
                c.send(None)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=20)
        self._kill()


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = argv.pop(0) if argv else "single"            # single | pair | single:lamport | pair:lamport
    names = argv or list(SCENARIOS_IN_ORDER)
    mode, _, variant = mode.partition(":")
    h = Harness(mode, variant or "flag")
    print(f"[{mode}] {h.describe}", flush=True)
    failed = 0
    try:
        for name in names:
            t = time.monotonic()
            try:
                out = h.run(name)
                print(f"[{mode}] PASS {name} ({time.monotonic() - t:.1f} s) {out}", flush=True)
            except Exception as e:
                failed += 1
                print(f"[{mode}] FAIL {name} ({time.monotonic() - t:.1f} s) {e}", flush=True)
    finally:
        h.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
