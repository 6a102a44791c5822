"""mHC: the four fp32 residual streams, their mix before each sublayer, and the HyperHead at exit. `fn` is rounded
to fp16 at every batch width (exllamav3 rounds only up to 32 rows, which would tie a request's drafts to its batch);
sums over the streams run k = 0..3 as separate multiply and add (no FMA).
"""
from __future__ import annotations

import torch

from . import ops
from .ops import exp, f16, rms_norm, rsqrt, sigmoid, tree_sum


def _mix_logits(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """v = (fn16 @ flatten(X)) * rho, rho = 1/sqrt(mean(X^2) + eps) over all M*h values."""
    xf = x.reshape(x.shape[0], -1)
    rho = rsqrt(tree_sum(xf * xf) / xf.shape[-1] + eps)
    fn16 = f16(fn).float()
    v = tree_sum(xf[:, None, :] * fn16[None, :, :])
    return v * rho[:, None]


def _weighted_streams(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_k w[:, k] * X[:, k] in k order, fp32."""
    acc = w[:, 0, None] * x[:, 0]
    for k in range(1, x.shape[1]):
        acc = acc + w[:, k, None] * x[:, k]
    return acc


def sinkhorn(s: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax + eps, column normalisation, then (iters - 1) rounds of row then column; s [source, dest]."""
    e = exp(s - s.amax(dim=-1, keepdim=True))
    p = e / tree_sum(e, -1)[..., None] + eps
    p = p / (tree_sum(p, -2)[..., None, :] + eps)
    for _ in range(iters - 1):
        p = p / (tree_sum(p, -1)[..., None] + eps)
        p = p / (tree_sum(p, -2)[..., None, :] + eps)
    return p


class HcSite:

    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, m: int, iters: int,
                 hc_eps: float, norm_eps: float):
        self.fn, self.base, self.scale = fn, base.float(), scale.float()
        self.m, self.iters, self.hc_eps, self.norm_eps = m, iters, hc_eps, norm_eps

    def collapse(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """c (rows, h) = f16(sum_k pre_k X_k), and the post weights and comb matrix for `expand`."""
        m = self.m
        v = _mix_logits(x, self.fn, self.norm_eps)
        b, sc = self.base, self.scale
        pre = sigmoid(v[:, :m] * sc[0] + b[:m]) + self.hc_eps
        post = 2.0 * sigmoid(v[:, m:2 * m] * sc[1] + b[m:2 * m])
        s = (v[:, 2 * m:] * sc[2] + b[2 * m:]).reshape(-1, m, m)
        comb = sinkhorn(s, self.iters, self.hc_eps)
        return f16(_weighted_streams(x, pre)), post, comb

    def collapse_norm(self, x: torch.Tensor, norm_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k = ops.fused("mhc_collapse_norm")
        if k is not None:
            return k(x, self.fn, self.base, self.scale, norm_w, iters=self.iters, hc_eps=self.hc_eps,
                     norm_eps=self.norm_eps)
        c, post, comb = self.collapse(x)
        return rms_norm(c, norm_w, self.norm_eps), post, comb

    @staticmethod
    def expand(x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """X[:, k] <- post_k * y + sum_i comb[i, k] * X[:, i]."""
        k = ops.fused("mhc_expand")
        if k is not None:
            return k(x, y, post, comb)
        out = []
        for k in range(x.shape[1]):
            acc = post[:, k, None] * y
            for i in range(x.shape[1]):
                acc = acc + comb[:, i, k, None] * x[:, i]
            out.append(acc)
        return torch.stack(out, dim=1)


class HyperHead:
    """Exit collapse: y = sum_k pre_k X_k (fp32), the PRE-norm hidden state."""

    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, hc_eps: float,
                 norm_eps: float):
        self.fn, self.base, self.scale = fn, base.float(), scale.float()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        v = _mix_logits(x, self.fn, self.norm_eps)
        pre = sigmoid(v * self.scale[0] + self.base) + self.hc_eps
        return _weighted_streams(x, pre)

    def with_norm(self, x: torch.Tensor, norm_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = ops.fused("hyper_head_norm")
        if k is not None:
            return k(x, self.fn, self.base, self.scale, norm_w, hc_eps=self.hc_eps, norm_eps=self.norm_eps)
        prenorm = self(x)
        return prenorm, rms_norm(prenorm, norm_w, self.norm_eps)
