"""EXL3 weights on exllamav3's kernels (kernels/exl3_gemm.py), on a GPU with exllamav3 installed (marker gpu).

What is checked: every EXL3 Linear of a tiny checkpoint (seed 000's mix and every stored kind, every rank's cut)
multiplies like its decoded fp16 weight (to the kernel's rounding); a forced `exl3_gemm` is deterministic and batch
invariant bit for bit; the expert bank's `exl3_mgemm` is deterministic and agrees with each expert's own product; the
fused MoE kernel agrees with the decoded experts, is deterministic and replays its eager bits in a CUDA graph; a
whole drafter on the kernels, eager and in the rank's CUDA graph set (fast path), gives the same bits, each request the
same bits in every batch bucket, and the same drafts as the decoded checkpoint except at near-ties."""
from __future__ import annotations

import pytest
import torch
from conftest import assert_set_drafts_like_eager

from dspark_ray.testing import workload
from dspark_ray.testing.batches import placed
from dspark_ray.kernels import exl3_gemm
from dspark_ray.model.layout import Layout
from dspark_ray.rank.modes import make_drafter, read_rank

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
    n_rows = 0
    for name, cut, rec in _records(exl3_ckpt):
        w = exl3_gemm.Exl3Weight(rec)
        variants = [w]
        if w.shape_idx != exl3_gemm.ROWS and exl3_gemm.rows_compatible(w.K, w.k, w.n, w.device):
            v = exl3_gemm.Exl3Weight(rec)       # the row-tile family too, whatever the table picked
            v.shape_idx = exl3_gemm.ROWS
            variants.append(v)
        for v in variants:
            n_rows += v.shape_idx == exl3_gemm.ROWS
            x = torch.randn(80, v.k, generator=g, device="cuda").half()
            full = v.matmul(x, torch.float16)           # 80 rows: two 64-row tiles
            assert torch.equal(full, v.matmul(x, torch.float16)), name
            for rows in ((3,), (0, 1), tuple(range(5, 22)), tuple(range(40)), tuple(range(2, 72)), tuple(range(24))):
                sub = v.matmul(x[list(rows)], torch.float16)     # 16, 16, 32, 48, 128, 32 rows
                assert torch.equal(sub, full[list(rows)]), (name, cut, v.shape_idx, len(rows))
    assert n_rows > 0


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



def _experts(w, cfg):
    from dspark_ray.model.moe import Experts
    e = "mtp.0.ffn.experts."
    return Experts([w[f"{e}{i}.w1.weight"] for i in range(cfg.n_routed_experts)],
                   [w[f"{e}{i}.w3.weight"] for i in range(cfg.n_routed_experts)],
                   [w[f"{e}{i}.w2.weight"] for i in range(cfg.n_routed_experts)],
                   tuple(w[f"mtp.0.ffn.shared_experts.{m}.weight"] for m in ("w1", "w3", "w2")),
                   limit=cfg.swiglu_limit)


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_experts_agree_with_the_decoded_experts_and_repeat_their_bits(exl3_ckpt, tp):
    """The fused MoE kernel (one decode of each routed expert for all its rows) against the reference form on the
    decoded experts, every rank's cut; deterministic bit for bit, graph replay == eager."""
    exl3_gemm = _need_exl3()
    from dspark_ray.model.ops import Ready
    ck, cfg = exl3_ckpt, exl3_ckpt.config
    lay = Layout(cfg, tp)
    g = torch.Generator(device="cuda").manual_seed(4)
    for rank in range(tp):
        fast = _experts(read_rank(ck, lay, rank, "cuda", exl3_kernels=True), cfg)
        ref = _experts(read_rank(ck, lay, rank, "cuda", exl3_kernels=False), cfg)
        if fast.fused_experts is None:
            assert not isinstance(fast.w1, exl3_gemm.Exl3Bank) or not exl3_gemm.fused_moe_takes(
                fast.w1, fast.w3, fast.w2)
            pytest.skip("this mix's routed experts do not take the fused kernel")
        for n in (1, 5, 24, 40):
            f = torch.randn(n, cfg.hidden_size, generator=g, device="cuda").half()
            # distinct experts per row, a few experts shared by many rows (as routing does)
            key = torch.rand(n, cfg.n_routed_experts, generator=g, device="cuda")
            key[:, :2] += 0.5
            ex = key.topk(cfg.num_experts_per_tok, dim=1).indices
            wt = (torch.rand(n, cfg.num_experts_per_tok, generator=g, device="cuda") + 0.2).half()
            shared = torch.randn(n, cfg.hidden_size, generator=g, device="cuda")
            got = fast.routed(f, ex, wt, Ready(shared))
            assert torch.equal(got, fast.routed(f, ex, wt, Ready(shared))), (rank, n)
            want = ref.routed(f, ex, wt, Ready(shared))
            err = (got - want).abs().max().item()
            assert err <= 4e-3 * want.abs().max().item() + 1e-3, (tp, rank, n, err)
        # graph replay == eager at one shape
        fs, es, ws, ss = f.clone(), ex.clone(), wt.clone(), shared.clone()
        eager = fast.routed(fs, es, ws, Ready(ss))
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fast.routed(fs, es, ws, Ready(ss))
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fast.routed(fs, es, ws, Ready(ss))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        # How much a row's bits depend on the other rows of the call: reported, not asserted.
        alone = torch.cat([fast.routed(f[j:j + 1], ex[j:j + 1], wt[j:j + 1], Ready(shared[j:j + 1]))
                           for j in range(n)])
        print(f"\nexl3_moe tp{tp} rank {rank}: {int((alone != got).any(dim=1).sum())} / {n} rows differ "
              f"between a call of 1 row and of {n}")

def test_drafter_on_the_kernels_matches_the_decoded_one_and_its_graphs(exl3_ckpt):
    exl3_gemm = _need_exl3()
    from dspark_ray.rank.graphs import GraphSet
    from dspark_ray.kernels.gemm import kernels_for
    ck, cfg = exl3_ckpt, exl3_ckpt.config
    d = make_drafter(cfg, "tp1", ckpt=ck, device="cuda", kernels=kernels_for("fast"))
    assert isinstance(d.head.shards[0].head, exl3_gemm.Exl3Weight)
    assert d.kernels.fused("branch") is None and d.kernels.fused("branch_parts") is None   # one stream for EXL3
    assert d.kernels.mode == "fast" and d.kernels.fused("attend") is not None
    gs = GraphSet(d, n_slots=6)
    gs.capture()
    rows = [6, 11, 3, 20]
    eager = []
    for r, n in enumerate(rows):
        taps = workload.make_taps(cfg, n, torch.Generator().manual_seed(11 + r))
        assert gs.run(placed([(gs.slots[r], 0, taps)]), [], [], 1, False) is None
        st = d.new_slot()
        d.insert(st, 0, taps)
        assert torch.equal(gs.slots[r].kv, st.kv), r
        eager.append(st)
    assert_set_drafts_like_eager(gs, d, eager, cfg.block_size, 5, 37)
    # Batch invariance (the fused MoE kernel and 16-row slabs): every bucket gives each request its one-request
    # answer, bit for bit.
    alone = [gs.run([], [gs.slots[r]], [5 + 37 * r], cfg.block_size, True) for r in range(4)]
    for bsz in range(2, 5):
        got = gs.run([], gs.slots[:bsz], [5 + 37 * r for r in range(bsz)], cfg.block_size, True)
        for r in range(bsz):
            for k in ("drafts", "confidences", "margins"):
                assert torch.equal(getattr(got, k)[r], getattr(alone[r], k)[0]), (bsz, r, k)


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
        dk.insert(a, 0, taps)
        dd.insert(b, 0, taps)
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
