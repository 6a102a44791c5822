"""STEP round trip over TCP loopback against a raw blocking-socket ping-pong of the same bytes.

The server runs in a second process (as a serving engine and the drafter would), with a fake front-end that answers
at once, so the figure is the transport's own cost: framing, msgpack, the connection thread and two socket hops.
The raw ping-pong sends the very same request / reply byte counts with bare send / recv_into: the floor for TCP here.

Placement decides the figure on the 2-core VM: client and server on one core measured ~10 us for the raw ping-pong,
on two cores ~60 us (waking an idle vCPU costs ~50 us there), and an unpinned run lands on either. So both are
measured, each pinned: `same_core` (the headline figures) and `split_cores`.

    python bench/tcp_roundtrip.py [--iters 3000] [--rows 6] [--out FILE]

`--service` instead measures the real front-end logic over the same transport: `StepService` (checks, slots,
batching, answers) in front of an instant pair, full-preset taps (`--rows` rows of 3 x 5120 fp16), client and
server in plain processes (unpinned), both polling for `--spin-us` before they block; from the stamps, the
server-side hops of bench/step_latency.py's timeline. Beside a deployed run it shows what the actor adds. With
`--shm` it also runs the same client through a shared-memory ring instead of the socket (transport/shm.py),
alternating the two, each in a fresh server process:

    python bench/tcp_roundtrip.py --service --shm --rows 3 --iters 2000 --repeats 3

`--service --metrics` asks what the front-end's metrics exporter (dspark_ray/observe/metrics.py) costs the step path: every
server process joins one local Ray (as the front-end actor's process is a Ray worker), and each repeat runs one server
with the exporter exporting every second through Ray's metrics agent and one without, alternating which goes first:

    python bench/tcp_roundtrip.py --service --metrics --rows 3 --iters 20000 --repeats 8
    python bench/tcp_roundtrip.py --service --metrics --rows 3 --iters 5000 --repeats 8 --gap-us 1000
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
import timeit

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench import report                            # noqa: E402
from dspark_ray.protocol import contract as C                 # noqa: E402
from dspark_ray.protocol import wire                         # noqa: E402
from dspark_ray.client import DrafterClient         # noqa: E402
from dspark_ray.config import tiny                  # noqa: E402

LIMITS = C.Limits.for_config(tiny(), slot_capacity=64)


class InstantFrontEnd:
    """Answers every entry at once with fixed drafts: the handler adds (almost) nothing to the round trip."""

    def open_session(self, peer):
        return 1

    def hello(self, session, msg):
        return C.HelloReply(ok=True, limits=LIMITS, session_id=session)

    def acquire(self, session, msg):
        return C.AcquireReply(slots=[C.SlotGrant(slot=i, generation=0) for i in range(msg.n)])

    def release(self, session, msg):
        return C.ReleaseReply(released=msg.slots)

    def step(self, session, msg, received_ns):
        return C.StepReply(results=[
            C.EntryResult(generation=e.generation, drafts=_DRAFTS[:4 * e.n_out], confidences=_CONF[:4 * e.n_out],
                          confident_len=e.n_out) for e in msg.entries])

    def close_session(self, session):
        pass


_DRAFTS = np.arange(5, dtype="<i4").tobytes()
_CONF = np.full(5, 0.75, "<f4").tobytes()


def _pin(cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def _serve_step(conn, cpu) -> None:
    from dspark_ray.transport.tcp import TcpServer
    _pin(cpu)
    srv = TcpServer(InstantFrontEnd(), "127.0.0.1", 0).start()
    conn.send(srv.port)
    conn.recv()                  # run until told to stop
    srv.stop()


def _recv_exactly(sock, view) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError
        got += n


def _serve_raw(conn, req_bytes: int, rep_bytes: int, cpu) -> None:
    _pin(cpu)
    lst = socket.create_server(("127.0.0.1", 0))
    conn.send(lst.getsockname()[1])
    s, _ = lst.accept()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(req_bytes))
    reply = bytes(rep_bytes)
    try:
        while True:
            _recv_exactly(s, buf)
            s.sendall(reply)
    except (EOFError, OSError):
        pass


def _stats(ns: list[int]) -> dict:
    # p90 beside p99: on the 2-core VM a few 1-5 ms host hiccups per second land in p99 of any loop this long.
    return report.percentiles(ns, "us", digits=1, scale=1e-3)


def bench_step(entries, iters: int, warmup: int, cpu) -> dict:
    parent, child = mp.Pipe()
    p = mp.Process(target=_serve_step, args=(child, cpu), daemon=True)
    p.start()
    port = parent.recv()
    times = []
    with DrafterClient("127.0.0.1", port, timeout_s=5.0) as c:
        c.hello(client="bench")
        for i in range(warmup + iters):
            t0 = time.perf_counter_ns()
            c.step(entries, deadline_ms=50.0)
            if i >= warmup:
                times.append(time.perf_counter_ns() - t0)
    parent.send("stop")
    p.join(10)
    return _stats(times)


def bench_raw(req_bytes: int, rep_bytes: int, iters: int, warmup: int, cpu) -> dict:
    parent, child = mp.Pipe()
    p = mp.Process(target=_serve_raw, args=(child, req_bytes, rep_bytes, cpu), daemon=True)
    p.start()
    port = parent.recv()
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    req = bytes(req_bytes)
    buf = memoryview(bytearray(rep_bytes))
    times = []
    for i in range(warmup + iters):
        t0 = time.perf_counter_ns()
        s.sendall(req)
        _recv_exactly(s, buf)
        if i >= warmup:
            times.append(time.perf_counter_ns() - t0)
    s.close()
    p.join(10)
    return _stats(times)


def _serve_service(conn, spin_us: float, ray_address: str | None = None, metrics: bool = False) -> None:
    """`ray_address`: join that Ray cluster first (a driver: a core worker in this process, as in an actor's);
    `metrics`: and run the front-end's metrics exporter (dspark_ray/observe/metrics.py) beside the service."""
    from dspark_ray.config import full
    from dspark_ray.observe.recorders import ServerRecorder, ServiceRecorder
    from dspark_ray.frontend.step_service import Identity, StepService
    from dspark_ray.transport.tcp import TcpServer
    from dspark_ray.testing.instant_pair import InstantPair
    if ray_address is not None:
        import logging

        import ray
        ray.init(address=ray_address, log_to_driver=False, logging_level=logging.WARNING)
    cfg = full()
    limits = C.Limits.for_config(cfg, slot_capacity=16)
    stamped = {"service": ServiceRecorder(), "tcp": ServerRecorder("bench", spin_us)}     # stamps, no rehearsals
    svc = StepService(Identity("bench", "bench", 2, cfg.max_model_len), limits, InstantPair(),
                      window=cfg.sliding_window, observer=stamped["service"])
    srv = TcpServer(svc, "127.0.0.1", 0, max_frame_bytes=limits.max_frame_bytes, spin_us=spin_us,
                    observer=stamped["tcp"]).start()
    exporter = None
    if metrics:
        from dspark_ray.observe.metrics import Exporter
        exporter = Exporter("bench", svc, None, srv).start()
    conn.send(srv.port)
    conn.recv()
    exports = None
    if exporter is not None:
        exporter.stop()
        exports = {"exports": exporter.exports, "steps": svc.stats["steps"],
                   "cpu_us_per_step": round(exporter.cpu_ns / 1e3 / max(1, svc.stats["steps"]), 2)}
    by_recv = {r["recv"]: r for r in stamped["service"].stamps.recent()}
    hops = {"frame_read": [], "checks": [], "batch_and_answers": [], "reply_send": []}
    for t in stamped["tcp"].stamps.recent():
        v = by_recv[t["recv"]]
        for k, a, b in (("frame_read", t["recv"], t["read"]), ("checks", t["read"], v["admitted"]),
                        ("batch_and_answers", v["admitted"], v["reply"]), ("reply_send", v["reply"], t["sent"])):
            hops[k].append(b - a)
    conn.send(({k: _stats(x) for k, x in hops.items()}, exports))
    srv.stop()


def bench_service(rows: int, iters: int, warmup: int, spin_us: float, shm: bool = False,
                  ray_address: str | None = None, metrics: bool = False, gap_us: float = 0.0) -> dict:
    from dspark_ray.config import full
    limits = C.Limits.for_config(full(), slot_capacity=16)
    taps = np.random.default_rng(0).standard_normal((rows, limits.taps_width)).astype(np.float16)
    # A process that joins Ray starts bare (spawn): a fork of this one would inherit its Ray driver.
    ctx = mp.get_context("spawn" if ray_address else "fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_serve_service, args=(child, spin_us, ray_address, metrics), daemon=True)
    p.start()
    port = parent.recv()
    times = []
    with DrafterClient("127.0.0.1", port, timeout_s=5.0, spin_us=spin_us, shm=shm) as c:
        c.hello(client="bench")
        (g,) = c.acquire(1)
        for i in range(warmup + iters):
            e = C.make_entry(slot=g.slot, generation=g.generation, seed_token=7, start_pos=i * rows,
                             token_ids=np.arange(rows), taps=taps)
            t0 = time.perf_counter_ns()
            (r,) = c.step([e], deadline_ms=1000.0)     # (a 2-core VM stalls now and then)
            t1 = time.perf_counter_ns()
            if i >= warmup:
                times.append(t1 - t0)
            assert r.code == C.Code.OK, r.reason
            while time.perf_counter_ns() - t1 < gap_us * 1e3:     # polled: both sides stay awake (--spin-us)
                pass
    parent.send("stop")
    hops, exports = parent.recv()
    p.join(10)
    return {"round_trip": _stats(times), "server_hops": hops,
            "config": {"preset": "full", "rows": rows, "taps_bytes": taps.nbytes, "spin_us": spin_us,
                       "iters": iters, "pair": "instant (dspark_ray/testing/instant_pair.py)",
                       "transport": "shm" if shm else "tcp", "gap_us": gap_us,
                       "server": "no Ray" if ray_address is None else
                       f"in a Ray driver, metrics exporter {'on' if metrics else 'off'}", "exporter": exports}}


def bench_metrics(a) -> dict:
    """Exporter off / on, alternating which runs first, each in a fresh server process joined to one local Ray."""
    import logging

    import ray
    ctx = ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    try:
        runs = []
        for k in range(a.repeats):
            for on in ((False, True) if k % 2 == 0 else (True, False)):
                r = bench_service(a.rows, a.iters, a.warmup, a.spin_us, ray_address=ctx.address_info["address"],
                                  metrics=on, gap_us=a.gap_us)
                runs.append({"metrics": "on" if on else "off", **r["round_trip"], "exporter": r["config"]["exporter"],
                             "server_hops_p50_us": {h: x["p50_us"] for h, x in r["server_hops"].items()}})
                print(json.dumps(runs[-1]), file=sys.stderr)
    finally:
        ray.shutdown()
    out = {**report.header(__file__), "bench": "tcp_roundtrip --service --metrics",
           "config": {**r["config"], "server": "in a Ray driver (one local Ray), exporter on / off alternating",
                      "exporter": "per run: its exports (one a second, one at the end), the STEPs, its CPU per STEP"},
           "runs": runs}
    for q in ("p50_us", "p90_us", "p99_us", "min_us"):
        out[f"{q}_median"] = {m: statistics.median(r[q] for r in runs if r["metrics"] == m) for m in ("off", "on")}
    out["exporter_cpu_us_per_step_median"] = statistics.median(r["exporter"]["cpu_us_per_step"] for r in runs
                                                               if r["metrics"] == "on")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--rows", type=int, default=6)
    ap.add_argument("--entries", type=int, default=1)
    ap.add_argument("--service", action="store_true", help="the real StepService over TCP (see above)")
    ap.add_argument("--spin-us", type=float, default=2000.0, help="--service: client and server polling")
    ap.add_argument("--shm", action="store_true",
                    help="--service: also through a shared-memory ring (transport/shm.py), alternating with TCP, "
                         "each --repeats times, each in a fresh server")
    ap.add_argument("--metrics", action="store_true",
                    help="--service: the metrics exporter off and on, alternating, --repeats times each (see above)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--gap-us", type=float, default=0.0,
                    help="--service: the client polls this long between a reply and its next STEP (a serving engine's "
                         "rounds come a trunk forward apart; keep it under --spin-us to keep both sides awake)")
    ap.add_argument("--out", help="also write the JSON here")
    a = ap.parse_args()
    if a.service and a.metrics:
        report.write(bench_metrics(a), a.out, indent=2)
        return
    if a.service:
        runs = [bench_service(a.rows, a.iters, a.warmup, a.spin_us, shm, gap_us=a.gap_us)
                for _ in range(a.repeats) for shm in ((False, True) if a.shm else (False,))]
        result = {**report.header(__file__), "bench": "tcp_roundtrip --service", **runs[0]}
        if len(runs) > 1:
            result["runs"] = [{"transport": r["config"]["transport"], **r["round_trip"]} for r in runs]
            result["p50_us_median"] = {t: statistics.median(r["round_trip"]["p50_us"] for r in runs
                                                            if r["config"]["transport"] == t)
                                       for t in dict.fromkeys(r["config"]["transport"] for r in runs)}
        report.write(result, a.out, indent=2)
        return

    rng = np.random.default_rng(0)
    entries = [C.make_entry(slot=i, generation=0, seed_token=7, start_pos=100, token_ids=np.arange(a.rows),
                            taps=rng.standard_normal((a.rows, LIMITS.taps_width)).astype(np.float16))
               for i in range(a.entries)]
    req = len(wire.encode(C.Step(entries=entries, deadline_ms=50.0)))
    rep = len(wire.encode(InstantFrontEnd().step(0, C.Step(entries=entries, deadline_ms=50.0), 0)))

    # What the front-end's stateless checks add per STEP (in-process, not part of the round trip above).
    step = C.Step(entries=entries, deadline_ms=50.0)
    validate_us = min(timeit.repeat(lambda: C.validate_entries(step, LIMITS), number=1000, repeat=5)) / 1000 * 1e6

    def both(server_cpu, client_cpu) -> dict:
        everywhere = os.sched_getaffinity(0)
        _pin(client_cpu)
        try:
            return {"step": bench_step(entries, a.iters, a.warmup, server_cpu),
                    "raw_socket": bench_raw(req, rep, a.iters, a.warmup, server_cpu)}
        finally:
            os.sched_setaffinity(0, everywhere)

    same = both(0, 0)
    split = both(0, 1) if os.cpu_count() > 1 else None
    result = {
        **report.header(__file__),
        **same["step"],
        "raw_socket": same["raw_socket"],
        "split_cores": split,
        "validate_entries_us": round(validate_us, 1),
        "config": {"preset": "tiny", "entries": a.entries, "rows": a.rows, "taps_width": LIMITS.taps_width,
                   "request_frame_bytes": req, "reply_frame_bytes": rep, "iters": a.iters,
                   "transport": "tcp loopback, two processes, blocking sockets, TCP_NODELAY",
                   "placement": "headline and raw_socket: client and server pinned to CPU 0; split_cores: 0 and 1"},
    }
    report.write(result, a.out, indent=2)


if __name__ == "__main__":
    main()
