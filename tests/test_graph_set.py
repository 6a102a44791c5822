"""The graph engine's input path on a CPU: the graph set's functions run uncaptured over the same static buffers (one
packed upload; windows gathered from the slot pool; inserts scattered into it, chunked and padded to buckets;
outputs packed into one fp64 tensor), so CI checks them against the eager engine bit for bit. The captured replays
are checked on the GPU (test_gpu_graphs.py)."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from dspark_ray.testing import workload
from dspark_ray.testing.batches import Driver, entry
from dspark_ray.protocol import records as M
from dspark_ray.protocol.contract import make_entry
from dspark_ray.rank.engine import RankEngine
from dspark_ray.rank.graphs import GraphSet, HostDraft
from dspark_ray.model.heads import confident_prefix
from dspark_ray.rank.modes import make_drafter
from dspark_ray import settings

N_SLOTS = 6


def _engines(cfg, ckpt):
    eager = Driver(RankEngine(make_drafter(cfg, "tp1", ckpt=ckpt), N_SLOTS))
    graph = Driver(RankEngine(make_drafter(cfg, "tp1", ckpt=ckpt), N_SLOTS, graphs=True))
    # draft, step: 1-4 requests at every (n_out, margins), the wide bucket 6 at n_out B (both margins); insert
    assert graph.graphs is not None and graph.graphs.n_graphs == 2 * (4 * cfg.block_size * 2 + 2) + 5
    return eager, graph


def _same_step(eager, graph, batch):
    """Both engines' answers to `batch`: equal in every field and byte, each of its entry's n_out."""
    a, b = eager.step(batch), graph.step(batch)
    assert len(a) == len(b) == len(batch)
    for e, x, y in zip(batch, a, b):
        assert x == y
        assert (len(x.drafts), len(x.confidences), len(x.margins)) == (4 * e.n_out, 4 * e.n_out,
                                                                        4 * e.n_out * e.want_margins)
        # an entry's prefix is over its own n_out drafts, also when the batch drafted more
        assert x.confident_len == int(confident_prefix(torch.from_numpy(x.confidences_array().copy()),
                                                       eager.drafter.head.threshold))
    return b


def _same_rings(eager, graph):
    for s, (x, y) in enumerate(zip(eager.slots, graph.slots)):
        assert (x.position, x.base) == (y.position, y.base), s
        assert torch.equal(x.kv, y.kv), s         # rows never written are zero in both


def test_graph_engine_equals_the_eager_engine_bit_for_bit(cfg, ckpt):
    """Rounds of 3 requests (partial windows, a far start, rollbacks, every n_out, margins), then batches the
    rounds do not cover: inserts of more than the largest bucket across two entries, and 5 requests (the wide
    bucket of 6, one pad request)."""
    eager, graph = _engines(cfg, ckpt)
    for batch in workload.rounds(cfg, n_requests=3, n_rounds=10, far_start=900_000):
        _same_step(eager, graph, batch)
    _same_rings(eager, graph)
    g = torch.Generator().manual_seed(3)
    pos = [s.position for s in graph.slots]

    def rows_at(slot, rows, **kw):
        return entry(slot=slot, seed_token=int(torch.randint(0, cfg.vocab_size, (1,), generator=g)), n_out=5,
                     start_pos=pos[slot], token_ids=torch.randint(0, cfg.vocab_size, (rows,), generator=g),
                     taps=workload.make_taps(cfg, rows, g), **kw)

    big = [rows_at(0, 100), rows_at(1, 90, want_margins=True), rows_at(3, 128)]   # 318 rows: three chunks
    _same_step(eager, graph, big)
    pos = [s.position for s in graph.slots]
    _same_step(eager, graph, [rows_at(s, 1 + s) for s in range(5)])
    _same_rings(eager, graph)
    assert graph.slots[5].fresh and not graph.slots[5].kv.any()       # pad rows went to the scratch slot only


def _replays(engine) -> list[str]:
    """The kinds of the graphs `engine` replays from now on, in order."""
    gs, log = engine.graphs, []
    kinds = {id(g): kind for kind, graphs in (("draft", gs.draft_graphs), ("insert", gs.insert_graphs),
                                               ("step", gs.step_graphs)) for g in graphs.values()}
    replay = gs._replay
    gs._replay = lambda g: (log.append(kinds[id(g)]), replay(g))[1]
    return log


def test_a_decode_round_is_one_step_graph_with_the_separate_graphs_bits(cfg, ckpt, monkeypatch):
    """A round whose rows fit the step graph (<= 8 per request) replays it alone: the insert beside the draft. More
    rows go through the insert graphs first, their last chunk beside the draft when it fits; a draft without rows
    runs the draft graph. Every answer and ring is the separate graphs' (`DSPARK_STEP_GRAPHS=0`) bit for bit."""
    monkeypatch.setenv("DSPARK_STEP_GRAPHS", "0")
    settings.reread()
    apart = Driver(RankEngine(make_drafter(cfg, "tp1", ckpt=ckpt), N_SLOTS, graphs=True))
    assert not apart.graphs.step_graphs
    monkeypatch.delenv("DSPARK_STEP_GRAPHS")
    settings.reread()
    graph = Driver(RankEngine(make_drafter(cfg, "tp1", ckpt=ckpt), N_SLOTS, graphs=True))
    assert graph.graphs.n_graphs == 2 * (4 * cfg.block_size * 2 + 2) + 5   # draft, step; insert
    log = _replays(graph)
    for batch in workload.rounds(cfg, n_requests=4, n_rounds=8, far_start=900_000):
        _same_step(apart, graph, batch)
    assert log == ["step"] * 8
    g = torch.Generator().manual_seed(5)

    def rows_at(slot, rows):
        return entry(slot=slot, seed_token=3 + slot, n_out=4, start_pos=graph.slots[slot].position,
                     token_ids=torch.randint(0, cfg.vocab_size, (rows,), generator=g),
                     taps=workload.make_taps(cfg, rows, g))
    for rows, kinds in (({0: 100, 1: 30}, ["insert", "step"]),      # a 128-row chunk, then 2 rows beside the draft
                        ({0: 40}, ["insert", "draft"]),              # 40 > 8: one insert chunk, then the draft
                        ({0: 6, 1: 9}, ["step"]),                    # 15 <= 2 x 8
                        ({2: 0}, ["draft"])):
        del log[:]
        _same_step(apart, graph, [rows_at(slot, n) for slot, n in rows.items()])
        assert log == kinds, (log, kinds)
    _same_rings(apart, graph)


def test_a_request_drafts_the_same_in_every_batch_bucket(cfg, ckpt):
    """Batch invariance through the packed path: each request of a 4-request batch gets its one-request answer."""
    _, graph = _engines(cfg, ckpt)
    batch = [entry(slot=s, seed_token=11 + s, n_out=5, token_ids=torch.arange(3 + 5 * s),
                   taps=workload.make_taps(cfg, 3 + 5 * s, torch.Generator().manual_seed(s))) for s in range(4)]
    alone = [graph.step([e])[0] for e in batch]
    together = graph.step(batch, resets=range(4))
    assert alone == together


def test_wide_batches_run_padded_in_their_bucket_with_the_eager_bits(cfg, ckpt):
    """5-16 requests run in the wide buckets (6, 8, 12, 16): one step graph each round, padded with copies of the
    first request and drafted at n_out = B. Every answer (each entry's own n_out, margins, the confident prefix cut
    there) and every ring is the eager engine's bit for bit; a draft in a bucket gives each request its one-request
    answer."""
    n = 16
    eager = Driver(RankEngine(make_drafter(cfg, "tp1", ckpt=ckpt), n))
    graph = Driver(RankEngine(make_drafter(cfg, "tp1", ckpt=ckpt), n, graphs=True))
    gs = graph.graphs
    assert gs.wide_buckets == (6, 8, 12, 16) and gs.max_requests == 16
    assert gs.n_graphs == 2 * (4 * cfg.block_size * 2 + 4 * 2) + 5
    assert [gs.buckets.of_requests[k] for k in range(1, 17)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16, 16, 16, 16]
    assert RankEngine(make_drafter(cfg, "tp1", ckpt=ckpt), 4, graphs=True).graphs.wide_buckets == ()
    assert GraphSet(make_drafter(cfg, "tp1", ckpt=ckpt), n, max_requests=10).wide_buckets == (6, 8, 10)
    log = _replays(graph)
    rounds = workload.rounds(cfg, seed=12, n_requests=n, n_rounds=3, far_start=900_000)
    for batch in rounds:                                  # contexts in every slot (the first round: 3-6 rows each)
        _same_step(eager, graph, batch)
    for width in (5, 7, 9, 13, 16):
        for batch in workload.rounds(cfg, seed=width, n_requests=width, n_rounds=2, first_rows=(2, 1)):
            for e in batch:
                e.start_pos = graph.slots[e.slot].position
            _same_step(eager, graph, batch)
    assert log == ["step"] * (3 + 5 * 2)
    _same_rings(eager, graph)
    states, seeds = gs.slots[:11], [7 + 3 * r for r in range(11)]
    for n_out, margins in ((5, True), (2, False)):
        together = gs.run([], states, seeds, n_out, margins, host=True)        # bucket 12, one pad request
        assert together.drafts.shape == (11, n_out)
        for r in range(11):
            alone = gs.run([], states[r:r + 1], seeds[r:r + 1], n_out, margins, host=True)
            assert np.array_equal(together.drafts[r], alone.drafts[0])
            assert np.array_equal(together.confidences[r], alone.confidences[0])
            assert together.confident_len[r] == alone.confident_len[0]
            if margins:
                assert np.array_equal(together.margins[r], alone.margins[0])


def test_no_batch_is_wider_than_the_slots_or_one_collective(cfg, ckpt, monkeypatch):
    """A graph set drafts at most one request a slot, and no more rows than one collective of its pair carries (the
    push pair's layout: 128 rows, 25 requests of the full preset); the deployment's batch limit says the same."""
    from dspark_ray.spec import PairSpec
    from dspark_ray.config import full
    from dspark_ray.comm.push import max_rows
    d = make_drafter(cfg, "tp1", ckpt=ckpt)
    assert GraphSet(d, 5).max_requests == 5 and GraphSet(d, 5).wide_buckets == (5,)
    monkeypatch.setattr(d.coll, "max_rows", lambda width: 3 * cfg.block_size + 1, raising=False)
    capped = GraphSet(d, 16)
    assert capped.max_requests == 3 and capped.wide_buckets == () and capped.buckets.of_requests == [0, 1, 2, 3]
    assert max_rows(5120) == 128
    push = PairSpec(checkpoint="x", backend="push", device="cuda")
    assert push.batch_limit(full()) == 16 and PairSpec(checkpoint="x").batch_limit(full()) == 16
    wide = dict(checkpoint="x", n_slots=32, max_batch=32)
    assert PairSpec(backend="push", device="cuda", **wide).batch_limit(full()) == 25       # 128 rows // 5
    assert PairSpec(**wide).batch_limit(full()) == 32
    assert PairSpec(checkpoint="x", n_slots=8).batch_limit(full()) == 8
    assert PairSpec(checkpoint="x", max_batch=3).batch_limit(full()) == 3
    with pytest.raises(ValueError, match="max_batch"):
        PairSpec(checkpoint="x", max_batch=0)
    # The dense kernel a rank installs: the one-read Triton kernel once a batch can span two 32-row chunks.
    from dspark_ray.kernels.gemm import dense_for
    rows = [PairSpec(checkpoint="x", max_batch=b).batch_limit(full()) * full().block_size for b in (4, 6, 7, 16)]
    assert [dense_for(r) for r in rows] == ["cublas", "cublas", "triton", "triton"]
    assert dense_for(80, "cublas") == "cublas" and dense_for(5, "triton") == "triton"
    with pytest.raises(ValueError, match="dense kernel"):
        dense_for(5, "cutlass")
    with pytest.raises(ValueError, match="dense"):
        PairSpec(checkpoint="x", dense="cutlass")


def test_the_engines_answers_come_from_the_download_in_the_contracts_dtypes(cfg, ckpt):
    """`run(host=True)` (what the engine answers from) is the drafter's `DraftOut` converted, bit for bit: int32
    drafts, fp32 scores, the confident lengths; and the answers own their memory (the pinned download is the next
    step's)."""
    _, graph = _engines(cfg, ckpt)
    gs = graph.graphs
    graph.step([entry(slot=0, seed_token=7, n_out=5, token_ids=torch.arange(9),
                      taps=workload.make_taps(cfg, 9, torch.Generator().manual_seed(1)))])
    states = [gs.slots[0]]
    for n_out, margins in ((5, True), (3, False)):
        want = HostDraft.of(gs.run([], states, [11], n_out, margins))       # a draft leaves the slot as it was
        got = gs.run([], states, [11], n_out, margins, host=True)
        assert got.drafts.dtype == np.int32 and got.confidences.dtype == np.float32
        assert np.array_equal(got.drafts, want.drafts) and np.array_equal(got.confidences, want.confidences)
        assert got.confident_len == want.confident_len
        assert (got.margins is None) == (not margins)
        if margins:
            assert np.array_equal(got.margins, want.margins)
        assert not np.shares_memory(got.drafts, gs.copies.out_host.numpy())


def test_a_ranks_slot_stands_where_the_front_end_placed_it(cfg, ckpt):
    """One account of where a slot stands: the engine takes each entry's placement as the ring hands it (the eager
    and the graph engine alike), after its rows went in at start_pos, and draws its window there."""
    eager, graph = _engines(cfg, ckpt)
    taps = workload.make_taps(cfg, 6, torch.Generator().manual_seed(5)).numpy()
    e = make_entry(slot=2, generation=0, seed_token=9, start_pos=40, token_ids=np.arange(6), taps=taps)
    for engine in (eager.engine, graph.engine):
        engine.step(M.RingBatch([], [M.RingEntry.of(e, (40, 46))]))
        st = engine.slots[2]
        assert (st.base, st.position) == (40, 46)
        # rolled back to 43 (rows past it are not read): the placement alone moves the slot, no rows
        engine.step(M.RingBatch([], [M.RingEntry.of(make_entry(slot=2, generation=0, seed_token=9, start_pos=43,
                                                               rollback_to=43), (40, 43))]))
        assert (st.base, st.position) == (40, 43)
    assert torch.equal(eager.slots[2].kv, graph.slots[2].kv)


def test_a_rank_reads_the_ring_slot_in_place():
    """The ring carries what the ranks read of each checked entry (no token ids, generation or rollback) with its
    slot's placement, and a rank's entries view the slot's bytes: its taps are read in place (a byte written into
    the slot shows through), an entry without rows has empty taps of the right width."""
    width = 12
    taps = np.arange(3 * width, dtype=np.float16).reshape(3, width)
    a = make_entry(slot=0, generation=3, seed_token=5, token_ids=np.arange(3), taps=taps)
    b = make_entry(slot=1, generation=1, seed_token=6, start_pos=4, n_out=2, want_margins=True, rollback_to=4)
    slot = bytearray(M.encode(M.RingBatch([2], [M.RingEntry.of(a, (0, 3)), M.RingEntry.of(b, (-1, 0))])))
    batch = M.decode_batch(memoryview(slot).toreadonly())
    ra, rb = batch.entries
    assert batch.resets == [2] and [(e.base, e.position) for e in batch.entries] == [(0, 3), (-1, 0)]
    assert (ra.slot, ra.seed_token, ra.start_pos, ra.n_out, ra.want_margins) == (0, 5, 0, 5, False)
    assert (rb.slot, rb.seed_token, rb.start_pos, rb.n_out, rb.want_margins) == (1, 6, 4, 2, True)
    assert set(msgspec.structs.asdict(ra)) == {"slot", "seed_token", "n_out", "want_margins", "start_pos", "taps",
                                               "base", "position"}
    t = ra.taps_array(width)
    assert t.shape == (3, width) and np.array_equal(t, taps)
    slot[slot.find(taps.tobytes()) + 1] ^= 0x40                                # the high byte of taps[0, 0]
    assert t[0, 0] != 0 and np.array_equal(t.flatten()[1:], taps.flatten()[1:])
    assert rb.taps_array(width).shape == (0, width)


def test_the_staged_pool_rows_are_the_ring_rows_of_every_position(cfg, ckpt):
    """The staging copies slices of tables made once: a window's pool rows and valid flags, and an insert chunk's
    positions and pool rows (pads on the scratch slot), are the ring arithmetic's at every ring offset, wrapped or
    not, for a fresh slot, a partial window and a full one."""
    gs = GraphSet(make_drafter(cfg, "tp1", ckpt=ckpt), 4)
    W, cap, NB, h = gs.W, gs.capacity, gs.n_blocks, gs.inp.h
    slot = gs.slots[2]
    row0 = (np.arange(NB) + 2 * NB) * cap                       # pool row of (slot 2, block b, ring row 0)
    for p0 in list(range(0, 2 * cap + 3)) + [900_001]:
        for base in {-1, max(0, p0 - 5), 0}:                     # fresh, partial window, (full for p0 >= W)
            slot.base, slot.position = base, p0
            gs.stage_draft([gs.slots[0], slot], [3, 7])
            win = h["win_rows"][:NB * 2 * W].reshape(NB, 2, W)[:, 1]
            assert np.array_equal(win, row0[:, None] + (p0 + np.arange(-W, 0)) % cap)
            held = 0 if base < 0 else min(W, p0 - base)
            assert np.array_equal(h["valid"][W:2 * W], np.arange(W) >= W - held)
            assert (h["seeds"][1], h["p0"][1]) == (7, p0)
        n = 1 + p0 % 11
        rows, bucket = gs.stage_insert([(slot, p0, np.ones((n, gs.inp.width), np.float16))])
        assert (rows, bucket) == (n, min(b for b in gs.insert_buckets if b >= n))
        assert np.array_equal(h["ins_pos"][:bucket], np.r_[p0 + np.arange(n), np.zeros(bucket - n)])
        dst = h["ins_rows"].reshape(NB, gs.T)[:, :bucket]
        assert np.array_equal(dst[:, :n], row0[:, None] + (p0 + np.arange(n)) % cap)
        assert (dst[:, n:] == (gs.scratch * NB + np.arange(NB))[:, None] * cap).all()


def test_a_set_captured_for_the_live_batches_first_answers_every_batch_and_captures_the_rest_later(cfg, ckpt):
    """A restart's graph set (`first`: the last batches' shapes): only their draft and step graphs, the insert
    graphs, are captured before serving. A batch of another shape captures what it needs first, before it stages
    anything (no slot changed by that capture), and answers the eager engine's bits; `capture_next` captures the
    rest one at a time, and then the set is the whole set."""
    eager = Driver(RankEngine(make_drafter(cfg, "tp1", ckpt=ckpt), N_SLOTS))
    graph = Driver(RankEngine(make_drafter(cfg, "tp1", ckpt=ckpt), N_SLOTS, graphs=True,
                              first=[(3, cfg.block_size, False), (3, cfg.block_size, True)]))
    gs = graph.graphs
    whole = 2 * (4 * cfg.block_size * 2 + 2) + 5
    assert sorted(gs.draft_graphs) == sorted(gs.step_graphs) == [(3, cfg.block_size, False), (3, cfg.block_size, True)]
    assert len(gs.insert_graphs) == 5 and gs.n_graphs == 9 and len(gs.pending) == whole - 9
    for batch in workload.rounds(cfg, n_requests=3, n_rounds=6, far_start=900_000):
        _same_step(eager, graph, batch)
    assert gs.n_graphs + len(gs.pending) == whole                  # the rounds' other shapes captured on demand
    before = {k: s.position for k, s in enumerate(graph.slots)}
    _same_rings(eager, graph)
    g = torch.Generator().manual_seed(5)
    one = [entry(slot=0, seed_token=7, n_out=2, start_pos=before[0], token_ids=torch.tensor([3, 4]),
                 taps=workload.make_taps(cfg, 2, g), want_margins=True)]
    n = gs.n_graphs
    _same_step(eager, graph, one)                                    # (1, 2, True): its step graph, on demand
    assert ("step", (1, 2, True)) not in gs.pending and gs.n_graphs == n + 1
    _same_rings(eager, graph)
    while gs.capture_next():
        pass
    assert gs.n_graphs == whole and not gs.pending
    for batch in workload.rounds(cfg, seed=9, n_requests=2, n_rounds=3):
        _same_step(eager, graph, [msgspec.structs.replace(e, slot=4 + i) for i, e in enumerate(batch)])
    _same_rings(eager, graph)
