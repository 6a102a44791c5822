"""Fused Triton kernels for the draft step's chains of small ops; `TABLE` maps `model.ops.fused`'s names to them.
Every rounding point stays where the reference has it, reductions run in each kernel's own fixed order (close to
the exact path, not bit-equal; kernels without a reduction, e.g. mhc_expand, swiglu, route, are bit-equal), and no
program's row reads another's (docs/engine.md, "Same bits everywhere" and "Fused kernels and the chain").
"""
from __future__ import annotations

from .fused_attention import attend, head_norm_rope
from .fused_head import confidence, confidence_prenorm, markov_rows, markov_step, pack_outputs
from .fused_mhc import embed_streams, hyper_head_norm, mhc_collapse_norm, mhc_expand
from .fused_moe import expert_act, expert_out, indexed_linear, route, router_logits, swiglu
from .fused_ops import pdl_launches, rms_norm, rows_linear

__all__ = ["TABLE", "indexed_linear", "rows_linear"]

TABLE = {
    "markov_step": markov_step,
    "markov_rows": markov_rows,
    "confidence": confidence,
    "confidence_prenorm": confidence_prenorm,
    "pack_outputs": pack_outputs,
    "route": route,
    "router_logits": router_logits,
    "expert_act": expert_act,
    "expert_out": expert_out,
    "mhc_collapse_norm": mhc_collapse_norm,
    "hyper_head_norm": hyper_head_norm,
    "mhc_expand": mhc_expand,
    "embed_streams": embed_streams,
    "rms_norm": rms_norm,
    "head_norm_rope": head_norm_rope,
    "attend": attend,
    "swiglu": swiglu,
    "graph_launches": pdl_launches,
}
