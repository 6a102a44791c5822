"""Parity with exllamav3 1.6.5's own DSpark drafter, bf16 and EXL3 checkpoints, and its draft-step time (GPU).

    source .devbundle/setup.sh && python bench/parity_exl3.py --preset tiny --out bench/results/gpu/parity_exl3_tiny_h200.json
    ... --preset full --time 1,4

Per format (bf16: `synthesize`; exl3: seed 000's mix) the same synthetic checkpoint is loaded twice on card 0:
* exllamav3's `DeepseekV4MTPModel` (Config.from_directory, Model.from_config(component="mtp"), a paged Cache, its
  own embedding and head), driven as its generator drives it: `update_kv_from_target` with the round's tap rows,
  `forward` of the seed token, `sample_from_state`;
* our rank as deployed at tp1: the fast path, EXL3 Linears on exllamav3's kernels, the rank's CUDA graph set,
  entries through `RankEngine.step`.
Workloads: `--seeds` x `--rounds` rounds of one request from position 0 (6 rows first, then 1..B rows a round: the
first rounds' windows are partial). `--batch B` drafts B requests a round in lockstep (the first seed of each group
of B sets the rows a round; the others draw their own taps and seed tokens): exllamav3 takes its fused decode kernel
(`run_bszN`) for its routed experts up to 8 rows (one request) and `exl3_moe` + `exl3_moe_gather` above, the path
our rank runs at every batch size. Per block: drafts equal, positions equal up to the first mismatch; per round:
confident length equal (the batch's longest: exllamav3 keeps only that). Each first mismatch is classified from both models' logits at that position (ours from the eager
drafter on the same weights, whose drafts equal the engine's; theirs by repeating `sample_from_state`'s head + Markov
loop on its own tokens): a near-tie when both models' gap between the two tokens is at most max(2 fp16 steps,
3 sqrt(2) sigma), sigma = 1.4826 x the median |logit difference| at the positions before it (identical inputs),
else a routing near-tie when that row's gap between the k-th and (k+1)-th expert keys is at most ROUTING_LINE in
some block (a rounding there swaps an expert, and the logits differ widely), otherwise unexplained. `--time R,...`: exllamav3's step (forward + sample_from_state, host included, as its
generator calls it) at R requests, median of `--replays`. Prints JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import report  # noqa: E402
from dspark_ray.testing.parity import fp16_step  # noqa: E402
from dspark_ray.testing.workload import lockstep_rounds  # noqa: E402

PAGE = 256
# A routing gap at most this wide counts as a routing near-tie: 4 fp16 steps of a selection key near 2 (the keys are
# sqrt(softplus) of fp16 router logits plus an fp16 bias, ~1-3 here), the same multiple the logit rule allows.
ROUTING_LINE = 4 * 2.0 ** -9


def log(msg: str) -> None:
    print(f"[parity_exl3 {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ensure(preset: str, fmt: str, root: Path) -> Path:
    from dspark_ray.config import preset as make
    from dspark_ray.weights.manifest import MANIFEST_NAME
    from dspark_ray.weights.synth import synthesize
    d = root / f"{preset}_{fmt}"
    if not (d / MANIFEST_NAME).is_file():
        t0 = time.time()
        synthesize(make(preset), d, device="cuda", progress=False, **({"fmt": "exl3"} if fmt == "exl3" else {}))
        log(f"synthesized {preset} {fmt} into {d} in {time.time() - t0:.1f} s")
    return d


def _as_exllamav3_sees_it(d: Path) -> Path:
    """exllamav3 registers the drafter as DeepseekV4ForCausalLM; the full preset's config names the V4.1 trunk
    (DeepseekV41ForCausalLM, the same drafter). A sibling directory with the one name changed and every other
    file linked."""
    cfg = json.loads((d / "config.json").read_text())
    if cfg.get("architectures") == ["DeepseekV4ForCausalLM"]:
        return d
    alias = d.with_name(d.name + "_exllamav3")
    alias.mkdir(exist_ok=True)
    for f in d.iterdir():
        if f.name != "config.json" and not (alias / f.name).exists():
            (alias / f.name).symlink_to(f.resolve())
    cfg["architectures"] = ["DeepseekV4ForCausalLM"]
    (alias / "config.json").write_text(json.dumps(cfg, indent=1))
    return alias


class Theirs:
    """exllamav3's drafter on one checkpoint, `pages` cache pages per sequence, up to `bsz` sequences."""

    def __init__(self, d: Path, pages: int, bsz: int = 1):
        from exllamav3 import Cache, Config, Model
        t0 = time.time()
        self.config = Config.from_directory(str(_as_exllamav3_sees_it(d)))
        self.model = Model.from_config(self.config, component="mtp")
        self.cache = Cache(self.model, max_num_tokens=pages * PAGE * bsz)
        self.model.load("cuda:0")
        self.model._load_own_embed_head()
        self.load_s = time.time() - t0
        self.pages = pages
        self.block_table = torch.arange(pages * bsz, dtype=torch.int32).reshape(bsz, pages)

    def insert(self, taps_list, start: int, h: int, n_taps: int) -> None:
        """taps_list: one (n, n_taps * h) fp16 tensor per sequence (equal n), written at `start`."""
        bsz = len(taps_list)
        n = taps_list[0].shape[0]
        x = torch.stack(taps_list).to("cuda")
        self.model.update_kv_from_target([x[:, :, t * h:(t + 1) * h].contiguous() for t in range(n_taps)],
                                         self.cache, {"block_table": self.block_table[:bsz],
                                                      "cache_seqlens": torch.full((bsz,), start, dtype=torch.int32)},
                                         lengths=[n] * bsz)

    def params(self, p0: int, bsz: int = 1) -> dict:
        return {"attn_mode": "flash_attn", "block_table": self.block_table[:bsz], "cache": self.cache,
                "cache_seqlens": torch.full((bsz,), p0, dtype=torch.int32)}

    def draft(self, seeds: list[int], p0: int):
        params = self.params(p0, len(seeds))
        state = self.model.forward(torch.tensor([[s] for s in seeds], dtype=torch.long), params)
        tokens = self.model.sample_from_state(state, params)
        return state, params, tokens

    def logits(self, state, params, tokens: torch.Tensor) -> torch.Tensor:
        """sample_from_state's per-position logits (head + Markov bias of the previous token), on its own tokens."""
        import torch.nn.functional as F
        m = self.model
        lm = m.own_head
        lg = lm.forward(lm.prepare_for_device(state, params), params).float()
        w1 = m.markov_w1.embedding.weight.data.to(lg.device)
        for i in range(lg.shape[1]):
            emb = F.embedding(tokens[:, i].to(lg.device), w1).half()
            lg[:, i] += m.markov_w2.forward(emb.unsqueeze(1), params)[:, 0].float()
        return lg

    def unload(self) -> None:
        self.model.unload()


def classify(ours_lg: torch.Tensor, their_lg: torch.Tensor, first: int, a: int, b: int) -> dict:
    """The first mismatch at position `first`: ours drafted a, theirs b."""
    if first > 0:
        diff = (ours_lg[:first] - their_lg[:first]).abs().flatten()
    else:
        diff = (ours_lg[:1] - their_lg[:1]).abs().flatten()       # (inputs already differ by the seed's kernels)
    sigma = 1.4826 * float(diff.median())
    go = float(ours_lg[first, a] - ours_lg[first, b])
    gt = float(their_lg[first, b] - their_lg[first, a])
    line = max(2 * fp16_step(float(ours_lg[first, a])), 3 * math.sqrt(2) * sigma)
    return {"position": first, "ours": a, "theirs": b, "our_gap": round(go, 5), "their_gap": round(gt, 5),
            "line": round(line, 5), "sigma": round(sigma, 6),
            "class": "near-tie" if max(go, gt) <= line else "unexplained"}


class RouterMargins:
    """While active, every Router.select records per row the gap between the k-th and (k+1)-th selection keys
    (sqrt(softplus(logit)) + bias): a small gap is a routing near-tie, where a GEMM's rounding can swap an expert."""

    def __init__(self):
        self.gaps: list[torch.Tensor] = []          # one (rows,) tensor per block, in block order

    def __enter__(self):
        from dspark_ray.model import moe
        from dspark_ray.model.ops import softplus
        self._orig = moe.Router.select
        rec = self

        def select(router, lg):
            key = (torch.sqrt(softplus(lg.float())) + router.bsel).nan_to_num(nan=-float("inf"))
            top = key.topk(router.top_k + 1, dim=-1).values
            rec.gaps.append((top[:, -2] - top[:, -1]).cpu())
            return rec._orig(router, lg)

        moe.Router.select = select
        return self

    def __exit__(self, *exc):
        from dspark_ray.model import moe
        moe.Router.select = self._orig


def run_format(preset: str, fmt: str, args, root: Path) -> dict:
    from dspark_ray.rank.engine import RankEngine
    from dspark_ray.testing.batches import Driver, entry
    from dspark_ray.kernels.gemm import describe, kernels_for
    from dspark_ray.rank.modes import make_drafter
    from dspark_ray.weights.loader import Checkpoint
    d = ensure(preset, fmt, root)
    ck = Checkpoint(d)
    cfg = ck.config
    B = args.batch
    groups = [args.seeds[i:i + B] for i in range(0, len(args.seeds), B)]
    all_rounds = {tuple(g): lockstep_rounds(cfg, args.rounds, [1000 + s for s in g]) for g in groups}
    rows = max(sum(n for _, n, _, _ in r) for r in all_rounds.values())
    pages = -(-(max(rows, cfg.sliding_window + 64) + cfg.block_size + 1) // PAGE)
    theirs = Theirs(d, pages, max([B] + args.time))
    log(f"{preset} {fmt}: exllamav3 loaded in {theirs.load_s:.1f} s ({torch.cuda.memory_allocated() / 2**30:.2f} "
        f"GiB on the card)")
    kernels = kernels_for("fast")
    t0 = time.time()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ours = make_drafter(cfg, "tp1", ckpt=ck, device="cuda", kernels=kernels)
    eng = Driver(RankEngine(ours, n_slots=B + 1, graphs=True, max_batch=B))
    ours_mib = (torch.cuda.memory_allocated() - base) / 2**20
    log(f"{preset} {fmt}: our rank loaded and captured in {time.time() - t0:.1f} s, {ours_mib:.0f} MiB "
        f"({describe(ours.kernels)})")
    res = {"format": fmt, "checkpoint_identity": ck.identity_digest, "exllamav3_load_s": round(theirs.load_s, 1),
           "our_rank_mib": round(ours_mib), "seeds": {}, "blocks": 0, "blocks_exact": 0, "positions": 0,
           "positions_exact": 0, "confident_len_rounds": 0, "confident_len_equal": 0, "engine_equals_eager": True, "mismatches": []}
    h = cfg.hidden_size
    for group, rounds in all_rounds.items():
        seeds = list(group)
        slots = list(range(len(seeds)))
        eager = [ours.new_slot() for _ in seeds]
        per = {s: [] for s in seeds}
        for r, (start, n, taps, toks) in enumerate(rounds):
            theirs.insert(taps, start, h, cfg.n_taps)
            p0 = start + n
            state, params, tokens = theirs.draft(toks, p0)
            t_len = int(params["draft_confidence_len"])        # exllamav3 keeps the batch's longest only
            outs = eng.step([entry(slot=j, seed_token=toks[j], n_out=cfg.block_size, start_pos=start,
                                   token_ids=torch.zeros(n, dtype=torch.int64), taps=taps[j], want_margins=True)
                             for j in slots], resets=slots if r == 0 else ())
            for j in slots:
                ours.insert(eager[j], start, taps[j].cuda())
            with RouterMargins() as rm:
                e = ours.draft(eager, toks, cfg.block_size, want_margins=True, debug=True)
            res["confident_len_rounds"] += 1
            res["confident_len_equal"] += int(max(o.confident_len for o in outs) == t_len)
            their_lg = None
            for j, out in zip(slots, outs):
                t_drafts = tokens[j, 1:].cpu()
                o_drafts = torch.from_numpy(out.drafts_array()).to(torch.int64)
                if not torch.equal(e.drafts[j].cpu(), o_drafts):
                    res["engine_equals_eager"] = False
                eq = o_drafts == t_drafts
                first = None if bool(eq.all()) else int((~eq).nonzero()[0])
                rec = {"p0": p0, "ours": o_drafts.tolist(), "exllamav3": t_drafts.tolist(),
                       "confident_len": [out.confident_len, t_len]}
                res["blocks"] += 1
                res["positions"] += len(eq)
                res["positions_exact"] += int(eq.int().cumprod(0).sum())
                if first is None:
                    res["blocks_exact"] += 1
                else:
                    if their_lg is None:
                        their_lg = theirs.logits(state, params, tokens).cpu()
                    m = classify(e.logits[j].float().cpu(), their_lg[j], first, int(o_drafts[first]),
                                 int(t_drafts[first]))
                    # the block row whose logits the first mismatch reads: its smallest routing gap over the blocks
                    gap = min(float(g.view(len(slots), -1)[j, first]) for g in rm.gaps)
                    m.update(seed=seeds[j], round=r, routing_gap=round(gap, 5))
                    if m["class"] == "unexplained" and gap <= ROUTING_LINE:
                        m["class"] = "routing near-tie"
                    rec["first_mismatch"] = m
                    res["mismatches"].append(m)
                per[seeds[j]].append(rec)
        res["seeds"].update({str(s): v for s, v in per.items()})
    res["blocks_exact_share"] = round(res["blocks_exact"] / max(1, res["blocks"]), 4)
    res["unexplained"] = sum(m["class"] == "unexplained" for m in res["mismatches"])
    res["near_ties"] = sum(m["class"] != "unexplained" for m in res["mismatches"])
    if args.time:
        res["exllamav3_step_ms"] = time_theirs(theirs, cfg, args)
    del eng, ours
    theirs.unload()
    torch.cuda.empty_cache()
    log(f"{preset} {fmt}: {res['blocks_exact']}/{res['blocks']} blocks exact, {res['unexplained']} unexplained")
    return res


def time_theirs(theirs: Theirs, cfg, args) -> dict:
    """exllamav3's draft step (forward + sample_from_state, synchronized) at R requests, full windows."""
    out = {}
    rows = cfg.sliding_window + 32
    g = torch.Generator().manual_seed(5)
    for bsz in args.time:
        taps = [torch.randn(rows, cfg.n_taps * cfg.hidden_size, generator=g).half() for _ in range(bsz)]
        theirs.insert(taps, 0, cfg.hidden_size, cfg.n_taps)
        seeds = [11 + i for i in range(bsz)]
        for _ in range(10):
            theirs.draft(seeds, rows)
        torch.cuda.synchronize()
        ms = []
        for _ in range(args.replays):
            t0 = time.perf_counter()
            _, _, tok = theirs.draft(seeds, rows)
            tok.cpu()
            ms.append((time.perf_counter() - t0) * 1000)
        out[str(bsz)] = report.percentiles(ms)
        log(f"exllamav3 step at {bsz} requests: p50 {out[str(bsz)]['p50_ms']} ms")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny", choices=["tiny", "full"])
    ap.add_argument("--formats", default="bf16,exl3")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--batch", type=int, default=1, help="requests a round, in lockstep (seeds taken B at a time)")
    ap.add_argument("--time", default="", help="comma list of request counts to time exllamav3's step at")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--root", default="/tmp/parity_exl3", help="where the synthetic checkpoints go")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    a.seeds = [int(s) for s in a.seeds.split(",")]
    a.time = [int(s) for s in a.time.split(",") if s]
    if not torch.cuda.is_available():
        print("bench/parity_exl3.py needs CUDA and exllamav3", file=sys.stderr)
        return 2
    torch.set_num_threads(8)
    out = {**report.header(__file__, argv, gpu=True), "preset": a.preset,
           "seeds": a.seeds, "rounds": a.rounds, "batch": a.batch, "formats": {}}
    for fmt in a.formats.split(","):
        out["formats"][fmt] = run_format(a.preset, fmt, a, Path(a.root))
        report.save(out, a.out)
    print(json.dumps({f: {k: v for k, v in r.items() if k != "seeds"} for f, r in out["formats"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
