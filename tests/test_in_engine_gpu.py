"""exllamav3's generator drafting through dspark-ray, lossless (issue 54, items 3 and 5; GPU and exllamav3 only).

On the tiny engine model (weights/engine_model.py, written on the card), the committed prompts, 64 new tokens each,
greedy, batch 1 and 4: (a) no drafting, (b) exllamav3's own DSpark drafter, (c) dspark-ray's worker on the same
card (tp1) through `RemoteDrafter`. (b) and (c) give (a)'s tokens; wherever their drafts agree at a position, their
accepted lengths agree; every difference is a near-tie with its margin, or the test fails. Then faults inside a
generation: the rank killed with SIGKILL, and the rank frozen for 5 s: the tokens are (a)'s, drafting resumes, and
no draft phase waits past the STEP's deadline plus a few milliseconds.

    source .devbundle/setup.sh && python -m pytest -q -rA tests/test_in_engine_gpu.py
"""
from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

exllamav3 = pytest.importorskip("exllamav3") if torch.cuda.is_available() else None

from dspark_ray.testing import in_engine as E  # noqa: E402

MAX_NEW = 64
DEADLINE_MS = 50.0
SLACK_MS = 5.0           # the deadline answer, its decode and the generator's own staging around the STEP


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from dspark_ray.weights.engine_model import write_engine_model
    d = tmp_path_factory.mktemp("engine_tiny")
    write_engine_model("tiny", d, device="cuda")
    return str(d)


@pytest.fixture(scope="module")
def trunk(model_dir):
    return E.load_trunk(model_dir)


@pytest.fixture(scope="module")
def worker(model_dir, ray_cluster):
    from dspark_ray import settings
    from dspark_ray.actors.placement import deploy, teardown
    from dspark_ray.spec import PairSpec
    # The worker shares the engine's card: no rehearsed graph launches between steps (bench/in_engine.py says why).
    saved = os.environ.get("DSPARK_KEEP_WARM_LAUNCH_US")
    os.environ["DSPARK_KEEP_WARM_LAUNCH_US"] = "0"
    settings.reread()
    # ... and its host: its parties spin 2 ms for the next step, not the GPU default 100 ms (docs/exllamav3.md)
    spec = PairSpec(checkpoint=model_dir, tp=1, n_slots=8, max_batch=8, backend="gloo", device="cuda",
                    collective_timeout_s=2.0, ring_spin_us=2000.0)
    fe, endpoint = deploy(spec, name="in-engine")
    yield fe, endpoint
    teardown("in-engine")
    if saved is None:
        os.environ.pop("DSPARK_KEEP_WARM_LAUNCH_US")
    else:
        os.environ["DSPARK_KEEP_WARM_LAUNCH_US"] = saved
    settings.reread()


@pytest.fixture(scope="module")
def undrafted(trunk):
    return {b: E.generate(trunk, E.prompts(), mode="none", batch=b, max_new=MAX_NEW) for b in (1, 4)}


@pytest.fixture(scope="module")
def margins(trunk):
    return E.trunk_margins(trunk, E.prompts(), MAX_NEW)


def remote(worker, trunk, **kw):
    from dspark_ray.engines.exllamav3 import RemoteDrafter
    return RemoteDrafter(worker[1], trunk.config, deadline_ms=DEADLINE_MS, margins=True, **kw)


def report(name, res):
    print(f"\n[in-engine] {name}: " + json.dumps(res, default=str))


@pytest.mark.parametrize("batch", [1, 4])
def test_dspark_drafts_leave_the_tokens_unchanged_and_agree_with_exllamav3s_drafter(trunk, worker, undrafted,
                                                                                    margins, batch):
    base = undrafted[batch]
    assert all(len(t) == MAX_NEW for t in base.tokens.values())
    model, cache = E.own_drafter(trunk)
    theirs = E.generate(trunk, E.prompts(), mode="exllamav3", batch=batch, max_new=MAX_NEW,
                        draft_model=model, draft_cache=cache)
    del model, cache
    torch.cuda.empty_cache()
    d = remote(worker, trunk)
    ours = E.generate(trunk, E.prompts(), mode="dspark", batch=batch, max_new=MAX_NEW, draft_model=d,
                      draft_cache=d.cache_for(trunk.cache))
    d.close()
    b_vs_a = E.compare(base, theirs, trunk_margins=margins)
    c_vs_a = E.compare(base, ours, drafter_ref=theirs, margins=ours.margins, trunk_margins=margins)
    report(f"batch {batch} exllamav3 vs none", b_vs_a | theirs.summary())
    report(f"batch {batch} dspark vs none and exllamav3", c_vs_a | ours.summary())
    assert b_vs_a["unexplained"] == 0 and c_vs_a["unexplained"] == 0
    assert c_vs_a["rounds_compared"] >= 8 * 5                      # the rounds line up and were compared
    assert ours.drafter_stats["ok"] == ours.drafter_stats["rows"]   # every row drafted OK: no fault here
    acc = ours.summary()["mean_accepted"]
    assert 1.0 <= acc <= 4.0, acc                                   # speculation is real, and not trivial


def _rank_pid(worker, ray_cluster):
    (pid,) = ray_cluster.get(worker[0].rank_pids.remote())
    return pid


def _wait_serving(worker, ray_cluster, timeout=120):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        st = ray_cluster.get(worker[0].status.remote())
        if not st.get("unavailable"):
            return st
        time.sleep(0.5)
    raise AssertionError("the worker did not serve again")


FAULT_NEW = 256          # long enough to outlast a restart at the pace below
TRUNK_PACE_S = 0.05      # after the fault, each round takes at least this (a real trunk's forward is 20-50 ms)


@pytest.fixture(scope="module")
def undrafted_long(trunk):
    return E.generate(trunk, E.prompts(4), mode="none", batch=4, max_new=FAULT_NEW)


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_a_fault_inside_a_generation_leaves_its_tokens_unchanged_and_drafting_resumes(trunk, worker, undrafted_long,
                                                                                    ray_cluster, fault):
    gen0 = _wait_serving(worker, ray_cluster)["worker_generation"]
    d = remote(worker, trunk)
    seen = {"fired_at": None, "ok_before": 0, "not_ok_after": 0, "ok_after": 0, "t_fault": None,
            "first_ok_after_s": None}

    def on_round(run, gen):
        codes = [c for c in d.last_codes if c is not None]
        ok = sum(c == 0 for c in codes)
        if seen["fired_at"] is None:
            seen["ok_before"] += ok
            if len(run.draft_ms) == 20:                  # mid-generation, drafting well under way
                seen["fired_at"], seen["t_fault"] = len(run.draft_ms), time.monotonic()
                if fault == "kill":
                    os.kill(_rank_pid(worker, ray_cluster), signal.SIGKILL)
                else:
                    ray_cluster.get(worker[0].set_fault.remote(0, "stall", count=1, seconds=5.0))
            return
        seen["not_ok_after"] += len(codes) - ok
        if seen["not_ok_after"] and ok:
            seen["ok_after"] += ok
            if seen["first_ok_after_s"] is None:
                seen["first_ok_after_s"] = round(time.monotonic() - seen["t_fault"], 3)
        if not seen["ok_after"]:
            time.sleep(TRUNK_PACE_S)

    ours = E.generate(trunk, E.prompts(4), mode=f"dspark+{fault}", batch=4, max_new=FAULT_NEW, draft_model=d,
                      draft_cache=d.cache_for(trunk.cache), on_round=on_round)
    d.close()
    res = E.compare(undrafted_long, ours) | ours.summary() | seen | {"slowest_draft_phases_ms": sorted(ours.draft_ms)[-3:]}
    report(f"fault {fault}", res)
    assert seen["fired_at"] is not None and res["unexplained"] == 0 and res["tokens_equal"] == 4
    assert seen["not_ok_after"] > 0                        # the fault was seen by the rounds after it ...
    assert seen["ok_after"] > 0                            # ... and drafting resumed within the generation
    assert max(ours.draft_ms) <= DEADLINE_MS + SLACK_MS, sorted(ours.draft_ms)[-5:]
    if fault == "kill":
        assert _wait_serving(worker, ray_cluster)["worker_generation"] > gen0      # the pair was restarted


def _mixed_specs(stops: dict[int, int] | None = None) -> list:
    """Issue 62's schedule: prompts of 1 to past one prefill chunk (2048), `max_new_tokens` from 1 to 300, jobs
    enqueued mid-generation, the longest prompt and a short one repeated (the repeat may start on the prefix cache),
    stop tokens on three jobs (`stops`: job -> token)."""
    import random
    rng = random.Random(62)
    prompt = lambda n: [rng.randrange(4, 4096) for _ in range(n)]     # noqa: E731
    long_prompt, short = prompt(2100), prompt(40)
    shape = [(prompt(1), 1, 0), (prompt(3), 200, 0), (prompt(17), 5, 0), (prompt(90), 64, 0), (prompt(300), 3, 0),
             (long_prompt, 50, 0), (short, 120, 2), (prompt(700), 90, 5), (long_prompt, 30, 40), (short, 300, 60),
             (prompt(9), 17, 70), (prompt(260), 40, 75)]
    stops = stops or {}
    return [E.JobSpec(p, n, (stops[i],) if i in stops else (), at) for i, (p, n, at) in enumerate(shape)]


@pytest.fixture(scope="module")
def mixed(trunk):
    """The schedule, its stop tokens taken from an undrafted run: each stops its job about a third of the way."""
    pre = E.generate(trunk, _mixed_specs(), mode="none", batch=4)
    return _mixed_specs({i: pre.tokens[i][len(pre.tokens[i]) // 3] for i in (1, 7, 9)})


@pytest.mark.parametrize("batch", [1, 2, 4, 8])
def test_a_mixed_schedule_generates_the_undrafted_tokens_and_drafts_as_exllamav3(trunk, worker, mixed, batch):
    """Short and long prompts, jobs ending at different times (max_new_tokens, stop tokens), jobs joining
    mid-generation, repeated prompts, up to 8 jobs a batch: the tokens are the undrafted run's, wherever both
    drafters drafted their drafts agree (or differ at a near-tie of ours), and the adapter never failed."""
    base = E.generate(trunk, mixed, mode="none", batch=batch)
    assert any(len(base.tokens[i]) < s.max_new for i, s in enumerate(mixed))       # a stop token ended a job
    model, cache = E.own_drafter(trunk)
    theirs = E.generate(trunk, mixed, mode="exllamav3", batch=batch, draft_model=model, draft_cache=cache)
    del model, cache
    torch.cuda.empty_cache()
    d = remote(worker, trunk)
    ours = E.generate(trunk, mixed, mode="dspark", batch=batch, draft_model=d, draft_cache=d.cache_for(trunk.cache))
    d.close()
    b_vs_a = E.compare(base, theirs)
    c_vs_a = E.compare(base, ours, drafter_ref=theirs, margins=ours.margins)
    report(f"mixed batch {batch} dspark vs none and exllamav3", c_vs_a | ours.summary())
    assert b_vs_a["tokens_equal"] == c_vs_a["tokens_equal"] == len(mixed)
    assert c_vs_a["unexplained"] == 0 and c_vs_a["rounds_compared"] >= 100
    st = ours.drafter_stats
    assert st["failures"] == st["unmatched_rows"] == st["partial_windows"] == st["unknown_rows"] == 0, st
    assert st["early_used"] > 0.5 * st["rows"]                      # most rounds' STEP left at verification


def test_the_readmes_exllamav3_lines_generate_the_undrafted_tokens(model_dir, worker, undrafted, trunk):
    """The README's "From exllamav3" block, run as written (MODEL_DIR, ENDPOINT, TOKEN filled in), then one job."""
    import re
    from pathlib import Path
    from exllamav3 import Job
    from exllamav3.generator.sampler import ArgmaxSampler
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "RemoteDrafter(" in b)
    scope = {"MODEL_DIR": model_dir, "ENDPOINT": worker[1], "TOKEN": None}      # its worker serves without one
    exec(compile(block, "README.md", "exec"), scope)
    gen, prompt = scope["generator"], E.prompts(1)[0]
    gen.enqueue(Job(input_ids=torch.tensor([prompt]), max_new_tokens=MAX_NEW, stop_conditions=[],
                    sampler=ArgmaxSampler(), identifier=0))
    tokens = []
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r.get("stage") == "streaming" and "token_ids" in r:
                tokens += r["token_ids"].reshape(-1).tolist()
    scope["drafter"].close()
    assert tokens == undrafted[1].tokens[0]
    assert scope["drafter"].stats["ok"] > 0
