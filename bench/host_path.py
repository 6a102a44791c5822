"""The host path's Python pieces, each timed alone in one process: what a STEP costs the CPU outside the GPU work.

bench/step_latency.py shows each hop of a deployed round trip; this shows the code inside the hops without the
processes, sockets and waits around it, so two hosts (or two commits) compare piece by piece. Two yardsticks of the
host's own speed come with it: a pure-Python loop and a numpy copy of one STEP's taps.
Full preset shapes (1 entry, `--rows` rows of 3 x 5120 fp16 taps, n_out 5); no GPU, no checkpoint needed.

    python bench/host_path.py [--rows 3] [--out FILE]
    python bench/host_path.py --between spin:1000          # each piece after a 1 ms wait: cold
    python bench/host_path.py --between spin:1000+warm:50  # ... having run 50 us before: warm
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench import report                                                    # noqa: E402
from dspark_ray.protocol import contract as C                                        # noqa: E402
from dspark_ray.protocol import records as M                                 # noqa: E402
from dspark_ray.model.collectives import LocalCollectives                         # noqa: E402
from dspark_ray.config import full                                          # noqa: E402
from dspark_ray.frontend.step_service import Identity, StepService                       # noqa: E402
from dspark_ray.rank.graphs import GraphSet                                      # noqa: E402
from dspark_ray.model.state import SlotState                                # noqa: E402
from dspark_ray.protocol.wire import HEADER_SIZE, FrameWriter, decode_payload        # noqa: E402
from dspark_ray.testing.instant_pair import InstantPair                                # noqa: E402


def between_calls(kind: str):
    """What runs between two timed calls: nothing ("none": the piece runs hot, back to back), or what a step-path
    thread does between STEPs, for `us` microseconds: "spin:us" polls the clock, "yield:us" polls with
    `os.sched_yield()` between checks (as the ring's waiters do), "sleep:us" sleeps. "+warm:us" after either: the
    piece also runs once, untimed, `us` before the timed call. A piece slower after a gap runs from cold caches in
    the service; a piece as fast with "+warm" can be kept warm by running it while the thread waits."""
    if kind == "none":
        return lambda fn: None
    gap, _, warm = kind.partition("+warm:")
    how, us = gap.split(":")
    if how not in ("spin", "yield", "sleep"):
        raise ValueError(f"--between {kind!r}: none, spin:US, yield:US or sleep:US, optionally +warm:US")
    ns = int(float(us) * 1e3)
    warm_ns = int(float(warm) * 1e3) if warm else None

    def wait(n):
        if how == "sleep":
            time.sleep(n / 1e9)
            return
        end = time.perf_counter_ns() + n
        while time.perf_counter_ns() < end:
            if how == "yield":
                os.sched_yield()

    def between(fn):
        if warm_ns is None:
            wait(ns)
        else:
            wait(max(0, ns - warm_ns))
            fn()
            wait(warm_ns)
    return between


BETWEEN = between_calls("none")


def timed(fn, n: int) -> dict:
    for _ in range(min(200, n)):
        fn()
    ts = []
    for _ in range(n):
        BETWEEN(fn)
        t0 = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t0)
    return report.percentiles(ts, "us", digits=2, scale=1e-3)


class ShapesOnly:
    """What a GraphSet reads of its drafter to build its buffers: the config, no weights (its staging and unpacking
    at full shapes, without a checkpoint)."""

    def __init__(self, cfg):
        self.cfg, self.device, self.coll = cfg, torch.device("cpu"), LocalCollectives(1)

    def new_slot(self) -> SlotState:
        c = self.cfg
        return SlotState(c.n_blocks, c.sliding_window, 128, c.head_dim)


def measure(rows: int, n: int) -> dict:
    """Every piece's timing, in this process."""
    torch.set_num_threads(1)
    cfg = full()
    limits = C.Limits.for_config(cfg, slot_capacity=16)
    width = limits.taps_width
    taps = np.random.default_rng(0).standard_normal((rows, width)).astype(np.float16)
    ids = np.arange(rows)

    def entry(pos):
        return C.make_entry(slot=0, generation=1, seed_token=5, start_pos=pos, token_ids=ids, taps=taps)

    step = C.Step(entries=[entry(0)], deadline_ms=100.0)
    writer = FrameWriter()
    frame = writer.encode(step, 1)
    payload = memoryview(frame)[HEADER_SIZE:]
    msg = decode_payload(C.MsgType.STEP, payload)
    batch = M.RingBatch([], [M.RingEntry.of(msg.entries[0], (0, rows))])
    batch_bytes = M.encode(batch)
    ring_slot = np.zeros(max(1 << 20, len(batch_bytes)), np.uint8)     # (a larger batch spills on the ring)
    slot_view = memoryview(ring_slot)
    slot_view[:len(batch_bytes)] = batch_bytes
    in_slot = slot_view[:len(batch_bytes)].toreadonly()
    drafts, confidences = np.arange(5, dtype=np.int32), np.full(5, 0.75, np.float32)

    def results_encode():               # the engine's answer from its host arrays, and the rank's reply
        return M.encode(M.RingReply([C.EntryResult(drafts=drafts.astype("<i4", copy=False).tobytes(),
                                                   confidences=confidences.astype("<f4", copy=False).tobytes(),
                                                   confident_len=3)]))
    reply = results_encode()
    results = M.decode_reply(reply).results

    service = StepService(Identity("m", "c", 2, cfg.max_model_len), limits, InstantPair(), window=cfg.sliding_window)
    session = service.open_session("bench")
    service.sessions[session]["hello"] = True
    (grant,) = service.acquire(session, C.Acquire(n=1)).slots
    pos = [0]

    def service_step():                 # a fresh, valid entry each time: the slot's cursor moves on
        e = C.Entry(slot=grant.slot, generation=grant.generation, seed_token=5, start_pos=pos[0],
                    token_ids=msg.entries[0].token_ids, taps=msg.entries[0].taps, n_out=5)
        pos[0] += rows
        if pos[0] > cfg.max_model_len - 2 * rows:
            pos[0] = 0
            service.table.grant(grant.slot, session)
        e.generation = service.slots[grant.slot].cursor.generation
        r = service.step(session, C.Step(entries=[e], deadline_ms=100.0), time.monotonic_ns())
        assert r.results[0].code == C.Code.OK, r.results[0].reason

    # The rank's graph set around its replays: staging the insert (its chunks, positions, pool rows and taps) and the
    # draft's inputs into the pinned buffer, and reading the downloaded outputs. `memcpy` set: as on a GPU, where the
    # graphs copy their inputs and outputs themselves (no host copy is timed).
    gs = GraphSet(ShapesOnly(cfg), 16)
    gs.copies.memcpy = lambda *a: None
    slot = gs.slots[0]
    slot.advance(0, 200)
    inserts = [(slot, 200, M.decode_batch(in_slot).entries[0].taps_array(width))]
    packed = torch.zeros(1, 2 * 5 + 1, dtype=torch.float64)          # drafts, confidences, confident length

    def py_loop():
        x = 0
        for i in range(1000):
            x += i
        return x

    def copy_taps():
        slot_view[:taps.nbytes] = taps.data.cast("B")

    return {
        "yardstick_python_1000_adds": timed(py_loop, n),
        "yardstick_copy_taps": timed(copy_taps, n),
        "client_encode_step": timed(lambda: writer.pack(step, 1), n),
        "server_decode_step": timed(lambda: decode_payload(C.MsgType.STEP, payload), n),
        "frontend_validate": timed(lambda: (C.validate_step(msg, limits), C.validate_entries(msg, limits)), n),
        "frontend_step_instant_pair": timed(service_step, n),
        "frontend_batch_encode": timed(lambda: M.encode(batch), n),
        "ring_publish_copy": timed(lambda: slot_view.__setitem__(slice(0, len(batch_bytes)), batch_bytes), n),
        "rank_decode_batch": timed(lambda: M.decode_batch(in_slot), n),
        "rank_decode_and_view_taps": timed(lambda: M.decode_batch(in_slot).entries[0].taps_array(width), n),
        "rank_stage_insert": timed(lambda: [gs.stage_insert(c) for c in gs.chunks(inserts)], n),
        "rank_stage_draft": timed(lambda: gs.stage_draft([slot], [5]), n),
        "rank_unpack": timed(lambda: gs._unpack(packed, 1, 5, 5, False, True), n),
        "rank_results_encode": timed(results_encode, n),
        "frontend_decode_reply": timed(lambda: M.decode_reply(reply), n),
        "reply_encode": timed(lambda: writer.pack(C.StepReply(results=[C.EntryResult(
            generation=1, drafts=results[0].drafts, confidences=results[0].confidences,
            confident_len=results[0].confident_len)]), 1), n),
    }


def measure_in_actor(rows: int, n: int) -> dict:
    """The same pieces inside a Ray actor (a local Ray): does the actor's process slow them down?"""
    import ray
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {"PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}

    @ray.remote(num_cpus=1, runtime_env={"env_vars": env})
    def run():
        from bench import host_path
        return host_path.measure(rows, n)
    try:
        return ray.get(run.remote())
    finally:
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=3)
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--in-actor", action="store_true", help="also time every piece inside a Ray worker process")
    ap.add_argument("--between", default="none",
                    help="none, spin:US, yield:US or sleep:US between two timed calls, optionally +warm:US")
    ap.add_argument("--out")
    a = ap.parse_args()
    global BETWEEN
    BETWEEN = between_calls(a.between)
    pieces = measure(a.rows, a.n)
    res = {**report.header(__file__),
           "config": {"preset": "full", "rows": a.rows, "between": a.between,
                      "taps_bytes": a.rows * full().n_taps * full().hidden_size * 2, "n_out": 5},
           "numpy": np.__version__, "torch": torch.__version__, "pieces": pieces}
    if a.in_actor:
        res["pieces_in_ray_worker"] = measure_in_actor(a.rows, a.n)
    report.write(res, a.out, indent=1)


if __name__ == "__main__":
    main()
