"""Round trip of the shared-memory step ring (dspark_ray/transport/ring.py) between unrelated processes.

One round trip = writer.publish(payload) -> every reader next() + copies the payload out + complete() (reader 0
posts a 256-byte output record, as rank 0 posts drafts/confidences) -> writer.wait_completions() returns.

Cases:
  ring_2readers_{1KB,64KB}   back to back: the readers are still spinning when the next step arrives
  ring_1reader_1KB           the plain 1-reader ping-pong through the ring
  ring_2readers_1KB_step1ms  each reader busy-waits 1 ms before completing (a stand-in for the replay): the
                             writer falls asleep in wait_completions and is woken by the last completion;
                             overhead_* = round trip - 1 ms
  ring_2readers_1KB_woken    the writer idles `--idle-ms` between steps, so both readers are asleep on their
                             doorbells (FIFO + select) when the step arrives: the blocked-then-woken path
  raw_shm_pingpong           baseline without the ring: two processes flip one uint64 in shared memory
                             (spin + sched_yield): the floor of a shared-memory hand-off

Prints one JSON object per line: {name, p50_us, p99_us, min_us, n, config, device, commit}.
Usage: python bench/ring_roundtrip.py [--n 5000] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from multiprocessing import shared_memory

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench import report                                       # noqa: E402
from dspark_ray.transport.ring import RingClosed, StepRing     # noqa: E402

CTX = mp.get_context("spawn")
OUT_BYTES = 256                                 # rank 0's outputs per step (drafts, confidences, margins)


def _busy(us):
    end = time.perf_counter_ns() + int(us * 1e3)
    while time.perf_counter_ns() < end:
        pass


def _reader(handle, idx, ready, work_us):
    r = StepRing.attach(handle, idx)
    sink = bytearray(handle.max_message_bytes if handle.max_message_bytes < (64 << 20) else 1 << 20)
    out = bytes(OUT_BYTES) if idx == 0 else b""
    ready.put(idx)
    try:
        while True:
            seq, view = r.next(60.0)
            n = view.nbytes
            sink[:n] = view                     # a rank copies its inputs into static tensors
            del view
            if work_us:
                _busy(work_us)                  # stands in for the rank's replay
            r.complete(seq, 0, out)
    except RingClosed:
        pass
    finally:
        r.close()


def _raw_peer(name, n):
    shm = shared_memory.SharedMemory(name=name)   # spawn child of the creator: same tracker, fine for a bench
    w = np.ndarray((16,), dtype=np.uint64, buffer=shm.buf)
    for k in range(1, n + 1):
        while w[0] != k:
            os.sched_yield()
        w[8] = k
    del w
    shm.close()


def _stats(name, ns, config, meta):
    return {"name": name, **report.percentiles(ns, "us", digits=2, scale=1e-3), "config": config, **meta}


def ring_case(name, n_readers, payload_bytes, n, warmup, idle_s, meta, spin_us, work_us=0.0):
    w = StepRing.create("dsr-bench", n_readers, slot_bytes=1 << 20, n_slots=4, completion_bytes=4096,
                        spin_us=spin_us, max_message_bytes=1 << 20)
    ready = CTX.Queue()
    procs = [CTX.Process(target=_reader, args=(w.handle, i, ready, work_us), daemon=True) for i in range(n_readers)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=30)
    payload = os.urandom(payload_bytes)
    ns, asleep = [], 0
    sleep_words = w._sleep_words                # peeked only to report how often the readers were asleep
    try:
        for k in range(warmup + n):
            if idle_s:
                time.sleep(idle_s)
            both_asleep = all(w._w[s] for s in sleep_words)
            t0 = time.perf_counter_ns()
            seq = w.publish(payload, timeout_s=5.0)
            w.wait_completions(seq, timeout_s=5.0)
            t1 = time.perf_counter_ns()
            if k >= warmup:
                ns.append(t1 - t0)
                asleep += both_asleep
    finally:
        w.unlink()
        for p in procs:
            p.join(10)
    config = {"readers": n_readers, "payload_bytes": payload_bytes, "n_slots": 4, "slot_bytes": 1 << 20,
              "completion_bytes_reader0": OUT_BYTES, "spin_us": spin_us, "idle_ms_between_steps": idle_s * 1e3,
              "reader_work_us": work_us,
              "readers_asleep_at_publish": round(asleep / n, 3), "warmup": warmup}
    row = _stats(name, ns, config, meta)
    if work_us:                                 # what the ring adds to a step of `work_us`
        row["overhead_p50_us"] = round(row["p50_us"] - work_us, 2)
        row["overhead_p99_us"] = round(row["p99_us"] - work_us, 2)
    return row


def raw_case(n, warmup, meta):
    total = n + warmup
    shm = shared_memory.SharedMemory(create=True, size=128)
    w = np.ndarray((16,), dtype=np.uint64, buffer=shm.buf)
    w[:] = 0
    p = CTX.Process(target=_raw_peer, args=(shm.name, total), daemon=True)
    p.start()
    ns = []
    for k in range(1, total + 1):
        t0 = time.perf_counter_ns()
        w[0] = k
        while w[8] != k:
            os.sched_yield()
        t1 = time.perf_counter_ns()
        if k > warmup:
            ns.append(t1 - t0)
    p.join(10)
    del w
    shm.close()
    shm.unlink()
    return _stats("raw_shm_pingpong", ns, {"peers": 2, "wait": "spin+sched_yield", "warmup": warmup}, meta)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--n-woken", type=int, default=500)
    ap.add_argument("--idle-ms", type=float, default=2.0, help="writer idle time before each woken-path step")
    ap.add_argument("--spin-us", type=float, default=50.0)
    ap.add_argument("--out", help="also append the JSON lines to this file")
    args = ap.parse_args()
    # The CPU machine is shared: the 1-minute load average says how much the figures were disturbed.
    meta = {"device": report.cpu(), "commit": report.commit(), "load_avg_1m_at_start": round(os.getloadavg()[0], 2)}
    warm = 200
    rows = [
        ring_case("ring_2readers_1KB", 2, 1 << 10, args.n, warm, 0.0, meta, args.spin_us),
        ring_case("ring_2readers_64KB", 2, 64 << 10, args.n, warm, 0.0, meta, args.spin_us),
        ring_case("ring_1reader_1KB", 1, 1 << 10, args.n, warm, 0.0, meta, args.spin_us),
        ring_case("ring_2readers_1KB_woken", 2, 1 << 10, args.n_woken, 20, args.idle_ms * 1e-3, meta,
                  args.spin_us),
        ring_case("ring_2readers_1KB_step1ms", 2, 1 << 10, args.n_woken, 20, 0.0, meta, args.spin_us,
                  work_us=1000.0),
        raw_case(args.n, warm, meta),
    ]
    lines = [json.dumps(r) for r in rows]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
