"""`dspark-ray status --json` while Ray declares a worker's node dead, on a real Ray cluster of several nodes on one
machine: every output parses (Ray tells every driver of the death, on its stdout, mid-command), the worker reads
"node dead" from the moment Ray's node table has it so until it serves again elsewhere, and each call's survey stays
within its 3 s bound."""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from dspark_ray.actors.placement import deploy_workers, teardown
from dspark_ray.client.endpoints import Directory
from dspark_ray.spec import PairSpec

from conftest import PAIR_BACKEND
from test_multinode import ROOM, ROOT, alive, small_cluster, wait_for

pytestmark = pytest.mark.slow
if PAIR_BACKEND != "gloo":
    pytest.skip("the nodes of this cluster are CPU-only", allow_module_level=True)

SURVEY_BOUND_S = 3.0          # the survey: from joined to Ray disconnected (docs/operations.md)
CALL_BOUND_S = 20.0           # the whole command: Python, Ray's import and the join too, on this loaded 2-core machine


@pytest.fixture
def one_node(monkeypatch):
    """A head with no CPUs and one node with room for one tiny pair: a worker whose node dies has nowhere to go
    until the test adds a node."""
    yield from small_cluster(monkeypatch, nodes=1)


class Calls:
    """`dspark-ray status --json` run again and again as a user runs it; each call's facts kept."""

    def __init__(self, address: str, name: str, node_id: str):
        self.address, self.name, self.node_id = address, name, node_id
        self.directory = Directory(address)
        self.done: list[dict] = []

    def node_dead(self) -> bool:
        return not self.directory.nodes()[self.node_id]["alive"]

    def run(self, notice: str | None = None) -> dict:
        """One call; with `notice`, that line is told to every driver of the cluster (as Ray tells them of a dead
        node) while this call is joined."""
        dead_before = self.node_dead()
        t = time.monotonic()
        p = subprocess.Popen([sys.executable, "-m", "dspark_ray.cli", "status", "--address", self.address, "--name",
                              self.name, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        err = ""
        if notice is not None:
            while "joined Ray" not in err and (line := p.stderr.readline()):
                err += line
            time.sleep(0.3)             # Ray's listener subscribes just after the join
            tell_every_driver(notice)
        out, rest = p.communicate(timeout=60)
        secs, err = time.monotonic() - t, err + rest
        try:
            st = json.loads(out)
        except json.JSONDecodeError as e:
            raise AssertionError(f"status --json printed what does not parse ({e}):\n{out}\nstderr:\n{err}")
        (w,) = st["workers"]
        call = dict(dead_before=dead_before, rc=p.returncode, state=w["state"], why=w["why"], secs=secs,
                    survey_s=st["survey_s"], told=" marked dead" in err, notice_on_stderr=notice in err if notice
                    else None)
        self.done.append(call)
        print(f"status: {call}")
        return call


def tell_every_driver(line: str) -> None:
    import ray
    from ray._private.utils import publish_error_to_driver
    publish_error_to_driver("test", line, ray._private.worker.global_worker.gcs_client)


def test_status_json_parses_and_says_node_dead_while_ray_declares_a_node_dead(one_node, tiny_ckpt):
    spec = PairSpec(checkpoint=str(tiny_ckpt), tp=1, n_slots=2, collective_timeout_s=3.0)
    before = {}
    try:
        workers = deploy_workers(spec, 1, name="nd")        # held: a front-end lives while its handle does
        before = Directory(one_node.address).workers("nd")["nd"]
        assert before["endpoint"] == workers[0][1]
        calls = Calls(one_node.address, "nd", before["node_id"])
        assert calls.run()["state"] == "serving"
        victim = next(n for n in one_node.worker_nodes if n.node_id == before["node_id"])
        victim.kill_raylet()
        # Calls back to back while Ray declares the node dead, and after: no node has room for the pair.
        while sum(c["dead_before"] for c in calls.done) < 2:
            calls.run()
            assert len(calls.done) < 20, calls.done
        # What Ray tells every driver mid-call goes to stderr (the front-end does not answer: the call waits 2 s).
        notice = "(raylet) The node with node id: 0123 has been marked dead (told by the test)"
        assert calls.run(notice)["notice_on_stderr"] is True
        # A node joins: Ray places the pair there, its front-end starts and serves.
        one_node.add_node(num_cpus=ROOM)
        while (call := calls.run())["state"] != "serving":
            assert len(calls.done) < 40, calls.done
        moved = Directory(one_node.address).workers("nd")["nd"]
        assert moved["moved_from"]["node_id"] == before["node_id"] != moved["node_id"]   # the node it moved from
        wait_for("the lost node's front-end gone", lambda: not alive(before["pid"]), 30)
    finally:
        teardown("nd")
        if before:
            remove_rings_of("nd", before["pid"])
    after_death = [c for c in calls.done[1:] if c["dead_before"] and c["state"] != "serving"]
    assert after_death and all(c["state"] == "node dead" and c["rc"] == 3 for c in after_death), calls.done
    assert all(c["state"] in ("serving", "unreachable", "node dead") for c in calls.done), calls.done
    for c in after_death:                           # placed again, or starting elsewhere, in words
        assert c["why"].endswith("is dead; Ray is placing it again") or "died; starting elsewhere" in c["why"], c
    assert all(c["survey_s"] <= SURVEY_BOUND_S and c["secs"] <= CALL_BOUND_S for c in calls.done), calls.done
    print(f"{len(calls.done)} calls; survey {min(c['survey_s'] for c in calls.done):.2f}-"
          f"{max(c['survey_s'] for c in calls.done):.2f} s, the command {min(c['secs'] for c in calls.done):.2f}-"
          f"{max(c['secs'] for c in calls.done):.2f} s; Ray's death notice on stderr in "
          f"{sum(c['told'] for c in calls.done)} of them")


def remove_rings_of(worker: str, pid: int) -> None:
    """The step ring of the lost node's front-end, which died without closing it, where its successor did not
    remove it first (it removes only rings whose owner is gone by then)."""
    for seg in glob.glob(f"/dev/shm/dspark-{worker}-{pid}-*"):
        os.unlink(seg)
    for bells in glob.glob(os.path.join(tempfile.gettempdir(), f"dspark-{worker}-{pid}-*.bells")):
        shutil.rmtree(bells, ignore_errors=True)
