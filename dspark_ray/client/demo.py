"""The scripted demo client: what a serving engine does each decode round (HELLO, ACQUIRE, a STEP a round with
synthetic taps, RELEASE), against one endpoint or several, comma-separated (a DrafterPool).
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from ..protocol.contract import Code, make_entry
from .pool import DrafterPool


def run(endpoint: str, rounds: int = 8, requests: int = 2, seed: int = 0, n_out: int = 5, quiet: bool = False,
        print_fn=print, shm: bool = False, token: str | None = None) -> dict:
    rng = np.random.default_rng(seed)
    with DrafterPool(endpoint, timeout_s=30, shm=shm, token=token) as c:
        hello = c.hello(client="dspark-ray demo")
        lim = hello.limits
        live = [w for w in c.status() if w["down"] is None]
        print_fn(f"HELLO ok: model {hello.model_digest}, config {hello.config_digest}, tp {hello.tp}, "
                 f"worker generation {hello.worker_generation}, {lim.slot_capacity} slots"
                 + (f" on each of {len(live)} workers" if len(c.workers) > 1 else ""))
        grants = c.acquire(requests)
        slots = {g.slot: g.generation for g in grants}
        pos = {s: 0 for s in slots}
        seeds = {s: int(rng.integers(lim.vocab_size)) for s in slots}
        lat = []
        for r in range(rounds):
            entries = []
            for s, gen in slots.items():
                rows = 6 if r == 0 else int(rng.integers(1, lim.max_n_out + 2))
                taps = rng.standard_normal((rows, lim.taps_width)).astype(np.float16)
                ids = rng.integers(0, lim.vocab_size, rows)
                entries.append(make_entry(slot=s, generation=gen, seed_token=seeds[s], start_pos=pos[s],
                                          token_ids=ids, taps=taps, n_out=n_out, want_margins=True))
                pos[s] += rows
            t0 = time.perf_counter()
            results = c.step(entries, deadline_ms=5000)
            lat.append((time.perf_counter() - t0) * 1e3)
            for (s, _), res in zip(slots.items(), results):
                if res.code != Code.OK:
                    print_fn(f"round {r:2d} slot {s}: {Code(res.code).name}: {res.reason}")
                    continue
                d = res.drafts_array()
                seeds[s] = int(d[0])
                if not quiet:
                    conf = " ".join(f"{x:.2f}" for x in res.confidences_array())
                    print_fn(f"round {r:2d} slot {s} p0 {pos[s]:5d}: drafts {d.tolist()}  confidences [{conf}]  "
                             f"confident prefix {res.confident_len}")
        c.release(list(slots))
    summary = {"rounds": rounds, "requests": requests, "p50_ms": statistics.median(lat), "min_ms": min(lat)}
    print_fn(f"{rounds} rounds x {requests} requests: STEP round trip p50 {summary['p50_ms']:.2f} ms, "
             f"min {summary['min_ms']:.2f} ms")
    return summary
