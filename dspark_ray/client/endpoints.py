"""A deployment's endpoint table in the Ray cluster's key-value store (the GCS, namespace "dspark"; keys, records and
what a stale endpoint is: docs/contract.md, section 11), and its token for the clients that can read the store. Read
through a `GcsClient`, not a Ray driver, each call bounded, so nothing clashes with an engine's own Ray; with Ray's
token where the process holds one (cluster_join.py).
"""
from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

from .cluster_join import cluster_address, refusal, refused_by_ray, use_ray_token

KV_NAMESPACE = b"dspark"


def worker_names(name: str, n: int) -> list[str]:
    """One worker keeps the deployment's name; several are NAME.0 .. NAME.(n-1)."""
    return [name] if n == 1 else [f"{name}.{i}" for i in range(n)]


def worker_pattern(name: str) -> re.Pattern:
    return re.compile(rf"{re.escape(name)}(\.\d+)?")


def gcs_address(address: str | None) -> str:
    """The GCS "host:port" of `address` ("HEAD:6379"; None: RAY_ADDRESS, else the one cluster on this host)."""
    found = cluster_address(address)
    if found is None:
        raise ConnectionError("no Ray cluster runs on this host: name one with --address (or RAY_ADDRESS)")
    return found


class Directory:
    """A cluster's endpoint table, through its GCS; a call not answered within `timeout_s` is a ConnectionError."""

    def __init__(self, address: str | None = None, timeout_s: float = 2.0):
        self.address = gcs_address(address)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._gcs = None

    def _client(self):
        with self._lock:
            if self._gcs is None:
                # A GcsClient waits ~12 s for a missing GCS whatever its timeout: a plain connect first.
                host, port = self.address.rsplit(":", 1)
                try:
                    socket.create_connection((host, int(port)), timeout=self.timeout_s).close()
                except OSError as e:
                    raise ConnectionError(f"the Ray cluster's GCS at {self.address} does not answer: {e}") from None
                use_ray_token()
                from ray._raylet import GcsClient
                try:
                    self._gcs = GcsClient(address=self.address)
                except Exception as e:
                    if refused_by_ray(e):
                        raise ConnectionError(refusal(self.address)) from None
                    raise ConnectionError(f"the Ray cluster's GCS at {self.address}: {type(e).__name__}: {e}") \
                        from None
            return self._gcs

    def check(self) -> None:
        """ConnectionError unless the GCS answers and takes this process's Ray credentials."""
        self._call("reading the table", lambda g: g.internal_kv_keys(b"deployment/", KV_NAMESPACE,
                                                                       timeout=self.timeout_s))

    def _call(self, what: str, fn):
        try:
            return fn(self._client())
        except ConnectionError:
            raise
        except Exception as e:          # ray.exceptions.RpcError and its kin: the GCS is slow, gone or refuses us
            if refused_by_ray(e):
                raise ConnectionError(f"{what}: {refusal(self.address)}") from None
            raise ConnectionError(f"{what} from the GCS at {self.address}: {type(e).__name__}: {e}") from None

    def put(self, key: str, record: dict) -> None:
        blob = json.dumps(record, default=str).encode()
        self._call(f"writing {key}", lambda g: g.internal_kv_put(key.encode(), blob, True, KV_NAMESPACE,
                                                                   timeout=self.timeout_s))

    def publish_deployment(self, name: str, workers: list[str], **facts) -> None:
        self.put(f"deployment/{name}", {"name": name, "workers": workers, "created": time.time(), **facts})

    def publish_worker(self, worker: str, **record) -> None:
        self.put(f"worker/{worker}", {"worker": worker, "updated": time.time(), **record})

    def remove_worker(self, worker: str) -> None:
        self._call(f"removing worker/{worker}", lambda g: g.internal_kv_del(f"worker/{worker}".encode(), False,
                                                                           KV_NAMESPACE, timeout=self.timeout_s))

    def publish_token(self, name: str, token: str) -> None:
        """The deployment's token, for `token()`: readable by whoever may read the cluster's GCS."""
        self._call("writing the token", lambda g: g.internal_kv_put(f"token/{name}".encode(), token.encode(), True,
                                                                    KV_NAMESPACE, timeout=self.timeout_s))

    def token(self, name: str) -> str | None:
        """The token the deployment `name` was served with, None when it has none (served --insecure)."""
        blob = self._call("reading the token", lambda g: g.internal_kv_get(f"token/{name}".encode(), KV_NAMESPACE,
                                                                           timeout=self.timeout_s))
        return None if blob is None else blob.decode()

    def remove(self, name: str) -> list[str]:
        """The deployment `name`, its token and every record of its workers; returns the keys that were there."""
        pat = worker_pattern(name)
        keys = self._call("listing workers", lambda g: g.internal_kv_keys(b"worker/", KV_NAMESPACE,
                                                                            timeout=self.timeout_s))
        keys = [k.decode() for k in keys if pat.fullmatch(k.decode()[len("worker/"):])]
        removed = []
        for key in keys + [f"token/{name}", f"deployment/{name}"]:
            if self._call(f"removing {key}", lambda g: g.internal_kv_del(key.encode(), False, KV_NAMESPACE,
                                                                          timeout=self.timeout_s)):
                removed.append(key)
        return removed

    def deployment(self, name: str) -> dict | None:
        blob = self._call(f"reading deployment/{name}", lambda g: g.internal_kv_get(
            f"deployment/{name}".encode(), KV_NAMESPACE, timeout=self.timeout_s))
        return None if blob is None else json.loads(blob)

    def workers(self, name: str) -> dict[str, dict | None]:
        """{worker: its record or None} of the deployment `name`, in order; LookupError if there is none."""
        dep = self.deployment(name)
        if dep is None:
            raise LookupError(f"no deployment named {name!r} on the Ray cluster at {self.address}")
        return self.workers_by_name(dep["workers"])

    def workers_by_name(self, workers: list[str]) -> dict[str, dict | None]:
        keys = [f"worker/{w}".encode() for w in workers]
        got = self._call("reading the workers", lambda g: g.internal_kv_multi_get(keys, KV_NAMESPACE,
                                                                                   timeout=self.timeout_s))
        return {w: (json.loads(got[k]) if got.get(k) is not None else None) for w, k in zip(workers, keys)}

    def nodes(self) -> dict[str, dict]:
        """{node id (hex): {"ip", "alive"}} of every node the cluster has known."""
        info = self._call("reading the nodes", lambda g: g.get_all_node_info(timeout=self.timeout_s))
        return {nid.hex(): {"ip": n.node_manager_address, "alive": n.state == 0} for nid, n in info.items()}

    def actor_states(self, actor_ids: list[str]) -> dict[str, str]:
        """{actor id (hex): its state in the cluster's actor table: "ALIVE", "RESTARTING", "DEAD", ...}; an id the
        table does not hold is left out."""
        from ray._raylet import ActorID
        from ray.core.generated.gcs_pb2 import ActorTableData

        async def ask(g):
            got = await asyncio.gather(*(g.async_get_all_actor_info(actor_id=ActorID.from_hex(a),
                                                                    timeout=self.timeout_s) for a in actor_ids))
            return {k.hex(): ActorTableData.ActorState.Name(v.state) for d in got for k, v in d.items()}
        return self._call("reading the actor table", lambda g: _on_a_loop_of_its_own(ask(g), self.timeout_s))

    def entries(self, name: str) -> dict[str, dict]:
        """{worker: {"endpoint": where its entry says it serves (or None), "live": whether it serves there now,
        "stale": whether its entry says `serving` though its owner is gone, "why": why not live (None when it is)}}.
        An entry that says `serving` is live while Ray holds its node and its front-end (`actor_id`) alive; stale
        when either is dead (a front-end killed outright, or with the `serve` that owned it, never removes it)."""
        workers = self.workers(name)
        ids = [r["actor_id"] for r in workers.values() if r and r.get("state") == "serving" and r.get("actor_id")]
        states = self.actor_states(ids) if ids else {}
        nodes = self.nodes()
        return {w: _entry(rec, nodes, states) for w, rec in workers.items()}

    def endpoints(self, name: str) -> dict[str, str | None]:
        """{worker: "host:port" where it serves now, or None (not placed yet, starting, its node dead, or its
        front-end gone)}."""
        return live_endpoints(self.entries(name))


def live_endpoints(entries: dict[str, dict]) -> dict[str, str | None]:
    """{worker: its endpoint where its entry (`Directory.entries`) is live, else None}."""
    return {w: e["endpoint"] if e["live"] else None for w, e in entries.items()}


def _entry(rec: dict | None, nodes: dict, states: dict) -> dict:
    """One worker's entry as `Directory.entries` reads it; `stale`: it says `serving`, but its owner is gone."""
    if rec is None:
        return {"endpoint": None, "live": False, "stale": False, "why": "no entry: not placed yet"}
    if rec.get("state") != "serving" or not rec.get("endpoint"):
        return {"endpoint": None, "live": False, "stale": False,
                "why": rec.get("why") or f"its front-end is {rec.get('state', 'not serving')}"}
    why, stale = None, True
    node = nodes.get(rec.get("node_id"))
    state = states.get(rec.get("actor_id"), "DEAD") if rec.get("actor_id") else "ALIVE"
    if not (node and node["alive"]):
        why = f"its node {str(rec.get('node_id'))[:8]} ({rec.get('node_ip')}) is dead"
    elif state == "DEAD":
        why = (f"its front-end (pid {rec.get('pid')} on {rec.get('node_ip')}) is gone: the serve that owned it "
               f"ended, or it was killed")
    elif state == "RESTARTING":
        why, stale = "its front-end is restarting", False
    return {"endpoint": rec["endpoint"], "live": why is None, "stale": why is not None and stale, "why": why}


def _on_a_loop_of_its_own(coro, timeout_s: float):
    """Run `coro` on a new event loop in a thread of its own, within `timeout_s` (+1 s): the caller may be inside
    a running loop of its own (an asyncio engine), where it can neither start another nor block its own."""
    out: dict = {}

    def run():
        try:
            out["value"] = asyncio.run(coro)
        except BaseException as e:          # handed to the caller
            out["error"] = e
    t = threading.Thread(target=run, name="dspark-gcs-read", daemon=True)
    t.start()
    t.join(timeout_s + 1.0)
    if t.is_alive():
        raise TimeoutError(f"no answer within {timeout_s + 1.0:g} s")
    if "error" in out:
        raise out["error"]
    return out["value"]
