"""The draft step's tensor-only forward captured in a CUDA graph: a replay over static input buffers gives the eager
bits, for the inputs it was captured with and for new inputs copied into the same buffers. Marker gpu."""
from __future__ import annotations

import os

import pytest
import torch

from dspark_ray.testing import workload
from dspark_ray.testing.batches import placed
from dspark_ray.observe.keep_warm import rehearse_launch
from dspark_ray.rank.modes import make_drafter
from dspark_ray import settings

pytestmark = pytest.mark.gpu


def _slots(d, cfg, rows, seed):
    out = []
    for i, n in enumerate(rows):
        st = d.new_slot()
        d.insert(st, 0, workload.make_taps(cfg, n, torch.Generator().manual_seed(seed + i)))
        out.append(st)
    return out


def _inputs(d, states, seeds):
    windows, valid = d.window_inputs(states)
    return (torch.tensor(seeds, device="cuda"), torch.tensor([s.position for s in states], device="cuda"),
            windows, valid)


@pytest.mark.parametrize("margins", [False, True])
def test_graph_replay_equals_eager_bit_for_bit(cfg, ckpt, margins):
    d = make_drafter(cfg, "tp1", ckpt=ckpt, device="cuda")
    a = _slots(d, cfg, [6, 11], 1)
    b = _slots(d, cfg, [3, 20], 5)
    static = _inputs(d, a, [7, 9])
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                d.forward(*static, 5, margins, True)          # warm-up: kernels loaded, caches built
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = d.forward(*static, 5, margins, True)
        for states, seeds in ((a, [7, 9]), (b, [100, 2000])):
            for buf, new in zip(static[:2] + (static[3],), _inputs(d, states, seeds)[:2] + (_inputs(d, states, seeds)[3],)):
                buf.copy_(new)
            for buf, new in zip(static[2], _inputs(d, states, seeds)[2]):
                buf.copy_(new)
            g.replay()
            torch.cuda.synchronize()
            eager = d.draft(states, seeds, 5, margins, debug=True)
            for k in ("drafts", "confidences", "confident_len", "logits", "normed"):
                assert torch.equal(getattr(out, k), getattr(eager, k)), k
            if margins:
                assert torch.equal(out.margins, eager.margins)


@pytest.fixture(params=["exact", "fast"])
def kernels(request):
    from dspark_ray.kernels.gemm import kernels_for
    return kernels_for(request.param)


def test_every_graph_of_the_set_replays_the_eager_bits(cfg, ckpt, kernels):
    """Every graph equals the eager step; every batch bucket gives each request its one-request answer; drafts
    for n_out = k are the first k of n_out = B; inserts through the pool (any row count, chunked past 128, pad rows
    to the scratch slot) write the eager rows."""
    from dspark_ray.rank.graphs import GraphSet
    d = make_drafter(cfg, "tp1", ckpt=ckpt, device="cuda", kernels=kernels)
    gs = GraphSet(d, n_slots=8)
    gs.capture()
    print(f"\n{len(gs.draft_graphs)} draft + {len(gs.insert_graphs)} insert graphs captured in "
          f"{gs.capture_seconds:.2f} s, {gs.graph_bytes / 2**20:.1f} MiB")
    rows = [6, 11, 3, 20]
    eager = _slots(d, cfg, rows, 11)
    for r, n in enumerate(rows):
        taps = workload.make_taps(cfg, n, torch.Generator().manual_seed(11 + r))
        assert gs.run(placed([(gs.slots[r], 0, taps)]), [], [], 1, False) is None
        assert torch.equal(gs.slots[r].kv, eager[r].kv), r
    pool = gs.slots[:4]
    alone = {}
    for r, st in enumerate(pool):
        for margins in (False, True):
            alone[(r, margins)] = gs.run([], [st], [5 + 37 * r], cfg.block_size, margins)
    for bsz in range(1, 5):
        seeds = [5 + 37 * r for r in range(bsz)]
        for n_out in range(1, cfg.block_size + 1):
            for margins in (False, True):
                got = gs.run([], pool[:bsz], seeds, n_out, margins)
                want = d.draft(eager[:bsz], seeds, n_out, margins)
                for k in ("drafts", "confidences", "confident_len") + (("margins",) if margins else ()):
                    assert torch.equal(getattr(got, k), getattr(want, k).cpu()), (bsz, n_out, margins, k)
                for r in range(bsz):          # batch invariance and the n_out prefix property, bit for bit
                    a = alone[(r, margins)]
                    assert torch.equal(got.drafts[r], a.drafts[0, :n_out]), (bsz, n_out, margins, r)
                    assert torch.equal(got.confidences[r], a.confidences[0, :n_out]), (bsz, n_out, margins, r)
                    if margins:
                        assert torch.equal(got.margins[r], a.margins[0, :n_out]), (bsz, n_out, margins, r)
    for n in (1, 8, 9, 77, 128, (100, 100)):
        ns = n if isinstance(n, tuple) else (n,)
        inserts, want = [], []
        for k, m in enumerate(ns):
            st = gs.slots[4 + k]
            st.reset()
            taps = workload.make_taps(cfg, m, torch.Generator().manual_seed(m + k))
            inserts.append((st, 1000, taps))
            ref = d.new_slot()
            d.insert(ref, 1000, taps)
            want.append(ref)
        gs.pool[4:6].zero_()
        gs.run(placed(inserts), [], [], 1, False)
        for k, ref in enumerate(want):
            assert torch.equal(gs.slots[4 + k].kv, ref.kv), n
            assert gs.slots[4 + k].position == ref.position
        assert not gs.pool[:4].sub(torch.stack([e.kv for e in eager])).any()     # other slots untouched


def test_every_step_graph_replays_the_eager_insert_and_draft(cfg, ckpt, kernels, monkeypatch):
    """Every step graph (the insert block by block beside the draft, each part joined by its block's attention)
    writes the eager insert's rows and drafts the eager bits, over rounds that wrap the slots' rings."""
    from dspark_ray.rank.graphs import GraphSet
    monkeypatch.delenv("DSPARK_STEP_GRAPHS", raising=False)
    settings.reread()
    d = make_drafter(cfg, "tp1", ckpt=ckpt, device="cuda", kernels=kernels)
    gs = GraphSet(d, n_slots=8)
    gs.capture()
    rows = [6, 11, 3, 20, 9, 2, 14, 5]
    eager = _slots(d, cfg, rows, 31)
    for r, n in enumerate(rows):
        gs.run(placed([(gs.slots[r], 0, workload.make_taps(cfg, n, torch.Generator().manual_seed(31 + r)))]), [], [], 1,
               False)
    g = torch.Generator().manual_seed(4)
    launches = 0
    assert len(gs.step_graphs) == 4 * cfg.block_size * 2 + 2 * 2          # 1-4 requests; the wide buckets 6 and 8
    for (bsz, n_out, margins) in gs.step_graphs:
        inserts = []
        for r in range(bsz):
            n = int(torch.randint(1, gs.step_rows[bsz] // bsz + 1, (1,), generator=g))
            taps, pos = workload.make_taps(cfg, n, g), eager[r].position
            inserts.append((gs.slots[r], pos, taps))
            d.insert(eager[r], pos, taps)
        seeds = [int(x) for x in torch.randint(0, cfg.vocab_size, (bsz,), generator=g)]
        launches += not gs.inp.in_use                # (the inserts-only runs above leave their upload in flight)
        rehearse_launch(gs)                          # keep_warm's launch between steps changes no bit
        got = gs.run(placed(inserts), gs.slots[:bsz], seeds, n_out, margins)
        want = d.draft(eager[:bsz], seeds, n_out, margins)
        for k in ("drafts", "confidences", "confident_len") + (("margins",) if margins else ()):
            assert torch.equal(getattr(got, k), getattr(want, k).cpu()), (bsz, n_out, margins, k)
        for r in range(bsz):
            assert torch.equal(gs.slots[r].kv, eager[r].kv), (bsz, n_out, margins, r)
            assert gs.slots[r].position == eager[r].position
    torch.cuda.synchronize()
    assert launches >= len(gs.step_graphs) - 1
    assert int(gs._noop_buf) == 1 + launches       # its warm-up, then one launch before each step with none in flight
    gs.inp.in_use = True                           # as while a step is in flight: no launch
    rehearse_launch(gs)
    torch.cuda.synchronize()
    assert int(gs._noop_buf) == 1 + launches
    gs.inp.in_use = False


def test_wide_buckets_replay_the_eager_bits_for_every_width(cfg, ckpt, kernels):
    """5-16 requests replay a wide bucket's graph (6, 8, 12, 16), padded with copies of the first request and drafted
    at n_out = B: for every width, the eager batch's bits and each request's one-request answer, bit for bit."""
    from dspark_ray.rank.graphs import GraphSet
    d = make_drafter(cfg, "tp1", ckpt=ckpt, device="cuda", kernels=kernels)
    gs = GraphSet(d, n_slots=16)
    gs.capture()
    assert gs.wide_buckets == (6, 8, 12, 16)
    print(f"\n{gs.n_graphs} graphs captured in {gs.capture_seconds:.2f} s, {gs.graph_bytes / 2**20:.1f} MiB")
    rows = [1 + (7 * r) % 23 for r in range(16)]
    eager = _slots(d, cfg, rows, 41)
    for r, n in enumerate(rows):
        gs.run(placed([(gs.slots[r], 0, workload.make_taps(cfg, n, torch.Generator().manual_seed(41 + r)))]), [], [], 1,
               False)
    seeds = [int(x) for x in torch.randint(0, cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(2))]
    alone = {m: [gs.run([], [gs.slots[r]], [seeds[r]], cfg.block_size, m) for r in range(16)] for m in (False, True)}
    for width in range(5, 17):
        for n_out, margins in ((cfg.block_size, True), (2, False), (1, True)):
            got = gs.run([], gs.slots[:width], seeds[:width], n_out, margins)
            want = d.draft(eager[:width], seeds[:width], n_out, margins)
            for k in ("drafts", "confidences", "confident_len") + (("margins",) if margins else ()):
                assert torch.equal(getattr(got, k), getattr(want, k).cpu()), (width, n_out, margins, k)
            for r in range(width):
                a = alone[margins][r]
                assert torch.equal(got.drafts[r], a.drafts[0, :n_out]), (width, n_out, margins, r)
                assert torch.equal(got.confidences[r], a.confidences[0, :n_out]), (width, n_out, margins, r)


def test_programmatic_dependent_launch_keeps_the_bits(cfg, ckpt, kernels):
    """Inside `ops.graph_launches()` the fast path's kernels launch with programmatic dependent launch on Hopper
    and later: a graph captured there replays the bits of one captured outside it, and of the eager step."""
    import contextlib

    from dspark_ray.kernels import fused_ops
    from dspark_ray.model import ops
    d = make_drafter(cfg, "tp1", ckpt=ckpt, device="cuda", kernels=kernels)
    states = _slots(d, cfg, [6, 11, 3], 21)
    static = _inputs(d, states, [7, 9, 4000])
    want = d.draft(states, [7, 9, 4000], 5, True, debug=True)
    outs = {}
    for scoped in (False, True):
        launches = ops.graph_launches if scoped else contextlib.nullcontext
        with ops.using(d.kernels), launches(), torch.inference_mode():      # the graph set captures so
            outs[scoped] = fused_ops.launch_opts(torch.empty(1, device="cuda"))["PDL"]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                d.forward(*static, 5, True, True)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = d.forward(*static, 5, True, True)
            for _ in range(3):
                g.replay()
            torch.cuda.synchronize()
        for k in ("drafts", "confidences", "confident_len", "margins", "logits", "normed"):
            assert torch.equal(getattr(out, k), getattr(want, k)), (scoped, k)
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert outs[False] is False
    assert outs[True] is (kernels.mode == "fast" and hopper and settings.current().pdl), outs
    if hopper:
        assert fused_ops.pdl_capable() or not settings.current().pdl, "this Triton cannot launch with PDL"
    from dspark_ray.kernels.gemm import describe
    assert describe(d.kernels).endswith("pdl=graphs" if outs[True] else "pdl=off"), describe(d.kernels)


def test_host_copy_kernel_moves_every_byte():
    """`kernels/host_copy.copy_bytes`, the graph set's upload and download: pinned host <-> device, sizes that are
    not a multiple of anything, one or two segments, eager and replayed from a graph (under PDL), byte for byte;
    bytes past a segment's end are left alone."""
    from dspark_ray.kernels.fused_ops import pdl_launches
    from dspark_ray.kernels.host_copy import copy_bytes
    g = torch.Generator().manual_seed(3)
    sizes = (1, 4095, 4096, 4097, 70001)
    host = [torch.randint(0, 256, (n + 64,), generator=g, dtype=torch.uint8).pin_memory() for n in sizes]
    dev = [torch.zeros(n + 64, dtype=torch.uint8, device="cuda") for n in sizes]
    back = [torch.zeros(n + 64, dtype=torch.uint8).pin_memory() for n in sizes]
    for h, d_, n in zip(host, dev, sizes):
        copy_bytes(d_, (d_.data_ptr(), h.data_ptr(), n))
    torch.cuda.synchronize()
    for h, d_, n in zip(host, dev, sizes):
        assert torch.equal(d_[:n].cpu(), h[:n]) and not d_[n:].any(), n
    for i in range(0, len(sizes) - 1, 2):       # two segments of different sizes in one launch
        copy_bytes(dev[0], (back[i].data_ptr(), dev[i].data_ptr(), sizes[i]),
                   (back[i + 1].data_ptr(), dev[i + 1].data_ptr(), sizes[i + 1]))
    torch.cuda.synchronize()
    for i in range(len(sizes) - 1):
        assert torch.equal(back[i][:sizes[i]], host[i][:sizes[i]]) and not back[i][sizes[i]:].any(), sizes[i]
    # captured with programmatic dependent launch, behind a kernel that writes what it copies
    src = torch.zeros(5000, dtype=torch.uint8, device="cuda")
    out = torch.zeros(5000, dtype=torch.uint8).pin_memory()
    with pdl_launches():                        # (the fast path's `ops.graph_launches`)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            src.add_(1)
            copy_bytes(src, (out.data_ptr(), src.data_ptr(), 4999))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            src.add_(1)
            copy_bytes(src, (out.data_ptr(), src.data_ptr(), 4999))
    for k in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert (out[:4999] == 2 + k).all() and out[4999] == 0, k
