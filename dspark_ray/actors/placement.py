"""Placing workers on a Ray cluster (docs/operations.md, "Scaling over card pairs"): each a STRICT_PACK placement
group, so it never spans nodes, the front-end's bundle last; where each serves goes into the endpoint table."""
from __future__ import annotations

import logging
import time
from dataclasses import asdict
from typing import TYPE_CHECKING

from ..client.endpoints import Directory, worker_names, worker_pattern
from ..settings import current as settings

if TYPE_CHECKING:
    from ..spec import PairSpec

log = logging.getLogger("dspark_ray.placement")

NAMESPACE = "dspark"


class _SafeHere(logging.Filter):
    """Drops Ray's warning about a restartable detached actor in a placement group: only `teardown` removes a
    front-end's group, to end it, so the case warned about is the one we want."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Scheduling a restartable detached actor with a placement group")


_SAFE_HERE = _SafeHere()


def bundles(tp: int, gpu: bool) -> tuple[list[dict], dict, dict]:
    """(bundles, rank resources, front-end resources); a quarter CPU each on a CPU host: two pairs fit 2 cores."""
    if gpu:
        return [{"GPU": 1, "CPU": 1}] * tp + [{"CPU": 1}], {"num_gpus": 1, "num_cpus": 1}, {"num_cpus": 1}
    return [{"CPU": 0.25}] * tp + [{"CPU": 0.25}], {"num_cpus": 0.25}, {"num_cpus": 0.25}


def deploy(spec: PairSpec, *, host: str = "127.0.0.1", port: int = 0, name: str = "dspark", detach: bool = False,
           restart_threshold: int = 3, on_progress=None, timeout_s: float = 600.0, token: str | None = None):
    """Place and start one pair; returns (front-end actor handle, endpoint "host:port")."""
    ((fe, endpoint),) = deploy_workers(spec, 1, host=host, port=port, name=name, detach=detach,
                                       restart_threshold=restart_threshold, on_progress=on_progress,
                                       timeout_s=timeout_s, token=token)
    return fe, endpoint


def deploy_workers(spec: PairSpec, n: int, *, host: str = "127.0.0.1", port: int = 0, name: str = "dspark",
                   detach: bool = False, restart_threshold: int = 3, on_progress=None, timeout_s: float = 600.0,
                   pending_ok: bool = False, place_timeout_s: float | None = None, token: str | None = None,
                   auth: dict | None = None) -> list[tuple[object, str | None]]:
    """Place and start `n` workers at once (`port` 0: a free one each); returns [(front-end, "host:port")]. All or
    nothing, except that with `pending_ok` a worker without room waits for a node to join (endpoint None).
    `token`: the one every HELLO must carry (None: none), kept in the cluster for `DrafterPool.from_deployment`;
    `auth`: where an operator finds it, for `status` (the deployment's record)."""
    import ray
    names = worker_names(name, n)
    if place_timeout_s is None:
        place_timeout_s = 10.0 if pending_ok else 60.0
    if find_workers(name):
        raise RuntimeError(f"a deployment named {name!r} runs on this cluster: `dspark-ray stop --name {name}` "
                           f"first, or serve under another --name")
    directory = _directory()
    directory.remove(name)          # left behind by a driver that died
    directory.publish_deployment(name, names, tp=spec.tp, device=spec.device, auth=auth or {"token": token is not None})
    if token is not None:
        directory.publish_token(name, token)
    try:
        pgs = [_placement_group(spec, w, detach) for w in names]
        placed = _wait_placed(pgs, place_timeout_s)
        if not all(placed) and not pending_ok:
            w, pg = next((w, pg) for w, pg, ok in zip(names, pgs, placed) if not ok)
            free = {k: v for k, v in ray.available_resources().items()
                    if "_group_" not in k and not k.startswith("node:")}
            raise RuntimeError(f"placement group {pg.bundle_specs} of {w} did not place within {place_timeout_s:g} s:"
                               f" the cluster has {free} free (serve --pending lets a worker wait for a node with "
                               f"room)")
        fes = [_frontend(spec, w, pg, host, port + i if port else 0, detach, restart_threshold, token)
               for i, (w, pg) in enumerate(zip(names, pgs))]
        starts = [fe.start.remote() for fe in fes]
        _wait_started([s for s, ok in zip(starts, placed) if ok], [fe for fe, ok in zip(fes, placed) if ok],
                      names, on_progress, timeout_s)
        endpoints = [ray.get(s) if ok else None for s, ok in zip(starts, placed)]
    except BaseException:
        teardown(name)
        raise
    here = ray.util.get_node_ip_address()
    for wname, fe, ep, pg in zip(names, fes, endpoints, pgs):
        if ep is None:
            log.warning("worker %s waits for room: no node has %s free; it starts when one joins", wname,
                        pg.bundle_specs)
            continue
        log.debug("worker %s serving on %s", wname, ep)      # `serve` prints the endpoints in its own line
        if ep.split(":")[0] not in ("127.0.0.1", "localhost"):
            continue
        node = ray.get(fe.node.remote(), timeout=30)
        if node != here:
            log.warning("worker %s runs on node %s but serves on %s: only clients on that node reach it "
                        "(serve with --host 0.0.0.0 to name each node's address)", wname, node, ep)
    return list(zip(fes, endpoints))


def _wait_placed(pgs: list, timeout_s: float) -> list[bool]:
    import ray
    refs = [pg.ready() for pg in pgs]
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    done = set(done)
    return [r in done for r in refs]


def _wait_started(starts: list, fes: list, names: list[str], on_progress, timeout_s: float) -> None:
    import ray
    t0 = time.monotonic()
    while starts:
        done, _ = ray.wait(starts, num_returns=len(starts), timeout=0.25)
        if on_progress:
            try:
                on_progress([p for fe in fes for p in ray.get(fe.progress.remote(), timeout=1)])
            except Exception:
                pass
        if len(done) == len(starts):
            return
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{', '.join(names)} did not start within {timeout_s} s")


def _placement_group(spec: PairSpec, name: str, detach: bool):
    from ray.util.placement_group import placement_group
    bl, _, _ = bundles(spec.tp, spec.device.startswith("cuda"))
    return placement_group(bl, strategy="STRICT_PACK", name=f"{name}-pg", lifetime="detached" if detach else None)


def _frontend(spec: PairSpec, name: str, pg, host: str, port: int, detach: bool, restart_threshold: int,
              token: str | None):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from ..spec import SAFE_ENV
    from .frontend import frontend_actor_class
    _, rank_res, fe_res = bundles(spec.tp, spec.device.startswith("cuda"))
    # Ray restarts it however often its node is lost; its own deaths have a budget of their own (frontend.py).
    opts = dict(fe_res, name=f"{name}-frontend", namespace=NAMESPACE, max_restarts=-1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=spec.tp),
                runtime_env={"env_vars": {**SAFE_ENV, **settings().as_env(), "OMP_NUM_THREADS": "1",
                                          "PYTHONUNBUFFERED": "1"}})
    if detach:
        opts["lifetime"] = "detached"
        logging.getLogger("ray.actor").addFilter(_SAFE_HERE)
    return frontend_actor_class().options(**opts).remote(asdict(spec), host, port, name, pg, list(range(spec.tp)),
                                                         rank_res, restart_threshold, token)


def _directory():
    import ray
    return Directory(ray.get_runtime_context().gcs_address)


def find(name: str = "dspark"):
    import ray
    return ray.get_actor(f"{name}-frontend", namespace=NAMESPACE)


def find_workers(name: str = "dspark") -> list[tuple[str, object]]:
    """[(worker name, front-end handle)] of the deployment's live front-ends."""
    import ray
    pat = worker_pattern(name)
    found = [a["name"][:-len("-frontend")] for a in ray.util.list_named_actors(all_namespaces=True)
             if a.get("namespace") == NAMESPACE and a["name"].endswith("-frontend")
             and pat.fullmatch(a["name"][:-len("-frontend")])]
    found.sort(key=lambda w: (len(w), w))
    return [(w, find(w)) for w in found]


def teardown(name: str = "dspark", timeout_s: float = 30.0) -> dict[str, list[str]]:
    """Remove every worker of `name`, placed or not: front-ends (running ones shut down within `timeout_s`, the
    rest killed), placement groups, endpoint entries. Returns, per worker, what of it was removed ("front-end",
    "placement group", "endpoint entry"), the deployment's own entry under its name where no worker had one."""
    import ray
    from ray.util import placement_group_table
    from ray.util.placement_group import get_placement_group
    directory = _directory()
    try:
        records = directory.workers(name)
        alive = {n for n, info in directory.nodes().items() if info["alive"]}
    except (LookupError, ConnectionError):
        records, alive = {}, None
    handles = find_workers(name)
    running = [(w, fe) for w, fe in handles if w not in records
               or (records[w] is not None and (alive is None or records[w].get("node_id") in alive))]
    shutdowns = {fe.shutdown.remote(): w for w, fe in running}
    done, late = ray.wait(list(shutdowns), num_returns=len(shutdowns), timeout=timeout_s) if shutdowns else ([], [])
    for ref in late + [r for r in done if _failed(r)]:      # killed below
        log.warning("worker %s did not shut down cleanly; killing it", shutdowns[ref])
    removed: dict[str, list[str]] = {}
    for w, fe in handles:
        ray.kill(fe)
        removed.setdefault(w, []).append("front-end")
    pat = worker_pattern(name)
    for pg in placement_group_table().values():
        pg_name = pg.get("name") or ""
        if pg.get("state") != "REMOVED" and pg_name.endswith("-pg") and pat.fullmatch(pg_name[:-len("-pg")]):
            try:
                ray.util.remove_placement_group(get_placement_group(pg_name))
                removed.setdefault(pg_name[:-len("-pg")], []).append("placement group")
            except Exception:
                pass
    try:
        keys = directory.remove(name)
    except ConnectionError as e:
        log.warning("deployment %s: its endpoint table entries stay: %s", name, e)
        keys = []
    entries = [k[len("worker/"):] for k in keys if k.startswith("worker/")]
    if not entries and f"deployment/{name}" in keys:
        entries = [name]
    for w in entries:
        removed.setdefault(w, []).append("endpoint entry")
    return dict(sorted(removed.items(), key=lambda kv: (len(kv[0]), kv[0])))


def _failed(ref) -> bool:
    import ray
    try:
        ray.get(ref, timeout=0)
        return False
    except Exception:
        return True
