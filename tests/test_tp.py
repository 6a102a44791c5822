"""The tensor-parallel split on the tiny preset: the cut table, the emulated and the gloo pair, bit identity with the
split reference, and agreement with the plain one-GEMM reference."""
from __future__ import annotations

import multiprocessing as mp
from types import SimpleNamespace

import pytest
import torch

from dspark_ray.testing import parity, workload
from dspark_ray.model.collectives import combine_max, combine_top2
from dspark_ray.config import ConfigError, full, tiny
from dspark_ray.model.layout import Layout, vocab_split
from dspark_ray.rank.modes import make_drafter, make_emulated, read_rank, run_pair

ROUNDS = dict(seed=7, n_requests=2, n_rounds=40, far_start=3000)


def test_vocab_split_points():
    assert vocab_split(full().vocab_size) == 64768
    assert Layout(full(), 2).vocab_range(1) == (64768, 129280)
    assert vocab_split(tiny().vocab_size) == 2048


def test_every_cut_is_on_a_128_channel_boundary_and_bad_configs_are_refused(cfg, ckpt):
    lay = Layout(cfg, 2)
    for name in ckpt.names():
        s = lay.slice_of(name, tuple(ckpt.shape(name)), 1)
        if s is not None and lay.rule_for(name).unit in ("channel", "group", "head") and "sink" not in name:
            assert s[1] % 128 == 0, name
    with pytest.raises(ConfigError, match="o_groups = 3 is odd"):
        Layout(tiny().replace(o_groups=3, num_attention_heads=6), 2)
    with pytest.raises(ConfigError, match="moe_intermediate_size = 384"):
        Layout(tiny().replace(moe_intermediate_size=384), 2)


def test_every_shard_equals_the_slice_of_the_full_tensor(cfg, ckpt, full_weights):
    lay = Layout(cfg, 2)
    ranks = [read_rank(ckpt, lay, r) for r in (0, 1)]
    split = 0
    for name, t in full_weights.items():
        s = lay.slice_of(name, tuple(t.shape), 0)
        if s is None:
            assert torch.equal(ranks[0][name], t) and torch.equal(ranks[1][name], t)
            continue
        split += 1
        halves = [ranks[r][name] for r in (0, 1)]
        assert torch.equal(torch.cat(halves, dim=s[0]), t), name
        assert halves[0].shape[s[0]] == s[2] - s[1]
    assert split == cfg.n_blocks * (4 + 3 * (cfg.n_routed_experts + 1)) + 2


def test_combine_rules_tie_to_rank_0_and_true_top2():
    m0, i0 = torch.tensor([1.0, 2.0, float("nan")]), torch.tensor([5, 6, 7])
    m1, i1 = torch.tensor([1.0, 3.0, 0.5]), torch.tensor([2053, 2054, 2055])
    m, i = combine_max((m0, i0), (m1, i1))
    assert i.tolist() == [5, 2054, 2055]
    t1, t2, i = combine_top2((torch.tensor([4.0, 4.0]), torch.tensor([3.0, 1.0]), torch.tensor([1, 2])),
                             (torch.tensor([4.0, 2.0]), torch.tensor([0.0, 1.5]), torch.tensor([2049, 2050])))
    assert i.tolist() == [1, 2] and (t1 - t2).tolist() == [0.0, 2.0]


@pytest.fixture(scope="module")
def rounds(cfg):
    return workload.rounds(cfg, **ROUNDS)


@pytest.fixture(scope="module")
def emulated(cfg, full_weights, rounds):
    d0, d1 = make_emulated(cfg, full=full_weights)
    return run_pair(lambda: parity.replay(d0, rounds), lambda: parity.replay(d1, rounds))


def test_workload_covers_inserts_rollbacks_and_a_partial_window(cfg, rounds):
    assert len(rounds) >= 40
    assert any(e.rollback_to >= 0 for b in rounds for e in b)
    assert rounds[0][0].rows < cfg.sliding_window          # request 0 starts on a partial window
    assert rounds[0][1].start_pos == ROUNDS["far_start"]


def test_emulated_pair_equals_split_reference_bit_for_bit(cfg, full_weights, rounds, emulated):
    split = parity.replay(make_drafter(cfg, "split", full=full_weights), rounds)
    parity.assert_identical(split, parity.join_ranks(*emulated), "split vs emulated")
    # Rank 1 holds the same replicated results as rank 0 (same drafts, confidences, head hidden).
    for ra, rb in zip(*emulated):
        for a, b in zip(ra, rb):
            assert torch.equal(a.drafts, b.drafts) and torch.equal(a.normed, b.normed)
            assert torch.equal(a.confidences, b.confidences) and torch.equal(a.margins, b.margins)


def test_margins_are_top1_minus_top2_of_the_combined_logits(emulated):
    for ra in parity.join_ranks(*emulated)[:10]:
        for a in ra:
            top = a.logits.topk(2, dim=-1).values
            assert torch.equal(a.margins, top[:, 0] - top[:, 1])
            assert torch.equal(a.drafts, a.logits.argmax(dim=-1))


def _gloo_rank(rank: int, ckpt_dir: str, init: str, out: str) -> None:
    torch.set_num_threads(1)
    from dspark_ray.comm.gloo import GlooCollectives
    from dspark_ray.weights.loader import Checkpoint
    ck = Checkpoint(ckpt_dir)
    coll = GlooCollectives(rank, init_method=init, timeout_s=60)
    d = make_drafter(ck.config, "pair", ckpt=ck, rank=rank, coll=coll)
    rec = parity.replay(d, workload.rounds(ck.config, **ROUNDS))
    torch.save(rec, out)
    coll.close()


def test_gloo_pair_in_two_processes_equals_emulated_pair_bit_for_bit(tiny_ckpt, tmp_path, emulated):
    ctx = mp.get_context("spawn")
    init = f"file://{tmp_path}/gloo_init"
    outs = [str(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    procs = [ctx.Process(target=_gloo_rank, args=(r, str(tiny_ckpt), init, outs[r])) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    got = [torch.load(o, weights_only=False) for o in outs]
    parity.assert_identical(parity.join_ranks(*emulated), parity.join_ranks(*got), "emulated vs gloo pair")
    parity.assert_identical(emulated[1], got[1], "rank 1: emulated vs gloo")


def _gloo_exit_without_close(rank: int, init: str) -> None:
    from dspark_ray.comm.gloo import GlooCollectives
    coll = GlooCollectives(rank, init_method=init, timeout_s=60)
    for _ in range(50):
        coll.all_reduce([torch.ones(64)])
    # no close(): a rank leaves on an error path, or forgets, and the interpreter exits with the group alive


def test_a_gloo_rank_that_exits_without_close_still_exits_cleanly(tmp_path):
    """A gloo group still alive at interpreter exit aborted its process in the group's destructor ("terminate called
    without an active exception", SIGABRT) about half the time; GlooCollectives closes it at exit."""
    ctx = mp.get_context("spawn")
    codes = []
    for k in range(8):
        init = f"file://{tmp_path}/gloo_init_{k}"
        procs = [ctx.Process(target=_gloo_exit_without_close, args=(r, init)) for r in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        codes.append(tuple(p.exitcode for p in procs))
    assert all(c == (0, 0) for c in codes), codes


# -- agreement with the plain tp1 reference (one library GEMM per layer) -------------------------------------------

@pytest.fixture(scope="module")
def plain_tp1(cfg, full_weights, rounds):
    return parity.replay(make_drafter(cfg, "tp1", full=full_weights, kernels=parity.NATIVE_MATMUL), rounds)


def _faulty_pair(cfg, full_weights, rounds, fault):
    d0, d1 = make_emulated(cfg, full=full_weights)
    for b in d1.blocks:
        b.experts[0] = fault(b.experts[0])
    return parity.join_ranks(*run_pair(lambda: parity.replay(d0, rounds), lambda: parity.replay(d1, rounds)))


def _drop_expert(ex, e=3):
    def routed(f, experts, weights, shared):
        return ex.routed(f, experts, torch.where(experts == e, torch.zeros_like(weights), weights), shared)
    return SimpleNamespace(shared=ex.shared, routed=routed)


def _scale(ex, k=1.001):
    return SimpleNamespace(shared=ex.shared, routed=lambda *a: ex.routed(*a) * k)


def test_tp2_agrees_with_plain_tp1_and_every_first_mismatch_is_a_near_tie(plain_tp1, emulated):
    ag = parity.compare(plain_tp1, parity.join_ranks(*emulated))
    print("\nplain tp1 vs pair:", ag.summary())
    assert ag.noise_ok and ag.unexplained == []
    assert ag.share >= 0.9


def test_a_dropped_routed_expert_is_caught_as_unexplained(cfg, full_weights, rounds, plain_tp1):
    ag = parity.compare(plain_tp1, _faulty_pair(cfg, full_weights, rounds, _drop_expert))
    print("\ndropped expert 3 on rank 1:", ag.summary())
    assert not ag.noise_ok
    assert ag.mismatches and all(not m["near_tie"] for m in ag.mismatches)


def test_a_scaled_ffn_partial_is_caught_against_the_split_reference(cfg, full_weights, rounds):
    split = parity.replay(make_drafter(cfg, "split", full=full_weights), rounds)
    ag = parity.compare(split, _faulty_pair(cfg, full_weights, rounds, _scale), floor=0.0)
    print("\nrank 1 FFN partial x 1.001 vs split:", ag.summary())
    assert not ag.noise_ok and ag.noise_mean > 0
    assert all(not m["near_tie"] for m in ag.mismatches)


def test_solo_rank_runs_alone_on_half_the_weights_with_local_stand_ins(cfg, full_weights):
    solo = make_drafter(cfg, "solo", full=full_weights, rank=1)
    tp1 = make_drafter(cfg, "tp1", full=full_weights)
    assert solo.coll.name == "solo" and solo.coll.local_ranks == (1,)
    assert solo.head.shards[0].head.shape[0] == cfg.vocab_size - vocab_split(cfg.vocab_size)
    assert solo.head.shards[0].start == vocab_split(cfg.vocab_size)
    st = solo.new_slot()
    solo.insert(st, 0, workload.make_taps(cfg, 6, torch.Generator().manual_seed(0)))
    out = solo.draft([st], [7], 5, want_margins=True)
    # Its drafts come from its own vocab slice only; the numbers are a stand-in's, not the pair's.
    assert bool((out.drafts >= vocab_split(cfg.vocab_size)).all())
    assert sum(t.numel() for n, t in solo.head.shards[0].__dict__.items() if isinstance(t, torch.Tensor)) < \
        sum(t.numel() for n, t in tp1.head.shards[0].__dict__.items() if isinstance(t, torch.Tensor))


def test_layout_cli_reports_each_ranks_bytes_from_the_table(capsys):
    import json

    from dspark_ray.cli import main
    from dspark_ray.weights.inventory import tensor_specs
    total = sum(s.nbytes for s in tensor_specs(full()).values())
    main(["layout", "--preset", "full", "--tp", "1", "--json"])
    one = json.loads(capsys.readouterr().out)
    assert sum(r["bytes"][0] for r in one["rows"]) == total
    main(["layout", "--preset", "full", "--tp", "2", "--json"])
    two = json.loads(capsys.readouterr().out)
    head = next(r for r in two["rows"] if r["item"] == "head")
    assert head["bytes"] == [64768 * 5120 * 2, (129280 - 64768) * 5120 * 2]
    assert sum(r["bytes"][0] for r in two["rows"]) < 0.6 * total
