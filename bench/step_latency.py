"""STEP latency over TCP loopback against the in-process step for the same inputs: the overhead of the front-end,
the shared-memory ring and the transport. Also the ring's own round trip.

Deploys one pair on a local Ray (tiny preset on CPU; `--preset full` with GPUs), runs the demo client's kind of
rounds (`--requests` entries a STEP, 1 by default; `--rows` fresh rows each per round, n_out 5), and times the
same entries through an in-process emulated pair (both ranks in this process, each on its own thread; on a CPU host
they share one interpreter lock, so this is slower than the deployed pair's two processes) and reads rank 0's own
engine time per step from the deployment: the service's overhead is the TCP round trip minus that. Every party
stamps each step (`dspark_ray/observe/stamps.py`); the JSON's "timeline" gives each hop of the round trip.
Prints one JSON object (p50 / p99 / min in ms, config, device, commit).

    python bench/step_latency.py [--rounds 60] [--out FILE]
    python bench/step_latency.py --preset full --ckpt /tmp/full --rounds 2000 --repeats 3 --pin-ab \
        --rank-cpus 2,3 --frontend-cpus 5 --client-cpu 7        # fresh pairs, alternating, medians of each
    python bench/step_latency.py --preset full --ckpt /tmp/full --rounds 400 --warmup-rounds 200 --gap-us 20000
        # as a serving engine steps: its trunk's forward (here 20 ms) between two STEPs
    python bench/step_latency.py --tp 1 --preset full --ckpt /tmp/full --rounds 2000   # one rank on one card
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench import report                                     # noqa: E402
from dspark_ray.cli import cpu_list                          # noqa: E402
from dspark_ray.rank.graphs import step_graphs_enabled              # noqa: E402
from dspark_ray.observe.keep_warm import keep_warm_enabled, keep_warm_period_us   # noqa: E402



def log(msg: str) -> None:
    print(f"[step_latency {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cpu_key(stamp: str) -> str:
    """The CPU stamp beside a joined wall stamp: "svc_admitted" -> "svc_cpu_admitted"."""
    party, name = stamp.split("_", 1)
    return f"{party}_cpu_{name}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--tp", type=int, choices=(1, 2), default=2, help="1: one rank on one card (the host path alone)")
    ap.add_argument("--shm", action="store_true", help="the client's requests through shared memory (contract "
                                                         "section 9) instead of TCP")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--rows", type=int, default=3)
    ap.add_argument("--requests", type=int, default=1, help="entries a STEP (one per request, each its own slot)")
    ap.add_argument("--warmup-rounds", type=int, default=None,
                    help="untimed rounds first (default 3000 with GPUs, 20 on a CPU): a serving engine steps without "
                         "pause, and the host path's hops took 2-3x longer in the first second of rounds on the GPU "
                         "host than after several")
    ap.add_argument("--ckpt", help="an existing checkpoint (else the preset's default, synthesized if missing)")
    ap.add_argument("--client-spin-us", type=float, default=3000.0,
                    help="the client polls this long for its reply before blocking (DrafterClient spin_us)")
    ap.add_argument("--rank-cpus", type=cpu_list, help="pin the ranks' step loops: one vCPU per rank (9,12)")
    ap.add_argument("--frontend-cpus", type=cpu_list, help="pin the front-end's endpoint threads (18)")
    ap.add_argument("--client-cpu", type=int, help="pin this bench's client thread to one vCPU")
    ap.add_argument("--gap-us", type=float, default=0.0,
                    help="the client busy-waits this long between a reply and its next STEP (the serving engine's "
                         "trunk forward between two decode rounds: ~10-50 ms); 0: back to back")
    ap.add_argument("--ring-spin-us", type=float, default=None,
                    help="PairSpec.ring_spin_us: how long the ranks and the front-end poll before they sleep "
                         "(default: the spec's, 100 ms on a GPU host)")
    ap.add_argument("--spare-ranks", type=int, default=None,
                    help="PairSpec.spare_ranks (default: the spec's, 2 on a GPU); timing starts once they are ready")
    ap.add_argument("--repeats", type=int, default=1, help="deploy a fresh pair this many times (per variant)")
    ap.add_argument("--pin-ab", action="store_true",
                    help="alternate unpinned deployments with ones pinned as --rank-cpus / --frontend-cpus / "
                         "--client-cpu say; the medians of each are reported")
    ap.add_argument("--out")
    a = ap.parse_args()

    import logging

    import numpy as np
    import ray
    import torch

    import msgspec

    from dspark_ray.testing import workload
    from dspark_ray.testing.at_rest import spares_pending, wait_for_spares
    from dspark_ray.testing.batches import Batcher, entry
    from dspark_ray.actors.placement import deploy, teardown
    from dspark_ray.spec import PairSpec
    from dspark_ray.cli import resolve_checkpoint
    from dspark_ray.client import DrafterClient
    from dspark_ray.protocol.contract import Code
    from dspark_ray.rank.engine import RankEngine
    from dspark_ray.rank.modes import make_emulated, run_pair
    from dspark_ray.scheduling import thread_deltas
    from dspark_ray.observe.stamps import CPU_HOPS, HOPS, RANK_PHASES, join_round_trips, now
    from dspark_ray.weights.loader import Checkpoint

    torch.set_num_threads(1)
    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= a.tp
    device = "cuda" if gpu else "cpu"
    ckpt = a.ckpt or resolve_checkpoint(a.preset, None, device=device)
    ck = Checkpoint(ckpt)
    cfg = ck.config
    g = torch.Generator().manual_seed(0)
    warm = a.warmup_rounds if a.warmup_rounds is not None else (3000 if gpu else 20)
    # Per round, one entry per request (request q on slot q); with several requests the taps come from a bank (fresh
    # taps for every entry of 3000 warm-up rounds would not fit in memory).
    R = a.requests
    bank = [workload.make_taps(cfg, a.rows, g) for _ in range(64)] if R > 1 else None
    entries = []
    pos = [0] * R
    for r in range(warm + a.rounds):
        n = 8 if r == 0 else a.rows
        batch = []
        for q in range(R):
            taps = workload.make_taps(cfg, n, g) if bank is None or r == 0 else bank[(r * R + q) % len(bank)]
            batch.append(entry(slot=q, seed_token=int(torch.randint(0, cfg.vocab_size, (1,), generator=g)), n_out=5,
                               start_pos=pos[q], token_ids=torch.randint(0, cfg.vocab_size, (n,), generator=g),
                               taps=taps))
            pos[q] += n
        entries.append(batch)

    # In-process: the emulated pair (two threads), same entries (CPU only: on a GPU host the reference for the
    # round trip is the pair's graph replay, bench/draft_step.py, and rank 0's own engine time below).
    inproc = []
    if not gpu:
        d0, d1 = make_emulated(cfg, ckpt=ck)
        e0, e1 = RankEngine(d0, R, 0), RankEngine(d1, R, 1)
        place = Batcher(e0.slots)
        for batch in entries:
            rb = place(batch)
            t0 = time.perf_counter()
            run_pair(lambda: e0.step(rb), lambda: e1.step(rb))
            inproc.append((time.perf_counter() - t0) * 1e3)

    # Every party also stamps its thread's CPU time (stamps.cpu_now): the front-end hands its settings to every
    # actor it starts (settings.as_env).
    os.environ["DSPARK_STAMP_CPU"] = "1"
    from dspark_ray.settings import reread
    reread()
    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING)
    all_cpus = os.sched_getaffinity(0)
    base = PairSpec(checkpoint=ckpt, tp=a.tp, n_slots=max(4, R), backend="push" if gpu else "gloo", device=device,
                    ring_spin_us=a.ring_spin_us, spare_ranks=a.spare_ranks)
    gap_ns = int(a.gap_us * 1e3)
    pinning = {"ranks": a.rank_cpus, "frontend": a.frontend_cpus, "client": a.client_cpu}
    unpinned = {"ranks": None, "frontend": None, "client": None}

    def deploy_and_step(pins: dict) -> dict:
        """One fresh deployment: the warm-up and timed rounds over TCP; the stamps of every party."""
        spec = dataclasses.replace(base, rank_cpus=pins["ranks"], frontend_cpus=pins["frontend"])
        log(f"deploying the pair ({spec.backend}, {spec.device}; pinned {pins})")
        fe, endpoint = deploy(spec, name="bench")
        log(f"serving on {endpoint}")
        st, waited = wait_for_spares(fe, limit_s=300.0, poll_s=0.2)     # time the worker at rest
        if spares_pending(st):
            raise RuntimeError(f"spare ranks not ready after {waited:.0f} s: {st['spares_ready']} of {st['spares']}")
        if st.get("spares"):
            log(f"{st['spares']} spare rank sets ready after {waited:.1f} s")
        host, port = endpoint.rsplit(":", 1)
        client = []                               # per round: (sent, received), stamps.now
        sent = []                                 # per round: the client's encode and send call, ns
        os.sched_setaffinity(0, {pins["client"]} if pins["client"] is not None else all_cpus)  # the client's thread
        with DrafterClient(host, int(port), timeout_s=60, spin_us=a.client_spin_us, shm=a.shm) as c:
            c.hello(client="step_latency bench")
            grants = c.acquire(R)
            log(f"warm-up rounds: {warm}")
            for i, batch in enumerate(entries):
                if i == warm:
                    before = ray.get(fe.status.remote())      # while connected: the connection's thread is listed
                    log(f"timed rounds: {a.rounds}")
                ents = [msgspec.structs.replace(e, slot=gr.slot, generation=gr.generation)
                        for gr, e in zip(grants, batch)]
                if gap_ns:
                    # Busy, like an engine's thread driving its trunk's forward (a sleep would also cool this core).
                    until = now() + gap_ns
                    while now() < until:
                        pass
                t0 = now()
                res = c.step(ents, deadline_ms=60_000)
                if i >= warm:
                    client.append((t0, now()))
                    sent.append(c.last_sent_ns - t0)
                assert all(x.code == Code.OK for x in res), [x.reason for x in res]
            log("timed rounds: done")
            status = ray.get(fe.status.remote())
        st = ray.get(fe.stamps.remote())
        teardown("bench")
        os.sched_setaffinity(0, all_cpus)
        return {"client": client, "sent": sent, "stamps": st, "before": before, "status": status}

    def analyze(run: dict) -> dict:
        """The round trip, its hops, the ranks' phases, the threads: one deployment's figures."""
        status, before = run["status"], run["before"]
        steps = join_round_trips(run["client"], run["stamps"])
        tcp = [(s["client_recv"] - s["client_send"]) / 1e6 for s in steps]
        rank_ms = [(s["r0_engine_out"] - s["r0_engine_in"]) / 1e6 for s in steps]
        res = {
            # The per-step processes: cores, load, each thread's last core and niceness (Ray starts workers at 15)
            # (scheduling.py).
            "processes": {"frontend": status.get("process"), "ranks": [r.get("process") for r in status["ranks"]]},
            "markov_cache": [r.get("markov_cache") for r in status["ranks"]],
            "rank0_engine_step": report.percentiles(rank_ms),
            "tcp_step": report.percentiles(tcp),
            # The client's own part of client_to_server: encoding the STEP and the send call (on loopback the send
            # call also runs the receiving side's TCP processing).
            "client_encode_and_send": report.percentiles([x / 1e6 for x in run["sent"]]),
            # What the service adds around the ranks' own step: front-end checks, batching, ring, TCP, client.
            "overhead_p50_ms": round(statistics.median(tcp) - statistics.median(rank_ms), 3),
            # Where a round trip goes, hop by hop (p50 of each hop over the rounds; the hops of one round add up to
            # its round trip). The rank hops are the rank that completed last (the critical path); its peer's are
            # under "ranks".
            "timeline": {name: report.percentiles([(s[b] - s[a]) / 1e6 for s in steps]) for name, a, b in HOPS
                         if all(a in s and b in s for s in steps)},        # (an eager engine has no graph stamps)
            "ranks": {f"rank{r}_{k}": report.percentiles([(s[f"r{r}_{b}"] - s[f"r{r}_{a}"]) / 1e6 for s in steps])
                      for r in range(base.tp) for k, a, b in RANK_PHASES},
            # Hops run by one thread: the CPU time its thread used in them against their wall time (p50 each). CPU
            # ~ wall: the code is slow; CPU << wall: the thread was off the CPU (preempted, or waiting for the GIL).
            "cpu_in_hops": {name: {"wall_p50_ms": report.percentiles([(s[b] - s[a]) / 1e6 for s in steps])["p50_ms"],
                                   "cpu_p50_ms": report.percentiles([(s[cpu_key(b)] - s[cpu_key(a)]) / 1e6
                                                                     for s in steps])["p50_ms"]}
                            for name, a, b in CPU_HOPS if all(cpu_key(a) in s and cpu_key(b) in s for s in steps)},
            # Per thread over the timed rounds: CPU used, time waited runnable for a core, preemptions.
            "threads_over_the_rounds": {
                "frontend": thread_deltas(before["process"], status["process"]),
                "ranks": [thread_deltas(b["process"], a_["process"]) for b, a_ in zip(before["ranks"],
                                                                                     status["ranks"])]},
        }
        # The target, from this one run: the round trip at most the pair's graph work (the slower rank's
        # run phase: upload, insert and draft replays, download) + 0.1 ms.
        work = max(res["ranks"][f"rank{r}_run"]["p50_ms"] for r in range(base.tp))
        res["target"] = {"round_trip_p50_ms": res["tcp_step"]["p50_ms"], "pair_work_p50_ms": work,
                         "limit_ms": round(work + 0.1, 3), "met": res["tcp_step"]["p50_ms"] <= work + 0.1}
        return res

    # With --pin-ab the deployments alternate unpinned / pinned; each is a fresh pair (the time outside the work
    # moves by ~0.05 ms from one deployment to the next, so one run each decides nothing).
    if a.pin_ab and pinning == unpinned:
        ap.error("--pin-ab needs the pinned variant: --rank-cpus, --frontend-cpus and/or --client-cpu")
    label = "pinned" if pinning != unpinned else "unpinned"
    plan = [("unpinned", unpinned), ("pinned", pinning)] * a.repeats if a.pin_ab else [(label, pinning)] * a.repeats
    runs = []
    for k, (name, pins) in enumerate(plan):
        log(f"run {k + 1} / {len(plan)}: {name}")
        res = analyze(deploy_and_step(pins))
        res["variant"], res["pinned_vcpus"] = name, pins
        runs.append(res)
    ray.shutdown()

    # The ring alone (2 readers, 1 KB), from its own bench.
    ring = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "ring_roundtrip.py"),
                           "--n", "2000", "--n-woken", "100"], capture_output=True, text=True)
    ring_rows = [json.loads(line) for line in ring.stdout.splitlines() if line.startswith("{")]
    first = runs[0]
    out = {
        **report.header(__file__, gpu=gpu),
        "config": {"preset": a.preset, "tp": base.tp, "backend": base.backend if base.tp == 2 else None,
                   "requests": R, "rows_per_round": a.rows,
                   "n_out": 5, "rounds": a.rounds, "warmup_rounds": warm, "repeats": a.repeats,
                   "pin_ab": a.pin_ab, "client_spin_us": a.client_spin_us, "gap_us": a.gap_us,
                   "server_and_ring_spin_us": base.spin_us, "spare_ranks": base.spares,
                   "markov_cache": base.markov_cache,
                   "pinned_vcpus": pinning, "step_graphs": step_graphs_enabled(),
                   "keep_warm_us": keep_warm_period_us() if keep_warm_enabled() else None,
                   "transport": "shm" if a.shm else "tcp"},
        "host_cpus": os.cpu_count(),
        "in_process_emulated_pair": report.percentiles(inproc[warm:]) if inproc else None,
        # every figure below is the first run's; "runs" and "medians" hold each run's headline
        **{k: v for k, v in first.items() if k not in ("variant", "pinned_vcpus")},
        "ring_roundtrip": ring_rows,
        "runs": [{"variant": r["variant"], "pinned_vcpus": r["pinned_vcpus"], **r["target"],
                  "outside_the_work_ms": round(r["target"]["round_trip_p50_ms"] - r["target"]["pair_work_p50_ms"], 3)}
                 for r in runs],
    }
    out["medians"] = {}
    for name in dict.fromkeys(r["variant"] for r in out["runs"]):
        mine = [r for r in out["runs"] if r["variant"] == name]
        out["medians"][name] = {k: round(statistics.median(r[k] for r in mine), 3)
                                for k in ("round_trip_p50_ms", "pair_work_p50_ms", "outside_the_work_ms")}
    report.write(out, a.out)
    del np


if __name__ == "__main__":
    main()
