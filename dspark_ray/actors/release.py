"""Ending a worker that gave up (frontend.py, OWN_RESTARTS): its front-end killed for good, then its placement group
removed, by a detached helper of its own. The front-end cannot do the second itself: an actor of a removed group is
killed as a failure, and Ray, restarting it into a group that is gone, holds it pending for ever; nor can it do
anything once killed.
"""
from __future__ import annotations

import logging
import threading
import time

from ..client.endpoints import Directory

log = logging.getLogger("dspark_ray.release")

DEAD_WAIT_S = 60.0        # a kill the GCS has not carried out within this is not waited for longer


def release_worker(name: str, pg) -> None:
    """Hand the worker `name` (its front-end and `pg`) to a helper that ends both; it outlives the caller."""
    import ray
    releaser_class().options(name=f"{name}-release", namespace="dspark", lifetime="detached").remote(
        name, pg, ray.get_runtime_context().gcs_address)


def releaser_class():
    import ray

    @ray.remote(num_cpus=0, max_restarts=0)
    class Releaser:
        # The work is the creation task's: its arguments are the GCS's to keep, whatever becomes of the caller.
        def __init__(self, name: str, pg, gcs: str):
            threading.Thread(target=_release, args=(name, pg, gcs), name="dspark-release", daemon=True).start()

    return Releaser


def _release(name: str, pg, gcs: str) -> None:
    import ray
    try:
        fe = ray.get_actor(f"{name}-frontend", namespace="dspark")
        actor_id = fe._actor_id.hex()
        ray.kill(fe, no_restart=True)
        _wait_dead(Directory(gcs), actor_id)
    except ValueError:          # gone already
        pass
    if pg is not None:
        ray.util.remove_placement_group(pg)
    log.warning("worker %s: its front-end ended and its placement group released", name)
    ray.kill(ray.get_actor(f"{name}-release", namespace="dspark"), no_restart=True)


def _wait_dead(directory: Directory, actor_id: str) -> None:
    deadline = time.monotonic() + DEAD_WAIT_S
    while time.monotonic() < deadline:
        try:
            if directory.actor_states([actor_id]).get(actor_id, "DEAD") == "DEAD":
                return
        except ConnectionError:
            pass
        time.sleep(0.2)
    log.warning("actor %s not dead within %g s: removing its placement group anyway", actor_id, DEAD_WAIT_S)
