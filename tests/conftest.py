"""Shared fixtures: one tiny synthetic checkpoint per session, its full weights, and a CPU-friendly torch."""
from __future__ import annotations

import os

import pytest
import torch

# The model's results do not depend on the thread count (pinned reduction order), but its many small ops run
# several times slower with two threads fighting over this 2-core machine's cores.
torch.set_num_threads(1)
os.environ.setdefault("RAY_ACCEPT_CALLBACKS", "0")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    from dspark_ray.config import tiny
    from dspark_ray.weights.synth import synthesize
    out = tmp_path_factory.mktemp("tiny_ckpt")
    synthesize(tiny(), out, seed=0)
    return out


@pytest.fixture(scope="session")
def ckpt(tiny_ckpt):
    from dspark_ray.weights.loader import Checkpoint
    return Checkpoint(tiny_ckpt)


@pytest.fixture(scope="session")
def cfg(ckpt):
    return ckpt.config


@pytest.fixture(scope="session")
def full_weights(ckpt):
    """The whole model in compute form (read once; tests that plant ties copy what they change)."""
    return {n: ckpt.read(n) for n in ckpt.names()}
