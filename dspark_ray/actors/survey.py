"""What every worker of a deployment is doing (`dspark-ray status`), within `timeout_s` whatever its node's state:
a worker that does not answer is described from the endpoint table, Ray's node table and its placement group.
"""
from __future__ import annotations

import logging
import time

from ..client.endpoints import Directory
from .placement import find_workers

log = logging.getLogger("dspark_ray.survey")

SERVING = "serving"
NODE_DEAD = "node dead"


def survey(name: str, timeout_s: float = 2.0) -> list[dict] | None:
    """One row per worker of `name` (None: no such deployment), with its front-end's `status` where it answered
    within `timeout_s` of the survey's start."""
    import ray
    from ray.util import placement_group_table
    deadline = time.monotonic() + timeout_s
    handles = dict(find_workers(name))
    asked = {w: fe.status.remote() for w, fe in handles.items()}
    # The tables are read while the front-ends answer, within the same bound.
    directory = Directory(ray.get_runtime_context().gcs_address, timeout_s=timeout_s)
    try:
        records = directory.workers(name)
    except LookupError:
        records = dict.fromkeys(handles)
    if not records:
        _cancel(asked.values())
        return None
    nodes = directory.nodes()
    groups = {g.get("name"): g.get("state") for g in placement_group_table().values()
              if g.get("state") != "REMOVED"}
    refs = list(asked.values())
    done, late = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic())) \
        if refs else ([], [])
    _cancel(late)
    done = set(done)
    return [_row(w, rec, *_answer(asked.get(w), asked.get(w) in done), w in handles, nodes,
                 groups.get(f"{w}-pg"), timeout_s) for w, rec in records.items()]


def _cancel(refs) -> None:
    import ray
    for ref in refs:            # else a front-end that comes back runs them all
        try:
            ray.cancel(ref)
        except Exception:
            pass


def _answer(ref, answered: bool) -> tuple[dict | None, str | None]:
    """(the front-end's status, None), or (None, how it failed to answer), or (None, None) where it did not answer."""
    if not answered:
        return None, None
    import ray
    try:
        return ray.get(ref, timeout=0), None
    except Exception as e:
        return None, f"its front-end failed to answer: {type(e).__name__}: {e}"


def _row(worker: str, rec: dict | None, status: dict | None, why: str | None, has_frontend: bool, nodes: dict,
         group: str | None, timeout_s: float) -> dict:
    """A worker's row from what is known of it: its endpoint record, its front-end's `status` (None: no answer;
    `why` then says how it failed, if it did), Ray's node table and its placement group's state."""
    rec = rec or {}
    row = {"worker": worker, "state": None, "why": why, "node_id": rec.get("node_id"), "node_ip": rec.get("node_ip"),
           "node_alive": None, "cards": rec.get("cards"), "endpoint": rec.get("endpoint"), "placement_group": group,
           "lost_node": None}
    if status is not None:
        row.update(node_id=status.get("node_id"), node_ip=status.get("node_ip"), cards=status.get("cards"),
                   endpoint=status.get("endpoint"), status=status)
    node = nodes.get(row["node_id"] or "")
    row["node_alive"] = None if node is None else node["alive"]
    row["lost_node"] = lost = _lost_node(rec, nodes)
    if status is not None and not status.get("unavailable"):
        row["state"], row["why"] = SERVING, None
    elif not has_frontend:
        row["state"] = "gone"
        row["why"] = rec.get("why") or "no front-end: it gave up after its own restarts, or was killed"
    elif lost is not None:
        row["state"] = NODE_DEAD
        row["why"] = _node_dead_why(lost, row, group, status)
    elif status is not None:
        row["state"], row["why"] = "unavailable", status.get("unavailable")
    elif group == "PENDING" and not rec:
        row["state"], row["why"] = "waiting for room", "no node has room for its placement group yet"
    elif rec.get("state") == "starting":
        row["state"], row["why"] = "starting", "its front-end is bringing its pair up"
    else:
        row["state"] = "unreachable"
        row["why"] = row["why"] or f"its front-end did not answer within {timeout_s:g} s"
    return row


def _lost_node(rec: dict, nodes: dict) -> dict | None:
    """The node the worker served on, where Ray's node table has it dead: the one its record names, or the one its
    front-end, placed again on another node, says it moved from (a placement group moves only when its node dies)."""
    for where in (rec, rec.get("moved_from") or {}):
        node = nodes.get(where.get("node_id") or "")
        if node is not None and not node["alive"]:
            return {"node_id": where["node_id"], "node_ip": where.get("node_ip") or node.get("ip")}
    return None


def _node_dead_why(lost: dict, row: dict, group: str | None, status: dict | None) -> str:
    dead = f"its node {lost['node_id'][:8]} ({lost['node_ip']})"
    if row["node_id"] == lost["node_id"]:       # its front-end has not started anywhere else yet
        # A placement group that outlives its node is placed again by Ray (RESCHEDULING, then CREATED elsewhere).
        return f"{dead} is dead" + ("; Ray is placing it again" if group is not None else "")
    doing = f": {status['unavailable']}" if status is not None else ""
    return f"{dead} died; starting elsewhere, on node {(row['node_id'] or '?')[:8]} ({row['node_ip']}){doing}"
