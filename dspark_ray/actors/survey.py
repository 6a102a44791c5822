"""What every worker of a deployment is doing (`dspark-ray status`), within `timeout_s` whatever its node's state:
a worker that does not answer is described from the endpoint table, Ray's node table and its placement group.
"""
from __future__ import annotations

import logging

from ..client.endpoints import Directory
from .placement import find_workers

log = logging.getLogger("dspark_ray.survey")

SERVING = "serving"


def survey(name: str, timeout_s: float = 2.0) -> list[dict] | None:
    """One row per worker of `name` (None: no such deployment), with its front-end's `status` where it answered."""
    import ray
    from ray.util import placement_group_table
    directory = Directory(ray.get_runtime_context().gcs_address, timeout_s=timeout_s)
    handles = dict(find_workers(name))
    try:
        records = directory.workers(name)
    except LookupError:
        records = dict.fromkeys(handles)
    if not records:
        return None
    nodes = directory.nodes()
    groups = {g.get("name"): g.get("state") for g in placement_group_table().values()
              if g.get("state") != "REMOVED"}
    asked = {w: handles[w].status.remote() for w in records if w in handles}
    done, late = ray.wait(list(asked.values()), num_returns=len(asked), timeout=timeout_s) if asked else ([], [])
    for ref in late:             # else a front-end that comes back runs them all
        try:
            ray.cancel(ref)
        except Exception:
            pass
    done = set(done)
    return [_row(w, rec, asked.get(w), asked.get(w) in done, w in handles, nodes, groups.get(f"{w}-pg"), timeout_s)
            for w, rec in records.items()]


def _row(worker: str, rec: dict | None, ref, answered: bool, has_frontend: bool, nodes: dict, group: str | None,
         timeout_s: float) -> dict:
    import ray
    rec = rec or {}
    row = {"worker": worker, "state": None, "why": None, "node_id": rec.get("node_id"), "node_ip": rec.get("node_ip"),
           "node_alive": None, "cards": rec.get("cards"), "endpoint": rec.get("endpoint"), "placement_group": group}
    status = None
    if answered:
        try:
            status = ray.get(ref, timeout=0)
        except Exception as e:
            row["why"] = f"its front-end failed to answer: {type(e).__name__}: {e}"
    if status is not None:
        row.update(node_id=status.get("node_id"), node_ip=status.get("node_ip"), cards=status.get("cards"),
                   endpoint=status.get("endpoint"), status=status)
    node = nodes.get(row["node_id"] or "")
    row["node_alive"] = None if node is None else node["alive"]
    if status is not None:
        row["state"] = "unavailable" if status.get("unavailable") else SERVING
        row["why"] = status.get("unavailable")
    elif not has_frontend:
        row["state"] = "gone"
        row["why"] = rec.get("why") or "no front-end: it gave up after its own restarts, or was killed"
    elif group == "PENDING" and not rec:
        row["state"], row["why"] = "waiting for room", "no node has room for its placement group yet"
    elif node is not None and not node["alive"]:
        row["state"] = "node dead"
        row["why"] = (f"its node {row['node_id'][:8]} ({row['node_ip']}) is dead"
                      + ("; Ray is placing it again" if group == "RESCHEDULING" else ""))
    elif rec.get("state") == "starting":
        row["state"], row["why"] = "starting", "its front-end is bringing its pair up"
    else:
        row["state"] = "unreachable"
        row["why"] = row["why"] or f"its front-end did not answer within {timeout_s:g} s"
    return row
