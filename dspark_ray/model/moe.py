"""The drafter block's MoE (spec 3b.4): sqrt-softplus router with a selection-only bias, top-k, clamped SwiGLU
experts, a shared expert. The router is whole (identical inputs route identically on every rank); the experts may
be a rank's intermediate-channel slice, giving that rank's fp32 partial.
"""
from __future__ import annotations

import torch

from . import ops
from .ops import F32, f16, linear, linear_indexed, softplus, swiglu, tree_sum


class Router:
    def __init__(self, gate: torch.Tensor, bias: torch.Tensor, *, top_k: int, scaling: float):
        self.gate = gate
        b = bias.float()
        # Selection only (noaux_tc): mean-centred, then fp16; centring changes the choice only through rounding.
        self.bsel = f16(b - tree_sum(b) / b.numel()).float()
        self.top_k, self.scaling = top_k, torch.tensor(scaling, dtype=F32)
        self.scaling_f = float(self.scaling)

    def __call__(self, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """f (n, h) fp16 -> (experts (n, k) int64 in selection order, weights (n, k) fp16)."""
        k = ops.fused("router_logits")
        return self.select(k(f, self.gate) if k is not None else linear(f, self.gate))

    def select(self, lg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = ops.fused("route")
        if k is not None:
            return k(lg, self.bsel, self.top_k, self.scaling_f)
        sc = torch.sqrt(softplus(lg.float()))       # sqrt is correctly rounded everywhere
        key = sc + self.bsel
        key = torch.where(torch.isnan(key), torch.full_like(key, -torch.inf), key)
        # stable: ties go to the lower expert id
        order = torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :self.top_k]
        chosen = torch.gather(sc, 1, order)
        den = chosen[:, 0]
        for i in range(1, self.top_k):                                   # summed in selection order
            den = den + chosen[:, i]
        w = f16(chosen * self.scaling / (den + 1e-20)[:, None])
        return order, w


class Experts:
    """Routed + shared experts of one block (maybe a channel slice). No shape depends on the routing (capturable);
    a row's routed outputs are added in ascending expert id, as exllamav3's dense path does."""

    def __init__(self, w1: list[torch.Tensor], w3: list[torch.Tensor], w2: list[torch.Tensor],
                 shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor], *, limit: float):
        self.w1, self.w3, self.w2 = torch.stack(w1), torch.stack(w3), torch.stack(w2)
        s1, s3, self.shared_w2 = shared
        self.shared_w13, self.shared_i = torch.cat((s1, s3)), s1.shape[0]
        self.limit = limit
        # An EXL3 bank may run the whole expert as one kernel (`kernels/exl3_gemm.py`).
        self.fused_experts = (None if isinstance(self.w1, torch.Tensor)
                              else self.w1.swiglu_experts(self.w3, self.w2, limit))

    def shared(self, f: torch.Tensor) -> torch.Tensor:
        gu, i = linear(f, self.shared_w13), self.shared_i
        return linear(swiglu(gu[..., :i], gu[..., i:], self.limit), self.shared_w2, out_dtype=F32)

    def routed(self, f: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, shared) -> torch.Tensor:
        """sum_k w_k d_{e_k} (ascending expert id) + shared, fp32; `shared` is a branch, joined where needed."""
        if self.fused_experts is not None:
            return self.fused_experts(f, experts, weights, shared.join())
        act_k, out_k = ops.fused("expert_act"), ops.fused("expert_out")
        if act_k is not None and out_k is not None and isinstance(self.w1, torch.Tensor):
            act = act_k(f, self.w1, self.w3, experts, self.limit)
            return out_k(act, self.w2, experts, weights, shared.join())
        n, k = experts.shape
        order = torch.argsort(experts, dim=1, stable=True)              # ascending expert id per row
        e = torch.gather(experts, 1, order).flatten()
        w = torch.gather(weights, 1, order).float()
        fr = f.repeat_interleave(k, dim=0)
        act = swiglu(linear_indexed(fr, self.w1, e), linear_indexed(fr, self.w3, e), self.limit)
        d = linear_indexed(act, self.w2, e).reshape(n, k, -1)
        routed = torch.zeros(n, d.shape[-1], dtype=F32, device=f.device)
        for j in range(k):
            routed = routed + w[:, j, None] * d[:, j]
        return routed + shared.join()
