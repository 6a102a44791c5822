"""Placing one pair on a Ray cluster: a STRICT_PACK placement group (one bundle per card plus one for the
front-end, so a pair never spans nodes), the FrontEnd actor in the last bundle, the ranks in the others."""
from __future__ import annotations

import logging
import time
from dataclasses import asdict

from .rank import SAFE_ENV, PairSpec

log = logging.getLogger("dspark_ray.placement")

NAMESPACE = "dspark"


def bundles(tp: int, gpu: bool) -> tuple[list[dict], dict, dict]:
    """(bundles, rank actor resources, front-end resources). On a CPU-only host the ranks take fractional CPU
    bundles so a pair places on a 2-core machine (each rank runs one torch thread)."""
    if gpu:
        return [{"GPU": 1, "CPU": 1}] * tp + [{"CPU": 1}], {"num_gpus": 1, "num_cpus": 1}, {"num_cpus": 1}
    return [{"CPU": 0.5}] * tp + [{"CPU": 0.5}], {"num_cpus": 0.5}, {"num_cpus": 0.5}


def deploy(spec: PairSpec, *, host: str = "127.0.0.1", port: int = 0, name: str = "dspark", detach: bool = False,
           restart_threshold: int = 3, on_progress=None, timeout_s: float = 600.0):
    """Place and start one pair; returns (front-end actor handle, endpoint "host:port")."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from .frontend import frontend_actor_class
    gpu = spec.device.startswith("cuda")
    bl, rank_res, fe_res = bundles(spec.tp, gpu)
    pg = placement_group(bl, strategy="STRICT_PACK", name=f"{name}-pg", lifetime="detached" if detach else None)
    ready = pg.ready()
    done, _ = ray.wait([ready], timeout=60)
    if not done:
        ray.util.remove_placement_group(pg)
        raise RuntimeError(f"placement group {bl} did not place within 60 s: the cluster has "
                           f"{ray.available_resources()}")
    FrontEnd = frontend_actor_class()
    if port == 0:
        port = _free_port(host)     # a concrete port, so a front-end restarted by Ray serves the same endpoint
    opts = dict(fe_res, name=f"{name}-frontend", namespace=NAMESPACE, max_restarts=3,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=spec.tp),
                runtime_env={"env_vars": {**SAFE_ENV, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}})
    if detach:
        opts["lifetime"] = "detached"
    fe = FrontEnd.options(**opts).remote(asdict(spec), host, port, name, pg, list(range(spec.tp)), rank_res,
                                         restart_threshold)
    start = fe.start.remote()
    t0 = time.monotonic()
    while True:
        done, _ = ray.wait([start], timeout=0.25)
        if on_progress:
            try:
                on_progress(ray.get(fe.progress.remote(), timeout=1))
            except Exception:
                pass
        if done:
            break
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"pair {name} did not start within {timeout_s} s")
    return fe, ray.get(start)


def _free_port(host: str) -> int:
    import socket
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def find(name: str = "dspark"):
    import ray
    return ray.get_actor(f"{name}-frontend", namespace=NAMESPACE)


def teardown(name: str = "dspark") -> None:
    import ray
    from ray.util.placement_group import get_placement_group
    try:
        fe = find(name)
        ray.get(fe.shutdown.remote(), timeout=30)
        ray.kill(fe)
    except ValueError:
        pass
    try:
        ray.util.remove_placement_group(get_placement_group(f"{name}-pg"))
    except Exception:
        pass
