"""The reference drafter on CUDA (marker gpu; run on the GPU machine).

The pinned reduction order (exact products, fixed pairwise tree) and fp64-evaluated transcendentals make the math
device-independent up to the final rounding of a few fp64 results, so the CUDA drafter is expected to give the
CPU drafter's bits; the test asserts exactly that, entry by entry, over the tiny workload.
"""
from __future__ import annotations

import pytest

from dspark_ray.testing import parity, workload
from dspark_ray.rank.modes import make_drafter, make_emulated, run_pair

pytestmark = pytest.mark.gpu


def test_cuda_drafter_equals_cpu_drafter_bit_for_bit(cfg, ckpt):
    rounds = workload.rounds(cfg, seed=7, n_requests=2, n_rounds=12, far_start=3000)
    cpu = parity.replay(make_drafter(cfg, "tp1", ckpt=ckpt), rounds)
    gpu = parity.replay(make_drafter(cfg, "tp1", ckpt=ckpt, device="cuda"), rounds)
    gpu = [[parity.EntryRecord(*(t.cpu() for t in (r.drafts, r.confidences, r.margins, r.logits, r.normed)))
            for r in batch] for batch in gpu]
    parity.assert_identical(cpu, gpu, "cpu vs cuda")


def test_emulated_pair_on_one_card_equals_split_reference(cfg, ckpt):
    rounds = workload.rounds(cfg, seed=8, n_requests=2, n_rounds=8)
    split = parity.replay(make_drafter(cfg, "split", ckpt=ckpt, device="cuda"), rounds)
    d0, d1 = make_emulated(cfg, ckpt=ckpt, device="cuda")
    r0, r1 = run_pair(lambda: parity.replay(d0, rounds), lambda: parity.replay(d1, rounds))
    parity.assert_identical(split, parity.join_ranks(r0, r1), "split vs emulated on cuda")
