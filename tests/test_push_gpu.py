"""The push collectives on real GPUs (marker `gpu`; skipped cleanly without CUDA / CuPy).

Every claim runs in two modes, `single` (both ranks in one process on one card, a thread and a stream each) and
`pair` (two processes, one card each, CUDA IPC; needs two GPUs), and for both all-reduce variants (`flag`, the
default, and `lamport`). The scenarios live in
dspark_ray/testing/push_selftest.py and run in spawned processes, so this process never touches CUDA and the poisoning
scenario, which runs last in each mode, cannot affect anything else.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.gpu

_CUDA = torch.cuda.is_available()
_CUPY = importlib.util.find_spec("cupy") is not None
if not (_CUDA and _CUPY):
    pytest.skip(f"push GPU tests need CUDA and CuPy (cuda={_CUDA}, cupy={_CUPY})", allow_module_level=True)


@pytest.fixture(scope="module", params=["single-flag", "pair-flag", "single-lamport", "pair-lamport"])
def harness(request):
    from dspark_ray.testing.push_selftest import Harness
    mode, variant = request.param.split("-")
    if mode == "pair" and torch.cuda.device_count() < 2:
        pytest.skip("pair mode needs two GPUs")
    h = Harness(mode, variant)
    print(f"\n[{request.param}] {h.describe}")
    yield h
    h.close()


def _run(h, name):
    out = h.run(name)
    print(f"[{h.mode}-{h.allreduce}] {name}: {out}")
    return out


def test_push_equals_the_plain_copy_oracle_bit_for_bit(harness):
    _run(harness, "exact")


def test_delayed_streams_still_give_exact_results(harness):
    _run(harness, "delayed")


def test_graph_of_20_collectives_replayed_many_times_equals_the_oracle(harness):
    _run(harness, "graph")


def test_lamport_allreduce_and_flagged_exchange_variants_are_exact(harness):
    _run(harness, "variants")


def test_strict_acks_make_a_peer_refusal_visible_in_the_same_round(harness):
    _run(harness, "strict")


def test_timeout_sets_bit_1_on_the_waiter_and_bit_2_on_the_peer_and_fails_closed(harness):
    _run(harness, "timeout")


def test_a_peer_flag_that_is_never_raised_gives_a_timeout_not_a_hang(harness):
    _run(harness, "flag_never_raised")


def test_cancel_from_an_independent_stream_unblocks_a_parked_collective(harness):
    _run(harness, "cancel")


def test_near_exhaustion_epoch_fails_closed_with_bit_16_and_no_peer_access(harness):
    _run(harness, "exhaustion")


def test_an_invalid_received_id_fails_closed_on_both_ranks(harness):
    _run(harness, "bad_id")


def test_a_poisoned_pair_refuses_launches_replays_and_reset(harness):
    # poisons the harness process: keep this test last in the file
    _run(harness, "poison")
