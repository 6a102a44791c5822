"""Replaying a workload through one drafter and comparing two replays: bit identity, and agreement with a
first-mismatch classification (near-tie or not).

The rule has two parts, both calibrated from measured noise (seed 000: "within max(2 bf16 steps, 3 sigma of the
cross-model logit noise)"; seed 001: a line set between the measured floor and a planted fault):

1. The run's noise: the mean |logit difference| of the two models at positions whose inputs are still identical
   must stay under a line of 2 x the floor measured for that reference. Plain tp1 (one library GEMM) against the
   pair: floor 0.00142 on the fixed tiny workload of `tests/test_tp.py`; a dropped routed expert reads 0.0236
   (17x). Against the split reference (the same partials added in rank order) the floor is exactly 0.
2. Each first mismatch: its two tokens' gap in either model's logits is at most max(2 fp16 steps at that
   magnitude, 3 sqrt(2) sigma), sigma = 1.4826 x the median |logit difference| (robust to the rare large
   differences a noise-induced routing flip causes).

A first mismatch is a near-tie when both hold; otherwise it is unexplained (a wrong shard, a missing reduction, a
rank out of step).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dspark_ray.protocol import contract as C
from dspark_ray.model import ops
from dspark_ray.model.drafter import Drafter

from .batches import Batcher


@dataclass
class EntryRecord:
    drafts: torch.Tensor
    confidences: torch.Tensor
    margins: torch.Tensor
    logits: torch.Tensor        # (n_out, local vocab) fp32
    normed: torch.Tensor        # (B, h) fp16 head input


def replay(d: Drafter, rounds: list[list[C.Entry]]) -> list[list[EntryRecord]]:
    """Insert and draft every batch of `rounds` through `d` (margins and debug outputs on)."""
    slots: dict[int, object] = {}
    width = d.cfg.n_taps * d.cfg.hidden_size
    out = []
    for batch in rounds:
        states = []
        for e in batch:
            st = slots.setdefault(e.slot, d.new_slot())
            d.insert(st, e.start_pos, torch.from_numpy(e.taps_array(width).copy()), e.rollback_to)
            states.append(st)
        n_out = max(e.n_out for e in batch)
        r = d.draft(states, [e.seed_token for e in batch], n_out, want_margins=True, debug=True)
        out.append([EntryRecord(r.drafts[j, :e.n_out].clone(), r.confidences[j, :e.n_out].clone(),
                                r.margins[j, :e.n_out].clone(), r.logits[j, :e.n_out].clone(), r.normed[j].clone())
                    for j, e in enumerate(batch)])
    return out


def replay_engine(eng, rounds: list[list[C.Entry]]) -> list[list[EntryRecord]]:
    """The same rounds through a `RankEngine` (graphs or eager): drafts, confidences, and margins where the entry
    asked for them (empty otherwise); no logits or head input (a graph keeps no debug outputs)."""
    out = []
    none = torch.empty(0)
    batcher = Batcher(eng.slots)
    for batch in rounds:
        res = eng.step(batcher(batch))
        out.append([EntryRecord(tensor(r.drafts_array()), tensor(r.confidences_array()), tensor(r.margins_array()),
                                none, none) for r in res])
    return out


def tensor(a) -> torch.Tensor:
    """A result's array (a read-only view of its bytes) as a tensor of its own."""
    return torch.from_numpy(a.copy())


def as_engine_records(recs: list[list[EntryRecord]], rounds: list[list[C.Entry]]) -> list[list[EntryRecord]]:
    """`replay` records cut to what `replay_engine` keeps (in the engine's dtypes: int32 drafts), for a bit-for-bit
    comparison of the two."""
    none = torch.empty(0)
    return [[EntryRecord(r.drafts.cpu().to(torch.int32), r.confidences.cpu(),
                         r.margins.cpu() if e.want_margins else none, none, none)
             for r, e in zip(rb, b)] for rb, b in zip(recs, rounds)]


def assert_identical(a: list[list[EntryRecord]], b: list[list[EntryRecord]], what: str = "") -> None:
    """Every field of every entry equal bit for bit (torch.equal), with the first difference named."""
    assert len(a) == len(b), f"{what}: {len(a)} vs {len(b)} rounds"
    for r, (ra, rb) in enumerate(zip(a, b)):
        for j, (x, y) in enumerate(zip(ra, rb)):
            for k in ("drafts", "confidences", "margins", "logits", "normed"):
                if not torch.equal(getattr(x, k), getattr(y, k)):
                    raise AssertionError(f"{what}: round {r} entry {j}: {k} differs")


# The plain tp1 reference's kernels: the library GEMM (one BLAS call, its own reduction order), the reference chains.
NATIVE_MATMUL = ops.Kernels(mode="native", matmul=lambda x, w: x.float() @ w.float().t())


def fp16_step(x: float) -> float:
    """The fp16 spacing at magnitude |x| (the logits are sums of fp16 values)."""
    m = max(abs(x), 2.0 ** -14)
    return 2.0 ** (math.floor(math.log2(m)) - 10)


# Mean |logit difference| between plain tp1 (library GEMM) and the pair at identical inputs, measured on the tiny
# preset's fixed parity workload (tests/test_tp.py ROUNDS: seed 7, 2 requests x 40 rounds), torch 2.13 CPU. (Seed 11,
# 4 requests x 40 rounds read 0.00098.)
PLAIN_TP1_NOISE_FLOOR = 0.00142
NOISE_LINE_FACTOR = 2.0


@dataclass
class Agreement:
    blocks: int = 0
    equal_blocks: int = 0
    sigma: float = 0.0                  # robust sd of the per-logit difference at identical inputs
    noise_mean: float = 0.0             # mean |logit difference| at identical inputs
    noise_line: float = 0.0
    threshold_sigmas: float = 3.0
    mismatches: list[dict] = field(default_factory=list)

    @property
    def noise_ok(self) -> bool:
        return self.noise_mean <= self.noise_line

    @property
    def share(self) -> float:
        return self.equal_blocks / max(1, self.blocks)

    @property
    def unexplained(self) -> list[dict]:
        return [m for m in self.mismatches if not m["near_tie"]]

    def summary(self) -> dict:
        return {"blocks": self.blocks, "equal_blocks": self.equal_blocks, "share_equal": round(self.share, 4),
                "sigma": self.sigma, "noise_mean": self.noise_mean, "noise_line": self.noise_line,
                "first_mismatches": len(self.mismatches),
                "near_ties": len(self.mismatches) - len(self.unexplained), "unexplained": len(self.unexplained)}


def compare(ref: list[list[EntryRecord]], test: list[list[EntryRecord]],
            floor: float = PLAIN_TP1_NOISE_FLOOR, k_sigma: float = 3.0) -> Agreement:
    """Share of request-blocks whose drafts are all equal, and every first mismatch classified (module doc)."""
    diffs = []
    for ra, rb in zip(ref, test):
        for a, b in zip(ra, rb):
            eq = (a.drafts == b.drafts).tolist()
            upto = eq.index(False) + 1 if False in eq else len(eq)      # inputs identical up to here
            diffs.append((b.logits[:upto] - a.logits[:upto]).flatten())
    d = torch.cat(diffs).abs() if diffs else torch.zeros(1)
    ag = Agreement(sigma=1.4826 * d.median().item(), noise_mean=d.mean().item(),
                   noise_line=NOISE_LINE_FACTOR * floor, threshold_sigmas=k_sigma)
    for r, (ra, rb) in enumerate(zip(ref, test)):
        for j, (a, b) in enumerate(zip(ra, rb)):
            ag.blocks += 1
            eq = (a.drafts == b.drafts).tolist()
            if all(eq):
                ag.equal_blocks += 1
                continue
            i = eq.index(False)
            ta, tb = int(a.drafts[i]), int(b.drafts[i])        # ref's and test's choices
            gap_ref = float(a.logits[i, ta] - a.logits[i, tb])
            gap_test = float(b.logits[i, tb] - b.logits[i, ta])
            band = max(2 * fp16_step(float(a.logits[i, ta])), k_sigma * math.sqrt(2.0) * ag.sigma)
            ag.mismatches.append({"round": r, "entry": j, "position": i, "ref_token": ta, "test_token": tb,
                                  "gap_ref": gap_ref, "gap_test": gap_test, "band": band,
                                  "near_tie": ag.noise_ok and min(gap_ref, gap_test) <= band})
    return ag


def join_ranks(r0: list[list[EntryRecord]], r1: list[list[EntryRecord]]) -> list[list[EntryRecord]]:
    """Rank 0's records with both ranks' vocab slices of the logits side by side (the pair's full logits)."""
    return [[EntryRecord(a.drafts, a.confidences, a.margins, torch.cat((a.logits, b.logits), dim=-1), a.normed)
             for a, b in zip(ra, rb)] for ra, rb in zip(r0, r1)]
