"""Placing workers on a Ray cluster. A worker is one pair (or one card at tp 1): a STRICT_PACK placement group (one
bundle per card plus one for the front-end, so a worker never spans nodes), the FrontEnd actor in the last bundle,
the ranks in the others, and its own STEP endpoint. `deploy_workers` places N of them side by side (`dspark-ray
serve --pairs N`); a client spreads its slots over them (pool.DrafterPool)."""
from __future__ import annotations

import logging
import re
import time
from dataclasses import asdict

from ..settings import current as settings
from ..spec import SAFE_ENV, PairSpec

log = logging.getLogger("dspark_ray.placement")

NAMESPACE = "dspark"


class _SafeHere(logging.Filter):
    """Drops Ray's warning that a restartable detached actor in a placement group cannot be restarted once its
    group is removed. A worker's front-end is such an actor (Ray restarts it after a crash), and only `teardown`
    removes its group, to end it: the case the warning is about is the one we want (docs/operations.md)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Scheduling a restartable detached actor with a placement group")


_SAFE_HERE = _SafeHere()


def bundles(tp: int, gpu: bool) -> tuple[list[dict], dict, dict]:
    """(bundles, rank actor resources, front-end resources). On a CPU-only host the ranks take fractional CPU
    bundles (a quarter each) so two pairs place on a 2-core machine (each rank runs one torch thread)."""
    if gpu:
        return [{"GPU": 1, "CPU": 1}] * tp + [{"CPU": 1}], {"num_gpus": 1, "num_cpus": 1}, {"num_cpus": 1}
    return [{"CPU": 0.25}] * tp + [{"CPU": 0.25}], {"num_cpus": 0.25}, {"num_cpus": 0.25}


def worker_names(name: str, n: int) -> list[str]:
    """One worker keeps the deployment's name; several are NAME.0 .. NAME.(n-1)."""
    return [name] if n == 1 else [f"{name}.{i}" for i in range(n)]


def deploy(spec: PairSpec, *, host: str = "127.0.0.1", port: int = 0, name: str = "dspark", detach: bool = False,
           restart_threshold: int = 3, on_progress=None, timeout_s: float = 600.0):
    """Place and start one pair; returns (front-end actor handle, endpoint "host:port")."""
    ((fe, endpoint),) = deploy_workers(spec, 1, host=host, port=port, name=name, detach=detach,
                                       restart_threshold=restart_threshold, on_progress=on_progress,
                                       timeout_s=timeout_s)
    return fe, endpoint


def deploy_workers(spec: PairSpec, n: int, *, host: str = "127.0.0.1", port: int = 0, name: str = "dspark",
                   detach: bool = False, restart_threshold: int = 3, on_progress=None,
                   timeout_s: float = 600.0) -> list[tuple[object, str]]:
    """Place and start `n` workers of `spec` side by side (named by `worker_names`; `port` 0: free ports, else
    port, port + 1, ...); returns [(front-end handle, endpoint "host:port")]. They load at the same time;
    `on_progress` gets every rank's (tensors loaded, total) together. All or nothing: if one does not start, every
    worker placed here is torn down and the error raised."""
    import ray
    names = worker_names(name, n)
    placed = []
    try:
        for i, wname in enumerate(names):
            placed.append(_place(spec, wname, host, port + i if port else 0, detach, restart_threshold))
        starts = [fe.start.remote() for fe in placed]
        t0 = time.monotonic()
        while True:
            done, _ = ray.wait(starts, num_returns=len(starts), timeout=0.25)
            if on_progress:
                try:
                    on_progress([p for fe in placed for p in ray.get(fe.progress.remote(), timeout=1)])
                except Exception:
                    pass
            if len(done) == len(starts):
                break
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"{', '.join(names)} did not start within {timeout_s} s")
        endpoints = ray.get(starts)
    except BaseException:
        for wname in names:
            teardown(wname)
        raise
    here = ray.util.get_node_ip_address()
    for wname, fe, ep in zip(names, placed, endpoints):
        log.info("worker %s serving on %s", wname, ep)
        if ep.split(":")[0] not in ("127.0.0.1", "localhost"):
            continue
        node = ray.get(fe.node.remote(), timeout=30)
        if node != here:
            log.warning("worker %s runs on node %s but serves on %s: only clients on that node reach it "
                        "(serve with --host 0.0.0.0 to name each node's address)", wname, node, ep)
    return list(zip(placed, endpoints))


def _place(spec: PairSpec, name: str, host: str, port: int, detach: bool, restart_threshold: int):
    """One worker's placement group and front-end actor (not started yet)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from .frontend import frontend_actor_class
    gpu = spec.device.startswith("cuda")
    bl, rank_res, fe_res = bundles(spec.tp, gpu)
    pg = placement_group(bl, strategy="STRICT_PACK", name=f"{name}-pg", lifetime="detached" if detach else None)
    done, _ = ray.wait([pg.ready()], timeout=60)
    if not done:
        ray.util.remove_placement_group(pg)
        raise RuntimeError(f"placement group {bl} of {name} did not place within 60 s: the cluster has "
                           f"{ray.available_resources()}")
    FrontEnd = frontend_actor_class()
    if port == 0:
        port = _free_port(host)     # a concrete port, so a front-end restarted by Ray serves the same endpoint
    opts = dict(fe_res, name=f"{name}-frontend", namespace=NAMESPACE, max_restarts=3,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=spec.tp),
                runtime_env={"env_vars": {**SAFE_ENV, **settings().as_env(), "OMP_NUM_THREADS": "1",
                                          "PYTHONUNBUFFERED": "1"}})
    if detach:
        opts["lifetime"] = "detached"
        logging.getLogger("ray.actor").addFilter(_SAFE_HERE)       # (idempotent)
    return FrontEnd.options(**opts).remote(asdict(spec), host, port, name, pg, list(range(spec.tp)), rank_res,
                                           restart_threshold)


def _free_port(host: str) -> int:
    import socket
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def find(name: str = "dspark"):
    import ray
    return ray.get_actor(f"{name}-frontend", namespace=NAMESPACE)


def _worker_pattern(name: str) -> re.Pattern:
    return re.compile(rf"{re.escape(name)}(\.\d+)?")


def find_workers(name: str = "dspark") -> list[tuple[str, object]]:
    """[(worker name, front-end handle)] of the deployment `name` whose front-ends are alive: the worker of that
    name, or NAME.0, NAME.1, ..."""
    import ray
    pat = _worker_pattern(name)
    found = [a["name"][:-len("-frontend")] for a in ray.util.list_named_actors(all_namespaces=True)
             if a.get("namespace") == NAMESPACE and a["name"].endswith("-frontend")
             and pat.fullmatch(a["name"][:-len("-frontend")])]
    found.sort(key=lambda w: (len(w), w))
    return [(w, find(w)) for w in found]


def teardown(name: str = "dspark") -> list[str]:
    """Remove the worker `name`, or every worker of the deployment `name` (NAME.0, NAME.1, ...): the front-ends
    (which stop their ranks) and the placement groups, also those of workers whose front-end is dead already.
    Returns what it removed (front-ends and placement groups, by name): empty when nothing was deployed."""
    import ray
    from ray.util import placement_group_table
    from ray.util.placement_group import get_placement_group
    removed = []
    for w, fe in find_workers(name):
        try:
            ray.get(fe.shutdown.remote(), timeout=30)
        except Exception as e:          # dead or hung: killing it below is all that is left
            log.warning("worker %s did not shut down cleanly (%s); killing it", w, e)
        ray.kill(fe)
        removed.append(f"{w}-frontend")
    pat = _worker_pattern(name)
    for pg in placement_group_table().values():
        pg_name = pg.get("name") or ""
        if pg.get("state") != "REMOVED" and pg_name.endswith("-pg") and pat.fullmatch(pg_name[:-len("-pg")]):
            try:
                ray.util.remove_placement_group(get_placement_group(pg_name))
                removed.append(pg_name)
            except Exception:
                pass
    return removed
