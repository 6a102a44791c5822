"""The reference drafter on the tiny preset: spec section 8's required tests and the properties the service promises."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark_ray.testing import workload
from dspark_ray.testing.batches import Driver
from dspark_ray.protocol.contract import Code
from dspark_ray.rank.engine import RankEngine
from dspark_ray.model import attention, heads, mhc, moe, ops
from dspark_ray.model.drafter import Drafter
from dspark_ray.model.heads import confident_prefix
from dspark_ray.model.moe import Router
from dspark_ray.rank.modes import make_drafter

G = torch.Generator


def taps(cfg, n, seed=0):
    return workload.make_taps(cfg, n, G().manual_seed(seed))


def filled(d: Drafter, rows: int, start: int = 0, seed: int = 0):
    st = d.new_slot()
    d.insert(st, start, taps(d.cfg, rows, seed))
    return st


@pytest.fixture(scope="module")
def tp1(cfg, full_weights):
    return make_drafter(cfg, "tp1", full=full_weights)


def same(a, b):
    return all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("drafts", "confidences", "confident_len"))


# -- the workload over the synthetic weights: finite, non-degenerate ------------------------------------------------

def test_weight_scales_keep_activations_finite_and_routing_and_argmax_non_degenerate(cfg, ckpt, monkeypatch):
    nonfinite = []
    orig = ops.f16

    def checked(x):
        y = orig(x)
        if not bool(torch.isfinite(y).all()):
            nonfinite.append(tuple(x.shape))
        return y

    for mod in (ops, attention, moe, mhc, heads):
        monkeypatch.setattr(mod, "f16", checked)
    d = make_drafter(cfg, "tp1", ckpt=ckpt)
    eng = Driver(RankEngine(d, 2))
    margins, used = [], [set() for _ in range(cfg.n_blocks)]
    for batch in workload.rounds(cfg, seed=1, n_rounds=24, far_start=1000, margins_every=1):
        for o in eng.step(batch):
            assert o.code == Code.OK and np.isfinite(o.confidences_array()).all()
            margins += o.margins_array().tolist()
        for b, ex in enumerate(d.last_experts):
            used[b] |= set(ex.flatten().tolist())
    assert nonfinite == []
    median = torch.tensor(margins).median().item()
    print(f"\nworkload: median top-1 minus top-2 margin {median:.4f} over {len(margins)} drafts; "
          f"experts selected per block {[len(u) for u in used]} of {cfg.n_routed_experts}")
    assert median >= 0.05
    assert all(len(u) == cfg.n_routed_experts for u in used)


# -- spec section 8: required tests ---------------------------------------------------------------------------------

def test_attn_sink_is_nonzero_and_takes_probability_mass(cfg, full_weights):
    for n in range(cfg.n_blocks):
        assert bool((full_weights[f"mtp.{n}.attn.attn_sink"] != 0).all())
    w = dict(full_weights)
    for n in range(cfg.n_blocks):
        w[f"mtp.{n}.attn.attn_sink"] = torch.full_like(w[f"mtp.{n}.attn.attn_sink"], -1e30)   # no sink
    with_sink = make_drafter(cfg, "tp1", full=full_weights)
    no_sink = make_drafter(cfg, "tp1", full=w)
    a = with_sink.draft([filled(with_sink, 6)], [7], 5, debug=True)
    b = no_sink.draft([filled(no_sink, 6)], [7], 5, debug=True)
    assert not torch.equal(a.normed, b.normed)


def test_gate_bias_changes_the_top_k_against_the_raw_scores(cfg, full_weights):
    d = make_drafter(cfg, "tp1", full=full_weights)
    gen = G().manual_seed(3)
    f = (torch.randn(64, cfg.hidden_size, generator=gen)).half()
    changed = 0
    for n, blk in enumerate(d.blocks):
        r = blk.router
        chosen, _ = r(f)
        raw = Router(r.gate, torch.zeros(cfg.n_routed_experts), top_k=r.top_k, scaling=1.5)(f)[0]
        changed += int((chosen.sort(1).values != raw.sort(1).values).any(1).sum())
    assert changed > 0


def test_router_tie_goes_to_the_lower_expert_id():
    h, e = 128, 6
    gate = (torch.randn(e, h, generator=G().manual_seed(0)) * 0.1).half()
    gate[4] = gate[1] = (torch.ones(h) * 0.5).half()       # experts 1 and 4 tie, far above the rest
    r = Router(gate, torch.zeros(e), top_k=1, scaling=1.0)
    chosen, w = r(torch.ones(3, h).half())
    assert chosen.flatten().tolist() == [1, 1, 1]
    r2 = Router(gate, torch.zeros(e), top_k=2, scaling=1.0)
    assert r2(torch.ones(1, h).half())[0].tolist() == [[1, 4]]


def plant_boundary_tie(cfg, full_weights, d_ref: Drafter, lo=100, hi=None):
    """Make head rows lo and hi (= lo + Vs, across the rank boundary) and their markov_w2 rows identical and large
    enough along the first row's hidden state to win the first argmax."""
    from dspark_ray.model.layout import vocab_split
    hi = hi if hi is not None else lo + vocab_split(cfg.vocab_size)
    st = filled(d_ref, 6)
    n0 = d_ref.draft([st], [7], 1, debug=True).normed[0, 0].float()
    w = dict(full_weights)
    head = w["head.weight"].clone()
    v = (n0 / n0.norm() * 4.0).half()
    head[lo] = head[hi] = v
    w["head.weight"] = head
    mk = f"mtp.{cfg.n_blocks - 1}.markov_head.markov_w2.weight"
    m2 = w[mk].clone()
    m2[hi] = m2[lo]
    w[mk] = m2
    return w, lo, hi


def test_argmax_tie_across_the_rank_boundary_goes_to_rank_0(cfg, full_weights, tp1):
    from dspark_ray.rank.modes import make_emulated, run_pair
    w, lo, hi = plant_boundary_tie(cfg, full_weights, tp1)
    assert hi == 2148
    ref = make_drafter(cfg, "tp1", full=w)
    a = ref.draft([filled(ref, 6)], [7], 1, want_margins=True, debug=True)
    assert a.logits[0, 0, lo] == a.logits[0, 0, hi] == a.logits[0, 0].max()
    assert a.drafts[0, 0].item() == lo and a.margins[0, 0].item() == 0.0
    d0, d1 = make_emulated(cfg, full=w)
    s0, s1 = filled(d0, 6), filled(d1, 6)
    r0, r1 = run_pair(lambda: d0.draft([s0], [7], 1, want_margins=True), lambda: d1.draft([s1], [7], 1, True))
    assert r0.drafts[0, 0].item() == r1.drafts[0, 0].item() == lo
    assert r0.margins[0, 0].item() == 0.0


def test_confident_prefix_crossing_at_zero_mid_and_none():
    conf = torch.tensor([[0.4, 0.9, 0.9, 0.9, 0.9],     # crosses at position 0
                         [0.9, 0.6, 0.49, 0.9, 0.9],    # crosses mid-block
                         [0.5, 0.6, 0.7, 0.8, 0.9]])    # never crosses (0.5 counts as confident)
    assert confident_prefix(conf, 0.5).tolist() == [0, 2, 5]


def test_confidence_bias_moves_the_prefix_to_none_and_all(cfg, full_weights):
    key = f"mtp.{cfg.n_blocks - 1}.confidence_head.proj.bias"
    lens = []
    for b in (-100.0, 100.0):
        w = dict(full_weights)
        w[key] = torch.tensor([b], dtype=torch.float16)
        d = make_drafter(cfg, "tp1", full=w)
        lens.append(d.draft([filled(d, 6)], [7], 5).confident_len.item())
    assert lens == [0, 5]


def test_batch_of_two_with_different_p0_equals_each_alone(tp1, cfg):
    # Different p0 (7 vs 13) and different accepted lengths; 13 > W exercises the ring past the window.
    a1, b1 = filled(tp1, 7, seed=1), filled(tp1, 13, seed=2)
    tp1.insert(b1, 13, taps(cfg, 3, seed=3))
    a2, b2 = filled(tp1, 7, seed=1), filled(tp1, 13, seed=2)
    tp1.insert(b2, 13, taps(cfg, 3, seed=3))
    both = tp1.draft([a1, b1], [11, 12], 5, want_margins=True, debug=True)
    one = tp1.draft([a2], [11], 5, want_margins=True, debug=True)
    two = tp1.draft([b2], [12], 5, want_margins=True, debug=True)
    for k in ("drafts", "confidences", "margins", "logits", "normed", "confident_len"):
        assert torch.equal(getattr(both, k)[0:1], getattr(one, k)), k
        assert torch.equal(getattr(both, k)[1:2], getattr(two, k)), k


def test_fp8_kv_fake_quant_switch(cfg, full_weights):
    off = make_drafter(cfg, "tp1", full=full_weights)
    on = make_drafter(cfg, "tp1", full=full_weights, fp8_kv=True)
    s_off, s_on = filled(off, 6), filled(on, 6)
    dn = cfg.nope_dim
    assert not torch.equal(s_off.kv[:, :6, :dn], s_on.kv[:, :6, :dn])
    assert torch.equal(s_off.kv[:, :6, dn:], s_on.kv[:, :6, dn:])       # the rope part is never quantized
    # Quantized values are e4m3 codes times a power-of-two scale per 64-group: re-quantizing changes nothing.
    assert torch.equal(ops.fp8_fake_quant(s_on.kv[:, :6, :dn]), s_on.kv[:, :6, :dn])
    assert not torch.equal(off.draft([s_off], [3], 5, debug=True).normed, on.draft([s_on], [3], 5, debug=True).normed)


# -- service properties ---------------------------------------------------------------------------------------------

def test_n_out_k_is_the_prefix_of_n_out_5_bit_for_bit(tp1):
    full = tp1.draft([filled(tp1, 9)], [21], 5, want_margins=True)
    for k in range(1, 5):
        part = tp1.draft([filled(tp1, 9)], [21], k, want_margins=True)
        assert torch.equal(part.drafts, full.drafts[:, :k])
        assert torch.equal(part.confidences, full.confidences[:, :k])
        assert torch.equal(part.margins, full.margins[:, :k])


def test_a_drafter_that_consumes_its_weights_stacks_each_expert_once_and_drafts_the_same(cfg, full_weights, tp1):
    """The rank hands the drafter its only copy (`consume=True`): each routed expert leaves the dict as it is
    stacked, so the full preset needs the experts' 25 GiB once, not twice (it did not fit one H100 beside the
    engine); the answers are the non-consuming drafter's bit for bit."""
    mine = dict(full_weights)
    d = Drafter(cfg, [mine], consume=True)
    routed = [k for k in full_weights if ".ffn.experts." in k]
    assert routed and not any(k in mine for k in routed)
    assert all(k in mine for k in full_weights if k not in routed)
    a = d.draft([filled(d, 9)], [21], 5, want_margins=True)
    b = tp1.draft([filled(tp1, 9)], [21], 5, want_margins=True)
    assert same(a, b) and torch.equal(a.margins, b.margins)


def test_margins_do_not_change_the_drafts(tp1):
    a = tp1.draft([filled(tp1, 9)], [21], 5, want_margins=True)
    b = tp1.draft([filled(tp1, 9)], [21], 5, want_margins=False)
    assert same(a, b) and b.margins is None


@pytest.mark.parametrize("p0", [0, 3, 8, 20])
def test_window_reads_the_last_min_w_p0_rows(tp1, cfg, p0):
    W = cfg.sliding_window
    st = filled(tp1, p0) if p0 else tp1.new_slot()
    assert st.hist_len() == min(W, p0)
    base = tp1.draft([st], [9], 5, debug=True)
    if p0 == 0:
        return
    # A row inside the window matters ...
    inside = filled(tp1, p0)
    inside.kv[:, (p0 - 1) % inside.capacity] += 1
    assert not torch.equal(tp1.draft([inside], [9], 5, debug=True).normed, base.normed)
    # ... a row older than the window does not.
    if p0 > W:
        older = filled(tp1, p0)
        older.kv[:, (p0 - W - 1) % older.capacity] += 1
        assert torch.equal(tp1.draft([older], [9], 5, debug=True).normed, base.normed)


def test_a_fresh_slots_first_insert_may_start_anywhere(tp1, cfg):
    far = filled(tp1, 10, start=900_000)
    assert far.position == 900_010 and far.hist_len() == cfg.sliding_window
    out = tp1.draft([far], [4], 5)
    assert out.drafts.shape == (1, 5)


def test_deterministic_across_two_runs(cfg, ckpt):
    runs = []
    for _ in range(2):
        d = make_drafter(cfg, "tp1", ckpt=ckpt)
        eng = Driver(RankEngine(d, 2))
        outs = [eng.step(b) for b in workload.rounds(cfg, seed=5, n_rounds=4)]
        runs.append([(o.drafts, o.confidences) for batch in outs for o in batch])
    assert runs[0] == runs[1]


def test_rollback_drops_rows(tp1, cfg):
    a = filled(tp1, 12)
    tp1.insert(a, 12, taps(cfg, 3, seed=9))
    tp1.insert(a, 13, taps(cfg, 1, seed=10), rollback_to=13)   # drop 13, 14; add a new 13
    b = filled(tp1, 12)
    tp1.insert(b, 12, taps(cfg, 3, seed=9)[:1])
    tp1.insert(b, 13, taps(cfg, 1, seed=10))
    assert a.position == b.position == 14
    assert same(tp1.draft([a], [3], 5), tp1.draft([b], [3], 5))


def test_graph_set_gathers_the_windows_of_drafter_window_inputs_across_the_ring_wrap(tp1, cfg):
    """The graph engine's window gather (slot pool, ring rows staged by the host) == `Drafter.window_inputs`, for
    partial windows, an exact fill and the wrap at every offset."""
    from dspark_ray.rank.graphs import GraphSet
    gs = GraphSet(tp1, n_slots=3, n_outs=(1,), insert_buckets=(8,))
    gs.pool.copy_(torch.randn(gs.pool.shape, generator=G().manual_seed(0)).half())
    a, b = gs.slots[0], gs.slots[2]
    a.advance(0, 3)
    b.advance(1000, 40)
    W = cfg.sliding_window
    for pos in [3, W, W + 1, gs.capacity - 1, gs.capacity, gs.capacity + 1, 2 * gs.capacity + 5, 1000]:
        a.position = pos
        gs.stage_draft([a, b], [1, 2])
        gs.inp.upload(gs.inp.off["taps"][0])
        got, got_valid = gs.fns.windows(2)
        want, want_valid = tp1.window_inputs([a, b])
        assert torch.equal(got_valid, want_valid), pos
        for n in range(cfg.n_blocks):
            assert torch.equal(got[n], want[n]), (pos, n)
