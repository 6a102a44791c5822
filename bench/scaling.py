"""The scaling experiment (DESIGN.md, "Scaling"): on the same cards, N tp2 pairs against 2N one-card workers.

A pair drafts one request faster (each card reads half the weights); two one-card workers draft twice as many
requests side by side (no replicated work, no collectives). Which wins depends on how many requests a serving engine
keeps live, which is the decision the seed notes made by hand. For each layout the bench deploys its workers
(`placement.deploy_workers`, as `dspark-ray serve --pairs N [--tp 1]`), and for each live-request count R one
engine thread (a `DrafterPool` over the workers' endpoints) steps decode rounds: one STEP of R entries a round
(`--rows` fresh rows and n_out 5 each), the pool's slots spread evenly, each worker's share sent before any answer
is read. Per (layout, R): the round's p50 / p99 / min, and requests and draft tokens per second at the p50.

    .venv/bin/python bench/scaling.py --out bench/results/scaling_cpu.json       # tiny, CPU "cards" (2)
    python bench/scaling.py --preset full --ckpt /tmp/full --cards 2 --rounds 300 --out ...   # a GPU host

On a CPU host the "cards" are CPU ranks (gloo): the figures test the machinery, not the hardware.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))      # support.workload

from step_latency import summary                            # noqa: E402
from tcp_roundtrip import _commit, _device, emit              # noqa: E402


def log(msg: str) -> None:
    print(f"[scaling {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def layouts(cards: int) -> list[tuple[str, int, int]]:
    """(name, tp, workers) for `cards` cards: pairs, then one-card workers."""
    return [("pairs", 2, cards // 2), ("one_card", 1, cards)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--ckpt", help="an existing checkpoint (else the preset's, synthesized if missing)")
    ap.add_argument("--cards", type=int, help="cards to use (default: every GPU; 2 on a CPU host)")
    ap.add_argument("--requests", default="1,2,4,8", help="live requests per round, comma-separated")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--warmup-rounds", type=int, default=None, help="default: 200 on a GPU, 5 on a CPU")
    ap.add_argument("--rows", type=int, default=3, help="fresh rows per request per round (the first round: 8)")
    ap.add_argument("--slots", type=int, default=8, help="slots per worker")
    ap.add_argument("--dense", default="auto", choices=["auto", "triton", "cublas"], help="serve --dense")
    ap.add_argument("--out")
    a = ap.parse_args()

    import numpy as np
    import ray
    import torch

    from support import workload
    from dspark_ray.actors.placement import deploy_workers, teardown
    from dspark_ray.spec import PairSpec
    from dspark_ray.cli import resolve_checkpoint
    from dspark_ray.contract import Code, make_entry
    from dspark_ray.pool import DrafterPool
    from dspark_ray.weights.loader import Checkpoint

    gpu = torch.cuda.is_available()
    cards = a.cards or (torch.cuda.device_count() if gpu else 2)
    device = "cuda" if gpu else "cpu"
    ckpt = a.ckpt or resolve_checkpoint(a.preset, None, device=device)
    cfg = Checkpoint(ckpt).config
    requests = [int(r) for r in a.requests.split(",")]
    warm = a.warmup_rounds if a.warmup_rounds is not None else (200 if gpu else 5)
    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING)
    g = torch.Generator().manual_seed(0)
    # Taps drawn once and reused round after round: drawing ~46 K random fp16 values per entry on the engine's
    # thread right before each STEP would cool its caches and cost the round trip more than the pool does.
    first_taps = workload.make_taps(cfg, 8, g).numpy()
    bank = [workload.make_taps(cfg, a.rows, g).numpy() for _ in range(16)]
    out = {"bench": "scaling", "device": torch.cuda.get_device_name(0) if gpu else _device(),
           "commit": _commit(), "command": "python " + " ".join(sys.argv),
           "config": {"preset": a.preset, "cards": cards, "requests": requests, "rounds": a.rounds,
                      "warmup_rounds": warm, "rows_per_round": a.rows, "n_out": 5, "slots_per_worker": a.slots,
                      "dense": a.dense},
           "layouts": []}
    for name, tp, n in layouts(cards):
        if n < 1:
            log(f"{name}: needs {tp} cards, {cards} given: skipped")
            continue
        spec = PairSpec(checkpoint=ckpt, tp=tp, n_slots=a.slots, device=device, dense=a.dense,
                        backend="push" if gpu and tp == 2 else "gloo")
        log(f"{name}: deploying {n} worker(s) of tp {tp}")
        t0 = time.monotonic()
        workers = deploy_workers(spec, n, name=f"scaling-{name}")
        log(f"{name}: ready in {time.monotonic() - t0:.1f} s: {[ep for _, ep in workers]}")
        rows = []
        try:
            for r in requests:
                if r > n * a.slots:
                    log(f"{name}: {r} requests > {n} x {a.slots} slots: skipped")
                    continue
                with DrafterPool([ep for _, ep in workers], timeout_s=60, spin_us=3000 if gpu else 0) as pool:
                    pool.hello(client="scaling bench")
                    grants = pool.acquire(r)
                    pos = [0] * r
                    lat = []
                    for k in range(warm + a.rounds):
                        entries = []
                        for i, gr in enumerate(grants):
                            taps = first_taps if k == 0 else bank[(k * r + i) % len(bank)]
                            m = len(taps)
                            entries.append(make_entry(
                                slot=gr.slot, generation=gr.generation, start_pos=pos[i], n_out=5,
                                seed_token=(k * 7919 + i) % cfg.vocab_size,
                                token_ids=(np.arange(m) + k * m + i) % cfg.vocab_size, taps=taps))
                            pos[i] += m
                        t = time.perf_counter()
                        res = pool.step(entries, deadline_ms=60_000)
                        if k >= warm:
                            lat.append((time.perf_counter() - t) * 1e3)
                        bad = [x.reason for x in res if x.code != Code.OK]
                        assert not bad, bad
                    where = [pool.worker_of(gr.slot) for gr in grants]
                    per_worker = [where.count(ep) for _, ep in workers]
                    pool.release([gr.slot for gr in grants])
                s = summary(lat)
                row = {"requests": r, "round": s, "requests_per_s": round(r / s["p50_ms"] * 1e3, 1),
                       "drafts_per_s": round(5 * r / s["p50_ms"] * 1e3, 1),
                       "per_worker": per_worker}
                rows.append(row)
                log(f"{name} R={r}: p50 {s['p50_ms']:.3f} ms, {row['requests_per_s']} requests/s")
        finally:
            teardown(f"scaling-{name}")
        out["layouts"].append({"layout": name, "tp": tp, "workers": n, "rows": rows})
    # Per R, the one-card workers' p50 against the pairs' (both measured in this run).
    by = {L["layout"]: {row["requests"]: row["round"]["p50_ms"] for row in L["rows"]} for L in out["layouts"]}
    if "pairs" in by and "one_card" in by:
        out["one_card_over_pairs_p50"] = {r: round(by["one_card"][r] / by["pairs"][r], 3)
                                          for r in requests if r in by["pairs"] and r in by["one_card"]}
    emit(out, a.out, 1)


if __name__ == "__main__":
    main()
