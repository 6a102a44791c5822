"""DSpark attention of one drafter block: MQA with one shared K=V row, per-head sinks, output de-rotation and the
grouped output projection (spec 3b.3).

Parallel-unaware: it runs whatever heads its weights hold. `wq_b` / `attn_sink` / `wo_a` / `wo_b` may be a rank's
slice (a whole number of o_groups); the result is then that rank's fp32 partial of the wo_b output, which the
caller reduces. The kv side (wkv, kv_norm, the main-kv history) is always whole.
"""
from __future__ import annotations

import torch

from . import ops
from .ops import F32, Rope, exp, f16, fp8_fake_quant, head_norm, linear, rms_norm, tree_sum


class Attention:
    def __init__(self, w: dict[str, torch.Tensor], *, head_dim: int, rope_dim: int, o_lora_rank: int,
                 heads_per_group: int, eps: float, rope: Rope, fp8_kv: bool):
        # wq_a and wkv both project the block input `a`: one (q_lora_rank + D, h) matrix, one GEMM (one launch on
        # the fast path; each output element is still its own row-times-row product). The insert's kv uses the
        # wkv rows alone (a view).
        self.q_rank = w["wq_a"].shape[0]
        self.wqkv_a = torch.cat((w["wq_a"], w["wkv"]))
        self.wq_a, self.wkv = self.wqkv_a[:self.q_rank], self.wqkv_a[self.q_rank:]
        self.q_norm, self.wq_b, self.kv_norm = w["q_norm"], w["wq_b"], w["kv_norm"]
        self.wo_b, self.sink = w["wo_b"], w["attn_sink"].float()
        self.D, self.rd, self.Ro, self.hpg, self.eps = head_dim, rope_dim, o_lora_rank, heads_per_group, eps
        self.n_heads = self.wq_b.shape[0] // head_dim            # local heads
        self.n_groups = self.n_heads // heads_per_group
        # wo_a is one 2-D tensor; group g uses rows [g*Ro, (g+1)*Ro). Views made once (the GEMM caches by tensor).
        self.wo_a_all = w["wo_a"].contiguous()          # one (G * Ro, K) matrix for the grouped GEMM
        self.wo_a = [w["wo_a"][g * o_lora_rank:(g + 1) * o_lora_rank] for g in range(self.n_groups)]
        self.scale = torch.tensor(head_dim ** -0.5, dtype=F32)
        self.scale_f = float(self.scale)            # the same fp32 value, for kernels (read once, not per call)
        self.rope, self.fp8_kv = rope, fp8_kv

    # -- the kv row: used for the context insert (main-kv rows) and for the block's own kv ----------------------
    def kv_rows(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x (n, h) fp16 -> kv (n, D) fp16: wkv, weighted RMS norm over all D dims, RoPE on the last rd dims."""
        return self._kv(linear(x, self.wkv), pos)

    def _kv(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The kv row from its wkv projection x (n, D) fp16 (may be a column slice)."""
        kv = self._norm_rope(x, self.kv_norm, pos)
        if self.fp8_kv:       # DeepSeek's reference quantizes the kv nope part; exllamav3 only on request
            kv = torch.cat((fp8_fake_quant(kv[:, :self.D - self.rd]), kv[:, self.D - self.rd:]), dim=-1)
        return kv

    def _norm_rope(self, x: torch.Tensor, w: torch.Tensor | None, pos: torch.Tensor) -> torch.Tensor:
        """head_norm over each D-row of x (n, ..., D), then RoPE on its tail at positions pos (n,)."""
        k = ops.fused("head_norm_rope")
        if k is not None:
            return k(x, w, self.eps, pos, self.rope.inv_freq, self.rd)
        return self._rope_tail(head_norm(x, w, self.eps), pos)

    def _rope_tail(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotate dims [Dn, D) of x (n, ..., D) at positions pos (n,) in fp32 and round them to fp16."""
        dn = self.D - self.rd
        cos, sin = self.rope.cos_sin(pos)
        shape = (pos.shape[0],) + (1,) * (x.dim() - 2) + (self.rd // 2,)
        tail = f16(Rope.rotate(x[..., dn:], cos.reshape(shape), sin.reshape(shape)))
        return torch.cat((x[..., :dn], tail), dim=-1)

    # -- the draft block -------------------------------------------------------------------------------------------
    def __call__(self, a: torch.Tensor, pos: torch.Tensor, window: torch.Tensor, valid: torch.Tensor,
                 block: int) -> torch.Tensor:
        """a (bsz*B, h) fp16, rows of request r at positions pos (bsz*B,) = p0[r] + j (int64, on a's device: made
        once per step by the drafter, every block reads the same); window (bsz, W, D) fp16: the main-kv rows of
        positions p0-W .. p0-1, of which `valid` (bsz, W) marks those the slot holds (a partial window masks its
        oldest rows); it may be a branch's result (`ops.joined`), joined after the q path. Returns this shard's fp32
        partial of the wo_b output (bsz*B, h).

        Every request attends over the same fixed layout [W window rows ; B block rows] (non-causal, V = K), masked
        rows taking exactly zero probability mass: no shape depends on the data, so the step has no host sync and
        can be captured in a CUDA graph, and the pinned summation order is the same for every request."""
        H, D = self.n_heads, self.D
        n = a.shape[0]
        bsz = n // block
        qkv = linear(a, self.wqkv_a)
        kv = ops.branch(self._kv, qkv[:, self.q_rank:], pos)           # the kv row beside the q path
        q = linear(rms_norm(qkv[:, :self.q_rank], self.q_norm, self.eps), self.wq_b).reshape(n, H, D)
        q = self._norm_rope(q, None, pos).reshape(bsz, block, H, D)
        kv = kv.join().reshape(bsz, block, D)
        window = ops.joined(window)        # it may come from a branch (an insert beside the step): read from here on
        fused_attend = ops.fused("attend")
        if fused_attend is not None:       # o straight into the grouped output projection's input layout
            o = fused_attend(q, window, valid, kv, self.sink, self.scale_f, pos, self.rope.inv_freq, self.rd,
                             groups=self.n_groups)
        else:
            keys = torch.cat((torch.where(valid[..., None], window, torch.zeros_like(window)), kv), dim=1)
            mask = torch.cat((valid, torch.ones(bsz, block, dtype=torch.bool, device=a.device)), dim=1)
            cos, sin = self.rope.cos_sin(pos)
            o = self._attend(q, keys, mask, cos.reshape(bsz, block, -1), sin.reshape(bsz, block, -1))
        # Grouped output: group g holds heads [g*hpg, (g+1)*hpg), concatenated in head order.
        u = o.reshape(n, self.n_groups, self.hpg * D)
        grouped = ops.fused("linear_grouped")
        if grouped is not None:
            z = grouped(u, self.wo_a_all)
        else:
            z = torch.cat([linear(u[:, g], self.wo_a[g]) for g in range(self.n_groups)], dim=-1)
        return linear(z, self.wo_b, out_dtype=F32)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """Softmax with sink; q (bsz, B, H, D), keys (bsz, m, D), mask (bsz, m) -> (bsz, B, H, D) fp16 after
        de-rotation. fp32 scores; one max over the unmasked keys and the sink; fp32 denominator from unrounded
        exponentials; exponentials rounded to fp16 for the PV product (exllamav3's rounding points). A masked key
        scores -inf, so its exponential is exactly 0 and it adds exact zeros to both sums."""
        kf = keys.float()[:, None, None, :, :]                                            # (bsz, 1, 1, m, D)
        s = tree_sum(q.float()[:, :, :, None, :] * kf) * self.scale                       # (bsz, B, H, m)
        s = torch.where(mask[:, None, None, :], s, torch.full_like(s, -torch.inf))
        sink = self.sink                                                                  # (H,)
        mu = torch.maximum(s.amax(dim=-1), sink)
        e = exp(s - mu[..., None])
        den = exp(sink - mu) + tree_sum(e)
        pv = tree_sum(f16(e).float()[..., None] * kf, dim=-2)                             # (bsz, B, H, D)
        o = pv / den[..., None]
        dn = self.D - self.rd
        tail = Rope.rotate(o[..., dn:], cos[:, :, None, :], sin[:, :, None, :], inverse=True)
        return f16(torch.cat((o[..., :dn], tail), dim=-1))
