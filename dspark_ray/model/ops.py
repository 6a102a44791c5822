"""Numeric building blocks with pinned rounding points and a pinned reduction order.

Every reduction the drafter does along a hidden dimension (GEMM dot products, RMS means, attention dots and
probability-weighted sums) goes through `tree_sum`: products are formed in fp32 (exact for fp16 x fp16), then added
as a fixed pairwise tree over the reduced axis. The order depends only on the axis length, never on how many rows
share the call, the thread count or the device, so

* a request's drafts do not depend on which other requests share its batch (batch invariance),
* the CPU suite, a CPU rank in a Ray actor (one thread) and an in-process reference (two threads) agree bit for bit.

A library GEMM (MKL, cuBLAS) chooses its blocking by the row count and thread count and so breaks both (on a CPU,
`x @ W.T` for 20 rows differs from the same rows one at a time). The GPU engine runs
`linear` on a batch-invariant kernel of its own: each drafter is handed its `Kernels` at start-up (`EXACT`, these
ops, by default), and the ops run on those of the drafter whose entry point is running (`using`).
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

# Bound the (rows, N, K) fp32 product tensor of one tree-sum GEMM chunk (bytes); the N-chunking does not change bits.
_CHUNK_BYTES = 64 << 20


def f16(x: torch.Tensor) -> torch.Tensor:
    """Round to fp16 (round-to-nearest-even). Overflow becomes inf, as on the GPU: the synthetic weights are scaled
    so that it never happens, and the tests check every activation stays finite."""
    return x if x.dtype == F16 else x.to(F16)


# Transcendentals are evaluated in fp64 and rounded once to fp32. torch's CPU kernels compute the bulk of a tensor
# with a vectorized exp / rsqrt and the tail with a scalar one, which can differ by an ulp, so an element's fp32
# value would depend on its position in the tensor, i.e. on the batch (seen here: logits of a lone request
# differed from the same request batched with another). In fp64 both paths are far inside one fp32 ulp, so the
# rounded fp32 result is the same wherever the element sits, on any device.
def exp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.double()).float()


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x.double()).float()


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    return torch.rsqrt(x.double()).float()


def softplus(x: torch.Tensor, threshold: float = 20.0) -> torch.Tensor:
    """softplus(x) = x above the threshold, log1p(exp(x)) otherwise (fp64, rounded once)."""
    xd = x.double()
    return torch.where(xd > threshold, xd, torch.log1p(torch.exp(xd))).float()


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum along `dim` in a fixed pairwise order: pad with zeros to a power of two 2h, add element i to element
    i + h, repeat until one is left. Zeros add exactly, so the padding never changes a bit. The reduced axis is
    moved to the front so every halving is one add of two contiguous blocks."""
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
    """The fp32, transposed (K, N) copy of a weight that the tree GEMM reads, made once and kept on the weight
    itself, so it lives exactly as long as the weight does."""
    wt = getattr(w, "_dspark_wt", None)
    if wt is None:
        wt = w.float().t().contiguous()
        w._dspark_wt = wt
    return wt


def linear_tree(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 result of x @ w.T with exact fp32 products (fp16-valued operands) and the fixed `tree_sum` order over
    K. x (..., K), w (N, K). Products are laid out (K, rows, N) so the halvings run over contiguous blocks."""
    lead = x.shape[:-1]
    xt = x.reshape(-1, x.shape[-1]).float().t()              # (K, rows)
    wt = _weight_t(w)                                         # (K, N)
    k, rows = xt.shape
    n = wt.shape[1]
    budget = _CHUNK_BYTES if xt.device.type == "cpu" else 16 * _CHUNK_BYTES     # fewer launches on a GPU
    step = max(1, budget // max(1, rows * k * 4))
    outs = [tree_sum(xt[:, :, None] * wt[:, None, c:c + step], dim=0) for c in range(0, n, step)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
    return out.reshape(*lead, n)


def linear_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 result of a per-row linear: out[m] = x[m] @ w[m].T, x (M, K), w (M, N, K) (each row its own weight,
    e.g. its routed expert gathered by index). Same exact products and the same `tree_sum` order over K as
    `linear_tree`, so a row's result equals what `linear_tree(x[m], w[m])` gives, bit for bit."""
    m, k = x.shape
    n = w.shape[1]
    budget = _CHUNK_BYTES if x.device.type == "cpu" else 16 * _CHUNK_BYTES
    step = max(1, budget // max(1, n * k * 4))
    outs = [tree_sum(x[c:c + step, None, :].float() * w[c:c + step].float()) for c in range(0, m, step)]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def linear_indexed_tree(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """fp32 result of out[p] = x[p] @ w[idx[p]].T: x (P, K), w stacked (E, N, K), idx (P,) int64 (each row its
    routed expert). The reference form: the experts gathered by index, then `linear_rows`."""
    return linear_rows(x, w[idx])


# Fused kernels by name (`kernels/fused.py`), each a one-launch twin of a chain of the reference ops here and in
# the model modules, which use it when the active kernels have it. Every name the model may ask for is listed here:
# an unknown name (a misspelling) raises instead of quietly taking the slow path.
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
    """The kernels a drafter's math runs on: the fp32-accumulating matmul of every dense layer, the indexed one of
    the routed experts, and the fused kernels by name (none: the reference chains). `mode` names the set in the
    logs ("exact", "fast" or a caller's own); `dense` is the fast path's dense kernel ("triton" or "cublas"), None
    where there is no such choice. A value made once at start-up (`kernels.gemm.kernels_for`) and handed to the
    drafter, which makes it the active set while one of its entry points runs (`using`)."""
    mode: str = "exact"
    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = linear_tree
    matmul_indexed: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = linear_indexed_tree
    fused_table: Mapping[str, Callable] = field(default_factory=dict)
    dense: str | None = None

    def __post_init__(self):
        _known(self.fused_table)
        # A read-only copy: whoever holds the set shares it, so no one may change it under the others.
        object.__setattr__(self, "fused_table", MappingProxyType(dict(self.fused_table)))

    def fused(self, name: str) -> Callable | None:
        """The fused kernel `name`, or None (use the reference chain); KeyError for a name no kernel has."""
        if name not in FUSED_NAMES:
            _known([name])
        return self.fused_table.get(name)

    def without(self, *names: str) -> "Kernels":
        """These kernels less the fused ones named: their reference chains run instead."""
        _known(names)
        return replace(self, fused_table={k: v for k, v in self.fused_table.items() if k not in names})


EXACT = Kernels()       # the reference: tree-sum matmuls, every op chain as written

# The kernels the ops run on: those of the drafter whose entry point is running (it sets them through `using`),
# the exact reference outside any. A context variable, not a module global, so that drafters with different kernels
# live in one process (one after the other or on threads of their own) and each runs on its own, while the model
# modules call `fused` / `linear` without a kernel argument. A new thread starts with the default, so every entry
# point sets it.
_ACTIVE: contextvars.ContextVar[Kernels] = contextvars.ContextVar("dspark_kernels", default=EXACT)


def active() -> Kernels:
    """The kernels the ops run on here and now."""
    return _ACTIVE.get()


@contextlib.contextmanager
def using(kernels: Kernels) -> Iterator[Kernels]:
    """Run the ops on `kernels` inside the block (this thread's context only); the set before comes back after."""
    if not isinstance(kernels, Kernels):
        raise TypeError(f"kernels {kernels!r} are not an ops.Kernels (kernels.gemm.kernels_for builds them)")
    token = _ACTIVE.set(kernels)
    try:
        yield kernels
    finally:
        _ACTIVE.reset(token)


def fused(name: str) -> Callable | None:
    """The active fused kernel `name`, or None (use the reference chain); KeyError for a name no kernel has."""
    return _ACTIVE.get().fused(name)


class Ready:
    """A branch run at once (the serial form): `join` gives its value."""

    def __init__(self, value):
        self.value = value

    def join(self):
        return self.value


def joined(x):
    """x, or when x is a branch (`branch`, or one part of `branch_parts`) its value, the caller's stream made to
    wait for it there: an input that a branch computes is joined by the op that reads it, as late as it can be."""
    join = getattr(x, "join", None)
    return join() if join is not None else x


def branch(fn: Callable, *args):
    """fn(*args) as a branch that may run beside what the caller does next; `.join()` gives its result. The fast
    path runs it on a side stream (`kernels/streams.py`); here it runs at once. Either way the same bits: a branch
    only reads its arguments, and the caller joins before it reads the result."""
    k = _ACTIVE.get().fused_table.get("branch")
    return k(fn, *args) if k is not None else Ready(fn(*args))


def branch_parts(fn: Callable, *args) -> list:
    """The values the generator fn(*args) yields, as branches that may run beside what the caller does next, each
    joined alone (`.join()` or `joined`) by the op that reads it: a reader of the first part need not wait for the
    work that makes the later ones. The serial form runs the generator at once."""
    k = _ACTIVE.get().fused_table.get("branch_parts")
    return k(fn, *args) if k is not None else [Ready(v) for v in fn(*args)]


def graph_launches():
    """The context the graph set warms up and captures in: there the fast path launches its kernels with
    programmatic dependent launch (`kernels/fused_ops.pdl_launches`), so the graphs hold programmatic edges; the
    same bits as without."""
    k = _ACTIVE.get().fused_table.get("graph_launches")
    return k() if k is not None else contextlib.nullcontext()


def linear_indexed(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """fp32 (P, N): row p times its own weight w[idx[p]] (E, N, K stacked), through the active kernel, or the
    bank's own product when the stacked weights carry one (EXL3 experts: `kernels/exl3_gemm.py`)."""
    if not isinstance(w, torch.Tensor):
        return w.matmul_indexed(x, idx, F32)
    return _ACTIVE.get().matmul_indexed(x, w, idx)


def linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype = F16,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """Linear(W, x) = x @ W.T of fp16-valued operands, fp32 accumulation, one rounding to `out_dtype`. A weight
    that carries its own product (an EXL3 Linear on its GPU kernels: `kernels/exl3_gemm.py`) runs it."""
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
    """Block RMSNorm: y = (x * w) * rsqrt(mean(x^2) + eps) entirely in fp32, output fp16 (spec section 4).
    x is fp16 or fp32; w is bf16 (kept) or fp16, read exactly as fp32."""
    k = _ACTIVE.get().fused_table.get("rms_norm")
    if k is not None:
        return k(x, w, eps)
    xf = x.float()
    r = rsqrt(tree_sum(xf * xf) / xf.shape[-1] + eps)
    return f16((xf * w.float()) * r[..., None])


def head_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The fused per-head norm of the q heads (w None: a ones vector) and of the kv row (w = kv_norm).
    Sum of squares in fp32; with a bf16 (or fp32) weight the product (x * rsqrt) * w is rounded once to fp16; with an
    fp16 weight exllamav3 rounds x * rsqrt to fp16 first and multiplies in fp16 (double rounding)."""
    xf = x.float()
    r = rsqrt(tree_sum(xf * xf) / xf.shape[-1] + eps)[..., None]
    if w is None:
        return f16(xf * r)
    if w.dtype == F16:
        return f16(f16(xf * r).float() * w.float())
    return f16((xf * r) * w.float())


class Rope:
    """GPT-J (interleaved) rotary embedding on the last `rd` dims, unscaled (the drafter's sliding blocks).

    inv_freq_i = 1 / theta^(2i/rd) and sin/cos are computed in fp64 and rounded to fp32; the angle is the fp32
    product f32(w_i * p). The table is computed per call for the positions asked (exact either way)."""

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
        """Rotate the interleaved pairs of x (..., rd) in fp32; returns fp32. cos/sin broadcast to (..., rd/2)."""
        xf = x.float()
        x0, x1 = xf[..., 0::2], xf[..., 1::2]
        if inverse:
            y0, y1 = x0 * cos + x1 * sin, x1 * cos - x0 * sin
        else:
            y0, y1 = x0 * cos - x1 * sin, x1 * cos + x0 * sin
        return torch.stack((y0, y1), dim=-1).flatten(-2)


def silu_f16(g: torch.Tensor) -> torch.Tensor:
    """silu(g) in correctly rounded fp16 steps, as exllamav3's dense path (h2exp / h2rcp):
    f16(g * f16(1 / f16(1 + f16(exp(-g)))))."""
    gf = g.float()
    t = f16(exp(-gf)).float()
    t = f16(1.0 + t).float()
    r = f16(1.0 / t).float()
    return f16(gf * r)


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamped SwiGLU in exllamav3's order: f16(min(silu(g), L) * clamp(u, -L, L)). g and u are the projections,
    fp16 or their fp32 accumulators (rounded to fp16 first: the projections' rounding point); fp16 out.

    We follow exllamav3 rather than DeepSeek's reference (silu(min(g, L))): exllamav3 is the implementation our
    spec was checked against bit for bit on drafts (spec section 10), and the two differ only where g > L, by at
    most L * (1 - sigmoid(L)) in the gate factor. limit == 0 disables both clamps."""
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
    """e4m3 fake-quant in groups of `group` with power-of-two scales (DeepSeek's act_quant), back to fp16."""
    g = x.float().reshape(*x.shape[:-1], -1, group)
    amax = g.abs().amax(-1, keepdim=True).clamp(min=1e-12).double()
    s = torch.exp2(torch.ceil(torch.log2(amax / 448.0))).float()     # a power of two: exact in fp32
    q = (g / s).to(torch.float8_e4m3fn).float() * s
    return f16(q.reshape(x.shape))
