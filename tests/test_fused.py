"""The fused kernels of `kernels/fused.py` against the reference chains they replace.

* Exact where the kernel has no reduction of its own: mhc_expand, swiglu, route, bit for bit, edge values included.
* Close where the kernel reduces in its own order (norms, mHC mixes and Sinkhorn, RoPE'd head norms, attention,
  the grouped experts).
* Batch invariant: every row (request) alone gives its bits in the batch.
* The tiny drafter on the fast path drafts what the exact path drafts, and a request alone equals it batched.

On CPU the checks run under Triton's interpreter in a subprocess (TRITON_INTERPRET must not leak into the other
tests); with CUDA they run on the card (`gpu` marker)."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from interpreter import ROOT, interpreter_env

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _alone_equals_batch(fn, n):
    """fn(rows) for rows = one index range; True when each row alone equals its rows of the whole batch."""
    full = fn(slice(0, n))
    return all(all(torch.equal(a, b[i:i + 1]) for a, b in zip(fn(slice(i, i + 1)), full)) for i in range(n))


def kernel_checks(dev: str) -> dict:
    """Every per-kernel check on `dev`; returns name -> result (bools must be True, floats small). The model's parts
    run on the exact kernels with the fused ones each check names (`use(table)`: from there on), none at first."""
    from dspark_ray.model import ops
    with contextlib.ExitStack() as stack:
        def use(table: dict) -> None:
            stack.enter_context(ops.using(ops.Kernels(mode="checks", fused_table=table)))
        use({})                 # the reference chains, whatever the caller runs on
        return _kernel_checks(dev, use)


def _kernel_checks(dev: str, use) -> dict:
    from dspark_ray.kernels import fused, gemm
    from dspark_ray.model import mhc, moe, ops
    from dspark_ray.model.attention import Attention
    from dspark_ray.model.ops import Rope, f16, head_norm
    g = torch.Generator().manual_seed(0)

    def rn(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(dev)

    res = {}
    R, h, eps = 3, 192, 1e-6
    x = rn(R, 4, h)
    fn, base, scale = rn(24, 4 * h, s=0.05), rn(24, s=0.1), torch.tensor([0.5, 0.7, 0.9], device=dev)
    nw = (1 + rn(h, s=0.1)).bfloat16()
    site = mhc.HcSite(fn, base, scale, m=4, iters=20, hc_eps=1e-6, norm_eps=eps)
    n1, p1, c1 = fused.mhc_collapse_norm(x, fn, base, scale, nw, iters=20, hc_eps=1e-6, norm_eps=eps)
    c, p, cb = site.collapse(x)
    res["collapse_normed"] = _rel(n1, ops.rms_norm(c, nw, eps))
    res["collapse_post"], res["collapse_comb"] = _rel(p1, p), _rel(c1, cb)
    res["collapse_alone"] = _alone_equals_batch(
        lambda s: fused.mhc_collapse_norm(x[s], fn, base, scale, nw, iters=20, hc_eps=1e-6, norm_eps=eps), R)
    from dspark_ray.kernels import fused_mhc           # a row wider than one block: the two-pass collapse
    saved_block, fused_mhc.COLLAPSE_BLOCK = fused_mhc.COLLAPSE_BLOCK, 64
    try:
        n2, p2, c2 = fused.mhc_collapse_norm(x, fn, base, scale, nw, iters=20, hc_eps=1e-6, norm_eps=eps)
        pr2, no2 = fused.hyper_head_norm(x, fn[:4], base[:4], scale[:1], nw, hc_eps=1e-6, norm_eps=eps)
    finally:
        fused_mhc.COLLAPSE_BLOCK = saved_block
    res["collapse_normed_looped"] = _rel(n2, ops.rms_norm(c, nw, eps))
    res["collapse_comb_looped"] = torch.equal(c2, c1) and torch.equal(p2, p1)     # the Sinkhorn half: unchanged
    y = rn(R, h)
    res["expand_exact"] = torch.equal(fused.mhc_expand(x, y, p, cb), mhc.HcSite.expand(x, y, p, cb))
    hh = mhc.HyperHead(fn[:4], base[:4], scale[:1], hc_eps=1e-6, norm_eps=eps)
    pr1, no1 = fused.hyper_head_norm(x, fn[:4], base[:4], scale[:1], nw, hc_eps=1e-6, norm_eps=eps)
    pr0 = hh(x)
    res["hyper_prenorm"], res["hyper_normed"] = _rel(pr1, pr0), _rel(no1, ops.rms_norm(pr0, nw, eps))
    res["hyper_prenorm_looped"] = torch.equal(pr2, pr1)          # no reduction in the pre-norm state: same bits
    res["hyper_normed_looped"] = _rel(no2, ops.rms_norm(pr0, nw, eps))
    xr = rn(5, 1100).half()
    res["rms_norm"] = _rel(fused.rms_norm(xr, nw.repeat(6)[:1100], eps), ops.rms_norm(xr, nw.repeat(6)[:1100], eps))
    wide = rn(5, 1792).half()          # a column slice of a wider GEMM output is read in place: the same bits
    res["rms_norm_slice"] = torch.equal(fused.rms_norm(wide[:, :1100], nw.repeat(6)[:1100], eps),
                                        fused.rms_norm(wide[:, :1100].contiguous(), nw.repeat(6)[:1100], eps))
    kvw, kvn = rn(4, 1792).half(), (1 + rn(512, s=0.1)).half()   # the kv row: a column slice of wq_a | wkv
    hargs = (kvn, eps, torch.arange(4, device=dev) + 77, Rope(64, 1e4, dev).inv_freq, 64)
    res["head_norm_rope_slice"] = torch.equal(fused.head_norm_rope(kvw[:, 1280:], *hargs),
                                              fused.head_norm_rope(kvw[:, 1280:].contiguous(), *hargs))
    gu = rn(7, 600, s=6.0)              # SwiGLU of the two halves of one GEMM output (the shared expert's w1 | w3)
    res["swiglu_halves"] = torch.equal(fused.swiglu(gu[:, :300], gu[:, 300:], 10.0),
                                       fused.swiglu(gu[:, :300].contiguous(), gu[:, 300:].contiguous(), 10.0))

    # SwiGLU: edge values (inf, nan, huge, tiny, negative zero) with and without the clamp, fp32 and fp16 inputs.
    gg = torch.cat([rn(500, s=6.0), torch.tensor([float("inf"), -float("inf"), float("nan"), 70000.0, -70000.0,
                                                  1e-8, -0.0, 0.0, 11.5, -11.5], device=dev)])
    uu = torch.cat([rn(500, s=6.0), torch.tensor([1.0, 2.0, 3.0, float("nan"), -0.0, float("inf"), 5.0, -5.0,
                                                  20.0, -20.0], device=dev)])
    for lim in (0.0, 10.0):
        for dt in (torch.float32, torch.float16):
            a, b = fused.swiglu(gg.to(dt), uu.to(dt), lim), ops.swiglu(f16(gg), f16(uu), lim)
            res[f"swiglu_exact_{lim}_{dt}"] = torch.equal(a.isnan(), b.isnan()) and torch.equal(
                torch.nan_to_num(a), torch.nan_to_num(b))

    # The small-linear kernel: two row blocks (rows 32+ in the second), fp32 and fp16 outputs, rows alone.
    xl, wl = rn(40, 300).half(), rn(70, 300, s=300 ** -0.5).half()
    ref = xl.double() @ wl.double().t()
    lin = fused.rows_linear(xl, wl)
    res["rows_linear"] = _rel(lin, ref)
    res["rows_linear_f16"] = _rel(fused.rows_linear(xl, wl, torch.float16), ref)
    res["rows_linear_alone"] = all(torch.equal(fused.rows_linear(xl[i:i + 1], wl), lin[i:i + 1]) for i in (0, 7, 33, 39))

    # Router: random logits with planted ties, NaN and -inf; selection order and weights exact.
    E = 40
    lg = rn(9, E, s=3.0).half()
    lg[1, 5] = lg[1, 9] = lg[1].max() + 1      # a tie: the lower id first
    lg[2, 3] = float("nan")
    lg[3, :] = -float("inf")                      # all equal keys
    lg[4, 7] = 30.0                               # softplus threshold branch
    lg[5, :] = -25.0                              # log1p(tiny)
    bias = rn(E, s=0.3)
    router = moe.Router(torch.zeros(E, 8, device=dev).half(), bias, top_k=3, scaling=1.5)
    r0, w0 = router.select(lg)
    r1, w1 = fused.route(lg, router.bsel, 3, router.scaling_f)
    res["route_exact"] = torch.equal(r0, r1) and torch.equal(w0, w1)
    res["route_alone"] = _alone_equals_batch(lambda s: fused.route(lg[s], router.bsel, 3, router.scaling_f), 9)
    res["route_warps"] = all(all(map(torch.equal, fused.route(lg, router.bsel, 3, router.scaling_f, w), (r1, w1)))
                             for w in (2, 4, 8))
    # The router's GEMV: close to the reference GEMM; one row alone gives its bits, in the default tiling and in
    # ones with several row blocks, a K wider than one chunk (a part-filled last chunk) and an odd expert count.
    fr, gate = rn(5, 300).half(), rn(E + 1, 300, s=0.06).half()
    ref = ops.f16(ops.linear_tree(fr, gate))
    for tiling in (None, (2, 128, 4), (8, 512, 2), (1, 64, 1)):
        name = "router_logits" + ("" if tiling is None else "_" + "x".join(map(str, tiling)))
        res[name] = _rel(fused.router_logits(fr, gate, tiling), ref)
        res[name + "_alone"] = _alone_equals_batch(lambda s, t=tiling: (fused.router_logits(fr[s], gate, t),), 5)

    # Experts, grouped by expert: close to the per-pair reference, every row alone equals its batched bits (rows
    # share experts here), pairs of one expert spread over several of the kernel's BM-pair chunks (30 rows on 4
    # experts), and more pairs of one expert than one pass takes (100 rows on 3 experts: 100 pairs each, GROUP_BM 64).
    for n, ne in ((4, 6), (30, 4), (100, 3)):
        kc, hid, inter = 3, 96, 80
        f = rn(n, hid).half()
        w1e, w3e = rn(ne, inter, hid, s=hid ** -0.5).half(), rn(ne, inter, hid, s=hid ** -0.5).half()
        w2e = rn(ne, hid, inter, s=inter ** -0.5).half()
        experts = torch.stack([torch.randperm(ne, generator=g)[:kc] for _ in range(n)]).to(dev)
        weights = rn(n, kc).half()
        shared = rn(n, hid)
        e_flat, fr = experts.flatten(), f.repeat_interleave(kc, dim=0)
        act = fused.expert_act(f, w1e, w3e, experts, 10.0)
        act0 = ops.swiglu(gemm.indexed_linear(fr, w1e, e_flat), gemm.indexed_linear(fr, w3e, e_flat), 10.0)
        res[f"expert_act_{n}"] = _rel(act, act0)
        out = fused.expert_out(act, w2e, experts, weights, shared)
        order = torch.argsort(experts, dim=1, stable=True)
        d = gemm.indexed_linear(act, w2e, e_flat).reshape(n, kc, -1)
        ref = torch.zeros(n, hid, device=dev)
        for j in range(kc):
            ref = ref + torch.gather(weights, 1, order)[:, j, None].float() * d[torch.arange(n), order[:, j]]
        res[f"expert_out_{n}"] = _rel(out, ref + shared)
        res[f"experts_alone_{n}"] = _alone_equals_batch(
            lambda s: (fused.expert_out(fused.expert_act(f[s], w1e, w3e, experts[s], 10.0), w2e, experts[s],
                                        weights[s], shared[s]),), min(n, 6))
        res[f"experts_repeat_{n}"] = torch.equal(out, fused.expert_out(
            fused.expert_act(f, w1e, w3e, experts, 10.0), w2e, experts, weights, shared))

    # Head norm + RoPE (q heads without weight; kv row with a bf16 and an fp16 weight), near position 900,000.
    D, rd, H, B, W, bsz = 128, 64, 4, 5, 8, 2
    rope = Rope(rd, 10000.0, dev)
    pos = torch.tensor([900_000 + j for j in range(B)] + [7 + j for j in range(B)], device=dev)
    att = Attention.__new__(Attention)
    att.D, att.rd, att.eps, att.rope = D, rd, eps, rope
    q_in = rn(bsz * B, H, D).half()
    ref_q = att._rope_tail(head_norm(q_in, None, eps), pos)
    res["head_norm_rope_q"] = _rel(fused.head_norm_rope(q_in, None, eps, pos, rope.inv_freq, rd), ref_q)
    kv_in = rn(bsz * B, D).half()
    for w in ((1 + rn(D, s=0.1)).bfloat16(), (1 + rn(D, s=0.1)).half()):
        res[f"head_norm_rope_kv_{w.dtype}"] = _rel(fused.head_norm_rope(kv_in, w, eps, pos, rope.inv_freq, rd),
                                                   att._rope_tail(head_norm(kv_in, w, eps), pos))

    # Attention: a partial window (request 1 holds 3 of 8 rows); the rows it does not hold are NaN and must not leak.
    sink, scale_f = rn(H), float(torch.tensor(D ** -0.5, dtype=torch.float32))
    att.sink, att.scale = sink, torch.tensor(D ** -0.5, dtype=torch.float32)
    q = ref_q.reshape(bsz, B, H, D)
    window, kv = rn(bsz, W, D).half(), rn(bsz, B, D).half()
    valid = torch.ones(bsz, W, dtype=torch.bool, device=dev)
    valid[1, :5] = False
    keys = torch.cat((torch.where(valid[..., None], window, torch.zeros_like(window)), kv), dim=1)
    mask = torch.cat((valid, torch.ones(bsz, B, dtype=torch.bool, device=dev)), dim=1)
    cos, sin = rope.cos_sin(pos)
    o0 = att._attend(q, keys, mask, cos.reshape(bsz, B, -1), sin.reshape(bsz, B, -1))
    window[1, :5] = float("nan")
    o1 = fused.attend(q, window, valid, kv, sink, scale_f, pos, rope.inv_freq, rd)
    res["attend"] = _rel(o1, o0)
    res["attend_finite"] = bool(torch.isfinite(o1).all())
    res["attend_alone"] = all(torch.equal(
        fused.attend(q[i:i + 1], window[i:i + 1], valid[i:i + 1], kv[i:i + 1], sink, scale_f,
                     pos[i * B:(i + 1) * B], rope.inv_freq, rd), o1[i:i + 1]) for i in range(bsz))
    # attend on a larger layout: several row blocks (the last partial), key chunks and output-column chunks; a full
    # window, a holey one (NaN in the rows not held), an empty one. Each request alone gives its bits of the batch.
    D2, H2, W2, n2 = 256, 8, 40, 3
    pos2 = torch.cat([torch.arange(B) + p for p in (50, 1000, 123_456)]).to(dev)
    q2 = fused.head_norm_rope(rn(n2 * B, H2, D2).half(), None, eps, pos2, rope.inv_freq, rd).reshape(n2, B, H2, D2)
    win2, kv2, sink2 = rn(n2, W2, D2, s=2.0).half(), rn(n2, B, D2, s=2.0).half(), rn(H2)
    valid2 = torch.ones(n2, W2, dtype=torch.bool, device=dev)
    valid2[1, torch.randperm(W2, generator=g)[:25].to(dev)] = False
    valid2[2] = False
    win2 = torch.where(valid2[..., None], win2, torch.full_like(win2, float("nan")))
    args2 = (sink2, float(torch.tensor(D2 ** -0.5, dtype=torch.float32)))
    s2 = fused.attend(q2, win2, valid2, kv2, *args2, pos2, rope.inv_freq, rd)
    att2 = Attention.__new__(Attention)
    att2.D, att2.rd, att2.rope, att2.sink, att2.scale = D2, rd, rope, sink2, torch.tensor(D2 ** -0.5)
    keys2 = torch.cat((torch.where(valid2[..., None], win2, torch.zeros_like(win2)), kv2), dim=1)
    mask2 = torch.cat((valid2, torch.ones(n2, B, dtype=torch.bool, device=dev)), dim=1)
    cos2, sin2 = rope.cos_sin(pos2)
    res["attend_wide"] = _rel(s2, att2._attend(q2, keys2, mask2, cos2.reshape(n2, B, -1), sin2.reshape(n2, B, -1)))
    res["attend_wide_finite"] = bool(torch.isfinite(s2).all())
    # Written straight into the grouped output GEMM's padded group-major input: the same bits, and the grouped
    # linear reads that buffer in place to the same result as from a copy.
    u2 = fused.attend(q2, win2, valid2, kv2, *args2, pos2, rope.inv_freq, rd, groups=4)
    res["attend_grouped_layout"] = torch.equal(u2, s2.reshape(n2 * B, 4, 2 * D2))
    wo_a2 = (torch.randn(4 * 64, 2 * D2, generator=torch.Generator().manual_seed(5)) * 0.05).half().to(dev)
    res["grouped_linear_in_place"] = torch.equal(gemm.padded_grouped_linear(u2, wo_a2),
                                                 gemm.padded_grouped_linear(u2.contiguous(), wo_a2))
    if dev == "cuda":       # the batched GEMM writes the row-major layout itself: two chunks, rows alone, the value
        xg = rn(40, 4, 2 * D2).half()
        yg = gemm.padded_grouped_linear(xg, wo_a2)
        refg = torch.cat([ops.f16(ops.linear_tree(xg[:, i], wo_a2[i * 64:(i + 1) * 64])) for i in range(4)], dim=-1)
        res["grouped_linear"] = _rel(yg, refg)
        res["grouped_linear_alone"] = all(torch.equal(gemm.padded_grouped_linear(xg[i:i + 1], wo_a2), yg[i:i + 1])
                                          for i in (0, 31, 32, 39))
    res["attend_wide_alone"] = all(torch.equal(
        fused.attend(q2[i:i + 1], win2[i:i + 1], valid2[i:i + 1], kv2[i:i + 1], *args2, pos2[i * B:(i + 1) * B],
                     rope.inv_freq, rd), s2[i:i + 1]) for i in range(n2))
    # The Markov head loop on two vocabulary shards: a tie planted across the shard boundary (ids 250 and 300 the
    # largest logits, equal), a NaN logit (id 10), margins and kept logits.
    from dspark_ray.model.collectives import LocalCollectives
    from dspark_ray.model.heads import DraftHead, VocabShard
    V, r, hd_ = 512, 32, 64
    head_w, w2 = rn(V, hd_, s=hd_ ** -0.5).half(), rn(V, r, s=r ** -0.5).half()
    b2, w1 = rn(V, s=0.1).half(), rn(V, r).bfloat16()
    head_w[250] = head_w[300] = head_w[250] * 4
    w2[250] = w2[300] = w2[250]
    b2[250] = b2[300] = 3.0
    b2[10] = float("nan")
    dh = DraftHead([VocabShard(head_w[:256], w2[:256], b2[:256], 0), VocabShard(head_w[256:], w2[256:], b2[256:], 256)],
                   w1, rn(1, hd_ + r, s=0.1).half(), None, LocalCollectives(2))
    normed, prenorm, seeds = rn(3, 5, hd_).half(), rn(3, 5, hd_), torch.tensor([1, 250, 300], device=dev)
    ref = dh(normed, prenorm, seeds, 5, True, keep_logits=True)
    use({"markov_step": fused.markov_step})
    out = dh(normed, prenorm, seeds, 5, True, keep_logits=True)
    res["markov_drafts_equal"] = torch.equal(out.drafts, ref.drafts)
    res["markov_tie_to_lower_id"] = bool((out.drafts == 250).any()) and not bool((out.drafts == 300).any())
    res["markov_nan_never_wins"] = not bool((out.drafts == 10).any())
    res["markov_margins"] = _rel(out.margins, ref.margins)
    res["markov_logits"] = _rel(torch.nan_to_num(out.logits, posinf=0, neginf=0), torch.nan_to_num(ref.logits, posinf=0, neginf=0))
    res["markov_logits_nan_kept"] = torch.equal(out.logits.isnan(), ref.logits.isnan())
    res["markov_confidences"] = _rel(out.confidences, ref.confidences)
    one = dh(normed[1:2], prenorm[1:2], seeds[1:2], 5, True, keep_logits=True)
    res["markov_alone"] = torch.equal(one.drafts[0], out.drafts[1]) and torch.equal(one.margins[0], out.margins[1])
    # Cached Markov bias rows: `markov_rows` makes the bits the step adds (with zero logits the step's logits are its
    # bias), and the loop with rows cached for some of its previous tokens (not others) drafts the uncached bits.
    use({"markov_step": fused.markov_step, "markov_rows": fused.markov_rows})
    prevs = torch.cat((seeds[:, None], out.drafts[:, :-1]), dim=1).flatten().unique()
    toks = torch.cat((prevs[::2], torch.arange(400, 470, device=dev)[~torch.isin(torch.arange(400, 470, device=dev),
                                                                                prevs)]))
    rows = fused.markov_rows(toks, w1, w2[256:], b2[256:])
    zero = torch.zeros(len(toks), 1, 256, dtype=torch.float16, device=dev)
    lz = fused.markov_step(zero, 0, toks, w1, w2[256:], b2[256:], 256, True)[4]
    res["markov_rows_step_bits"] = torch.equal(lz.nan_to_num(7.0), rows.float().nan_to_num(7.0))
    hits = torch.isin(prevs, toks)
    res["markov_cache_hits_and_misses"] = bool(hits.any()) and not bool(hits.all())
    for name, cached_toks in (("some", toks), ("every", torch.arange(V - 1, -1, -1, device=dev))):
        # some tokens: the partial kernel's branch; every token (given in any order): the table kernel
        cached = DraftHead([VocabShard(s.head, s.markov_w2, s.markov_b2, s.start) for s in dh.shards], w1,
                           dh.conf_w, None, LocalCollectives(2))
        cached.cache_markov_rows(cached_toks)
        got = cached(normed, prenorm, seeds, 5, True, keep_logits=True)
        res[f"markov_cache_{name}_same_bits"] = (
            torch.equal(got.drafts, out.drafts) and torch.equal(got.margins, out.margins)
            and torch.equal(got.confidences, out.confidences)
            and torch.equal(got.logits.nan_to_num(7.0), out.logits.nan_to_num(7.0)))
    use({"markov_step": fused.markov_step})
    # Every tiling of the Markov step gives the default's bits: on 200 vocab rows (part-filled and empty tiles), a
    # tie across tiles (ids 20 and 37: the lower wins, the runner-up equals the top), a NaN logit.
    from dspark_ray.kernels.fused_head import MARKOV_TILING
    lg_t = (torch.randn(2, 5, 200, generator=torch.Generator().manual_seed(7)) * 2.0).half().to(dev)  # (own generator:
    # the checks below keep their inputs)
    lg_t[:, :, 20] = lg_t[:, :, 37] = 60.0
    lg_t[0, :, 5] = float("nan")
    w2_t, b2_t = w2[:200].clone(), b2[:200].nan_to_num()
    w2_t[37], b2_t[37] = w2_t[20], b2_t[20]

    def markov_bits(tiling):
        prev, out = seeds[:2], []
        for i in range(5):
            me_, t1, t2, idx, lgt = fused.markov_step(lg_t, i, prev, w1, w2_t, b2_t, 7, True,
                                                      tiling=tiling)
            out += [me_.view(torch.int16).flatten().long(), t1.view(torch.int32).long(), t2.view(torch.int32).long(),
                    idx, lgt.view(torch.int32).flatten().long()]
            prev = idx - 7
        return torch.cat(out), out
    base_bits, base = markov_bits(MARKOV_TILING)
    res["markov_tie_across_tiles"] = bool((base[3] == 27).all()) and torch.equal(base[1], base[2])
    res["markov_tilings_same_bits"] = all(torch.equal(markov_bits(t)[0], base_bits)
                                          for t in ((16, 1, 2), (16, 4, 1), (32, 2, 4), (64, 4, 4), (32, 1, 4)))
    # The confidence head in one kernel: close to the reference chain; its prefix lengths are exactly
    # confident_prefix of its own scores (threshold at the median: the prefixes vary); a request alone, the same bits.
    from dspark_ray.model.heads import confident_prefix
    me = rn(3, 5, r).half()
    cw, cb = rn(1, hd_ + r, s=0.1).half(), rn(1, s=0.1).half()
    ci = torch.cat((ops.f16(prenorm), me), dim=-1)
    ref_conf = ops.sigmoid(ops.f16(ops.linear_tree(ci, cw) + cb.float())[..., 0].float())
    thr = float(ref_conf.median())

    def confidence(pre, me_, b_):            # the head's two halves: prenorm (beside the head GEMM), then Markov
        return fused.confidence(fused.confidence_prenorm(pre, cw, me_.shape[1]), me_, cw, b_, thr)
    conf, lens = confidence(prenorm, me, cb)
    res["confidence"] = _rel(conf, ref_conf)
    res["confident_len_exact"] = torch.equal(lens, confident_prefix(conf, thr))
    res["confident_len_varies"] = len(set(lens.tolist())) > 1
    res["confidence_alone"] = _alone_equals_batch(lambda s: confidence(prenorm[s], me[s], cb), 3)
    c3, l3 = confidence(prenorm, me[:, :3], None)        # n_out 3: rows past n_out never read
    res["confidence_n_out_prefix_bits"] = torch.equal(confidence(prenorm, me[:, :3], cb)[0], conf[:, :3])
    # A Markov step's embedding written into one column of the loop's (bsz, n_out, r) buffer: its own bits there,
    # the other columns untouched.
    embs = torch.full((2, 5, w1.shape[1]), 7.0, dtype=torch.float16, device=dev)
    fresh = fused.markov_step(lg_t, 2, seeds[:2], w1, w2_t, b2_t, 7, False)
    into = fused.markov_step(lg_t, 2, seeds[:2], w1, w2_t, b2_t, 7, False, me_out=embs[:, 3])
    res["markov_embedding_in_place"] = (torch.equal(embs[:, 3], fresh[0])
                                        and into[0].data_ptr() == embs[:, 3].data_ptr()
                                        and bool((embs[:, [0, 1, 2, 4]] == 7.0).all())
                                        and all(torch.equal(a, b) for a, b in zip(fresh[1:4], into[1:4])))
    # The graph set's packing and the block's input streams: no arithmetic, so the reference's exact bits.
    d_, m_ = torch.randint(0, 129280, (3, 4), device=dev), rn(3, 4)
    for marg in (m_, None):
        parts = [d_, conf[:, :4]] + ([marg] if marg is not None else []) + [lens[:, None]]
        res[f"pack_exact_{marg is not None}"] = torch.equal(fused.pack_outputs(d_, conf[:, :4], marg, lens),
                                                            torch.cat([p.double() for p in parts], dim=1))
    emb, sd = rn(50, 1100).bfloat16(), torch.tensor([7, 0, 49], device=dev)
    ids = torch.full((3, 5), 11, dtype=torch.int64, device=dev)
    ids[:, 0] = sd
    streams, pos = fused.embed_streams(sd, torch.tensor([0, 900000, 2 ** 24 + 3], device=dev), emb, 5, 11, 4)
    res["embed_streams_exact"] = torch.equal(streams, emb[ids.flatten()].float()[:, None].expand(-1, 4, -1))
    res["embed_positions_exact"] = pos.tolist() == [p + j for p in (0, 900000, 2 ** 24 + 3) for j in range(5)]
    res["confidence_n_out_prefix"] = _rel(c3, ops.sigmoid(ops.f16(ops.linear_tree(ci[:, :3], cw))[..., 0].float()))
    return res


def drafter_checks(ckpt_dir: str, dev: str) -> dict:
    """The tiny drafter, exact path vs fast path (matmuls and fused kernels), two requests at different p0: two
    drafters of one checkpoint, one on each kernel set, drafting over the same slots (filled on the exact path)."""
    from dspark_ray.config import load_config
    from dspark_ray.kernels.gemm import kernels_for
    from dspark_ray.rank.modes import make_drafter
    from dspark_ray.weights.loader import Checkpoint
    cfg = load_config(ckpt_dir)
    d = make_drafter(cfg, "tp1", ckpt=Checkpoint(ckpt_dir), device=dev)
    fast = make_drafter(cfg, "tp1", ckpt=Checkpoint(ckpt_dir), device=dev, kernels=kernels_for("fast"))
    states = [d.new_slot(), d.new_slot()]
    g = torch.Generator().manual_seed(1)
    for i, s in enumerate(states):
        n = 6 + 7 * i                                   # request 0 holds a partial window, request 1 a full one
        d.insert(s, 3,
                 torch.randn(n, cfg.n_taps * cfg.hidden_size, generator=g).half().to(dev))
    ref = d.draft(states, [5, 9], 5, want_margins=True, debug=True)
    out = fast.draft(states, [5, 9], 5, want_margins=True, debug=True)
    one = fast.draft(states[1:], [9], 5, want_margins=True, debug=True)
    return {"drafts_equal": torch.equal(ref.drafts, out.drafts), "logits": _rel(out.logits, ref.logits),
            "alone": torch.equal(one.logits[0], out.logits[1]) and torch.equal(one.drafts[0], out.drafts[1])}


def _assert_kernels(res: dict) -> None:
    tol = {"collapse_normed": 2e-3, "collapse_post": 1e-6, "collapse_comb": 1e-5, "hyper_prenorm": 1e-6,
           "hyper_normed": 2e-3, "rms_norm": 2e-3, "head_norm_rope_q": 2e-3, "attend": 2e-3, "attend_wide": 2e-3}
    for name, v in res.items():
        if isinstance(v, bool):
            assert v, name
        else:
            assert v <= tol.get(name, 2e-3), (name, v)


def _interpreted(code: str) -> dict:
    env = interpreter_env()
    proc = subprocess.run([sys.executable, "-c", code], cwd=os.path.join(ROOT, "tests"), env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


cpu_only = pytest.mark.skipif(torch.cuda.is_available() or not HAS_TRITON,
                              reason="the interpreter stand-in (CUDA present: the gpu tests run the kernels)")


@cpu_only
def test_fused_kernels_interpreter_cpu():
    _assert_kernels(_interpreted("import json, test_fused; print(json.dumps(test_fused.kernel_checks('cpu')))"))


@cpu_only
def test_fast_path_drafter_interpreter_cpu(tiny_ckpt):
    res = _interpreted(f"import json, test_fused; print(json.dumps(test_fused.drafter_checks({str(tiny_ckpt)!r}, "
                       f"'cpu')))")
    assert res["drafts_equal"] and res["alone"], res
    assert res["logits"] < 1e-2, res


@pytest.mark.gpu
def test_fused_kernels_gpu():
    res = kernel_checks("cuda")
    print(json.dumps(res))
    _assert_kernels(res)


@pytest.mark.gpu
def test_fast_path_drafter_gpu(tiny_ckpt):
    res = drafter_checks(str(tiny_ckpt), "cuda")
    print(json.dumps(res))
    assert res["drafts_equal"] and res["alone"], res
    assert res["logits"] < 1e-2, res


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_grouped_expert_tiles_fit_the_cards_shared_memory():
    """The grouped experts keep their tiles and drop pipeline stages only where a card's shared memory per block
    cannot hold them (limits: H200 / H100, A100, RTX 3090)."""
    from dspark_ray.kernels.fused_moe import GROUPED_TILES, GROUPED_TILES_BY_SHAPE, fit_stages, grouped_tiles
    gated, plain = GROUPED_TILES[True], GROUPED_TILES[False]
    assert fit_stages(gated, True, 232448) == gated and gated.stages == 4  # what the H200 bench chose
    assert fit_stages(gated, True, 166912) == gated._replace(stages=3)     # 192 KiB > 163 KiB: 3 stages
    assert fit_stages(gated, True, 101376) == gated._replace(stages=2)
    assert fit_stages(plain, False, 101376) == plain                       # 4 x 24 KiB fits 99 KiB
    assert fit_stages(gated, True, 1) == gated._replace(stages=1)          # never below one stage
    assert grouped_tiles(True, 1152, 5120, None) == gated                  # a CPU: the tiles as set
    assert grouped_tiles(True, 2304, 5120, None) == GROUPED_TILES_BY_SHAPE[(True, 2304, 5120)]   # one card's own
    from dspark_ray.kernels.fused_moe import FEW_PAIR_TIERS
    (one, one_request), (few, up_to_four) = FEW_PAIR_TIERS
    assert (one, few) == (16, 60)                                           # one request; up to four
    assert grouped_tiles(True, 1152, 5120, None, 15) == up_to_four[(True, 1152, 5120)]    # a rank: no 1-request tier
    assert grouped_tiles(True, 2304, 5120, None, 15) == one_request[(True, 2304, 5120)]   # one card, one request
    assert grouped_tiles(True, 2304, 5120, None, 17) == up_to_four[(True, 2304, 5120)]    # one card, two requests
    assert grouped_tiles(False, 5120, 2304, None, 60).bm == 16
    assert grouped_tiles(False, 5120, 2304, None, 61) == GROUPED_TILES[False]            # past the tiers
    assert grouped_tiles(True, 96, 80, None, 15) == gated                 # a shape without few-pair tiles


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("gated,n,k", [(True, 1152, 5120), (True, 2304, 5120), (False, 5120, 1152),
                                       (False, 5120, 2304)])
def test_few_pair_expert_tiles_same_bits_gpu(gated, n, k):
    """Every few-pair tier's tiles (16-pair passes) give the bits of the batch's tiles at the full preset's shapes,
    for one to four requests' pairs, spread over and stacked on experts: a request's drafts do not depend on
    whether it shares the replay."""
    from dspark_ray.kernels.fused_moe import FEW_PAIR_TIERS, _fit_card, grouped_launch, grouped_tiles
    g = torch.Generator(device="cuda").manual_seed(n + k)
    e = 16
    w1 = torch.randn((e, n, k), generator=g, device="cuda", dtype=torch.float16) * 0.02
    w3 = torch.randn((e, n, k), generator=g, device="cuda", dtype=torch.float16) * 0.02 if gated else None
    wide = grouped_tiles(gated, n, k, 0)
    tiers = [_fit_card(t[(gated, n, k)], gated, 0) for _, t in FEW_PAIR_TIERS if (gated, n, k) in t]
    assert tiers and all(t.bm == 16 and t != wide for t in tiers)
    for pairs in (3, 15, 16, 17, 60):
        assert grouped_tiles(gated, n, k, 0, pairs) in tiers
        idx = torch.randint(0, e, (pairs,), generator=g, device="cuda")
        idx[: pairs // 3] = 5                                    # several pairs on one expert: more than one pass
        rows = -(-pairs // 3) if gated else pairs          # pair p reads row p // 3 (top-3) or row p
        x = torch.randn((rows, k), generator=g, device="cuda", dtype=torch.float16)
        outs = []
        for t in (wide, *tiers):
            out = torch.full((pairs, n), float("nan"), dtype=torch.float16 if gated else torch.float32, device="cuda")
            outs.append(grouped_launch(x, w1, w3, idx, out, 3 if gated else 1, 7.0, t))
        torch.cuda.synchronize()
        assert not outs[0].isnan().any(), (gated, n, k, pairs)
        for t, o in zip(tiers, outs[1:]):
            assert torch.equal(o, outs[0]), (gated, n, k, pairs, t)
