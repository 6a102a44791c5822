"""The DSpark block drafter, composed from its parts (spec section 3). Parallel-unaware: it holds this process's
shards (`model/layout.py`) and hands one partial per shard to its `Collectives`. Kernel-unaware: its entry points
make its `ops.Kernels` the active ones while they run.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.profiler import record_function as stage

from .collectives import Collectives, LocalCollectives
from ..config import DrafterConfig
from . import ops
from .attention import Attention
from .heads import DraftHead, HeadOut, VocabShard, markov_cache_rows
from .mhc import HcSite, HyperHead
from .moe import Experts, Router
from .ops import Rope, linear, rms_norm
from .state import SlotState

Weights = dict[str, torch.Tensor]


def _on_own_kernels(method):
    @functools.wraps(method)
    def run(self, *args, **kw):
        with ops.using(self.kernels):
            return method(self, *args, **kw)
    return run


@dataclass
class DraftOut(HeadOut):
    normed: torch.Tensor | None = None      # (bsz, B, h) fp16 head input, with debug


class _Block:
    def __init__(self, cfg: DrafterConfig, n: int, shards: list[Weights], rope: Rope, fp8_kv: bool, consume: bool):
        p = f"mtp.{n}."
        w0 = shards[0]
        hc = dict(m=cfg.hc_mult, iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
        self.hc_attn = HcSite(w0[p + "hc_attn_fn"], w0[p + "hc_attn_base"], w0[p + "hc_attn_scale"], **hc)
        self.hc_ffn = HcSite(w0[p + "hc_ffn_fn"], w0[p + "hc_ffn_base"], w0[p + "hc_ffn_scale"], **hc)
        self.attn_norm, self.ffn_norm = w0[p + "attn_norm.weight"], w0[p + "ffn_norm.weight"]
        self.attn = [Attention({k: w[p + "attn." + k + ("" if k == "attn_sink" else ".weight")]
                                for k in ("wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "wo_a", "wo_b", "attn_sink")},
                               head_dim=cfg.head_dim, rope_dim=cfg.qk_rope_head_dim, o_lora_rank=cfg.o_lora_rank,
                               heads_per_group=cfg.heads_per_group, eps=cfg.rms_norm_eps, rope=rope, fp8_kv=fp8_kv)
                     for w in shards]
        self.router = Router(w0[p + "ffn.gate.weight"], w0[p + "ffn.gate.bias"], top_k=cfg.num_experts_per_tok,
                             scaling=cfg.routed_scaling_factor)
        e = p + "ffn.experts."
        s = p + "ffn.shared_experts."
        take = dict.pop if consume else dict.__getitem__
        self.experts = [Experts([take(w, f"{e}{i}.w1.weight") for i in range(cfg.n_routed_experts)],
                                [take(w, f"{e}{i}.w3.weight") for i in range(cfg.n_routed_experts)],
                                [take(w, f"{e}{i}.w2.weight") for i in range(cfg.n_routed_experts)],
                                (w[s + "w1.weight"], w[s + "w3.weight"], w[s + "w2.weight"]),
                                limit=cfg.swiglu_limit)
                        for w in shards]

    def __call__(self, x, pos, window, valid, block, coll: Collectives):
        with stage("dspark.mhc_norm"):
            a, post, comb = self.hc_attn.collapse_norm(x, self.attn_norm)
        with stage("dspark.attention"):
            parts = [attn(a, pos, window, valid, block) for attn in self.attn]
        with stage("dspark.all_reduce"):
            y = coll.all_reduce(parts)
        with stage("dspark.mhc_norm"):
            x = HcSite.expand(x, y, post, comb)
            f, post, comb = self.hc_ffn.collapse_norm(x, self.ffn_norm)
        with stage("dspark.routing"):
            # beside the router, not the routed experts (docs/engine.md, "Tried and removed")
            shared = [ops.branch(ex.shared, f) for ex in self.experts]
            experts, weights = self.router(f)
        with stage("dspark.experts"):
            parts = [ex.routed(f, experts, weights, s) for ex, s in zip(self.experts, shared)]
        with stage("dspark.all_reduce"):
            y = coll.all_reduce(parts)
        with stage("dspark.mhc_norm"):
            return HcSite.expand(x, y, post, comb), experts


class Drafter:
    def __init__(self, cfg: DrafterConfig, shards: list[Weights], vocab_starts: list[int] | None = None,
                 coll: Collectives | None = None, *, fp8_kv: bool = False, conf_threshold: float = 0.5,
                 markov_cache: int = 0, kernels: ops.Kernels = ops.EXACT, consume: bool = False):
        """`consume`: the shards are the caller's only copy; each block's routed experts leave them as they are
        stacked, so the experts need their memory once, not twice (the full preset's: 25 GiB, not 50)."""
        self.cfg = cfg
        if not isinstance(kernels, ops.Kernels):
            raise TypeError(f"kernels {kernels!r} are not an ops.Kernels (kernels.gemm.kernels_for builds them)")
        # exllamav3's kernels share one lock array per card: no second stream (kernels/exl3_gemm.py)
        if any(getattr(t, "serial_launches", False) for w in shards for t in w.values()):
            kernels = kernels.without("branch", "branch_parts")
        self.kernels = kernels
        self.coll = coll or LocalCollectives(len(shards))
        if len(shards) != len(self.coll.local_ranks):
            raise ValueError(f"{len(shards)} shards for collectives with local ranks {self.coll.local_ranks}")
        vocab_starts = vocab_starts or [0]
        w0 = shards[0]
        dev = w0["embed.weight"].device
        self.device = dev
        self.rope = Rope(cfg.qk_rope_head_dim, cfg.rope_theta, dev)
        self.embed = w0["embed.weight"]
        self.main_proj, self.main_norm = w0["mtp.0.main_proj.weight"], w0["mtp.0.main_norm.weight"]
        self.blocks = [_Block(cfg, n, shards, self.rope, fp8_kv, consume) for n in range(cfg.n_blocks)]
        last = f"mtp.{cfg.n_blocks - 1}."
        self.hyper_head = HyperHead(w0[last + "hc_head_fn"], w0[last + "hc_head_base"], w0[last + "hc_head_scale"],
                                    hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
        self.final_norm = w0[last + "norm.weight"]
        mk = last + "markov_head."
        self.head = DraftHead(
            [VocabShard(w["head.weight"], w[mk + "markov_w2.weight"], w.get(mk + "markov_w2.bias"), start)
             for w, start in zip(shards, vocab_starts)],
            w0[mk + "markov_w1.weight"], w0[last + "confidence_head.proj.weight"],
            w0.get(last + "confidence_head.proj.bias"), self.coll, conf_threshold)
        self.markov_cache_bytes = 0
        if markov_cache > 0:
            self.cache_markov(markov_cache)
        self.last_experts: list[torch.Tensor] = []      # the last draft's routing per block, for diagnostics

    def use_collectives(self, coll: Collectives) -> None:
        """Meet the peer through `coll` (same local ranks) from now on, e.g. the engine's counting wrapper."""
        if tuple(coll.local_ranks) != tuple(self.coll.local_ranks):
            raise ValueError(f"collectives of local ranks {coll.local_ranks}; the drafter's: {self.coll.local_ranks}")
        self.coll = self.head.coll = coll

    @_on_own_kernels
    def cache_markov(self, rows: int) -> int:
        """Cache the Markov bias rows of ids [0, rows) (a BPE vocabulary's lower ids are its frequent ones): the
        same drafts, less read per step. Returns their bytes."""
        if rows <= 0:
            self.head.drop_markov_rows()
            self.markov_cache_bytes = 0
        else:
            self.markov_cache_bytes = self.head.cache_markov_rows(torch.arange(min(rows, self.cfg.vocab_size)))
        return self.markov_cache_bytes

    def cache_markov_for(self, choice: str | int) -> int:
        """Cache the rows `choice` asks for (`heads.markov_cache_rows`); returns the row count."""
        rows = self.markov_rows_for(choice)
        self.cache_markov(rows)
        return rows

    def markov_rows_for(self, choice: str | int) -> int:
        free = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info(self.device)[0]
        row_bytes = sum(s.markov_w2.shape[0] for s in self.head.shards) * 2
        return markov_cache_rows(choice, self.cfg.vocab_size, row_bytes=row_bytes, free_bytes=free)

    def cache_markov_in_steps(self, rows: int) -> Iterator[None]:
        """`cache_markov(rows)` one device-finished chunk per `next`, for a caller between steps; the rows serve
        once all are made (the same drafts before as after)."""
        if rows <= 0:
            self.cache_markov(0)
            return
        built, end = self.head.build_markov_rows(torch.arange(min(rows, self.cfg.vocab_size))), object()
        while True:
            with ops.using(self.kernels):
                more = next(built, end) is not end
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
            if not more:
                break
            yield
        self.markov_cache_bytes = sum(s.markov_rows.numel() * s.markov_rows.element_size() for s in self.head.shards)

    def new_slot(self) -> SlotState:
        c = self.cfg
        return SlotState(c.n_blocks, c.sliding_window, 128, c.head_dim, self.device)

    # -- context insert (spec 3a)
    def insert(self, state: SlotState, start: int, taps: torch.Tensor, rollback_to: int = -1) -> None:
        """Roll back, then write the main-kv rows of taps (n, n_taps * hidden) fp16 at start .. start+n-1. Unchecked:
        the front-end validates every entry first."""
        if rollback_to >= 0:
            state.rollback(rollback_to)
        n = taps.shape[0]
        if n == 0:
            return
        state.write(start, self.context_rows(taps.to(self.device), torch.arange(start, start + n, device=self.device)))

    def context_rows(self, taps: torch.Tensor, pos: torch.Tensor) -> list[torch.Tensor]:
        """Capturable: taps (n, n_taps*h) fp16 at positions pos -> one main-kv row block (n, D) per drafter block."""
        return list(self.context_rows_by_block(taps, pos))

    def context_rows_by_block(self, taps: torch.Tensor, pos: torch.Tensor) -> Iterator[torch.Tensor]:
        """`context_rows` a block at a time; the kernels are set around each step only, so an unfinished generator
        leaves nothing set."""
        with ops.using(self.kernels):
            x = rms_norm(linear(taps, self.main_proj), self.main_norm, self.cfg.rms_norm_eps)
        for b in self.blocks:
            with ops.using(self.kernels):
                rows = b.attn[0].kv_rows(x, pos)
            yield rows

    # -- draft forward + head (spec 3b, 3c, 3d)
    @torch.inference_mode()
    def draft(self, states: list[SlotState], seeds: list[int], n_out: int, want_margins: bool = False,
              debug: bool = False) -> DraftOut:
        """Draft n_out tokens per slot, seeds at p0 = the slot's position; row i predicts p0 + i + 1, and n_out = k
        gives the first k of n_out = B."""
        dev = self.device
        windows, valid = self.window_inputs(states)
        return self.forward(torch.tensor(seeds, dtype=torch.int64, device=dev),
                            torch.tensor([s.position for s in states], dtype=torch.int64, device=dev),
                            windows, valid, n_out, want_margins, debug)

    def window_inputs(self, states: list[SlotState]) -> tuple[list[torch.Tensor], torch.Tensor]:
        windows = [torch.stack([s.window_rows(n)[0] for s in states]) for n in range(self.cfg.n_blocks)]
        return windows, torch.stack([s.window_valid(self.device) for s in states])

    @_on_own_kernels
    def forward(self, seeds: torch.Tensor, p0: torch.Tensor, windows: list[torch.Tensor], valid: torch.Tensor,
                n_out: int, want_margins: bool = False, debug: bool = False) -> DraftOut:
        """The draft step, capturable (no data-dependent shape, no host sync). seeds, p0 (bsz,) int64; windows per
        block (bsz, W, D) fp16, maybe branches (`ops.joined`); valid (bsz, W) bool."""
        c = self.cfg
        B, bsz = c.block_size, seeds.shape[0]
        k = ops.fused("embed_streams")
        if k is not None:
            x, pos = k(seeds, p0, self.embed, B, c.dspark_noise_token_id, c.hc_mult)
        else:
            ids = torch.full((bsz, B), c.dspark_noise_token_id, dtype=torch.int64, device=seeds.device)
            ids[:, 0] = seeds
            e = self.embed[ids.flatten()].float()                           # bf16 -> fp32 is exact
            x = e[:, None, :].expand(-1, c.hc_mult, -1).contiguous()
            pos = (p0[:, None] + torch.arange(B, device=p0.device)).flatten()
        self.last_experts = []
        for n, blk in enumerate(self.blocks):
            x, experts = blk(x, pos, windows[n], valid, B, self.coll)
            self.last_experts.append(experts)
        with stage("dspark.mhc_norm"):
            prenorm, normed = self.hyper_head.with_norm(x, self.final_norm)
        with stage("dspark.head"):
            out = self.head(normed.reshape(bsz, B, -1), prenorm.reshape(bsz, B, -1),
                            seeds, n_out, want_margins, keep_logits=debug)
        return DraftOut(**vars(out), normed=normed.reshape(bsz, B, -1) if debug else None)
