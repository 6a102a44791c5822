"""A front-end's restart budget (issue 64): Ray restarts it however often its node is lost, and at most OWN_RESTARTS
times after deaths of its own; past that it releases its placement group and says so, in its entry, `endpoints`,
`status` and its log. (Node losses on a multi-node cluster: tests/test_multinode.py.)"""
from __future__ import annotations

import os
import signal
import time

import pytest

from dspark_ray.actors.frontend import OWN_RESTARTS, own_failures
from dspark_ray.actors.placement import teardown

from conftest import deploy_pair

ALIVE, DEAD = {"n1": {"alive": True}}, {"n1": {"alive": False}}


def test_a_lost_node_is_not_counted_and_a_death_on_a_live_node_is():
    assert own_failures({"node_id": "n1", "own_failures": 2}, DEAD) == 2
    assert own_failures({"node_id": "n1", "own_failures": 2}, ALIVE) == 3
    assert own_failures({"node_id": "n1"}, ALIVE) == 1
    assert own_failures({}, ALIVE) == 1                # no entry to read: counted, so the budget still ends


def _serving_pid(ray_cluster, fe, timeout_s: float = 120) -> int:
    """The front-end's pid once it serves again after a restart."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            st = ray_cluster.get(fe.status.remote(), timeout=10)
            if st["endpoint"] and not st["unavailable"]:
                return st["pid"]
        except Exception:       # not rebuilt yet
            pass
        time.sleep(0.5)
    pytest.fail(f"the front-end did not serve again within {timeout_s} s")


def _group_state(name: str) -> str | None:
    from ray.util import placement_group_table
    states = [g.get("state") for g in placement_group_table().values() if g.get("name") == f"{name}-pg"]
    return states[-1] if states else None


def test_a_front_end_that_keeps_dying_releases_its_placement_group_and_says_so(ray_cluster, tiny_ckpt, capsys):
    from dspark_ray.actors.survey import survey
    from dspark_ray.cli import main
    from dspark_ray.client.endpoints import Directory
    name = "budget"
    fe, _, _ = deploy_pair(ray_cluster, tiny_ckpt, name, tp=1)
    gcs = ray_cluster.get_runtime_context().gcs_address
    try:
        pid = _serving_pid(ray_cluster, fe)
        for death in range(1, OWN_RESTARTS + 2):
            os.kill(pid, signal.SIGKILL)
            if death <= OWN_RESTARTS:
                pid = _serving_pid(ray_cluster, fe)
                assert Directory(gcs).workers(name)[name]["own_failures"] == death
        deadline = time.monotonic() + 60
        while _group_state(name) != "REMOVED" and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _group_state(name) == "REMOVED"                  # its resources are free again
        entry = Directory(gcs).workers(name)[name]
        assert entry["state"] == "gave up" and entry["own_failures"] == OWN_RESTARTS + 1, entry
        why = entry["why"]
        assert why.startswith(f"gave up after its front-end died {OWN_RESTARTS + 1} times on a live node"), why
        assert main(["endpoints", "--address", gcs, "--name", name]) == 3
        assert f"{name}: not serving: {why}" in capsys.readouterr().err
        (row,) = survey(name)
        assert (row["state"], row["why"]) == ("gone", why), row
    finally:
        removed = teardown(name)
    assert removed == {name: ["endpoint entry"]}, removed
