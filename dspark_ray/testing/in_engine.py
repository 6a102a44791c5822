"""exllamav3 1.6.5's generator generating greedily on a synthetic DeepSeek-V4 model (weights/engine_model.py), three
ways: no drafting, its own DSpark drafter, dspark-ray's deployed worker through `engines.exllamav3.RemoteDrafter`.
The GPU test (tests/test_in_engine_gpu.py) and the bench (bench/in_engine.py) share it.

A run records, per job: its tokens; per draft round, its position (kv), the drafts it verified, how many were
accepted (exllamav3's own `draft_stats`); per round of the generator, the draft phase's wall time (the generator's
`iterate_draftmodel_dflash_gen`, timed from outside). `compare` applies the issue's rule: wherever two drafters'
drafts agree at a position, their accepted lengths agree; every first difference of drafts is a near-tie of ours
(margin recorded); every token differing from the undrafted run is a trunk near-tie (margin recorded); the rest is
unexplained.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

PROMPTS = Path(__file__).resolve().parents[2] / "bench" / "in_engine_prompts.json"
# A first difference of drafts is a drafter near-tie when our margin there is at most this (logits are fp16 values
# up to ~50 here: 2 fp16 steps at 32-64 are 0.06; one at 64-128 is 0.06 too).
DRAFT_TIE = 0.0625
TRUNK_TIE = 0.0625


def prompts(n: int | None = None) -> list[list[int]]:
    p = json.loads(PROMPTS.read_text())["prompts"]
    return p if n is None else p[:n]


@dataclass
class Trunk:
    config: object
    model: object
    cache: object
    tokenizer: object


def load_trunk(model_dir: str, max_tokens: int = 16384, device: str = "cuda:0") -> Trunk:
    from exllamav3 import Cache, Config, Model, Tokenizer
    config = Config.from_directory(model_dir)
    model = Model.from_config(config)
    cache = Cache(model, max_num_tokens=max_tokens, max_history=config.dspark_block_size + 1)
    model.load(device=device, max_batch_size=8)
    return Trunk(config, model, cache, Tokenizer.from_config(config))


def own_drafter(trunk: Trunk, device: str = "cuda:0"):
    """exllamav3's own DSpark drafter (the `mtp` component) and its draft cache."""
    from exllamav3 import Cache, Model
    model = Model.from_config(trunk.config, component="mtp")
    cache = Cache(model, max_num_tokens=trunk.cache.max_num_tokens)
    model.load(device=device)
    return model, cache


@dataclass
class Run:
    mode: str
    batch: int
    tokens: dict[int, list[int]] = field(default_factory=dict)            # prompt index -> new tokens
    rounds: dict[int, dict[int, tuple]] = field(default_factory=dict)     # prompt index -> kv -> (drafts, accepted)
    draft_ms: list[float] = field(default_factory=list)                   # per draft phase
    margins: dict[tuple[int, int], list[float]] = field(default_factory=dict)   # (prompt, kv) -> ours, if asked
    verify_ms: list[float] = field(default_factory=list)       # per generation pass (the trunk's forward, sampling,
    update_ms: list[float] = field(default_factory=list)       # ... and the drafter's update_kv_from_target in it)
    timeline: list[dict] = field(default_factory=list)         # per draft phase: perf_counter stamps (see summary)
    steps: list[dict] = field(default_factory=list)            # per STEP the drafter sent: its stamps
    in_draft: bool = False
    iterations: int = 0
    wall_s: float = 0.0
    drafter_stats: dict = field(default_factory=dict)

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens.values())

    def summary(self) -> dict:
        drafted = [a for r in self.rounds.values() for (_, a) in r.values()]
        return {"mode": self.mode, "batch": self.batch, "new_tokens": self.new_tokens, "wall_s": round(self.wall_s, 4),
                "tokens_per_s": round(self.new_tokens / self.wall_s, 2) if self.wall_s else None,
                "rounds_per_s": round(self.iterations / self.wall_s, 2) if self.wall_s else None,
                "draft_rounds": len(drafted),
                "mean_accepted": round(statistics.fmean(drafted), 4) if drafted else None,
                "draft_phase_ms_p50": round(statistics.median(self.draft_ms), 4) if self.draft_ms else None,
                "draft_phase_ms_p99": round(sorted(self.draft_ms)[int(0.99 * (len(self.draft_ms) - 1))], 4)
                if self.draft_ms else None,
                "draft_phases": len(self.draft_ms),
                "verify_phase_ms_p50": round(statistics.median(self.verify_ms), 4) if self.verify_ms else None,
                "update_ms_p50": round(statistics.median(self.update_ms), 4) if self.update_ms else None,
                **self.round_timeline(),
                **({"drafter": self.drafter_stats} if self.drafter_stats else {})}

    def round_timeline(self) -> dict:
        """Where a round's time goes around the draft phase: the generator's host work from the end of one
        verification to the next draft call; the draft phase of rounds with no job drafting for the first time
        (their STEP can leave at verification) and of the rest; the STEPs' flight (sent to read) and how often an
        early STEP's answer was there already when the draft call read it."""
        t = self.timeline
        gaps = [(b["draft_start"] - a["verified_at"]) * 1e3 for a, b in zip(t, t[1:]) if "verified_at" in a]
        steady = [(r["draft_end"] - r["draft_start"]) * 1e3 for r in t if not r["first_drafts"]]
        first = [(r["draft_end"] - r["draft_start"]) * 1e3 for r in t if r["first_drafts"]]
        early = [s for s in self.steps if not s["in_draft"]]
        out = {"host_gap_ms_p50": _pct(gaps, 50), "host_gap_ms_p99": _pct(gaps, 99),
               "draft_phase_steady_ms_p50": _pct(steady, 50), "draft_phase_steady_ms_p99": _pct(steady, 99),
               "draft_phase_first_ms_p50": _pct(first, 50), "draft_phase_first_ms_p99": _pct(first, 99),
               "first_draft_phases": len(first)}
        if self.steps:
            out |= {"steps_early": len(early), "steps_in_draft": len(self.steps) - len(early),
                    "early_step_flight_ms_p50": _pct([(s["read_end"] - s["sent"]) * 1e3 for s in early], 50),
                    "early_step_ready_when_read": round(sum(s["ready"] for s in early) / len(early), 4)
                    if early else None,
                    "early_step_read_wait_ms_p50": _pct([(s["read_end"] - s["read_start"]) * 1e3 for s in early], 50),
                    "early_step_read_wait_ms_p99": _pct([(s["read_end"] - s["read_start"]) * 1e3 for s in early], 99)}
        return out


def _pct(xs: list[float], q: int) -> float | None:
    return round(sorted(xs)[int(q / 100 * (len(xs) - 1))], 4) if xs else None


def _stamp_steps(drafter, run: "Run | None") -> None:
    """Stamp each STEP the drafter's pool sends (instance wrappers over `step_begin` / `step_end`; `run` None takes
    them off): when it left, whether its answer was readable when the read began, when the read ended."""
    import select
    pool = getattr(drafter, "pool", None)
    if pool is None:
        return
    if run is None:
        for name in ("step_begin", "step_end"):
            pool.__dict__.pop(name, None)
        return
    begin, end = type(pool).step_begin.__get__(pool), type(pool).step_end.__get__(pool)

    def step_begin(entries, deadline_ms=100.0):
        pending = begin(entries, deadline_ms)
        pending.stamp = {"sent": time.perf_counter(), "in_draft": run.in_draft, "entries": len(entries)}
        return pending

    def step_end(pending):
        st = getattr(pending, "stamp", {"sent": time.perf_counter(), "in_draft": run.in_draft, "entries": 0})
        socks = [pool.workers[i].client._sock for i, _, _ in pending.sent if pool.workers[i].client is not None]
        st["read_start"] = time.perf_counter()
        st["ready"] = bool(socks) and len(select.select(socks, [], [], 0)[0]) == len(socks)
        try:
            return end(pending)
        finally:
            st["read_end"] = time.perf_counter()
            run.steps.append(st)

    pool.step_begin, pool.step_end = step_begin, step_end


@dataclass
class JobSpec:
    """One job of a schedule: its prompt, `max_new` tokens at most, stop tokens, enqueued at generator iteration
    `at` (0: before the first)."""
    prompt: list[int]
    max_new: int = 64
    stop: tuple[int, ...] = ()
    at: int = 0


def generate(trunk: Trunk, jobs: list[JobSpec] | list[list[int]], *, mode: str, batch: int, max_new: int = 64,
             draft_model=None, draft_cache=None, on_round=None) -> Run:
    """Every job through one Generator, at most `batch` at a time, greedy (`jobs`: specs, or prompts that each
    generate exactly `max_new` tokens). `on_round(run, generator)` is called after every iterate (fault injection
    hooks in there). The drafter's STEP, where it has a pool, is stamped (`Run.timeline`)."""
    from exllamav3 import Generator, Job
    from exllamav3.generator.sampler import ArgmaxSampler
    specs = [j if isinstance(j, JobSpec) else JobSpec(list(j), max_new) for j in jobs]
    gen = Generator(trunk.model, trunk.cache, trunk.tokenizer, max_batch_size=batch, draft_model=draft_model,
                    draft_cache=draft_cache, record_draft_stats=True, enable_defrag=True)
    if hasattr(draft_model, "bind"):
        draft_model.bind(gen)
    run = Run(mode, batch)
    verified: dict[tuple[int, int], list[int]] = {}           # (prompt, kv) -> the drafts the generator verified
    if draft_model is not None:
        inner = gen.iterate_draftmodel_dflash_gen

        def timed(results, window):
            jobs = [j for j in gen.active_jobs if j.is_prefill_done()]
            t0 = time.perf_counter()
            run.in_draft = True
            out = inner(results, window)
            run.in_draft = False
            run.draft_ms.append((time.perf_counter() - t0) * 1e3)
            run.timeline.append({"draft_start": t0, "draft_end": time.perf_counter(), "rows": len(jobs),
                                 "first_drafts": sum(j.identifier not in drafted for j in jobs)})
            drafted.update(j.identifier for j in jobs)
            if out is not None:
                for k, j in enumerate(jobs):
                    verified[(j.identifier, j.sequences[0].kv_position)] = out[k].tolist()
            # exllamav3 skips the drafter when no job has finished its prefill: the margins are the last call's
            for k, m in enumerate(getattr(draft_model, "last_margins", []) if out is not None else []):
                if m is not None:
                    run.margins[(jobs[k].identifier, jobs[k].sequences[0].kv_position)] = m.tolist()
            return out

        gen.iterate_draftmodel_dflash_gen = timed
        update = draft_model.update_kv_from_target

        def timed_update(*args, **kw):
            t0 = time.perf_counter()
            update(*args, **kw)
            if kw.get("lengths") is not None:
                run.update_ms.append((time.perf_counter() - t0) * 1e3)
                if run.timeline:
                    run.timeline[-1]["verified_at"] = time.perf_counter()

        draft_model.update_kv_from_target = timed_update
        drafted: set[int] = set()
        _stamp_steps(draft_model, run)
    inner_gen = gen.iterate_gen

    def timed_gen(results, draft_tokens=None):
        t0 = time.perf_counter()
        inner_gen(results, draft_tokens)
        run.verify_ms.append((time.perf_counter() - t0) * 1e3)

    gen.iterate_gen = timed_gen
    jobs = [Job(input_ids=torch.tensor([s.prompt], dtype=torch.long), max_new_tokens=s.max_new,
                stop_conditions=list(s.stop), sampler=ArgmaxSampler(), identifier=i) for i, s in enumerate(specs)]
    for i in range(len(specs)):
        run.tokens[i] = []
    waiting = sorted(range(len(specs)), key=lambda i: specs[i].at)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while waiting or gen.num_remaining_jobs():
        due = [i for i in waiting if specs[i].at <= run.iterations or not gen.num_remaining_jobs()]
        if due:
            gen.enqueue([jobs[i] for i in due])
            waiting = [i for i in waiting if i not in due]
        for r in gen.iterate():
            if r.get("stage") == "streaming" and "token_ids" in r:
                run.tokens[r["identifier"]] += r["token_ids"].reshape(-1).tolist()
        run.iterations += 1
        if on_round is not None:
            on_round(run, gen)
    torch.cuda.synchronize()
    run.wall_s = time.perf_counter() - t0
    for j in jobs:       # draft_stats: (new tokens after the round, window, drafts accepted) per drafted round
        kv0 = len(specs[j.identifier].prompt) - 1
        run.rounds[j.identifier] = {kv0 + n - acc - 1: (verified.get((j.identifier, kv0 + n - acc - 1)), acc)
                                    for n, _, acc in j.draft_stats}
    if draft_model is not None:
        del draft_model.update_kv_from_target          # the instance's own method again
        _stamp_steps(draft_model, None)
    if hasattr(draft_model, "stats"):
        run.drafter_stats = json.loads(json.dumps(draft_model.stats))
    if hasattr(gen, "close"):
        gen.close()
    return run


def compare(base: Run, other: Run, drafter_ref: Run | None = None, margins: dict | None = None,
            trunk_margins: dict | None = None) -> dict:
    """`other`'s tokens against `base`'s (the undrafted run), and, when `drafter_ref` is given, `other`'s rounds
    against `drafter_ref`'s. `margins[(prompt, kv)]`: our per-draft margins there; `trunk_margins[(prompt, i)]`: the
    undrafted trunk's top-1 minus top-2 at new token i. Returns counts and the cases, each classified."""
    out = {"prompts": len(base.tokens), "tokens_equal": 0, "token_differences": [], "rounds_compared": 0,
           "rounds_drafts_equal": 0, "accepted_mismatch_where_drafts_equal": [], "draft_differences": []}
    for i, want in base.tokens.items():
        got = other.tokens[i]
        if got == want:
            out["tokens_equal"] += 1
            continue
        k = next((n for n, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        m = None if trunk_margins is None else trunk_margins.get((i, k))
        out["token_differences"].append({"prompt": i, "first_at": k, "trunk_margin": m,
                                         "class": "trunk near-tie" if m is not None and m <= TRUNK_TIE
                                         else "unexplained"})
    if drafter_ref is not None:
        for i, rounds in other.rounds.items():
            ref = drafter_ref.rounds.get(i, {})
            for kv, (drafts, acc) in sorted(rounds.items()):
                if kv not in ref or drafts is None or ref[kv][0] is None:
                    continue
                out["rounds_compared"] += 1
                rd, racc = ref[kv]
                n = min(len(drafts), len(rd))
                if drafts[:n] == rd[:n]:
                    out["rounds_drafts_equal"] += 1
                    if acc != racc:
                        out["accepted_mismatch_where_drafts_equal"].append({"prompt": i, "kv": kv, "ours": acc,
                                                                            "theirs": racc})
                    continue
                j = next(q for q in range(n) if drafts[q] != rd[q])
                m = None if margins is None or (i, kv) not in margins else float(margins[(i, kv)][j])
                out["draft_differences"].append({"prompt": i, "kv": kv, "position": j, "ours": drafts[j],
                                                 "theirs": rd[j], "our_margin": m,
                                                 "class": "drafter near-tie" if m is not None and m <= DRAFT_TIE
                                                 else "unexplained"})
    out["unexplained"] = sum(c["class"] == "unexplained" for c in out["token_differences"] + out["draft_differences"])
    out["unexplained"] += len(out["accepted_mismatch_where_drafts_equal"])
    return out


def trunk_margins(trunk: Trunk, prompt_ids: list[list[int]], max_new: int = 64) -> dict:
    """The undrafted trunk's top-1 minus top-2 logit at each new token (one job at a time, its logits returned)."""
    from exllamav3 import Generator, Job
    from exllamav3.generator.sampler import ArgmaxSampler
    gen = Generator(trunk.model, trunk.cache, trunk.tokenizer, max_batch_size=1)
    out = {}
    for i, p in enumerate(prompt_ids):
        job = Job(input_ids=torch.tensor([p], dtype=torch.long), max_new_tokens=max_new, stop_conditions=[],
                  sampler=ArgmaxSampler(), identifier=i, return_logits=True)
        gen.enqueue(job)
        k = 0
        while gen.num_remaining_jobs():
            for r in gen.iterate():
                if r.get("stage") == "streaming" and "logits" in r:
                    lg = r["logits"].float().reshape(-1, r["logits"].shape[-1])
                    for row in lg:
                        top = row.topk(2).values
                        out[(i, k)] = float(top[0] - top[1])
                        k += 1
    return out
