"""Numeric building blocks with pinned rounding points and a pinned reduction order: every reduction along a hidden
dimension goes through `tree_sum` (exact fp32 products, a fixed pairwise tree), so results depend on neither the
batch, the thread count nor the device; a library GEMM blocks by row and thread count and would break that. The GPU
runs its own batch-invariant `Kernels` (docs/engine.md, "A GPU rank at a glance").
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Callable, Iterator, Mapping

import torch

F16 = torch.float16
F32 = torch.float32

# Bounds one tree-sum GEMM chunk's fp32 products; the N-chunking does not change bits.
_CHUNK_BYTES = 64 << 20


def f16(x: torch.Tensor) -> torch.Tensor:
    """Round to fp16 (nearest-even); overflow becomes inf, as on the GPU."""
    return x if x.dtype == F16 else x.to(F16)


# Transcendentals in fp64, rounded once to fp32: torch's CPU vectorized bulk and scalar tail differ by an ulp in
# fp32, which would make an element's value depend on its place in the batch; in fp64 both round alike.
def exp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.double()).float()


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x.double()).float()


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    return torch.rsqrt(x.double()).float()


def softplus(x: torch.Tensor, threshold: float = 20.0) -> torch.Tensor:
    xd = x.double()
    return torch.where(xd > threshold, xd, torch.log1p(torch.exp(xd))).float()


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum along `dim` in a fixed pairwise order: zero-pad to a power of two 2h (zeros add exactly), add element
    i + h to i, repeat."""
    x = x.movedim(dim, 0)
    n = x.shape[0]
    if n == 0:
        return x.new_zeros(x.shape[1:])
    p = 1 << max(0, math.ceil(math.log2(n)))
    if p != n:
        x = torch.cat((x, x.new_zeros((p - n,) + tuple(x.shape[1:]))))
    while x.shape[0] > 1:
        h = x.shape[0] // 2
        x = x[:h] + x[h:]
    return x[0]


def _weight_t(w: torch.Tensor) -> torch.Tensor:
    """The tree GEMM's fp32 (K, N) copy of w, kept on the weight so it lives exactly as long."""
    wt = getattr(w, "_dspark_wt", None)
    if wt is None:
        wt = w.float().t().contiguous()
        w._dspark_wt = wt
    return wt


def linear_tree(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 x @ w.T: exact fp32 products of fp16-valued operands, `tree_sum` over K."""
    lead = x.shape[:-1]
    xt = x.reshape(-1, x.shape[-1]).float().t()              # (K, rows)
    wt = _weight_t(w)                                         # (K, N)
    k, rows = xt.shape
    n = wt.shape[1]
    budget = _CHUNK_BYTES if xt.device.type == "cpu" else 16 * _CHUNK_BYTES
    step = max(1, budget // max(1, rows * k * 4))
    outs = [tree_sum(xt[:, :, None] * wt[:, None, c:c + step], dim=0) for c in range(0, n, step)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
    return out.reshape(*lead, n)


def linear_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 out[m] = x[m] @ w[m].T, x (M, K), w (M, N, K): bit for bit `linear_tree(x[m], w[m])`."""
    m, k = x.shape
    n = w.shape[1]
    budget = _CHUNK_BYTES if x.device.type == "cpu" else 16 * _CHUNK_BYTES
    step = max(1, budget // max(1, n * k * 4))
    outs = [tree_sum(x[c:c + step, None, :].float() * w[c:c + step].float()) for c in range(0, m, step)]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def linear_indexed_tree(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """fp32 out[p] = x[p] @ w[idx[p]].T, w stacked (E, N, K)."""
    return linear_rows(x, w[idx])


# Every fused kernel name the model may ask for (`kernels/fused.py`): a misspelling raises rather than quietly
# taking the reference chain.
FUSED_NAMES = frozenset({
    "attend", "branch", "branch_parts", "confidence", "confidence_prenorm", "embed_streams", "expert_act",
    "expert_out", "graph_launches", "head_norm_rope", "hyper_head_norm", "linear_f16", "linear_grouped",
    "markov_rows", "markov_step", "mhc_collapse_norm", "mhc_expand", "pack_outputs", "rms_norm", "route",
    "router_logits", "swiglu",
})


def _known(names) -> None:
    unknown = sorted(set(names) - FUSED_NAMES)
    if unknown:
        raise KeyError(f"no fused kernel named {', '.join(map(repr, unknown))} (ops.FUSED_NAMES lists them)")


@dataclass(frozen=True)
class Kernels:
    """The kernels a drafter's math runs on: the dense matmul, the routed experts' indexed one, and the fused
    kernels by name (none: the reference chains). Made at start-up (`kernels.gemm.kernels_for`)."""
    mode: str = "exact"
    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = linear_tree
    matmul_indexed: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = linear_indexed_tree
    fused_table: Mapping[str, Callable] = field(default_factory=dict)
    dense: str | None = None

    def __post_init__(self):
        _known(self.fused_table)
        # Read-only: the set is shared.
        object.__setattr__(self, "fused_table", MappingProxyType(dict(self.fused_table)))

    def fused(self, name: str) -> Callable | None:
        if name not in FUSED_NAMES:
            _known([name])
        return self.fused_table.get(name)

    def without(self, *names: str) -> "Kernels":
        _known(names)
        return replace(self, fused_table={k: v for k, v in self.fused_table.items() if k not in names})


EXACT = Kernels()       # the reference: tree-sum matmuls, every op chain as written

# The running drafter entry point's kernels (`using`). A context variable, so drafters with different kernels share
# a process; a new thread starts at EXACT, so every entry point sets it.
_ACTIVE: contextvars.ContextVar[Kernels] = contextvars.ContextVar("dspark_kernels", default=EXACT)


def active() -> Kernels:
    return _ACTIVE.get()


@contextlib.contextmanager
def using(kernels: Kernels) -> Iterator[Kernels]:
    """Run the ops on `kernels` inside the block (this context only)."""
    if not isinstance(kernels, Kernels):
        raise TypeError(f"kernels {kernels!r} are not an ops.Kernels (kernels.gemm.kernels_for builds them)")
    token = _ACTIVE.set(kernels)
    try:
        yield kernels
    finally:
        _ACTIVE.reset(token)


def fused(name: str) -> Callable | None:
    """The active fused kernel `name`, or None (the reference chain); KeyError for an unknown name."""
    return _ACTIVE.get().fused(name)


class Ready:
    """A branch run at once (the serial form)."""

    def __init__(self, value):
        self.value = value

    def join(self):
        return self.value


def joined(x):
    """x, or a branch's joined value: the op that reads a branch's result joins it, as late as it can be."""
    join = getattr(x, "join", None)
    return join() if join is not None else x


def branch(fn: Callable, *args):
    """fn(*args), maybe beside what the caller does next (`kernels/streams.py`); the same bits either way, as a
    branch only reads its arguments and the caller joins before reading the result."""
    k = _ACTIVE.get().fused_table.get("branch")
    return k(fn, *args) if k is not None else Ready(fn(*args))


def branch_parts(fn: Callable, *args) -> list:
    """The values the generator fn(*args) yields, as branches each joined alone by the op that reads it."""
    k = _ACTIVE.get().fused_table.get("branch_parts")
    return k(fn, *args) if k is not None else [Ready(v) for v in fn(*args)]


def graph_launches():
    """The graph set's warm-up and capture context: PDL launches on the fast path (same bits)."""
    k = _ACTIVE.get().fused_table.get("graph_launches")
    return k() if k is not None else contextlib.nullcontext()


def linear_indexed(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """fp32 (P, N): row p times w[idx[p]], or the bank's own product (EXL3: `kernels/exl3_gemm.py`)."""
    if not isinstance(w, torch.Tensor):
        return w.matmul_indexed(x, idx, F32)
    return _ACTIVE.get().matmul_indexed(x, w, idx)


def linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype = F16,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T of fp16-valued operands, fp32 accumulation, one rounding to `out_dtype`."""
    if not isinstance(w, torch.Tensor):
        y = w.matmul(x, F16 if bias is None and out_dtype == F16 else F32)
        if bias is None:
            return y
        y = y + bias.float()
        return f16(y) if out_dtype == F16 else y
    kernels = _ACTIVE.get()
    if bias is None and out_dtype == F16 and "linear_f16" in kernels.fused_table:
        return kernels.fused_table["linear_f16"](x, w)
    y = kernels.matmul(x, w)
    if bias is not None:
        y = y + bias.float()
    return f16(y) if out_dtype == F16 else y


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """f16((x * w) * rsqrt(mean(x^2) + eps)), all in fp32 (spec section 4)."""
    k = _ACTIVE.get().fused_table.get("rms_norm")
    if k is not None:
        return k(x, w, eps)
    xf = x.float()
    r = rsqrt(tree_sum(xf * xf) / xf.shape[-1] + eps)
    return f16((xf * w.float()) * r[..., None])


def head_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Per-head norm of the q heads (w None) and the kv row: f16((x * rsqrt) * w) for a bf16 / fp32 weight; with
    an fp16 weight exllamav3 rounds x * rsqrt to fp16 first (double rounding)."""
    xf = x.float()
    r = rsqrt(tree_sum(xf * xf) / xf.shape[-1] + eps)[..., None]
    if w is None:
        return f16(xf * r)
    if w.dtype == F16:
        return f16(f16(xf * r).float() * w.float())
    return f16((xf * r) * w.float())


class Rope:
    """GPT-J (interleaved) RoPE on the last `rd` dims, unscaled: inv_freq and sin / cos in fp64 rounded to fp32,
    angle f32(w_i * p), no table."""

    def __init__(self, rd: int, theta: float, device: torch.device | str = "cpu"):
        i = torch.arange(rd // 2, dtype=torch.float64)
        self.inv_freq = (1.0 / (theta ** (2.0 * i / rd))).to(F32).to(device)
        self.rd = rd

    def cos_sin(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ang = pos.to(F32)[..., None] * self.inv_freq          # fp32 product
        a64 = ang.double()
        return torch.cos(a64).float(), torch.sin(a64).float()

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate the interleaved pairs of x (..., rd) in fp32."""
        xf = x.float()
        x0, x1 = xf[..., 0::2], xf[..., 1::2]
        if inverse:
            y0, y1 = x0 * cos + x1 * sin, x1 * cos - x0 * sin
        else:
            y0, y1 = x0 * cos - x1 * sin, x1 * cos + x0 * sin
        return torch.stack((y0, y1), dim=-1).flatten(-2)


def silu_f16(g: torch.Tensor) -> torch.Tensor:
    """silu in fp16 steps as exllamav3's dense path: f16(g * f16(1 / f16(1 + f16(exp(-g)))))."""
    gf = g.float()
    t = f16(exp(-gf)).float()
    t = f16(1.0 + t).float()
    r = f16(1.0 / t).float()
    return f16(gf * r)


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """f16(min(silu(f16(g)), L) * clamp(f16(u), -L, L)); limit 0: no clamps. exllamav3's order, not DeepSeek's
    silu(min(g, L)): the spec was checked bit for bit against exllamav3 (spec section 10)."""
    k = _ACTIVE.get().fused_table.get("swiglu")
    if k is not None:
        return k(g, u, limit)
    s = silu_f16(f16(g)).float()
    uf = f16(u).float()
    if limit > 0:
        s = torch.clamp(s, max=limit)
        uf = torch.clamp(uf, -limit, limit)
    return f16(s * uf)


def fp8_fake_quant(x: torch.Tensor, group: int = 64) -> torch.Tensor:
    """e4m3 fake-quant in groups with power-of-two scales (DeepSeek's act_quant), back to fp16."""
    g = x.float().reshape(*x.shape[:-1], -1, group)
    amax = g.abs().amax(-1, keepdim=True).clamp(min=1e-12).double()
    s = torch.exp2(torch.ceil(torch.log2(amax / 448.0))).float()     # a power of two: exact in fp32
    q = (g / s).to(torch.float8_e4m3fn).float() * s
    return f16(q.reshape(x.shape))
