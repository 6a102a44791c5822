"""Spare ranks (actors/pair.py): a worker keeps rank processes started ahead; a rank killed with SIGKILL is
replaced by a spare, a kill during that restart by the next one, the answers after are a fresh deployment's bits,
the spares are made again, and nothing of them is left once the worker is torn down."""
from __future__ import annotations

from bench.restart import measure


def _rank_actors(ray, name: str, want: list[str], bound_s: float = 60.0) -> list[str]:
    """The live rank actors of worker `name`, looked at until they are `want` or `bound_s` has passed (a killed or
    torn-down actor's name goes some moments later, more on a loaded host)."""
    import time

    from ray.util import list_named_actors
    deadline = time.monotonic() + bound_s
    while True:
        now = sorted(a["name"] for a in list_named_actors(all_namespaces=True)
                     if a["namespace"] == "dspark" and a["name"].startswith(f"{name}-rank"))
        if now == want or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def test_a_killed_rank_is_replaced_by_a_spare(ray_cluster, tiny_ckpt):
    from dspark_ray.spec import PairSpec
    spec = PairSpec(checkpoint=str(tiny_ckpt), tp=1, n_slots=4, max_batch=4, spare_ranks=2)
    # The second kill as the restart begins (second_kill_at 0): the spare set it takes, whatever the host's pace.
    out = measure(spec, name="spare-test", requests=2, rounds=4, kills=1, kills_during_restart=1, gap_ms=5,
                  second_kill_at=0)
    (single,), (doubled,) = out["kills_detail"], out["during_restart"]["kills_detail"]
    assert out["recovered"] == 2 and single["from_spares"] and doubled["from_spares"]
    # the spare had its process and imports done before the kill: the restart waited for neither
    assert single["phases_s"]["process_start"] == single["phases_s"]["imports"] == 0.0
    assert doubled["second_kill"] is not None
    cr = out["correctness"]
    assert cr["ok_answers_checked_after_a_kill"] >= 4 * 2 and cr["reference_not_ok"] == 0
    assert cr["wrong_drafts"] == 0 and cr["wrong_other_fields"] == 0, cr["first_wrong"]
    assert _rank_actors(ray_cluster, "spare-test", []) == []


def test_spares_are_made_again_after_a_restart(ray_cluster, tiny_ckpt, capsys):
    import os
    import signal
    import time

    from dspark_ray.actors.placement import deploy_workers, teardown
    from dspark_ray.spec import PairSpec
    spec = PairSpec(checkpoint=str(tiny_ckpt), tp=1, n_slots=4, max_batch=4, spare_ranks=1)
    from dspark_ray.client import demo
    ((fe, endpoint),) = deploy_workers(spec, 1, name="spare-refill")
    try:
        st = ray_cluster.get(fe.status.remote())
        want = ["spare-refill-rank0", "spare-refill-rank0.spare1"]
        assert st["spares"] == 1 and _rank_actors(ray_cluster, "spare-refill", want) == want
        os.kill(st["ranks"][0]["pid"], signal.SIGKILL)
        demo.run(endpoint, rounds=2, quiet=True, print_fn=lambda *a: None)     # a STEP finds the rank dead
        deadline = time.monotonic() + 60
        while True:
            st = ray_cluster.get(fe.status.remote())
            if st["supervisor"]["restarts"] == 1 and not st["supervisor"]["restarting"]:
                break
            assert time.monotonic() < deadline, st["supervisor"]
            time.sleep(0.2)
        assert st["startup"]["from_spares"] and st["spares"] == 1
        from dspark_ray.cli import _print_status
        _print_status(st)                                   # what `dspark-ray status` shows of them
        assert "spare ranks: " in capsys.readouterr().out
        want = ["spare-refill-rank0.spare1", "spare-refill-rank0.spare2"]
        assert _rank_actors(ray_cluster, "spare-refill", want) == want
        # a spare that dies before use is noticed (status) and made again
        os.kill(ray_cluster.get(ray_cluster.get_actor("spare-refill-rank0.spare2", namespace="dspark")
                                .status.remote())["pid"], signal.SIGKILL)
        want = ["spare-refill-rank0.spare1", "spare-refill-rank0.spare3"]
        deadline = time.monotonic() + 60
        while _rank_actors(ray_cluster, "spare-refill", want, bound_s=0) != want:
            ray_cluster.get(fe.status.remote())           # (status notices the dead spare and makes another)
            assert time.monotonic() < deadline
            time.sleep(0.2)
        st = ray_cluster.get(fe.status.remote())
        assert st["spares"] == 1
    finally:
        teardown("spare-refill")
    assert _rank_actors(ray_cluster, "spare-refill", []) == []
