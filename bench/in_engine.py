"""What an engine gains: exllamav3 1.6.5's generator on the full-width synthetic DeepSeek-V4 model (GPU).

    source .devbundle/setup.sh && python bench/in_engine.py --out bench/results/gpu/in_engine_full_h200.json

One H200: the engine model (weights/engine_model.py: the full preset's drafter over a 3-layer trunk, FP8 Linears) is
written on the card, exllamav3 loads the trunk, and the committed prompts (bench/in_engine_prompts.json) each
generate `--new` tokens, greedy, at batch 1 and 4, three ways in one run: (a) no drafting, (b) exllamav3's own
DSpark drafter, (c) dspark-ray's worker on the same card (tp1, deployed on a local Ray) through
`engines.exllamav3.RemoteDrafter`. Per mode and batch: tokens/s, rounds/s, mean accepted drafts a round, and the
draft phase's time per round inside the generator (its `iterate_draftmodel_dflash_gen`, p50 / p99); the tokens of
(b) and (c) against (a). Beside it, what the measured draft times and acceptance would give at seed 000's
production round (its trunk's verify forward 43.68 ms at depth 5): tokens/s = (1 + accepted) / (43.68 ms + draft).
Each mode first generates a short warm-up (not counted), then the modes alternate `--repeats` times; the tables take
each mode's median run (by tokens/s). Prints JSON.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

# The worker shares the engine's card here: its ranks' rehearsed graph launches between steps (a kernel every 1 ms,
# for a card of their own) would time-slice the card against the trunk's forward. Off, before dspark_ray is read.
os.environ.setdefault("DSPARK_KEEP_WARM_LAUNCH_US", "0")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from bench import report  # noqa: E402
from support import in_engine as E  # noqa: E402

PRODUCTION_VERIFY_MS = 43.68        # seed 000: REMOTE_ROUND_MS at depth 5 (its trunk's verify forward)


def log(msg: str) -> None:
    print(f"[in_engine {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def projection(summary: dict) -> dict:
    acc, draft = summary["mean_accepted"], summary["draft_phase_ms_p50"]
    if acc is None or draft is None:
        return {"tokens_per_s": round(1e3 / PRODUCTION_VERIFY_MS, 2), "round_ms": PRODUCTION_VERIFY_MS}
    round_ms = PRODUCTION_VERIFY_MS + draft
    return {"tokens_per_s": round((1 + acc) * 1e3 / round_ms, 2), "round_ms": round(round_ms, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full", choices=["tiny", "full"])
    ap.add_argument("--model-dir", default=None, help="where the engine model is (written there if missing)")
    ap.add_argument("--new", type=int, default=64, help="new tokens a prompt")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--deadline-ms", type=float, default=50.0)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each mode, alternated; the median is reported")
    ap.add_argument("--ring-spin-us", type=float, default=2000.0,
                    help="the worker's parties spin this long for the next step (PairSpec.ring_spin_us; 2 ms: the "
                         "worker shares the engine's host, docs/exllamav3.md)")
    ap.add_argument("--client-spin-us", type=float, default=0.0, help="the adapter's client spin for a reply")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    t_start = time.time()
    model_dir = a.model_dir or f"/tmp/engine_{a.preset}"
    from dspark_ray.weights.manifest import MANIFEST_NAME
    if not (Path(model_dir) / MANIFEST_NAME).is_file():
        from dspark_ray.weights.engine_model import write_engine_model
        t0 = time.time()
        write_engine_model(a.preset, model_dir, device="cuda", progress=False)
        log(f"engine model {a.preset} written to {model_dir} in {time.time() - t0:.1f} s")
    t0 = time.time()
    trunk = E.load_trunk(model_dir)
    log(f"trunk loaded in {time.time() - t0:.1f} s")

    import ray
    from dspark_ray.actors.placement import deploy, teardown
    from dspark_ray.engines.exllamav3 import RemoteDrafter
    from dspark_ray.spec import PairSpec
    ray.init(num_cpus=max(4, min(8, os.cpu_count() or 4)), include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING, namespace="dspark")
    prompts = E.prompts(a.prompts)
    batches = [int(b) for b in a.batches.split(",")]
    out = {**report.header(__file__, gpu=True), "preset": a.preset,
           "config": {"prompts": len(prompts), "prompt_lengths": [len(p) for p in prompts], "new_tokens": a.new,
                      "batches": batches, "deadline_ms": a.deadline_ms, "greedy": True,
                      "engine": "exllamav3 1.6.5 Generator", "dspark": "tp1 worker on the same card, TCP",
                      "DSPARK_KEEP_WARM_LAUNCH_US": os.environ["DSPARK_KEEP_WARM_LAUNCH_US"],
                      "ring_spin_us": a.ring_spin_us, "client_spin_us": a.client_spin_us},
           "runs": [], "lossless": {}, "projection_at_seed000_round": {}}
    def save() -> None:
        out["wall_s"] = round(time.time() - t_start, 1)
        report.save(out, a.out)

    try:
        t0 = time.time()               # before the worker: its Markov cache is sized by the memory left then
        own, own_cache = E.own_drafter(trunk)
        log(f"exllamav3's drafter loaded in {time.time() - t0:.1f} s")
        t0 = time.time()
        spec = PairSpec(checkpoint=model_dir, tp=1, n_slots=16, max_batch=max(batches), backend="gloo", device="cuda",
                        ring_spin_us=a.ring_spin_us)
        fe, endpoint = deploy(spec, name="in-engine")
        log(f"dspark-ray worker serving on {endpoint} in {time.time() - t0:.1f} s")
        remote = RemoteDrafter(endpoint, trunk.config, deadline_ms=a.deadline_ms, margins=True,
                               spin_us=a.client_spin_us)
        modes = {"none": {}, "exllamav3": dict(draft_model=own, draft_cache=own_cache),
                 "dspark": dict(draft_model=remote, draft_cache=remote.cache_for(trunk.cache))}
        for b in batches:
            for mode, kw in modes.items():
                E.generate(trunk, prompts[:2], mode=mode, batch=b, max_new=8, **kw)           # warm-up
            reps = {m: [] for m in modes}
            for rep in range(a.repeats):            # the modes alternate: drift in the card's clocks hits each alike
                for mode, kw in modes.items():
                    r = E.generate(trunk, prompts, mode=mode, batch=b, max_new=a.new, **kw)
                    reps[mode].append(r)
                    s = r.summary() | {"repeat": rep}
                    out["runs"].append(s)
                    log(f"batch {b} {mode} #{rep}: {s['tokens_per_s']} tok/s, accepted {s['mean_accepted']}, draft "
                        f"phase p50 {s['draft_phase_ms_p50']} ms, generation pass p50 {s['verify_phase_ms_p50']} ms")
            runs = {m: sorted(rs, key=lambda r: r.new_tokens / r.wall_s)[len(rs) // 2] for m, rs in reps.items()}
            out.setdefault("median_runs", {})[f"batch{b}"] = {m: r.summary() for m, r in runs.items()}
            out["lossless"][f"batch{b}"] = {
                "exllamav3_vs_none": E.compare(runs["none"], runs["exllamav3"]),
                "dspark_vs_none_and_exllamav3": E.compare(runs["none"], runs["dspark"], drafter_ref=runs["exllamav3"],
                                                          margins=runs["dspark"].margins)}
            sb, sc, sa = (runs[m].summary() for m in ("exllamav3", "dspark", "none"))
            out.setdefault("ratios", {})[f"batch{b}"] = {
                "draft_phase_exllamav3_over_dspark": round(sb["draft_phase_ms_p50"] / sc["draft_phase_ms_p50"], 3),
                "tokens_per_s_dspark_over_exllamav3": round(sc["tokens_per_s"] / sb["tokens_per_s"], 3),
                "tokens_per_s_dspark_over_none": round(sc["tokens_per_s"] / sa["tokens_per_s"], 3)}
            out["projection_at_seed000_round"][f"batch{b}"] = {m: projection(runs[m].summary())
                                                               for m in ("none", "exllamav3", "dspark")}
            save()
        remote.close()
    finally:
        teardown("in-engine")
        ray.shutdown()
    out["wall_s"] = round(time.time() - t_start, 1)
    report.write(out, a.out)


if __name__ == "__main__":
    main()
