"""The deployment end to end on a real local Ray cluster: tiny preset, tp2 over gloo, STEP over TCP."""
from __future__ import annotations

import collections
import errno
import os
import socket
import struct
import threading
import time
import urllib.request

import numpy as np
import pytest
import torch

from dspark_ray.testing import workload
from dspark_ray.actors.placement import teardown
from dspark_ray.scheduling import pin_thread, thread_deltas, thread_niceness, threads_named
from dspark_ray.client import ClientError, DrafterClient
from dspark_ray.protocol.contract import Code, make_entry
from dspark_ray.rank.engine import RankEngine
from dspark_ray.testing.batches import Driver, entry
from dspark_ray.model.layout import Layout
from dspark_ray.rank.modes import make_drafter
from dspark_ray import settings

from conftest import PAIR_BACKEND, deploy_pair, step_as_reference, to_entry


# The step path's threads pinned as a user would (dspark serve --rank-cpus --frontend-cpus): on the 2-core CI machine
# rank 0 on the first core, rank 1 and the front-end's endpoint on the last.
CPUS = sorted(os.sched_getaffinity(0))
RANK_CPUS, FRONTEND_CPUS = [CPUS[0], CPUS[-1]], [CPUS[-1]]


@pytest.fixture(scope="module")
def pair(ray_cluster, tiny_ckpt):
    # Every token's Markov bias row cached (serve --markov-cache all): every answer below is still checked against
    # the in-process reference, which caches none.
    fe, host, port = deploy_pair(ray_cluster, tiny_ckpt, "e2e", rank_cpus=RANK_CPUS, frontend_cpus=FRONTEND_CPUS,
                                 markov_cache="all")
    yield fe, host, port
    teardown("e2e")


# A STEP that a test expects answered (OK, or refused for what it holds) carries a 60 s deadline: the client's default
# 100 ms is a serving engine's, which a loaded 2-core host misses, and these tests are about the answers, not the time.
def client(pair, **hello):
    c = DrafterClient(pair[1], pair[2], timeout_s=60)
    c.hello(client="test", **hello)
    return c


def acquire_when_free(c, n, seconds=30.0):
    """Acquire n slots, retrying while slots of closed sessions are still being freed (the server frees them when
    it sees the connection close, asynchronously to the client)."""
    import time
    deadline = time.monotonic() + seconds
    while True:
        try:
            return c.acquire(n)
        except ClientError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def step_one_request(pair, cfg, n_rounds: int, rows: int, gap_s: float = 0.0) -> None:
    """`n_rounds` STEPs of one request with `rows` fresh rows each, every one answered OK, `gap_s` apart."""
    with client(pair) as c:
        (gr,) = acquire_when_free(c, 1)
        for k in range(n_rounds):
            if k:
                time.sleep(gap_s)
            e = make_entry(slot=gr.slot, generation=gr.generation, seed_token=5, start_pos=rows * k,
                           token_ids=np.arange(rows), taps=workload.make_taps(cfg, rows, torch.Generator()).numpy())
            assert c.step([e], deadline_ms=60_000)[0].code == Code.OK


def test_every_actor_carries_the_no_multicast_environment(pair, ray_cluster):
    st = ray_cluster.get(pair[0].status.remote())
    want = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    assert st["env"] == want
    assert [r["env"] for r in st["ranks"]] == [want, want]
    assert st["tp"] == 2 and st["backend"] == PAIR_BACKEND
    # The per-step path's threads run at niceness 0; Ray starts workers at 15, and lowering it needs CAP_SYS_NICE
    # (as root). The loading threads keep 15.
    if os.geteuid() == 0:
        assert thread_niceness(st["process"], "tcp-accept") == [0]
        for r, rank in enumerate(st["ranks"]):
            assert thread_niceness(rank["process"], f"dspark-rank{r}") == [0]
            if "RAY_worker_niceness" not in os.environ:
                assert thread_niceness(rank["process"], "MainThread") == [15]


def test_pin_thread_pins_the_calling_thread_only_and_refuses_a_bad_set():
    seen = {}

    def body():
        seen["pinned"] = pin_thread([CPUS[-1]], "test thread")
        seen["inside"] = os.sched_getaffinity(0)
        seen["refused"] = pin_thread([max(CPUS) + 4096], "test thread")     # no such vCPU
        seen["after"] = os.sched_getaffinity(0)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen["pinned"] == seen["inside"] == seen["after"] == {CPUS[-1]}
    assert seen["refused"] is None
    assert sorted(os.sched_getaffinity(0)) == CPUS          # the creating thread keeps its set
    assert pin_thread(None, "test") is None and sorted(os.sched_getaffinity(0)) == CPUS


def test_a_bad_pinning_is_refused_before_anything_starts():
    from dspark_ray.spec import PairSpec
    with pytest.raises(ValueError, match="one vCPU per rank, 2 for tp 2"):
        PairSpec(checkpoint="x", tp=2, rank_cpus=[3])
    with pytest.raises(ValueError, match="frontend_cpus"):
        PairSpec(checkpoint="x", frontend_cpus=[])
    with pytest.raises(ValueError, match="vCPU numbers >= 0"):
        PairSpec(checkpoint="x", rank_cpus=[0, -1])
    assert PairSpec(checkpoint="x", tp=1, rank_cpus=[3]).rank_cpus == [3]
    with pytest.raises(ValueError, match="a spin of 0 us or more"):
        PairSpec(checkpoint="x", ring_spin_us=-1.0)
    assert PairSpec(checkpoint="x", device="cuda").spin_us == 100_000.0       # longer than a trunk's forward
    assert PairSpec(checkpoint="x").spin_us == 50.0 and PairSpec(checkpoint="x", ring_spin_us=0.0).spin_us == 0.0
    with pytest.raises(ValueError, match="markov cache 'most'"):
        PairSpec(checkpoint="x", markov_cache="most")


def test_serve_refuses_a_bad_pinning_before_it_starts_ray(capsys, tiny_ckpt):
    from dspark_ray.cli import main
    assert main(["serve", "--checkpoint", str(tiny_ckpt), "--rank-cpus", "0"]) == 2
    assert "rank_cpus [0]: one vCPU per rank" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:               # argparse's refusal: a spin is 0 ms or more
        main(["serve", "--checkpoint", str(tiny_ckpt), "--spin-ms", "-1"])
    assert e.value.code == 2 and "argument --spin-ms: -1: must be >= 0" in capsys.readouterr().err


def test_step_path_threads_run_on_their_pinned_vcpus_only(pair, ray_cluster):
    def allowed(facts, prefix):
        return [t["allowed"] for t in threads_named(facts, prefix)]

    with client(pair):              # a connection thread exists while its client is connected
        st = ray_cluster.get(pair[0].status.remote())
    for r, rank in enumerate(st["ranks"]):
        assert allowed(rank["process"], f"dspark-rank{r}") == [str(RANK_CPUS[r])]
        # only the step loop is pinned: the actor's other threads keep the process's cores
        assert allowed(rank["process"], "MainThread") != [str(RANK_CPUS[r])] or len(CPUS) == 1
    # the accept thread pins itself; the connection threads it starts inherit its set
    assert allowed(st["process"], "tcp-accept") == [str(FRONTEND_CPUS[0])]
    assert allowed(st["process"], "tcp-conn") == [str(FRONTEND_CPUS[0])]
    # `dspark-ray status` says where they run
    from dspark_ray.cli import step_threads
    assert step_threads(st["ranks"][0]["process"], "dspark-rank0").startswith(f"vCPUs {RANK_CPUS[0]} (last on ")
    assert step_threads(st["process"], "tcp-").count(f"vCPUs {FRONTEND_CPUS[0]} (last on") == 2   # accept + conn
    assert step_threads(st["process"], "no-such-thread") == "-"


def test_hello_accepted_and_refused(pair, ckpt, cfg):
    with client(pair, config_digest=cfg.digest(), tp=2, model_digest=ckpt.identity_digest) as c:
        assert c.limits.slot_capacity == 8
    c = DrafterClient(pair[1], pair[2], timeout_s=30)
    with pytest.raises(ClientError, match="config_digest") as e:
        c.hello(config_digest="0" * 16)
    assert e.value.code == Code.CONFIG_MISMATCH
    with pytest.raises(ClientError, match="tp"):
        c.hello(tp=1)
    assert c.hello().ok                  # the refused session may say HELLO again
    c.close()


def test_rounds_over_the_wire_equal_the_in_process_reference_bit_for_bit(pair, cfg, ckpt):
    rounds = workload.rounds(cfg, seed=3, n_requests=2, n_rounds=40, far_start=2000)
    ref = Driver(RankEngine(make_drafter(cfg, "split", ckpt=ckpt), 2))
    with client(pair) as c:
        grants = acquire_when_free(c, 2)
        for batch in rounds:
            step_as_reference(c, ref, grants, batch)
        c.release([g.slot for g in grants])


def frees_slots(pair, ray_cluster, n: int, close) -> None:
    """close() ends a session: within 30 s the front-end holds n slots fewer."""
    def held():
        return ray_cluster.get(pair[0].status.remote())["slots"]["held"]
    before = held()
    close()
    deadline = time.monotonic() + 30
    while held() > before - n and time.monotonic() < deadline:
        time.sleep(0.1)
    assert held() == before - n


def test_rounds_through_shared_memory_equal_the_in_process_reference_bit_for_bit(pair, cfg, ckpt, ray_cluster):
    """A client on the service's host sends its requests through a shared-memory ring (transport/shm.py): the
    answers are the reference's bit for bit, and closing the client frees its slots."""
    rounds = workload.rounds(cfg, seed=5, n_requests=2, n_rounds=12, far_start=700)
    ref = Driver(RankEngine(make_drafter(cfg, "split", ckpt=ckpt), 2))
    c = DrafterClient(pair[1], pair[2], timeout_s=60, shm=True)
    c.hello(client="test shm")
    grants = acquire_when_free(c, 2)
    for batch in rounds:
        step_as_reference(c, ref, grants, batch)
    frees_slots(pair, ray_cluster, 2, c.close)


def test_n_out_prefix_over_the_wire(pair, cfg):
    taps = workload.make_taps(cfg, 7, torch.Generator().manual_seed(1)).numpy()
    outs = {}
    with client(pair) as c:
        for n_out in (5, 2):
            (g,) = acquire_when_free(c, 1)
            (r,) = c.step([make_entry(slot=g.slot, generation=g.generation, seed_token=9, token_ids=np.arange(7),
                                      taps=taps, n_out=n_out, want_margins=True)], deadline_ms=60_000)
            outs[n_out] = r
            c.release([g.slot])
    assert np.array_equal(outs[2].drafts_array(), outs[5].drafts_array()[:2])
    assert np.array_equal(outs[2].confidences_array(), outs[5].confidences_array()[:2])
    assert np.array_equal(outs[2].margins_array(), outs[5].margins_array()[:2])


def test_bad_entry_fails_alone_and_stale_generation_is_refused(pair, cfg):
    taps = workload.make_taps(cfg, 3, torch.Generator().manual_seed(2)).numpy()
    with client(pair) as c:
        a, b = acquire_when_free(c, 2)
        good = make_entry(slot=a.slot, generation=a.generation, seed_token=5, token_ids=[1, 2, 3], taps=taps)
        bad = make_entry(slot=b.slot, generation=b.generation, seed_token=cfg.vocab_size + 7, token_ids=[1, 2, 3],
                         taps=taps)
        r = c.step([good, bad], deadline_ms=60_000)
        assert r[0].code == Code.OK and r[1].code == Code.BAD_ENTRY and "4103" in r[1].reason
        gap = make_entry(slot=a.slot, generation=a.generation, seed_token=5, start_pos=9, token_ids=[1], taps=taps[:1])
        r = c.step([gap], deadline_ms=60_000)
        assert r[0].code == Code.BAD_ENTRY and "position gap" in r[0].reason
        stale = make_entry(slot=a.slot, generation=a.generation + 1, seed_token=5, start_pos=3, token_ids=[1],
                           taps=taps[:1])
        r = c.step([stale], deadline_ms=60_000)
        assert r[0].code == Code.STALE_GENERATION and r[0].generation == a.generation
        c.release([a.slot, b.slot])


def test_bad_frames_close_only_their_own_connection(pair, cfg):
    taps = workload.make_taps(cfg, 2, torch.Generator().manual_seed(4)).numpy()
    with client(pair) as c:
        (g,) = acquire_when_free(c, 1)
        pos = 0
        for junk in (b"\x00" * 64, b"DSPK" + b"\xff" * 20, struct.pack("<4sHHHHQI", b"DSPK", 1, 7, 0, 0, 1, 1 << 31)):
            s = socket.create_connection((pair[1], pair[2]), timeout=10)
            s.sendall(junk)
            try:
                s.shutdown(socket.SHUT_WR)
                assert s.recv(1 << 16) is not None      # the server answers or closes; it never hangs
            except OSError as e:
                # The server may close (and reset) the junk connection before this end shuts its side; a hang
                # would be a timeout here (no errno) and fails.
                assert e.errno in (errno.ENOTCONN, errno.ECONNRESET), e
            s.close()
            r = c.step([make_entry(slot=g.slot, generation=g.generation, seed_token=1, start_pos=pos,
                                   token_ids=[3, 4], taps=taps)], deadline_ms=60_000)
            assert r[0].code == Code.OK
            pos += 2


def test_concurrent_clients_are_batched_and_get_the_same_bits_as_alone(pair, cfg, ckpt, ray_cluster):
    n = 3
    rounds = workload.rounds(cfg, seed=9, n_requests=n, n_rounds=6)
    ref = Driver(RankEngine(make_drafter(cfg, "split", ckpt=ckpt), n))
    want = [ref.step(b) for b in rounds]
    before = ray_cluster.get(pair[0].status.remote())["stats"]["batch_sizes"]
    got: dict[int, list] = {}
    barrier = threading.Barrier(n)

    def worker(i):
        with client(pair) as c:
            (g,) = acquire_when_free(c, 1)
            out = []
            for batch in rounds:
                barrier.wait(30)
                out.append(c.step([to_entry(batch[i], g.slot, g.generation)], deadline_ms=60_000)[0])
            got[i] = out
            c.release([g.slot])

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    for i in range(n):
        for r, w in zip(got[i], [b[i] for b in want]):
            assert r.code == Code.OK and (r.drafts, r.confidences) == (w.drafts, w.confidences)
    after = ray_cluster.get(pair[0].status.remote())["stats"]["batch_sizes"]
    merged = sum(after[k] - before[k] for k in range(2, len(after)))
    assert merged > 0, (before, after)


def test_a_step_past_its_deadline_answers_deadline(pair, cfg):
    taps = workload.make_taps(cfg, 2, torch.Generator().manual_seed(5)).numpy()
    with client(pair) as c:
        (g,) = acquire_when_free(c, 1)
        r = c.step([make_entry(slot=g.slot, generation=g.generation, seed_token=1, token_ids=[1, 2], taps=taps)],
                   deadline_ms=1e-6)
        assert r[0].code == Code.DEADLINE
        # Nothing ran: the slot is still fresh, an insert at 0 is accepted.
        r = c.step([make_entry(slot=g.slot, generation=g.generation, seed_token=1, token_ids=[1, 2], taps=taps)],
                   deadline_ms=60_000)
        assert r[0].code == Code.OK


def test_a_closed_sessions_slots_are_free_again(pair):
    c = client(pair)
    assert len(acquire_when_free(c, 8)) == 8       # earlier tests' sessions may still be closing
    other = client(pair)
    with pytest.raises(ClientError):
        other.acquire(1)
    c.close()
    try:
        assert len(acquire_when_free(other, 8)) == 8
    except ClientError:
        pytest.fail("slots of the closed session never came free")
    other.close()


def test_a_step_larger_than_the_replay_limit_is_split(pair, cfg, ckpt, ray_cluster, capsys):
    """The test pair takes 6 entries a replay (`max_batch=6`: graph buckets 1-4 and 6): 8 entries run as a batch of
    6 (a wide bucket) and one of 2, with the in-process engine's answers bit for bit."""
    g = torch.Generator().manual_seed(6)
    batch = [entry(slot=i, seed_token=3 + i, n_out=1 + i % 5, token_ids=torch.arange(2 + i),
                   taps=workload.make_taps(cfg, 2 + i, g), want_margins=i % 3 == 0) for i in range(8)]
    before = ray_cluster.get(pair[0].status.remote())["stats"]["batch_sizes"]
    with client(pair) as c:
        grants = acquire_when_free(c, 8)
        step_as_reference(c, Driver(RankEngine(make_drafter(cfg, "split", ckpt=ckpt), 8)), grants, batch)
        c.release([g.slot for g in grants])
    st = ray_cluster.get(pair[0].status.remote())
    after = st["stats"]["batch_sizes"]
    assert len(after) == 7 and after[6] - before[6] >= 1 and sum(after) - sum(before) >= 2
    assert st["max_batch"] == 6 and all(list(r["graphs"]["request_buckets"]) == [1, 2, 3, 4, 6] for r in st["ranks"])
    from dspark_ray.cli import _print_status                        # what `dspark-ray status` prints of it
    _print_status(st)
    out = capsys.readouterr().out
    assert "(up to 6 entries each)" in out
    for r in st["ranks"]:              # the kernels each rank installed: a CPU rank the exact path, no dense kernel
        m = r["matmul"]
        assert m["mode"] in ("exact", "fast") and (m["dense"] is None) == (m["mode"] == "exact"), m
        assert f"matmul {m['mode']}" in out
    assert out.count(f"markov cache {cfg.vocab_size} rows") == 2          # the fixture's --markov-cache all


def test_status_reports_each_step_threads_cpu_time_and_waits(pair, cfg, ray_cluster):
    """What the latency bench diffs over its rounds: each step thread's CPU time, run-queue wait and preemptions,
    growing (never shrinking) between two readings with steps in between."""
    before = ray_cluster.get(pair[0].status.remote())
    step_one_request(pair, cfg, n_rounds=3, rows=2)
    after = ray_cluster.get(pair[0].status.remote())
    for r in range(2):
        d = thread_deltas(before["ranks"][r]["process"], after["ranks"][r]["process"])[f"dspark-rank{r}"]
        assert set(d) == {"cpu_ms", "run_delay_ms", "preempted"} and min(d.values()) >= 0, d
    t = after["ranks"][0]["process"]["threads"]["dspark-rank0"]
    assert t["cpu_ms"] > 0 and t["run_delay_ms"] >= 0 and t["preempted"] >= 0
    for r in range(2):               # the fixture's --markov-cache all: every id, on the rank's vocabulary shard
        lo, hi = Layout(cfg, 2).vocab_range(r)
        assert after["ranks"][r]["markov_cache"] == {"rows": cfg.vocab_size, "bytes": cfg.vocab_size * (hi - lo) * 2}


def test_every_party_keeps_its_step_path_warm_between_steps(pair, cfg, ray_cluster):
    """The front-end rehearses a STEP's decode, checks and coding, each rank its decode, checks and staging (rank 0
    its reply's encoding too), between steps; none of them fails (test_rounds_over_the_wire checks the bits with
    them running)."""
    step_one_request(pair, cfg, n_rounds=4, rows=3)
    st = ray_cluster.get(pair[0].status.remote())
    fe, ranks = st["keep_warm"], [r["keep_warm"] for r in st["ranks"]]
    assert fe["pieces"] == ["batch", "frame_checks", "frame_decode", "frame_reply", "reply"]
    assert fe["enabled"] and fe["runs"] > 0 and not fe["dropped"]
    # a GPU rank also rehearses a graph launch (every 1 ms unless DSPARK_KEEP_WARM_LAUNCH_US=0)
    launch = ["launch"] if PAIR_BACKEND == "push" and settings.current().keep_warm_launch_us > 0 else []
    assert ranks[0]["pieces"] == ["decode", "engine", *launch, "reply"]
    assert ranks[1]["pieces"] == ["decode", "engine", *launch]
    assert all(r["runs"] > 0 and not r["dropped"] for r in ranks), ranks
    # every party runs the driver's settings (conftest's 0 us periods), handed on by the front-end
    assert st["settings"] == settings.current().to_dict() and st["settings"]["keep_warm_us"] == 0.0
    assert all(r["settings"] == st["settings"] for r in st["ranks"])


def test_every_party_counts_the_steps_that_found_it_asleep(pair, cfg, ray_cluster):
    """STEPs further apart than the parties' spin each find the endpoint's thread and both ranks asleep, and each
    party says so in its status (wake_ups.py; the front-end also as the dspark_steps_after_sleep gauge)."""
    def counts():
        st = ray_cluster.get(pair[0].status.remote())
        return [st["wake_ups"]] + [r["wake_ups"] for r in st["ranks"]]
    before = counts()
    spin_s = before[0]["spin_ms"] / 1e3
    assert [b["spin_ms"] for b in before] == [before[0]["spin_ms"]] * 3
    step_one_request(pair, cfg, n_rounds=4, rows=2, gap_s=spin_s + 0.1)
    after = counts()
    for party, b, a in zip(("front-end", "rank 0", "rank 1"), before, after):
        assert a["steps"] - b["steps"] == 4, party
        assert a["after_sleep"] - b["after_sleep"] >= 3, party        # (the first may follow a busy earlier test)
    from dspark_ray.cli import asleep                                # what `dspark-ray status` prints of it
    assert asleep(after[1]) == f"{after[1]['after_sleep']} of {after[1]['steps']} STEPs found it asleep (spin " \
                               f"{after[1]['spin_ms']:g} ms)"
    assert asleep(None) == "no STEPs counted yet"


def dspark_samples(ray_cluster, pair_name: str) -> dict[tuple[str, str | None], float]:
    """The pair's samples on its node's Prometheus endpoint (Ray's metrics agent; one node here): (name, its `code`
    or `le` label) -> value, summed over the series (Ray labels each process's series apart)."""
    from prometheus_client.parser import text_string_to_metric_families
    (node,) = [n for n in ray_cluster.nodes() if n["Alive"]]
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[tuple[str, str | None], float] = collections.defaultdict(float)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("ray_dspark_") and s.labels.get("pair") == pair_name:
                out[s.name, s.labels.get("code") or s.labels.get("le")] += s.value
    return out


def metrics_agent_missing() -> str | None:
    """Why this Ray has no metrics agent (a `ray` install without `ray[default]`'s dashboard packages: the node's
    Prometheus port is then never served), or None when it has one."""
    from ray._private.utils import get_dashboard_dependency_error
    e = get_dashboard_dependency_error()
    return None if e is None else f"Ray's metrics agent is not installed (ray[default] is missing: {e})"


def test_prometheus_counters_move_during_a_run_without_a_status_call(pair, cfg, ray_cluster):
    """The front-end's metrics are live (metrics.py): STEPs move its counters on the node's Prometheus endpoint and
    fill the step-latency histogram, and the slots gauge counts a slot held, without any FrontEnd.status call (the
    only refresh there was before). The agent shows a worker's metrics some seconds late: polled, bounded. Skipped,
    with the reason, where Ray runs without its metrics agent (CI installs ray[default], so it runs there)."""
    if (why := metrics_agent_missing()) is not None:
        pytest.skip(why)
    n = 6
    before = dspark_samples(ray_cluster, "e2e")
    taps = workload.make_taps(cfg, 2, torch.Generator().manual_seed(8)).numpy()
    with client(pair) as c:
        (g,) = acquire_when_free(c, 1)
        for k in range(n):
            (r,) = c.step([make_entry(slot=g.slot, generation=g.generation, seed_token=5, start_pos=2 * k,
                                      token_ids=[1, 2], taps=taps)], deadline_ms=60_000)
            assert r.code == Code.OK, r.reason
        (r,) = c.step([make_entry(slot=g.slot, generation=g.generation, seed_token=cfg.vocab_size, start_pos=2 * n,
                                  token_ids=[1, 2], taps=taps)], deadline_ms=60_000)
        assert r.code == Code.BAD_ENTRY
        want = {("ray_dspark_steps_total", None): n + 1, ("ray_dspark_answers_total", "ok"): n,
                ("ray_dspark_answers_total", "bad_entry"): 1, ("ray_dspark_entries_total", None): n,
                ("ray_dspark_batches_total", None): n, ("ray_dspark_step_seconds_count", None): n + 1,
                ("ray_dspark_step_seconds_bucket", "+Inf"): n + 1}
        deadline = time.monotonic() + 60
        while True:
            now = dspark_samples(ray_cluster, "e2e")
            moved = {k: now.get(k, 0) - before.get(k, 0) for k in want}
            if all(moved[k] >= v for k, v in want.items()) and now.get(("ray_dspark_slots_held", None), 0) >= 1:
                break
            assert time.monotonic() < deadline, f"after 60 s: moved {moved}, want {want}, now {dict(now)}"
            time.sleep(1.0)
    assert now["ray_dspark_step_seconds_sum", None] > before.get(("ray_dspark_step_seconds_sum", None), 0)
    assert now["ray_dspark_unavailable", None] == 0 and ("ray_dspark_worker_generation", None) in now


def test_every_party_stamps_a_step_and_the_hops_join_in_path_order(pair, cfg, ray_cluster):
    """The timeline of bench/step_latency.py: each round trip's stamps (client, TCP thread, service, ring, both
    ranks) join by frame arrival time and ring seq, and follow the path's order."""
    from dspark_ray.observe.stamps import HOPS, join_round_trips, now
    g = torch.Generator().manual_seed(3)
    sent = []
    with client(pair) as c:
        (gr,) = acquire_when_free(c, 1)
        for k in range(4):
            e = make_entry(slot=gr.slot, generation=gr.generation, seed_token=5, start_pos=3 * k,
                           token_ids=np.arange(3), taps=workload.make_taps(cfg, 3, g).numpy())
            t0 = now()
            (r,) = c.step([e], deadline_ms=60_000)
            sent.append((t0, now()))
            assert r.code == Code.OK, r.reason
    rounds = join_round_trips(sent, ray_cluster.get(pair[0].stamps.remote()))
    assert len(rounds) == 4
    for row in rounds:
        # One clock for every process: each hop ends where the next starts and none runs backwards (the reply's
        # "sent" is stamped after sendall returns, by when the client may have read it).
        for name, a, b in HOPS:
            if name != "server_to_client":
                assert row[b] >= row[a], (name, row[b] - row[a])
        assert row["client_recv"] - row["client_send"] >= row["rank_ran"] - row["rank_started"] > 0


def test_step_over_http_through_ray_serve_equals_the_reference(pair, cfg, ckpt, ray_cluster):
    """The Serve HTTP app (http_gateway.py) in front of the pair: a JSON session acquires slots, steps rounds whose
    answers are the in-process reference's bit for bit, gets clear refusals ({code, reason}: 409 with the contract's
    code, 422 for a malformed body, 404 for an unknown session), and frees its slots when deleted."""
    import json
    import urllib.error
    import urllib.request

    from ray import serve

    from dspark_ray import http_gateway as http

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        http_port = s.getsockname()[1]
    try:
        base = http.start("e2e", f"{pair[1]}:{pair[2]}", "127.0.0.1", http_port)

        def call(method, url, body=None):
            req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        st, opened = call("POST", base, {"client": "http test", "tp": 2, "config_digest": cfg.digest()})
        assert st == 200 and opened["tp"] == 2 and opened["limits"]["slot_capacity"] == 8, opened
        sess = f"{base}/{opened['session']}"
        st, got = call("POST", f"{sess}/acquire", {"n": 2})
        assert st == 200, got
        grants = got["slots"]
        ref = Driver(RankEngine(make_drafter(cfg, "split", ckpt=ckpt), 2))
        for batch in workload.rounds(cfg, seed=11, n_requests=2, n_rounds=6, far_start=300):
            want = ref.step(batch)
            body = {"deadline_ms": 60_000, "entries": [
                http.entry_to_json(grants[i]["slot"], grants[i]["generation"], e.seed_token, e.token_array(),
                                   e.taps_array(cfg.n_taps * cfg.hidden_size), e.start_pos, e.rollback_to, e.n_out,
                                   e.want_margins)
                for i, e in enumerate(batch)]}
            st, got = call("POST", f"{sess}/step", body)
            assert st == 200, got
            for w, g in zip(want, got["results"]):
                assert g["code"] == "OK", g
                assert np.array_equal(np.asarray(g["drafts"], np.int32), w.drafts_array())
                assert np.array_equal(np.asarray(g["confidences"], np.float32), w.confidences_array())
                assert (g["margins"] is None) == (not w.margins)
                if w.margins:
                    assert np.array_equal(np.asarray(g["margins"], np.float32), w.margins_array())
                assert g["confident_len"] == w.confident_len
        st, got = call("POST", f"{sess}/acquire", {"n": 7})       # 6 of 8 free
        assert st == 409 and got["code"] == "OVERLOADED", got
        st, got = call("POST", f"{sess}/acquire", {"n": 99})      # more than the slots: never
        assert st == 409 and got["code"] == "BAD_ENTRY", got
        st, got = call("POST", f"{sess}/step", {"entries": [{"slot": 0}]})
        assert st == 422, got
        no_n_out = {k: v for k, v in body["entries"][0].items() if k != "n_out"}     # refused, not guessed at
        st, got = call("POST", f"{sess}/step", {"deadline_ms": 1000, "entries": [no_n_out]})
        assert st == 422 and "missing required field `n_out`" in got["reason"], got
        st, got = call("POST", f"{base}/nope/step", {"entries": []})
        assert st == 404 and got["code"] == "NO_SESSION", got
        st, refused = call("POST", base, {"tp": 1})
        assert st == 409 and refused["code"] == "CONFIG_MISMATCH", refused
        def delete():
            assert call("DELETE", sess) == (200, {"closed": True})
        frees_slots(pair, ray_cluster, 2, delete)
        # Serve cannot move its proxy: asking for another port is refused before anything is deployed.
        with pytest.raises(http.ProxyElsewhere, match=f"127.0.0.1:{http_port}"):
            http.start("e2e-other", f"{pair[1]}:{pair[2]}", "127.0.0.1", http_port + 1)
        assert "e2e-other-http" not in serve.status().applications
        http.check_address("127.0.0.1", http_port)
        http.stop("e2e")
        assert "e2e-http" not in serve.status().applications
    finally:
        serve.shutdown()
