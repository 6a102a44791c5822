"""Pairs against one-card workers (docs/performance.md, "Pairs or one-card workers"), for 1..N workers each.

A pair drafts one request faster (each card reads half the weights); two one-card workers draft twice as many
requests side by side (no replicated work, no collectives). Which wins depends on how many requests a serving engine
keeps live, which is the decision the seed notes made by hand. For each layout (pairs, one-card workers) and each
worker count the bench deploys the workers (`placement.deploy_workers`, as `dspark-ray serve --pairs N [--tp 1]`),
and for each live-request count R one engine thread (a `DrafterPool` over the workers' endpoints) steps decode
rounds: one STEP of R entries a round (`--rows` fresh rows and n_out 5 each), the pool's slots spread evenly, each
worker's share sent before any answer is read. Per (layout, workers, R): the round's p50 / p99 / min, and requests
and draft tokens per second at the p50. The figure beside the JSON (same name, .png) draws requests/s and round p50
against R, one line per layout and worker count.

    python bench/scaling.py --out bench/results/scaling_tiny_cpu.json           # tiny, CPU ranks, 1-4 workers
    python bench/scaling.py --preset full --ckpt /tmp/full --cards 2 --out scaling_h200x2.json
    python bench/scaling.py --plot bench/results/scaling_tiny_cpu.json          # redraw a result's figure

On a GPU host the worker counts default to every count the cards hold (pairs: 1..cards/2, one-card: 1..cards). On a
CPU host the "cards" are CPU ranks (gloo) sharing the host's cores: the figures test the machinery, not the
hardware (the result says so, and its file name ends in _cpu).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench import report                                    # noqa: E402


def log(msg: str) -> None:
    print(f"[scaling {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


LAYOUTS = (("pairs", 2), ("one_card", 1))       # (name, cards a worker)


def plan(cards: int | None, workers: list[int] | None) -> list[tuple[str, int, int]]:
    """(layout, tp, worker count) to run: the counts asked for, else every count the cards hold."""
    out = []
    for name, tp in LAYOUTS:
        counts = workers or list(range(1, (cards or 0) // tp + 1))
        out += [(name, tp, n) for n in counts if cards is None or n * tp <= cards]
    return out


def plot(result: dict, png: str) -> None:
    """The result's figure, written to `png`."""
    import matplotlib.pyplot as plt
    fig = figure(result)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def figure(result: dict):
    """Requests/s and round p50 against live requests: one line per layout (pairs solid, one-card workers dashed)
    and worker count (one colour each)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_rate, ax_p50) = plt.subplots(1, 2, figsize=(12, 4.8))
    counts = sorted({L["workers"] for L in result["layouts"]})
    colours = {n: plt.get_cmap("viridis")(i / max(1, len(counts) - 1) * 0.85) for i, n in enumerate(counts)}
    for L in result["layouts"]:
        if not L["rows"]:
            continue
        r = [row["requests"] for row in L["rows"]]
        style = dict(color=colours[L["workers"]], linestyle="-" if L["layout"] == "pairs" else "--", marker="o",
                     label=f"{L['workers']} {'pair' if L['layout'] == 'pairs' else 'one-card worker'}"
                           f"{'s' if L['workers'] > 1 else ''}")
        ax_rate.plot(r, [row["requests_per_s"] for row in L["rows"]], **style)
        ax_p50.plot(r, [row["round"]["p50_ms"] for row in L["rows"]], **style)
    where = "CPU ranks (gloo): machinery, not hardware" if result.get("cpu_figures") else result["device"]
    for ax, what in ((ax_rate, "requests / s (at the round p50)"), (ax_p50, "round p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(result["config"]["requests"], [str(r) for r in result["config"]["requests"]])
        ax.set_xlabel("live requests (one STEP entry each a round)")
        ax.set_ylabel(what)
        ax.grid(True, alpha=0.3)
    ax_rate.legend(fontsize=8)
    fig.suptitle(f"scaling, {result['config']['preset']} preset, {where} (commit {result['commit']})", fontsize=10)
    fig.tight_layout()
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--ckpt", help="an existing checkpoint (else the preset's, synthesized if missing)")
    ap.add_argument("--cards", type=int, help="cards to use (default: every GPU); a GPU host only")
    ap.add_argument("--workers", help="worker counts, comma-separated (default: 1,2,3,4 on a CPU host, every count "
                                      "the cards hold on a GPU host)")
    ap.add_argument("--requests", default="1,2,4,8", help="live requests per round, comma-separated")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--warmup-rounds", type=int, default=None, help="default: 200 on a GPU, 5 on a CPU")
    ap.add_argument("--rows", type=int, default=3, help="fresh rows per request per round (the first round: 8)")
    ap.add_argument("--slots", type=int, default=8, help="slots per worker")
    ap.add_argument("--dense", default="auto", choices=["auto", "triton", "cublas"], help="serve --dense")
    ap.add_argument("--out", help="the result's JSON; its figure is written beside it (.png)")
    ap.add_argument("--plot", metavar="JSON", help="only redraw the figure of this result (beside it, .png)")
    a = ap.parse_args()
    if a.plot:
        with open(a.plot) as f:
            plot(json.load(f), os.path.splitext(a.plot)[0] + ".png")
        return

    import numpy as np
    import ray
    import torch

    from dspark_ray.testing import workload
    from dspark_ray.actors.placement import bundles, deploy_workers, teardown
    from dspark_ray.spec import PairSpec
    from dspark_ray.cli import resolve_checkpoint
    from dspark_ray.protocol.contract import Code, make_entry
    from dspark_ray.client.pool import DrafterPool
    from dspark_ray.weights.loader import Checkpoint

    gpu = torch.cuda.is_available()
    cards = (a.cards or torch.cuda.device_count()) if gpu else None
    workers = [int(n) for n in a.workers.split(",")] if a.workers else (None if gpu else [1, 2, 3, 4])
    runs = plan(cards, workers)
    device = "cuda" if gpu else "cpu"
    ckpt = a.ckpt or resolve_checkpoint(a.preset, None, device=device)
    cfg = Checkpoint(ckpt).config
    requests = [int(r) for r in a.requests.split(",")]
    warm = a.warmup_rounds if a.warmup_rounds is not None else (200 if gpu else 5)
    # On a CPU host the ranks' bundles are logical (a quarter CPU each): enough of them for the widest layout.
    need = max(n * sum(b.get("CPU", 0) for b in bundles(tp, gpu)[0]) for _, tp, n in runs)
    ray.init(num_cpus=max(os.cpu_count() or 2, math.ceil(need)), include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING)
    g = torch.Generator().manual_seed(0)
    # Taps drawn once and reused round after round: drawing ~46 K random fp16 values per entry on the engine's
    # thread right before each STEP would cool its caches and cost the round trip more than the pool does.
    first_taps = workload.make_taps(cfg, 8, g).numpy()
    bank = [workload.make_taps(cfg, a.rows, g).numpy() for _ in range(16)]
    out = {**report.header(__file__, gpu=gpu), "cpu_figures": not gpu,
           "config": {"preset": a.preset, "cards": cards, "workers": sorted({n for _, _, n in runs}),
                      "requests": requests, "rounds": a.rounds, "warmup_rounds": warm, "rows_per_round": a.rows,
                      "n_out": 5, "slots_per_worker": a.slots, "dense": a.dense},
           "layouts": []}
    if not gpu:
        out["note"] = ("CPU figures: every rank a gloo process on this host's cores, shared by all workers; they show "
                       "the machinery (placement, pool fan-out), not what cards would do")
    for name, tp, n in runs:
        spec = PairSpec(checkpoint=ckpt, tp=tp, n_slots=a.slots, device=device, dense=a.dense,
                        backend="push" if gpu and tp == 2 else "gloo")
        log(f"{name} x{n}: deploying {n} worker(s) of tp {tp}")
        t0 = time.monotonic()
        deployed = deploy_workers(spec, n, name=f"scaling-{name}-{n}")
        log(f"{name} x{n}: ready in {time.monotonic() - t0:.1f} s: {[ep for _, ep in deployed]}")
        rows = []
        try:
            for r in requests:
                if r > n * a.slots:
                    log(f"{name} x{n}: {r} requests > {n} x {a.slots} slots: skipped")
                    continue
                with DrafterPool([ep for _, ep in deployed], timeout_s=60, spin_us=3000 if gpu else 0) as pool:
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
                    per_worker = [where.count(ep) for _, ep in deployed]
                    pool.release([gr.slot for gr in grants])
                s = report.percentiles(lat)
                row = {"requests": r, "round": s, "requests_per_s": round(r / s["p50_ms"] * 1e3, 1),
                       "drafts_per_s": round(5 * r / s["p50_ms"] * 1e3, 1),
                       "per_worker": per_worker}
                rows.append(row)
                log(f"{name} x{n} R={r}: p50 {s['p50_ms']:.3f} ms, {row['requests_per_s']} requests/s")
        finally:
            teardown(f"scaling-{name}-{n}")
        out["layouts"].append({"layout": name, "tp": tp, "workers": n, "rows": rows})
    # Per worker count and R, the one-card workers' p50 against the pairs' (both measured in this run).
    by = {(L["layout"], L["workers"]): {row["requests"]: row["round"]["p50_ms"] for row in L["rows"]}
          for L in out["layouts"]}
    out["one_card_over_pairs_p50"] = {
        n: {r: round(by["one_card", n][r] / by["pairs", n][r], 3) for r in requests
            if r in by.get(("pairs", n), {}) and r in by.get(("one_card", n), {})}
        for n in sorted({n for _, _, n in runs}) if ("pairs", n) in by and ("one_card", n) in by}
    report.write(out, a.out)
    if a.out:
        plot(out, os.path.splitext(a.out)[0] + ".png")


if __name__ == "__main__":
    main()
