"""EXL3 weights on exllamav3's kernels (kernels/exl3_gemm.py), on a GPU with exllamav3 installed (marker gpu).

What is checked: every EXL3 Linear of a tiny checkpoint (seed 000's mix and every stored kind, every rank's cut)
multiplies like its decoded fp16 weight (to the kernel's rounding); a forced `exl3_gemm` is deterministic and batch
invariant bit for bit; the expert bank's `exl3_mgemm` is deterministic and agrees with each expert's own product; a
whole drafter on the kernels, eager and in the rank's CUDA graph set (fast path), gives the same bits, and the same
drafts as the decoded checkpoint except at near-ties."""
from __future__ import annotations

import pytest
import torch
from conftest import assert_set_drafts_like_eager

from dspark_ray import workload
from dspark_ray.kernels import exl3_gemm
from dspark_ray.model.layout import Layout
from dspark_ray.modes import make_drafter, read_rank

pytestmark = pytest.mark.gpu

KINDS_MIX = "head=6:3inst,experts=1mcg,wo_a=3mcg,wq_b=5,wkv=3mcg,shared=1.5mul1,wo_b=8:3inst,wq_a=16,rest=7mcg"


def _need_exl3():
    from dspark_ray.kernels import exl3_gemm
    if not exl3_gemm.available():
        pytest.skip("exllamav3 (make-bundle.sh --exl3) is not installed")
    return exl3_gemm


@pytest.fixture(scope="module", params=["seed000", "kinds"])
def exl3_ckpt(request, tmp_path_factory):
    _need_exl3()
    from dspark_ray.config import tiny
    from dspark_ray.weights.loader import Checkpoint
    from dspark_ray.weights.mix import DEFAULT_MIX
    from dspark_ray.weights.synth import synthesize
    d = tmp_path_factory.mktemp(f"exl3_{request.param}")
    synthesize(tiny(), d, fmt="exl3", bits=DEFAULT_MIX if request.param == "seed000" else KINDS_MIX, device="cuda")
    return Checkpoint(d)


def _records(ck):
    """(name, rank cut, record on the GPU) of every EXL3 Linear that a rank multiplies by (wo_a is decoded)."""
    for tp in (1, 2):
        lay = Layout(ck.config, tp)
        for rank in range(tp):
            for name in ck.names():
                if exl3_gemm.on_kernels(ck, name):
                    s = lay.slice_of(name, tuple(ck.shape(name)), rank)
                    yield name, (tp, rank), ck.exl3(name, *(s or ()), device="cuda")[0]


def test_every_exl3_linear_multiplies_like_its_decoded_weight(exl3_ckpt):
    exl3_gemm = _need_exl3()
    g = torch.Generator(device="cuda").manual_seed(0)
    n = 0
    for name, cut, rec in _records(exl3_ckpt):
        w = exl3_gemm.Exl3Weight(rec)
        x = torch.randn(7, w.k, generator=g, device="cuda").half()
        got = w.matmul(x, torch.float32)
        want = x.float() @ rec.weight().float()            # the decoded (in, out) fp16 weight
        err = (got - want).abs().max().item()
        scale = want.abs().max().item()
        assert err <= 2e-3 * scale + 1e-3, (name, cut, err, scale)
        n += 1
    assert n > 0


def test_forced_gemm_is_deterministic_and_batch_invariant(exl3_ckpt):
    exl3_gemm = _need_exl3()
    g = torch.Generator(device="cuda").manual_seed(1)
    for name, cut, rec in _records(exl3_ckpt):
        w = exl3_gemm.Exl3Weight(rec)
        x = torch.randn(24, w.k, generator=g, device="cuda").half()
        full = w.matmul(x, torch.float16)
        assert torch.equal(full, w.matmul(x, torch.float16)), name
        for rows in ((3,), (0, 1), (5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21)):
            sub = w.matmul(x[list(rows)], torch.float16)
            assert torch.equal(sub, full[list(rows)]), (name, cut, rows)


def test_expert_bank_agrees_with_each_expert_and_repeats_its_bits(exl3_ckpt):
    exl3_gemm = _need_exl3()
    ck = exl3_ckpt
    cfg = ck.config
    w = read_rank(ck, Layout(cfg, 1), 0, "cuda")
    names = [f"mtp.0.ffn.experts.{e}.w1.weight" for e in range(cfg.n_routed_experts)]
    if not isinstance(w[names[0]], exl3_gemm.Exl3Weight):
        pytest.skip("routed experts are not EXL3 in this mix")
    bank = torch.stack([w[n] for n in names])
    assert isinstance(bank, exl3_gemm.Exl3Bank)
    g = torch.Generator(device="cuda").manual_seed(2)
    p = 6 * cfg.num_experts_per_tok
    x = torch.randn(p, bank.k, generator=g, device="cuda").half()
    idx = torch.randint(0, cfg.n_routed_experts, (p,), generator=g, device="cuda")
    got = bank.matmul_indexed(x, idx, torch.float32)
    assert torch.equal(got, bank.matmul_indexed(x, idx, torch.float32))
    dec = {}
    for j in range(p):
        e = int(idx[j])
        if e not in dec:
            (rec,) = ck.exl3(names[e], device="cuda")
            dec[e] = rec.weight().float()                  # (in, out)
        want = x[j].float() @ dec[e]
        assert (got[j] - want).abs().max().item() <= 2e-3 * want.abs().max().item() + 1e-3, j
    # How much a slot's bits depend on the call's slot count (mgemm sizes its grid by it): reported, not asserted.
    alone = torch.cat([bank.matmul_indexed(x[j:j + 1], idx[j:j + 1], torch.float32) for j in range(p)])
    print(f"\nmgemm: {int((alone != got).any(dim=1).sum())} / {p} slots differ between a call of 1 slot and of {p}")


def test_drafter_on_the_kernels_matches_the_decoded_one_and_its_graphs(exl3_ckpt):
    exl3_gemm = _need_exl3()
    from dspark_ray.graphs import GraphSet
    from dspark_ray.kernels.gemm import use_matmul
    from dspark_ray.model import ops
    ck, cfg = exl3_ckpt, exl3_ckpt.config
    saved = ops.current_matmul()
    try:
        use_matmul("fast")
        d = make_drafter(cfg, "tp1", ckpt=ck, device="cuda")
        assert isinstance(d.head.shards[0].head, exl3_gemm.Exl3Weight)
        assert ops.fused("branch") is None              # one stream for every EXL3 launch
        gs = GraphSet(d, n_slots=6)
        gs.capture()
        rows = [6, 11, 3, 20]
        eager = []
        for r, n in enumerate(rows):
            taps = workload.make_taps(cfg, n, torch.Generator().manual_seed(11 + r))
            assert gs.run([(gs.slots[r], 0, taps)], [], [], 1, False) is None
            st = d.new_slot()
            d.insert(st, 0, torch.arange(n), taps)
            assert torch.equal(gs.slots[r].kv, st.kv), r
            eager.append(st)
        assert_set_drafts_like_eager(gs, d, eager, cfg.block_size, 5, 37)
    finally:
        ops.set_matmul(*saved)


def test_kernels_draft_like_the_decoded_checkpoint_up_to_near_ties(exl3_ckpt):
    _need_exl3()
    from dspark_ray.model.drafter import Drafter
    ck, cfg = exl3_ckpt, exl3_ckpt.config
    lay = Layout(cfg, 1)
    dk = Drafter(cfg, [read_rank(ck, lay, 0, "cuda", exl3_kernels=True)])
    dd = Drafter(cfg, [read_rank(ck, lay, 0, "cuda", exl3_kernels=False)])
    same = total = 0
    for r in range(12):
        n = 6 + r
        taps = workload.make_taps(cfg, n, torch.Generator().manual_seed(300 + r))
        a, b = dk.new_slot(), dd.new_slot()
        dk.insert(a, 0, torch.arange(n), taps)
        dd.insert(b, 0, torch.arange(n), taps)
        x = dk.draft([a], [r + 1], cfg.block_size, True)
        y = dd.draft([b], [r + 1], cfg.block_size, True)
        eq = x.drafts[0] == y.drafts[0]
        total += 1
        if bool(eq.all()):
            same += 1
        else:
            first = int((~eq).nonzero()[0])
            assert min(float(x.margins[0, first]), float(y.margins[0, first])) < 0.05, (r, first)
    assert same >= total // 2, (same, total)
