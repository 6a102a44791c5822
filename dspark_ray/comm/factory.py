"""A rank's collectives, chosen once at start-up against what this process can run, and logged. A pair always
forms a gloo group first: the CPU pair's data path and the push backend's start-up channel (never per-step data).
"""
from __future__ import annotations

import logging

from ..model.collectives import CollectiveError, Collectives

log = logging.getLogger("dspark_ray.comm")

BACKENDS = {
    "gloo": "two processes over torch.distributed gloo (CPU)",
    "push": "NVLink push kernels on CUDA IPC peer memory (two cards)",
}


def check_backend(backend: str, tp: int, device: str) -> None:
    """Raise ValueError where `backend` cannot drive a tp-`tp` deployment on `device` (before any actor starts)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if tp == 2 and backend == "push" and not device.startswith("cuda"):
        raise ValueError(f"backend push runs on CUDA devices, not {device!r} (gloo is the CPU pair)")


def missing_capability(backend: str) -> str | None:
    """What this process lacks to run `backend`, or None. Peer access itself is proven by the push handshake."""
    if backend == "push":
        from .push import push_unavailable_reason
        return push_unavailable_reason()
    return None


def connect(backend: str, rank: int, tp: int, *, init_method: str | None, peer_ids: tuple[int, int],
            timeout_s: float) -> Collectives:
    """Rank `rank`'s collectives; both ranks call it at once (tp 1: the local backend). `peer_ids`: the peer's
    vocabulary range."""
    from ..model.collectives import LocalCollectives
    if tp == 1:
        coll: Collectives = LocalCollectives(1)
    else:
        why = missing_capability(backend)
        if why is not None:
            raise CollectiveError(f"rank {rank}: backend {backend} cannot run here: {why}")
        from .gloo import GlooCollectives
        gloo = GlooCollectives(rank, 2, init_method=init_method, timeout_s=timeout_s)
        if backend == "gloo":
            coll = gloo
        else:
            from .push import connect_over
            coll = connect_over(gloo.group, rank, peer_ids, timeout_s)
    log.info("rank %d: collectives %s (%s)", rank, coll.describe(), BACKENDS.get(backend, "one rank") if tp == 2
             else "one rank, no peer")
    return coll
