"""Cached Markov bias rows (`DraftHead.cache_markov_rows`, `serve --markov-cache`): a step whose previous token has
a cached row reads it instead of computing it from markov_w2, and drafts the same bits.

On the CPU the reference path selects the cached row where one exists (it still computes the live one: it is the
exact twin, not a fast path); the fused kernel's cached path runs under the interpreter in test_fused and on the card
here (marker gpu, with the graph set)."""
from __future__ import annotations

import pytest
import torch
from conftest import assert_set_drafts_like_eager

from dspark_ray.testing import parity, workload
from dspark_ray.testing.batches import placed
from dspark_ray.model.heads import markov_cache_rows
from dspark_ray.rank.modes import make_drafter


@pytest.fixture(scope="module")
def rounds(cfg):
    return workload.rounds(cfg)


@pytest.fixture(scope="module")
def uncached(cfg, full_weights, rounds):
    return parity.replay(make_drafter(cfg, "split", full=full_weights), rounds)


@pytest.mark.parametrize("part", [1, 2])
def test_cached_rows_change_no_bit_on_either_shard(cfg, full_weights, rounds, uncached, part):
    """All rows, or the lower half of the ids (steps whose previous token has no row compute it): every draft,
    score, margin, logit of 40+ rounds on the two vocabulary shards equals the uncached drafter's."""
    assert len(rounds) >= 40
    d = make_drafter(cfg, "split", full=full_weights, markov_cache=cfg.vocab_size // part)
    assert d.markov_cache_bytes == cfg.vocab_size // part * cfg.vocab_size * 2
    if part == 2:           # both kinds of step happen: previous tokens with a row and without
        prevs = torch.cat([torch.cat((torch.tensor([e.seed_token]), r.drafts[:-1]))
                           for batch, recs in zip(rounds, uncached) for e, r in zip(batch, recs)])
        assert (prevs < cfg.vocab_size // 2).any() and (prevs >= cfg.vocab_size // 2).any()
    parity.assert_identical(uncached, parity.replay(d, rounds), f"cache of {cfg.vocab_size // part} rows")


def test_a_step_reads_its_tokens_cached_row(cfg, full_weights, rounds):
    """A planted bias in every cached row's column 77 makes every draft 77: the step adds the row it holds."""
    d = make_drafter(cfg, "split", full=full_weights, markov_cache=cfg.vocab_size)
    for s in d.head.shards:
        if s.start <= 77 < s.start + s.markov_w2.shape[0]:
            s.markov_rows[:, 77 - s.start] = 60000.0
    recs = parity.replay(d, rounds[:3])
    assert all(bool((r.drafts == 77).all()) for batch in recs for r in batch)


def test_cache_choices_and_bad_tokens_are_refused(cfg, full_weights):
    V = 129280
    assert markov_cache_rows("off", V) == 0 and markov_cache_rows("all", V) == V
    assert markov_cache_rows("4096", V) == 4096 and markov_cache_rows(10**9, V) == V
    assert markov_cache_rows("auto", V, row_bytes=V * 2, free_bytes=None) == 0          # a CPU: none
    assert markov_cache_rows("auto", V, row_bytes=V * 2, free_bytes=3 * V * V * 2) == V
    small = markov_cache_rows("auto", V, row_bytes=V * 2, free_bytes=V * 2 * 1000)
    assert small == 256 and small % 256 == 0
    for bad in ("most", -1, "1.5"):
        with pytest.raises(ValueError, match="markov cache"):
            markov_cache_rows(bad, V)
    d = make_drafter(cfg, "tp1", full=full_weights)
    for toks in ([1, 1], [cfg.vocab_size], [-1], []):
        with pytest.raises(ValueError, match="distinct ids"):
            d.head.cache_markov_rows(torch.tensor(toks))
    assert d.head.markov_map is None and d.head.shards[0].markov_rows is None      # a refused cache changes nothing
    assert d.cache_markov(64) == 64 * cfg.vocab_size * 2 and d.cache_markov(0) == 0
    assert d.head.markov_map is None and d.head.shards[0].markov_rows is None      # 0 rows: none held, none read
    assert d.cache_markov_for("auto") == 0 and d.head.markov_map is None            # a CPU drafter: auto is none
    assert d.cache_markov_for("all") == cfg.vocab_size and d.markov_cache_bytes == cfg.vocab_size ** 2 * 2


@pytest.mark.gpu
def test_cached_rows_give_the_live_bits_on_the_card(cfg, ckpt):
    """The fused path on the card (DSPARK_TEST_CKPT=/tmp/full: the full preset, every id cached): eager replays with
    and without the rows, and every 1-4-request graph captured with them against the eager step without them."""
    from dspark_ray.rank.graphs import GraphSet
    from dspark_ray.kernels.gemm import kernels_for
    d = make_drafter(cfg, "tp1", ckpt=ckpt, device="cuda", kernels=kernels_for("fast"))
    rounds = workload.rounds(cfg, seed=9, n_requests=2, n_rounds=12, far_start=3000)
    live = parity.replay(d, rounds)
    d.cache_markov(cfg.vocab_size)                              # every id's row, made by the fused kernel
    parity.assert_identical(live, parity.replay(d, rounds), "cached vs live on the card")
    gs = GraphSet(d, n_slots=5, max_requests=4, n_outs=(cfg.block_size,))
    gs.capture()
    cmap, d.head.markov_map = d.head.markov_map, None        # the eager steps below: live rows
    eager = []
    for r in range(4):
        taps = workload.make_taps(cfg, 6 + 5 * r, torch.Generator().manual_seed(40 + r))
        gs.run(placed([(gs.slots[r], 0, taps)]), [], [], 1, False)
        st = d.new_slot()
        d.insert(st, 0, taps)
        eager.append(st)
    assert_set_drafts_like_eager(gs, d, eager, cfg.block_size, 3, 1009)
    d.head.markov_map = cmap
