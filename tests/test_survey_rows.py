"""`dspark-ray status`'s row for one worker (actors/survey.py's `_row`), from what is known of it, without Ray: a
worker whose node Ray's node table has dead says "node dead" (not unreachable, not plain starting), whether its
front-end is still to be placed or already starting elsewhere; and the command's own output is all its stdout holds
while Ray is joined."""
from __future__ import annotations

import os
import sys

from dspark_ray.actors.survey import _row

OLD, NEW = "a" * 56, "b" * 56                      # node ids (hex), as Ray's node table keys them
RECORD = {"state": "serving", "endpoint": "10.0.0.1:18627", "node_id": OLD, "node_ip": "10.0.0.1", "cards": [[]]}
MOVED = {"state": "starting", "endpoint": None, "node_id": NEW, "node_ip": "10.0.0.2", "cards": [[]],
         "moved_from": {"node_id": OLD, "node_ip": "10.0.0.1"}}
OLD_DEAD = {OLD: {"ip": "10.0.0.1", "alive": False}, NEW: {"ip": "10.0.0.2", "alive": True}}
OLD_ALIVE = {OLD: {"ip": "10.0.0.1", "alive": True}, NEW: {"ip": "10.0.0.2", "alive": True}}
STARTING = {"node_id": NEW, "node_ip": "10.0.0.2", "cards": [[]], "endpoint": None, "unavailable": "starting"}


def row(rec, nodes, status=None, why=None, has_frontend=True, group="RESCHEDULING"):
    return _row("w", rec, status, why, has_frontend, nodes, group, 2.0)


def test_a_worker_on_a_dead_node_is_node_dead_while_ray_places_it_again():
    r = row(RECORD, OLD_DEAD)
    assert (r["state"], r["why"]) == ("node dead", "its node aaaaaaaa (10.0.0.1) is dead; Ray is placing it again")
    assert r["lost_node"] == {"node_id": OLD, "node_ip": "10.0.0.1"} and r["node_alive"] is False


def test_a_front_end_that_failed_to_answer_on_a_dead_node_is_node_dead_not_unreachable():
    r = row(RECORD, OLD_DEAD, why="its front-end failed to answer: ActorUnavailableError: ...")
    assert r["state"] == "node dead" and r["why"].endswith("is dead; Ray is placing it again"), r


def test_once_placed_again_the_placement_groups_state_does_not_change_the_words():
    # CREATED on another node, its front-end not yet started there: the record still names the dead node.
    assert row(RECORD, OLD_DEAD, group="CREATED")["why"].endswith("is dead; Ray is placing it again")
    assert row(RECORD, OLD_DEAD, group=None)["why"] == "its node aaaaaaaa (10.0.0.1) is dead"   # no group left


def test_a_front_end_starting_elsewhere_after_its_node_died_is_node_dead():
    r = row(MOVED, OLD_DEAD)                        # its record rewritten from the new node, no answer yet
    assert (r["state"], r["why"]) == ("node dead", "its node aaaaaaaa (10.0.0.1) died; starting elsewhere, on node "
                                                   "bbbbbbbb (10.0.0.2)")
    assert (r["node_id"], r["node_alive"]) == (NEW, True) and r["lost_node"]["node_id"] == OLD
    r = row(MOVED, OLD_DEAD, status=STARTING)       # it answers from there: unavailable while its pair starts
    assert (r["state"], r["why"]) == ("node dead", "its node aaaaaaaa (10.0.0.1) died; starting elsewhere, on node "
                                                   "bbbbbbbb (10.0.0.2): starting")


def test_a_front_end_that_answers_from_where_it_moved_while_its_record_is_old_is_starting_elsewhere():
    r = row(RECORD, OLD_DEAD, status=STARTING)
    assert r["state"] == "node dead" and "died; starting elsewhere, on node bbbbbbbb (10.0.0.2)" in r["why"], r


def test_a_worker_serving_where_it_moved_is_serving():
    r = row({**MOVED, "state": "serving", "endpoint": "10.0.0.2:18627"}, OLD_DEAD,
            status={**STARTING, "unavailable": None, "endpoint": "10.0.0.2:18627"})
    assert (r["state"], r["why"], r["node_id"]) == ("serving", None, NEW)


def test_before_ray_declares_the_node_dead_the_worker_is_unreachable():
    r = row(RECORD, OLD_ALIVE, group="CREATED")
    assert (r["state"], r["lost_node"]) == ("unreachable", None) and "did not answer within 2 s" in r["why"]
    assert row(MOVED, OLD_ALIVE)["state"] == "starting"     # the node it moved from is alive: no death to say


def test_a_worker_without_a_front_end_is_gone_whatever_its_node():
    assert row(RECORD, OLD_DEAD, has_frontend=False)["state"] == "gone"


def test_ray_s_lines_go_to_stderr_while_joined_and_the_command_s_output_to_stdout(capfd):
    from dspark_ray.cli import ray_says_it_on_stderr
    with ray_says_it_on_stderr():
        print("(raylet) The node with node id: x has been marked dead")     # Ray's error listener: sys.stdout
        os.write(1, b"a line of Ray's C++ parts\n")
    print("{}")
    sys.stdout.flush()
    out, err = capfd.readouterr()
    assert out == "{}\n" and "marked dead" in err and "C++" in err, (out, err)
