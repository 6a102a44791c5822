"""What an engine gains: exllamav3 1.6.5's generator on the full-width synthetic DeepSeek-V4 model (GPU).

    source .devbundle/setup.sh && python bench/in_engine.py --out bench/results/gpu/in_engine_full_h100.json

The engine model (weights/engine_model.py: the full preset's drafter over a 3-layer trunk, FP8 Linears) is written
on the card, exllamav3 loads the trunk, and the committed prompts (bench/in_engine_prompts.json) each generate
`--new` tokens, greedy, at each batch size, five ways:

  none        (a) no drafting
  exllamav3   (b) exllamav3's own DSpark drafter
  dspark      (c) dspark-ray's worker on the same card (tp1, a local Ray) through `RemoteDrafter`, its STEP sent when
                  verification ends (the default)
  dspark_blocking (c) the same, its STEP sent from the draft call and waited for there (`early=False`)
  ceiling     (d) a drafter that costs nothing: the drafts (c) verified at each (job, position), replayed from memory,
                  so its acceptance is (c)'s. No drafter can do better in this engine.

exllamav3's drafter and dspark-ray's worker do not fit one 80 GB card beside the trunk together, so (b) runs first,
its drafter loaded for it alone; the worker is then deployed and (a), (c) and (d) alternate `--repeats` times (drift
in the card's clocks hits each alike). Each mode first generates a short warm-up. Per mode and batch: tokens/s,
mean accepted drafts a round, the draft phase as the generator sees it (p50 / p99; steady rounds and a job's first
draft apart), the generator's host work between verification and the next draft call, and the early STEP's flight;
the tables take each mode's median run by tokens/s, and `ratio_to_ceiling` gives (c) / (d). Prints JSON.
"""
from __future__ import annotations

import argparse
import gc
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

import torch  # noqa: E402

from bench import report  # noqa: E402
from dspark_ray.testing import in_engine as E  # noqa: E402

WORKER_MODES = ("none", "dspark_blocking", "dspark", "ceiling")


def log(msg: str) -> None:
    print(f"[in_engine {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class ReplayDrafter:
    """Mode (d): each row's drafts are those a recorded run verified at the same (job, position), from memory; its
    rows, calls and capabilities are the remote drafter's, its cost none."""

    def __init__(self, like, recorded: "E.Run"):
        from dspark_ray.engines.exllamav3.remote_drafter import _Drafts
        self._drafts_type = _Drafts
        self.config, self.caps, self.block_size = like.config, like.caps, like.block_size
        self.draft_verifier_params = like.draft_verifier_params     # the trunk exports the same taps
        self.table = {(i, kv): d for i, rounds in recorded.rounds.items() for kv, (d, _) in rounds.items() if d}
        self.rows = None

    def cache_for(self, cache):
        from dspark_ray.engines.exllamav3.draft_cache import DraftCache
        return DraftCache(cache, lambda: None)

    def bind(self, generator) -> "ReplayDrafter":
        from dspark_ray.engines.exllamav3.generator_rows import GeneratorRows
        self.rows = GeneratorRows(generator)
        return self

    def attach_to(self, target) -> None:
        pass

    def update_kv_from_target(self, *args, **kw) -> None:
        pass

    def forward(self, input_ids, params, **kw):
        kv = params["cache_seqlens"].tolist()
        out = input_ids[:, -1:].to(torch.long).repeat(1, self.block_size + 1)
        conf = 0
        for i, row in enumerate(self.rows.batch(params["block_table"], kv)):
            d = self.table.get((row.job.identifier, kv[i])) if row is not None else None
            if d:
                out[i, 1:1 + len(d)] = torch.tensor(d)
                conf = max(conf, len(d))
        return self._drafts_type(out, conf)

    def sample_from_state(self, state, params):
        params["draft_confidence_len"] = state.confidence_len
        return state.ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full", choices=["tiny", "full"])
    ap.add_argument("--model-dir", default=None, help="where the engine model is (written there if missing)")
    ap.add_argument("--new", type=int, default=64, help="new tokens a prompt")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--deadline-ms", type=float, default=50.0)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each mode, alternated; the median is reported")
    ap.add_argument("--ring-spin-us", type=float, default=2000.0,
                    help="the worker's parties spin this long for the next step (PairSpec.ring_spin_us; 2 ms: the "
                         "worker shares the engine's host, docs/exllamav3.md)")
    ap.add_argument("--client-spin-us", type=float, default=0.0, help="the adapter's client spin for a reply")
    ap.add_argument("--skip-exllamav3", action="store_true", help="leave mode (b) out")
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
    prompts = E.prompts(a.prompts)
    batches = [int(b) for b in a.batches.split(",")]
    out = {**report.header(__file__, gpu=True), "preset": a.preset,
           "config": {"prompts": len(prompts), "prompt_lengths": [len(p) for p in prompts], "new_tokens": a.new,
                      "batches": batches, "deadline_ms": a.deadline_ms, "greedy": True, "repeats": a.repeats,
                      "engine": "exllamav3 1.6.5 Generator", "dspark": "tp1 worker on the same card, TCP",
                      "DSPARK_KEEP_WARM_LAUNCH_US": os.environ["DSPARK_KEEP_WARM_LAUNCH_US"],
                      "ring_spin_us": a.ring_spin_us, "client_spin_us": a.client_spin_us,
                      "order": "(b) alone first, then (a), (c) blocking, (c) early, (d) alternated"},
           "runs": [], "median_runs": {}, "lossless": {}, "ratios": {}}

    def save() -> None:
        out["wall_s"] = round(time.time() - t_start, 1)
        report.save(out, a.out)

    def record(reps: dict, mode: str, b: int, rep: int, r: "E.Run") -> None:
        reps.setdefault(mode, []).append(r)
        s = r.summary() | {"repeat": rep}
        out["runs"].append(s)
        log(f"batch {b} {mode} #{rep}: {s['tokens_per_s']} tok/s, accepted {s['mean_accepted']}, draft phase p50 "
            f"{s['draft_phase_ms_p50']} p99 {s['draft_phase_ms_p99']} ms, host gap p50 {s['host_gap_ms_p50']} ms")

    by_batch: dict[int, dict[str, list]] = {b: {} for b in batches}
    if not a.skip_exllamav3:                 # (b) alone: its drafter and the worker do not fit one card together
        t0 = time.time()
        own, own_cache = E.own_drafter(trunk)
        log(f"exllamav3's drafter loaded in {time.time() - t0:.1f} s")
        for b in batches:
            E.generate(trunk, prompts[:2], mode="exllamav3", batch=b, max_new=8, draft_model=own,
                       draft_cache=own_cache)
            for rep in range(a.repeats):
                record(by_batch[b], "exllamav3", b, rep, E.generate(trunk, prompts, mode="exllamav3", batch=b,
                                                                      max_new=a.new, draft_model=own,
                                                                      draft_cache=own_cache))
        del own, own_cache
        gc.collect()
        torch.cuda.empty_cache()
        save()

    import ray
    from dspark_ray.actors.placement import deploy, teardown
    from dspark_ray.engines.exllamav3 import RemoteDrafter
    from dspark_ray.spec import PairSpec
    ray.init(num_cpus=max(4, min(8, os.cpu_count() or 4)), include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING, namespace="dspark")
    try:
        t0 = time.time()
        spec = PairSpec(checkpoint=model_dir, tp=1, n_slots=16, max_batch=max(batches), backend="gloo", device="cuda",
                        ring_spin_us=a.ring_spin_us)
        fe, endpoint = deploy(spec, name="in-engine")
        log(f"dspark-ray worker serving on {endpoint} in {time.time() - t0:.1f} s")
        remotes = {early: RemoteDrafter(endpoint, trunk.config, deadline_ms=a.deadline_ms, margins=True,
                                        spin_us=a.client_spin_us, early=early) for early in (True, False)}
        drafters = {"none": None, "dspark_blocking": remotes[False], "dspark": remotes[True]}
        for b in batches:
            reps = by_batch[b]
            recorded = None
            for mode in WORKER_MODES:                                          # warm-up
                d = drafters.get(mode) if mode != "ceiling" else ReplayDrafter(remotes[True], E.Run(mode, b))
                E.generate(trunk, prompts[:2], mode=mode, batch=b, max_new=8, draft_model=d,
                           draft_cache=d.cache_for(trunk.cache) if d is not None else None)
            for rep in range(a.repeats):
                for mode in WORKER_MODES:
                    if mode == "ceiling":
                        d = ReplayDrafter(remotes[True], recorded)
                    else:
                        d = drafters[mode]
                    r = E.generate(trunk, prompts, mode=mode, batch=b, max_new=a.new, draft_model=d,
                                   draft_cache=d.cache_for(trunk.cache) if d is not None else None)
                    if mode == "dspark" and recorded is None:
                        recorded = r
                    record(reps, mode, b, rep, r)
            runs = {m: sorted(rs, key=lambda r: r.new_tokens / r.wall_s)[len(rs) // 2] for m, rs in reps.items()}
            summ = {m: r.summary() for m, r in runs.items()}
            out["median_runs"][f"batch{b}"] = summ
            lossless = {f"{m}_vs_none": E.compare(runs["none"], runs[m], margins=runs[m].margins or None)
                        for m in runs if m != "none"}
            if "exllamav3" in runs:
                lossless["dspark_vs_exllamav3_drafts"] = E.compare(runs["none"], runs["dspark"],
                                                                   drafter_ref=runs["exllamav3"],
                                                                   margins=runs["dspark"].margins)
            out["lossless"][f"batch{b}"] = lossless
            tps = {m: s["tokens_per_s"] for m, s in summ.items()}
            out["ratios"][f"batch{b}"] = {
                "dspark_ratio_to_ceiling": round(tps["dspark"] / tps["ceiling"], 4),
                "dspark_blocking_ratio_to_ceiling": round(tps["dspark_blocking"] / tps["ceiling"], 4),
                "dspark_over_dspark_blocking": round(tps["dspark"] / tps["dspark_blocking"], 4),
                "dspark_over_none": round(tps["dspark"] / tps["none"], 4),
                **({"dspark_over_exllamav3": round(tps["dspark"] / tps["exllamav3"], 4)} if "exllamav3" in tps
                   else {})}
            log(f"batch {b}: {out['ratios'][f'batch{b}']}")
            save()
        for r in remotes.values():
            r.close()
    finally:
        teardown("in-engine")
        ray.shutdown()
    out["wall_s"] = round(time.time() - t_start, 1)
    report.write(out, a.out)


if __name__ == "__main__":
    main()
