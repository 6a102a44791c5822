"""Fused Triton kernels for the draft step's chains of small ops (the fast path, `kernels.gemm.kernels_for("fast")`).

Why: in the reference form (`model/*`), the mHC mixes, the 20 Sinkhorn rounds, every norm, RoPE, the attention
softmax and SwiGLU are chains of small torch ops, and every tree-sum level is a kernel of its own. The full drafter
ran ~3,300 kernels per step, bound by their count (docs/engine.md, "Fused kernels and the chain"). Each kernel
here does one chain in a single launch.

What they keep and what they change, against the reference:
* Every rounding point stays where the reference has it: fp16 rounding of the mixing rows, of c, of the norm
  outputs, of the exponentials before PV, of each SwiGLU step. Transcendentals run in fp64 and are rounded once
  to fp32. Divisions are IEEE (`div_rn`). Kernels launch with `enable_fp_fusion=False`, so a * b + c is never
  contracted into an FMA.
* Reductions (RMS means, mixing dots, Sinkhorn sums, attention dots) use the kernel's own fixed order (`tl.sum`
  over fixed blocks, `tl.dot`), not the reference's pairwise tree. So the fast path is close to the exact path,
  not bit-equal to it, as for the cuBLAS matmuls. Kernels with no reduction of their own (`mhc_expand`, `swiglu`,
  `route`) give the reference's exact bits.
* Batch invariance: one program per row (or per (row, block)), and no program reads another row's data; where rows
  share a program (the grouped experts, `rows_linear`), each is its own row of a `tl.dot` of a fixed tile shape,
  whose sums for one row never involve another. A request's bits never depend on its neighbours (tested: each
  row alone equals its batched bits).
* No autotune, fixed num_warps: the compiled code, and so the bits, are the same in every process on a card
  kind.

The kernels live beside the model module whose chains they replace (`fused_mhc`, `fused_attention`, `fused_moe`,
`fused_head`, `fused_ops`); `TABLE` maps the names that `model.ops.fused` looks up to them.
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
