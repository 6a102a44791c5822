"""Every tensor of the DeepSeek-V4 drafter namespace, as data: its name, shape, synthetic storage dtype and the
`kind` that decides the compute form the loader hands out, whatever a real checkpoint stores.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..config import DrafterConfig

# As exllamav3 runs them.
COMPUTE_RULES = {
    "linear": "fp16 (any float storage; FP8/FP4 dequantized)",
    "linear_bias": "fp16",
    "norm": "bf16 or fp16 kept as stored; fp32 -> fp16",
    "table": "kept as stored (embed.weight, markov_w1: bf16)",
    "fp32": "fp32 (hc_*, attn_sink, gate.bias)",
}

# First match wins: the catch-alls `.bias` / `.weight` last.
_KIND_RULES: list[tuple[re.Pattern, str]] = [(re.compile(p), k) for p, k in [
    (r"\.hc_(attn|ffn|head)_(fn|base|scale)$", "fp32"),
    (r"\.attn\.attn_sink$", "fp32"),
    (r"\.ffn\.gate\.(bias|e_score_correction_bias)$", "fp32"),
    (r"(_norm|\.norm)\.weight$", "norm"),
    (r"^embed\.weight$|\.markov_w1\.weight$", "table"),
    (r"\.bias$", "linear_bias"),
    (r"\.weight$", "linear"),
]]


def kind_of(name: str) -> str:
    for pat, kind in _KIND_RULES:
        if pat.search(name):
            return kind
    raise KeyError(f"tensor {name!r}: not a drafter tensor (no kind rule matches)")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype      # the synthetic checkpoint's
    kind: str               # key of COMPUTE_RULES

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


# Norms bf16 so the loader's "bf16 norm stays bf16" path is the one exercised.
_STORAGE = {"linear": torch.float16, "linear_bias": torch.float16, "norm": torch.bfloat16,
            "table": torch.bfloat16, "fp32": torch.float32}


def _spec(name: str, *shape: int) -> TensorSpec:
    kind = kind_of(name)
    return TensorSpec(name, tuple(int(s) for s in shape), _STORAGE[kind], kind)


def tensor_specs(cfg: DrafterConfig) -> dict[str, TensorSpec]:
    """Every required tensor, block by block, then the borrowed trunk tensors (tied: no `head.weight`)."""
    h, H, D, Rq = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    G, Ro, M, E, I = cfg.o_groups, cfg.o_lora_rank, cfg.hc_mult, cfg.n_routed_experts, cfg.moe_intermediate_size
    Is, V, r, NB = cfg.shared_intermediate_size, cfg.vocab_size, cfg.dspark_markov_rank, cfg.n_blocks
    mix = 2 * M + M * M         # mHC rows: M pre, M post, M x M combine
    out: list[TensorSpec] = []
    for n in range(NB):
        p = f"mtp.{n}"
        if n == 0:
            out += [_spec(f"{p}.main_proj.weight", h, cfg.n_taps * h), _spec(f"{p}.main_norm.weight", h)]
        out += [
            _spec(f"{p}.attn_norm.weight", h), _spec(f"{p}.ffn_norm.weight", h),
            _spec(f"{p}.attn.wq_a.weight", Rq, h), _spec(f"{p}.attn.q_norm.weight", Rq),
            _spec(f"{p}.attn.wq_b.weight", H * D, Rq),
            _spec(f"{p}.attn.wkv.weight", D, h), _spec(f"{p}.attn.kv_norm.weight", D),
            _spec(f"{p}.attn.wo_a.weight", G * Ro, H * D // G), _spec(f"{p}.attn.wo_b.weight", h, G * Ro),
            _spec(f"{p}.attn.attn_sink", H),
        ]
        for part in ("attn", "ffn"):
            out += [_spec(f"{p}.hc_{part}_fn", mix, M * h), _spec(f"{p}.hc_{part}_base", mix),
                    _spec(f"{p}.hc_{part}_scale", 3)]
        out += [_spec(f"{p}.ffn.gate.weight", E, h), _spec(f"{p}.ffn.gate.bias", E)]
        for e in range(E):
            q = f"{p}.ffn.experts.{e}"
            out += [_spec(f"{q}.w1.weight", I, h), _spec(f"{q}.w2.weight", h, I), _spec(f"{q}.w3.weight", I, h)]
        q = f"{p}.ffn.shared_experts"
        out += [_spec(f"{q}.w1.weight", Is, h), _spec(f"{q}.w2.weight", h, Is), _spec(f"{q}.w3.weight", Is, h)]
        if n == NB - 1:
            out += [
                _spec(f"{p}.hc_head_fn", M, M * h), _spec(f"{p}.hc_head_base", M), _spec(f"{p}.hc_head_scale", 1),
                _spec(f"{p}.norm.weight", h),
                _spec(f"{p}.markov_head.markov_w1.weight", V, r), _spec(f"{p}.markov_head.markov_w2.weight", V, r),
                _spec(f"{p}.confidence_head.proj.weight", 1, h + r),
            ]
    out.append(_spec("embed.weight", V, h))
    if not cfg.tie_word_embeddings:
        out.append(_spec("head.weight", V, h))
    return {s.name: s for s in out}


def optional_specs(cfg: DrafterConfig) -> dict[str, TensorSpec]:
    """Tensors a loader must accept when present (not seen in a real checkpoint)."""
    last = f"mtp.{cfg.n_blocks - 1}"
    out = [_spec(f"{last}.markov_head.markov_w2.bias", cfg.vocab_size),
           _spec(f"{last}.confidence_head.proj.bias", 1)]
    if cfg.tie_word_embeddings:
        out.append(_spec("head.weight", cfg.vocab_size, cfg.hidden_size))   # a tied checkpoint may still carry one
    return {s.name: s for s in out}


def fallback_names(cfg: DrafterConfig) -> dict[str, str]:
    """Required name -> DeepSeek's original key that may stand for it."""
    return {f"mtp.{n}.ffn.gate.bias": f"mtp.{n}.ffn.gate.e_score_correction_bias" for n in range(cfg.n_blocks)}
