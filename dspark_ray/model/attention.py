"""DSpark attention of one drafter block (spec 3b.3): MQA with one shared K=V row, per-head sinks, output
de-rotation, grouped output projection. It runs whatever heads its weights hold (a rank's whole o_groups, giving
that rank's fp32 wo_b partial); the kv side is always whole.
"""
from __future__ import annotations

import torch

from . import ops
from .ops import F32, Rope, exp, f16, fp8_fake_quant, head_norm, linear, rms_norm, tree_sum


class Attention:
    def __init__(self, w: dict[str, torch.Tensor], *, head_dim: int, rope_dim: int, o_lora_rank: int,
                 heads_per_group: int, eps: float, rope: Rope, fp8_kv: bool):
        # wq_a and wkv read the same input: one GEMM (each output element still its own row-times-row product).
        self.q_rank = w["wq_a"].shape[0]
        self.wqkv_a = torch.cat((w["wq_a"], w["wkv"]))
        self.wq_a, self.wkv = self.wqkv_a[:self.q_rank], self.wqkv_a[self.q_rank:]
        self.q_norm, self.wq_b, self.kv_norm = w["q_norm"], w["wq_b"], w["kv_norm"]
        self.wo_b, self.sink = w["wo_b"], w["attn_sink"].float()
        self.D, self.rd, self.Ro, self.hpg, self.eps = head_dim, rope_dim, o_lora_rank, heads_per_group, eps
        self.n_heads = self.wq_b.shape[0] // head_dim
        self.n_groups = self.n_heads // heads_per_group
        # group g uses rows [g*Ro, (g+1)*Ro); views made once, as the GEMM caches by tensor
        self.wo_a_all = w["wo_a"].contiguous()
        self.wo_a = [w["wo_a"][g * o_lora_rank:(g + 1) * o_lora_rank] for g in range(self.n_groups)]
        self.scale = torch.tensor(head_dim ** -0.5, dtype=F32)
        self.scale_f = float(self.scale)
        self.rope, self.fp8_kv = rope, fp8_kv

    def kv_rows(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x (n, h) fp16 -> main-kv rows (n, D) fp16 (the context insert)."""
        return self._kv(linear(x, self.wkv), pos)

    def _kv(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        kv = self._norm_rope(x, self.kv_norm, pos)
        if self.fp8_kv:       # DeepSeek's reference quantizes the kv nope part; exllamav3 only on request
            kv = torch.cat((fp8_fake_quant(kv[:, :self.D - self.rd]), kv[:, self.D - self.rd:]), dim=-1)
        return kv

    def _norm_rope(self, x: torch.Tensor, w: torch.Tensor | None, pos: torch.Tensor) -> torch.Tensor:
        k = ops.fused("head_norm_rope")
        if k is not None:
            return k(x, w, self.eps, pos, self.rope.inv_freq, self.rd)
        return self._rope_tail(head_norm(x, w, self.eps), pos)

    def _rope_tail(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotate dims [Dn, D) in fp32, round once to fp16."""
        dn = self.D - self.rd
        cos, sin = self.rope.cos_sin(pos)
        shape = (pos.shape[0],) + (1,) * (x.dim() - 2) + (self.rd // 2,)
        tail = f16(Rope.rotate(x[..., dn:], cos.reshape(shape), sin.reshape(shape)))
        return torch.cat((x[..., :dn], tail), dim=-1)

    def __call__(self, a: torch.Tensor, pos: torch.Tensor, window: torch.Tensor, valid: torch.Tensor,
                 block: int) -> torch.Tensor:
        """a (bsz*B, h) fp16 at positions pos = p0[r] + j; window (bsz, W, D) fp16, main-kv of p0-W .. p0-1 with
        `valid` (bsz, W) marking the rows held -> this shard's fp32 partial of the wo_b output. Every request
        attends over one fixed [window ; block] layout, masked rows taking exactly zero mass: capturable, and the
        same summation order for every request."""
        H, D = self.n_heads, self.D
        n = a.shape[0]
        bsz = n // block
        qkv = linear(a, self.wqkv_a)
        kv = ops.branch(self._kv, qkv[:, self.q_rank:], pos)
        q = linear(rms_norm(qkv[:, :self.q_rank], self.q_norm, self.eps), self.wq_b).reshape(n, H, D)
        q = self._norm_rope(q, None, pos).reshape(bsz, block, H, D)
        kv = kv.join().reshape(bsz, block, D)
        window = ops.joined(window)        # maybe an insert beside the step
        fused_attend = ops.fused("attend")
        if fused_attend is not None:
            o = fused_attend(q, window, valid, kv, self.sink, self.scale_f, pos, self.rope.inv_freq, self.rd,
                             groups=self.n_groups)
        else:
            keys = torch.cat((torch.where(valid[..., None], window, torch.zeros_like(window)), kv), dim=1)
            mask = torch.cat((valid, torch.ones(bsz, block, dtype=torch.bool, device=a.device)), dim=1)
            cos, sin = self.rope.cos_sin(pos)
            o = self._attend(q, keys, mask, cos.reshape(bsz, block, -1), sin.reshape(bsz, block, -1))
        # group g holds heads [g*hpg, (g+1)*hpg) in head order
        u = o.reshape(n, self.n_groups, self.hpg * D)
        grouped = ops.fused("linear_grouped")
        if grouped is not None:
            z = grouped(u, self.wo_a_all)
        else:
            z = torch.cat([linear(u[:, g], self.wo_a[g]) for g in range(self.n_groups)], dim=-1)
        return linear(z, self.wo_b, out_dtype=F32)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """Softmax with sink, exllamav3's rounding points: one max over the keys and the sink, fp32 denominator
        from unrounded exponentials, fp16 exponentials for PV; a masked key adds exact zeros to both sums."""
        kf = keys.float()[:, None, None, :, :]
        s = tree_sum(q.float()[:, :, :, None, :] * kf) * self.scale                       # (bsz, B, H, m)
        s = torch.where(mask[:, None, None, :], s, torch.full_like(s, -torch.inf))
        sink = self.sink
        mu = torch.maximum(s.amax(dim=-1), sink)
        e = exp(s - mu[..., None])
        den = exp(sink - mu) + tree_sum(e)
        pv = tree_sum(f16(e).float()[..., None] * kf, dim=-2)
        o = pv / den[..., None]
        dn = self.D - self.rd
        tail = Rope.rotate(o[..., dn:], cos[:, :, None, :], sin[:, :, None, :], inverse=True)
        return f16(torch.cat((o[..., :dn], tail), dim=-1))
