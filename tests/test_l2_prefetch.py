"""The L2 read-ahead hint (`kernels/l2_prefetch.py`): which weights it reads ahead, that it runs on a card without
changing a byte, and that a draft step gives the same bits with it and without it."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from dspark_ray.kernels import l2_prefetch  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_fit_rule_and_cpu_noop(monkeypatch):
    monkeypatch.setattr(l2_prefetch, "_l2_bytes", {0: 60 << 20})
    w = torch.zeros(8, dtype=torch.float16)
    assert not l2_prefetch.fits(w)                    # a CPU tensor is never read ahead
    l2_prefetch.prefetch(w)                           # and the call is a no-op there


@pytest.mark.gpu
@gpu
def test_prefetch_runs_and_changes_nothing(monkeypatch):
    dev = torch.device("cuda")
    l2 = l2_prefetch.l2_bytes(dev)
    small = torch.randn(1000, 37, device=dev).half()           # odd size: the last sector is part-filled
    big = torch.empty(int(l2) // 2 + 4096, dtype=torch.float16, device=dev)
    assert l2_prefetch.fits(small) and not l2_prefetch.fits(big)
    before = small.clone()
    for stride in (32, 128):
        l2_prefetch.prefetch(small, stride=stride)
    torch.cuda.synchronize()
    assert torch.equal(small, before)


@pytest.mark.gpu
@gpu
def test_draft_bits_with_and_without_prefetch(monkeypatch, cfg, ckpt):
    """The fast path with every weight read ahead (eager, and in a PDL graph) gives the bits of the step without."""
    from dspark_ray.kernels.gemm import use_matmul
    from dspark_ray.model import ops
    from dspark_ray.modes import make_drafter
    from tests.test_gpu_graphs import _inputs, _slots
    saved = ops.current_matmul()
    use_matmul("fast")
    try:
        d = make_drafter(cfg, "tp1", ckpt=ckpt, device="cuda")
        states = _slots(d, cfg, [6, 11], 3)
        monkeypatch.setenv("DSPARK_L2_PREFETCH", "0")
        want = d.draft(states, [7, 9], 5, True, debug=True)
        monkeypatch.setenv("DSPARK_L2_PREFETCH", "1")
        monkeypatch.setattr(l2_prefetch, "FIT", 1e9)                # read ahead every weight, whatever its size
        got = d.draft(states, [7, 9], 5, True, debug=True)
        static = _inputs(d, states, [7, 9])
        with ops.graph_launches(), torch.inference_mode():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                d.forward(*static, 5, True, True)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = d.forward(*static, 5, True, True)
            g.replay()
            torch.cuda.synchronize()
        for k in ("drafts", "confidences", "confident_len", "margins", "logits", "normed"):
            assert torch.equal(getattr(got, k), getattr(want, k)), ("eager", k)
            assert torch.equal(getattr(out, k), getattr(want, k)), ("graph", k)
    finally:
        ops.set_matmul(*saved)
