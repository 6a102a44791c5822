"""A synthetic DeepSeek-V4 model an engine runs (exllamav3 loads it as `DeepseekV4ForCausalLM`): a sliding-window
trunk and the preset's drafter in one directory, agreeing on one bigram `succ` except on a `disagree` share of ids,
so speculation is real (docs/exllamav3.md, "The synthetic model").
"""
from __future__ import annotations

import fnmatch
import json
import math
from functools import partial
from pathlib import Path

import torch

from ..config import DrafterConfig, preset
from .inventory import TensorSpec, tensor_specs, _spec
from .synth import (DEFAULT_SHARD_BYTES, Draw, StoredSpec, _fp8_parts, draw_for, draw_values, fan_in, hash32,
                    uniform, write_checkpoint)

SPECIALS = ["<bos>", "<eos>", "<pad>", "<unk>"]     # ids 0..3
TRUNK_GAIN = 0.02        # small residual updates: the head sees mostly embed[t], yet the taps follow the context
EMBED_NOISE = 0.3
MARKOV_GAIN = 40.0
DRAFT_NORM = 0.05        # the drafter's own logits stay small beside the Markov bias
CONFIDENCE_BIAS = 2.0    # sigmoid(2) = 0.88: every draft passes the 0.5 line

# Otherwise a trunk tensor draws as synth.SCALES says for the same tensor of a drafter block.
TRUNK_SCALES: list[tuple[str, Draw]] = [
    ("layers.*.attn.wo_b.weight", fan_in(TRUNK_GAIN)),
    ("layers.*.ffn.experts.*.w2.weight", fan_in(TRUNK_GAIN)),
    ("layers.*.ffn.shared_experts.w2.weight", fan_in(TRUNK_GAIN)),
    ("*.confidence_head.proj.weight", fan_in(0.01)),
]


def engine_config(name: str, trunk_layers: int | None = None) -> DrafterConfig:
    """The preset's drafter over `trunk_layers` sliding-window layers, tapping the last n_taps."""
    cfg = preset(name)
    n = trunk_layers or (cfg.num_hidden_layers if cfg.num_hidden_layers <= 8 else cfg.n_taps)
    if n < cfg.n_taps:
        raise ValueError(f"trunk_layers {n}: the drafter taps {cfg.n_taps} layers")
    return cfg.replace(num_hidden_layers=n, compress_ratios=(0,) * (n + cfg.n_blocks),
                       dspark_target_layer_ids=tuple(range(n - cfg.n_taps, n)), architecture="DeepseekV4ForCausalLM")


def trunk_specs(cfg: DrafterConfig) -> list[TensorSpec]:
    """The trunk's tensors: each layer is a drafter block's (attention, mHC, MoE) without the drafter's entry and
    exit, then the trunk's stream collapse and final norm (embed and head are the drafter's borrowed ones)."""
    block = [s for s in tensor_specs(cfg).values() if s.name.startswith("mtp.0.")
             and not s.name.startswith(("mtp.0.main_", "mtp.0.hc_head", "mtp.0.norm", "mtp.0.markov",
                                        "mtp.0.confidence"))]
    out = [_spec(f"layers.{i}." + s.name[len("mtp.0."):], *s.shape) for i in range(cfg.num_hidden_layers)
           for s in block]
    M, h = cfg.hc_mult, cfg.hidden_size
    head = [TensorSpec("hc_head_fn", (M, M * h), torch.float32, "fp32"),
            TensorSpec("hc_head_base", (M,), torch.float32, "fp32"),
            TensorSpec("hc_head_scale", (1,), torch.float32, "fp32")]
    return out + head + [TensorSpec("norm.weight", (h,), torch.bfloat16, "norm")]


def _draw(spec: TensorSpec) -> Draw:
    for pattern, d in TRUNK_SCALES:
        if fnmatch.fnmatchcase(spec.name, pattern):
            return d
    name = spec.name
    if name.startswith("layers."):
        name = "mtp.0." + name.split(".", 2)[2]
    elif name.startswith("hc_head_"):
        name = "mtp.0." + name
    return draw_for(name)


def _drawn(spec: TensorSpec) -> StoredSpec:
    return StoredSpec(spec.name, spec.shape, spec.dtype, partial(draw_values, spec, draw=_draw(spec)))


def successor(vocab: int, seed: int, device="cpu") -> torch.Tensor:
    """A random cyclic order of ids 4 .. vocab-1 (a greedy trunk never repeats); the specials lead into it."""
    keys = hash32(seed, "engine.succ", 0, vocab - 4, device)
    order = torch.argsort(keys, stable=True) + 4
    succ = torch.empty(vocab, dtype=torch.int64, device=device)
    succ[order] = torch.roll(order, -1)
    succ[:4] = order[0]
    return succ


def drafter_successor(succ: torch.Tensor, disagree: float, seed: int) -> torch.Tensor:
    """succ but on a `disagree` share of ids, where succ(succ): never the trunk's choice."""
    u = (uniform(seed, "engine.disagree", 0, len(succ), succ.device) + 1.0) / 2.0     # [0, 1)
    return torch.where(u < disagree, succ[succ], succ)


def _whole(spec: TensorSpec, seed: int, device) -> torch.Tensor:
    return draw_values(spec, seed, 0, spec.numel, device, _draw(spec)).reshape(spec.shape)


def _fixed(values: torch.Tensor, seed: int, start: int, count: int, device="cpu") -> torch.Tensor:
    return values.reshape(-1)[start:start + count].to(device)


def structured(cfg: DrafterConfig, seed: int, disagree: float, device="cpu") -> dict[str, torch.Tensor]:
    """The tensors that carry the shared bigram and the confidence bias."""
    specs = tensor_specs(cfg)
    last = f"mtp.{cfg.n_blocks - 1}"
    head = _whole(specs["head.weight"], seed, device).float()
    succ = successor(cfg.vocab_size, seed, device)
    direction = head[succ]
    direction *= torch.rsqrt(direction.square().mean(dim=1, keepdim=True))            # unit entries
    noise = uniform(seed, "engine.embed_noise", 0, direction.numel(), device).reshape(direction.shape)
    embed = direction + noise * (EMBED_NOISE * math.sqrt(3.0))
    w2 = _whole(specs[f"{last}.markov_head.markov_w2.weight"], seed, device)
    w1 = MARKOV_GAIN * w2.float()[drafter_successor(succ, disagree, seed)]
    norm = specs[f"{last}.norm.weight"]
    return {"embed.weight": embed.to(torch.bfloat16),
            f"{last}.markov_head.markov_w1.weight": w1.to(torch.bfloat16),
            f"{last}.norm.weight": torch.full(norm.shape, DRAFT_NORM, dtype=norm.dtype, device=device),
            f"{last}.confidence_head.proj.bias": torch.full((1,), CONFIDENCE_BIAS, dtype=torch.float16,
                                                            device=device)}


# Linears kept plain with fp8: the tables' neighbours and the small heads (as exllamav3 keeps them unquantized).
_PLAIN_LINEARS = ("head.weight",)
_PLAIN_LINEAR_ENDS = (".gate.weight", ".markov_w2.weight", ".proj.weight")


def engine_specs(cfg: DrafterConfig, seed: int, disagree: float, fp8: bool, device="cpu") -> list[StoredSpec]:
    """Every stored tensor; `fp8` stores the blocks' Linears as DeepSeek does, so the full width fits the GPU disk."""
    fixed = structured(cfg, seed, disagree, device)
    out = []
    for spec in list(tensor_specs(cfg).values()) + trunk_specs(cfg):
        if spec.name in fixed:
            out.append(StoredSpec(spec.name, spec.shape, spec.dtype, partial(_fixed, fixed.pop(spec.name))))
        elif fp8 and spec.kind == "linear" and not spec.name.startswith(_PLAIN_LINEARS) \
                and not spec.name.endswith(_PLAIN_LINEAR_ENDS):
            out += _fp8_parts(spec, _draw(spec))
        else:
            out.append(_drawn(spec))
    for name, t in fixed.items():                   # optional tensors the drafter loads when present
        out.append(StoredSpec(name, tuple(t.shape), t.dtype, partial(_fixed, t)))
    return out


def tokenizer_files(vocab: int) -> dict[str, dict]:
    """A word-level tokenizer without pre-tokenizer; exllamav3's Tokenizer probes that " t" is one piece."""
    words = {s: i for i, s in enumerate(SPECIALS)} | {" t": 4} | {f" t{k}": k for k in range(5, vocab)}
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, s in enumerate(SPECIALS)]
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
                 "pre_tokenizer": None, "post_processor": None, "decoder": None,
                 "model": {"type": "WordLevel", "vocab": words, "unk_token": "<unk>"}}
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
              "add_bos_token": False, "tokenizer_class": "PreTrainedTokenizerFast"}
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config}


def write_engine_model(name: str, out_dir: str | Path, *, seed: int = 0, disagree: float = 0.25,
                       trunk_layers: int | None = None, fp8: bool | None = None, device="cpu",
                       shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool | None = None) -> dict:
    """Write the model; returns the drafter's manifest. `fp8` defaults to on for the full preset."""
    if not 0.0 <= disagree <= 1.0:
        raise ValueError(f"disagree {disagree}: must be in [0, 1]")
    cfg = engine_config(name, trunk_layers)
    fp8 = (name == "full") if fp8 is None else fp8
    config = cfg.to_json_dict() | {"num_hash_layers": 0, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
                                   "dspark_engine_model": {"seed": seed, "disagree": disagree, "preset": name}}
    specs = engine_specs(cfg, seed, disagree, fp8, device)
    manifest = write_checkpoint(specs, config, cfg.digest(), out_dir, seed=seed, device=device,
                                shard_bytes=shard_bytes, progress=progress,
                                listed=lambda n: n.startswith("mtp.") or n in ("embed.weight", "head.weight"))
    for fname, body in tokenizer_files(cfg.vocab_size).items():
        (Path(out_dir) / fname).write_text(json.dumps(body) + "\n")
    return manifest
