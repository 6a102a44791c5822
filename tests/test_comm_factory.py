"""The collectives are chosen once, at start-up, by `comm.factory`: a spec names a backend this build has, and a
process that cannot run the backend it was given says why before it meets its peer."""
from __future__ import annotations

import pytest
import torch

from dspark_ray.comm import CollectiveError
from dspark_ray.comm.factory import BACKENDS, connect, missing_capability
from dspark_ray.spec import PairSpec


def test_a_spec_refuses_a_backend_it_cannot_run_before_any_actor_starts():
    assert set(BACKENDS) == {"gloo", "push"}
    with pytest.raises(ValueError, match="choose one of gloo, push"):
        PairSpec(checkpoint="x", backend="nccl")
    with pytest.raises(ValueError, match="push runs on CUDA devices"):
        PairSpec(checkpoint="x", tp=2, backend="push", device="cpu")
    PairSpec(checkpoint="x", tp=1, backend="push", device="cpu")       # one rank meets no peer


def test_one_rank_takes_the_local_collectives_whatever_the_backend():
    for backend in BACKENDS:
        coll = connect(backend, 0, 1, init_method=None, peer_ids=(0, 0), timeout_s=1.0)
        assert coll.name == "tp1" and coll.local_ranks == (0,) and coll.capturable


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only process")
def test_a_push_rank_without_a_card_fails_before_meeting_its_peer():
    assert missing_capability("gloo") is None
    assert "CUDA is not available" in missing_capability("push")
    with pytest.raises(CollectiveError, match="backend push cannot run here: CUDA is not available"):
        connect("push", 0, 2, init_method="tcp://127.0.0.1:1", peer_ids=(0, 1), timeout_s=1.0)
