"""mHC: the four residual streams, their mix before each sublayer, and the HyperHead that collapses them at exit.

Streams X (rows, M=4, h) stay fp32 throughout. The mixing rows `fn` are rounded to fp16 at every batch width
(exllamav3 does so for batches of <= 32 rows, 6 requests x 5 tokens, and keeps them unrounded above: there a request's
drafts would depend on its batch; here they are its drafts alone, exllamav3's at any width); dots in fp32 with the
pinned tree order. Sums over the 4 streams run k = 0..3 as separate multiply and add (no FMA), a fixed choice.
"""
from __future__ import annotations

import torch

from . import ops
from .ops import exp, f16, rms_norm, rsqrt, sigmoid, tree_sum


def _mix_logits(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """v = (fn16 @ flatten(X)) * rho, rho = 1/sqrt(mean(X^2) + eps) over all M*h values. x (rows, M, h)."""
    xf = x.reshape(x.shape[0], -1)
    rho = rsqrt(tree_sum(xf * xf) / xf.shape[-1] + eps)
    fn16 = f16(fn).float()
    v = tree_sum(xf[:, None, :] * fn16[None, :, :])           # (rows, n_out) fp32
    return v * rho[:, None]


def _weighted_streams(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_k w[:, k] * X[:, k] in k order (rows, M) x (rows, M, h) -> (rows, h) fp32."""
    acc = w[:, 0, None] * x[:, 0]
    for k in range(1, x.shape[1]):
        acc = acc + w[:, k, None] * x[:, k]
    return acc


def sinkhorn(s: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax + eps, column normalisation, then (iters - 1) rounds of row then column normalisation.
    s (rows, M, M) fp32 indexed [source a, destination b]."""
    e = exp(s - s.amax(dim=-1, keepdim=True))
    p = e / tree_sum(e, -1)[..., None] + eps
    p = p / (tree_sum(p, -2)[..., None, :] + eps)
    for _ in range(iters - 1):
        p = p / (tree_sum(p, -1)[..., None] + eps)
        p = p / (tree_sum(p, -2)[..., None, :] + eps)
    return p


class HcSite:
    """One mHC site (`hc_attn` or `hc_ffn` of a block): collapse the streams into the sublayer input, then fold the
    sublayer output back into every stream."""

    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, m: int, iters: int,
                 hc_eps: float, norm_eps: float):
        self.fn, self.base, self.scale = fn, base.float(), scale.float()
        self.m, self.iters, self.hc_eps, self.norm_eps = m, iters, hc_eps, norm_eps

    def collapse(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns c (rows, h) fp16 = f16(sum_k pre_k X_k), and the post weights and comb matrix for `expand`."""
        m = self.m
        v = _mix_logits(x, self.fn, self.norm_eps)
        b, sc = self.base, self.scale
        pre = sigmoid(v[:, :m] * sc[0] + b[:m]) + self.hc_eps
        post = 2.0 * sigmoid(v[:, m:2 * m] * sc[1] + b[m:2 * m])
        s = (v[:, 2 * m:] * sc[2] + b[2 * m:]).reshape(-1, m, m)
        comb = sinkhorn(s, self.iters, self.hc_eps)
        return f16(_weighted_streams(x, pre)), post, comb

    def collapse_norm(self, x: torch.Tensor, norm_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`collapse`, then the sublayer's RMS norm of c: (normed (rows, h) fp16, post, comb)."""
        k = ops.fused("mhc_collapse_norm")
        if k is not None:
            return k(x, self.fn, self.base, self.scale, norm_w, iters=self.iters, hc_eps=self.hc_eps,
                     norm_eps=self.norm_eps)
        c, post, comb = self.collapse(x)
        return rms_norm(c, norm_w, self.norm_eps), post, comb

    @staticmethod
    def expand(x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """X[:, k] <- post_k * y + sum_i comb[i, k] * X[:, i] (comb indexed [source i, destination k])."""
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
    """Exit collapse of the last block: y = sum_k pre_k X_k (fp32), the PRE-norm hidden state."""

    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, hc_eps: float,
                 norm_eps: float):
        self.fn, self.base, self.scale = fn, base.float(), scale.float()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        v = _mix_logits(x, self.fn, self.norm_eps)
        pre = sigmoid(v * self.scale[0] + self.base) + self.hc_eps
        return _weighted_streams(x, pre)

    def with_norm(self, x: torch.Tensor, norm_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The exit state and its final RMS norm: (prenorm (rows, h) fp32, normed (rows, h) fp16)."""
        k = ops.fused("hyper_head_norm")
        if k is not None:
            return k(x, self.fn, self.base, self.scale, norm_w, hc_eps=self.hc_eps, norm_eps=self.norm_eps)
        prenorm = self(x)
        return prenorm, rms_norm(prenorm, norm_w, self.norm_eps)
