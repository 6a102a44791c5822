"""The drafter's configuration, read from a DeepSeek-V4-style `config.json` (field names as the checkpoint's) and
validated before any weight is read; presets `tiny` (every code path on a CPU) and `full` (V4.1-Flash's drafter).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config field breaks a rule."""


@dataclass(frozen=True)
class DrafterConfig:
    vocab_size: int
    hidden_size: int
    num_attention_heads: int
    q_lora_rank: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    num_hidden_layers: int
    compress_ratios: tuple[int, ...]
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    n_shared_experts: int = 1
    routed_scaling_factor: float = 1.0
    # Read so that a checkpoint naming another router than model/moe.py's is refused, not served with it.
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_markov_rank: int = 256
    dspark_target_layer_ids: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    # Not a checkpoint field: the longest position served (sizes the RoPE table).
    max_model_len: int = 1 << 20
    architecture: str = "DeepseekV4ForCausalLM"

    @property
    def n_blocks(self) -> int:
        """Drafter blocks: the compress_ratios entries past the trunk's layers."""
        return len(self.compress_ratios) - self.num_hidden_layers

    @property
    def n_taps(self) -> int:
        return max(len(self.dspark_target_layer_ids), 1)

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.o_groups

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def block_size(self) -> int:
        return self.dspark_block_size

    def validate(self) -> "DrafterConfig":
        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ConfigError(f"config field {name} = {getattr(self, name)!r}: {rule}")

        for name in ("vocab_size", "hidden_size", "num_attention_heads", "head_dim", "q_lora_rank", "o_groups",
                     "o_lora_rank", "sliding_window", "moe_intermediate_size", "n_routed_experts",
                     "num_experts_per_tok", "n_shared_experts", "dspark_markov_rank", "hc_sinkhorn_iters"):
            need(getattr(self, name) > 0, name, "must be > 0")
        need(self.num_key_value_heads == 1, "num_key_value_heads", "the drafter is MQA: must be 1")
        need(self.hc_mult == 4, "hc_mult", "the mHC kernels assume 4 streams")
        need(0 < self.qk_rope_head_dim <= self.head_dim and self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim",
             "must be even and in (0, head_dim]")
        need(self.num_attention_heads % self.o_groups == 0, "o_groups", "must divide num_attention_heads")
        need(self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
             "must be <= n_routed_experts")
        need(self.vocab_size % 128 == 0, "vocab_size",
             "must be a multiple of 128 (padded head columns would take part in the argmax)")
        need(self.num_hidden_layers >= 0, "num_hidden_layers", "must be >= 0")
        need(self.n_blocks > 0, "compress_ratios",
             f"needs entries past num_hidden_layers={self.num_hidden_layers} (one per drafter block)")
        need(all(r == 0 for r in self.compress_ratios[self.num_hidden_layers:]), "compress_ratios",
             "every drafter-block entry (past num_hidden_layers) must be 0 (sliding)")
        need(1 <= self.dspark_block_size <= 16, "dspark_block_size", "must be in 1..16 (0 disables the drafter)")
        need(0 <= self.dspark_noise_token_id < self.vocab_size, "dspark_noise_token_id", "must be a token id < vocab_size")
        need(list(self.dspark_target_layer_ids) == sorted(set(self.dspark_target_layer_ids)), "dspark_target_layer_ids",
             "must be sorted ascending without repeats (taps are concatenated in trunk execution order)")
        need(self.scoring_func == "sqrtsoftplus", "scoring_func",
             "the drafter's router implements only 'sqrtsoftplus' (sqrt(softplus(logit)) scores)")
        need(self.topk_method == "noaux_tc", "topk_method",
             "the drafter's router implements only 'noaux_tc' (bias-corrected top-k over all experts)")
        need(self.swiglu_limit >= 0, "swiglu_limit", "must be >= 0 (0 disables the clamp)")
        need(self.rms_norm_eps > 0, "rms_norm_eps", "must be > 0")
        need(self.max_model_len > 0, "max_model_len", "must be > 0")
        return self

    def to_json_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["compress_ratios"] = list(self.compress_ratios)
        d["dspark_target_layer_ids"] = list(self.dspark_target_layer_ids)
        d["architectures"] = [d.pop("architecture")]
        d["num_nextn_predict_layers"] = 1      # what real checkpoints carry (ignored: NB comes from compress_ratios)
        return d

    def digest(self) -> str:
        """Hash of every field that changes the drafter's output; not max_model_len (it sizes tables) nor the router
        fields, which validate() pins (so older checkpoints keep their digest)."""
        d = self.to_json_dict()
        for k in ("max_model_len", "scoring_func", "topk_method"):
            d.pop(k)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def replace(self, **kw) -> "DrafterConfig":
        return dataclasses.replace(self, **kw).validate()


_FIELDS = {f.name for f in dataclasses.fields(DrafterConfig)}


def from_dict(raw: dict[str, Any], **overrides) -> DrafterConfig:
    """A config dict, flat or with a `text_config` (V4.1); `dspark_*` MoE fields win over the trunk's."""
    src = dict(raw)
    if isinstance(src.get("text_config"), dict):
        outer = {k: v for k, v in src.items() if k != "text_config"}
        src = {**outer, **src["text_config"]}
    if "dspark_n_routed_experts" in src:
        src["n_routed_experts"] = src["dspark_n_routed_experts"]
    if "dspark_num_experts_per_tok" in src:
        src["num_experts_per_tok"] = src["dspark_num_experts_per_tok"]
    arch = src.get("architectures") or [src.get("architecture", "DeepseekV4ForCausalLM")]
    kw = {k: v for k, v in src.items() if k in _FIELDS}
    kw["architecture"] = arch[0]
    missing = [f.name for f in dataclasses.fields(DrafterConfig)
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in kw]
    if missing:
        raise ConfigError(f"config is missing required field(s): {', '.join(missing)}")
    if kw.get("rope_scaling") is not None:
        kw.pop("rope_scaling")      # not used by the drafter's sliding blocks
    kw["compress_ratios"] = tuple(int(x) for x in kw["compress_ratios"])
    kw["dspark_target_layer_ids"] = tuple(int(x) for x in kw.get("dspark_target_layer_ids", ()))
    kw.update(overrides)
    try:
        cfg = DrafterConfig(**kw)
    except TypeError as e:
        raise ConfigError(f"bad config: {e}") from None
    return cfg.validate()


def load_config(path: str | Path, **overrides) -> DrafterConfig:
    """Read `config.json`, or a checkpoint directory's."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    with open(p) as f:
        return from_dict(json.load(f), **overrides)


def tiny() -> DrafterConfig:
    """The same structure as `full` at a size where the CPU runs every code path."""
    return DrafterConfig(
        vocab_size=4096, hidden_size=256, num_attention_heads=8, head_dim=128, qk_rope_head_dim=64,
        q_lora_rank=128, o_groups=4, o_lora_rank=128, sliding_window=8,
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, moe_intermediate_size=256,
        routed_scaling_factor=1.5, swiglu_limit=1.0, rms_norm_eps=1e-6, rope_theta=10000.0,
        num_hidden_layers=4, compress_ratios=(0, 0, 0, 0, 0, 0, 0),
        dspark_block_size=5, dspark_noise_token_id=4000, dspark_markov_rank=32,
        dspark_target_layer_ids=(1, 2, 3), tie_word_embeddings=False, max_model_len=1 << 20,
    ).validate()


def full() -> DrafterConfig:
    """The DeepSeek-V4.1-Flash drafter."""
    return DrafterConfig(
        vocab_size=129280, hidden_size=5120, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64,
        q_lora_rank=1280, o_groups=8, o_lora_rank=1024, sliding_window=128,
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        n_routed_experts=128, num_experts_per_tok=3, n_shared_experts=1, moe_intermediate_size=2304,
        routed_scaling_factor=1.5, swiglu_limit=10.0, rms_norm_eps=1e-20, rope_theta=10000.0,
        num_hidden_layers=43, compress_ratios=tuple([4] * 43 + [0, 0, 0]),
        dspark_block_size=5, dspark_noise_token_id=128799, dspark_markov_rank=256,
        dspark_target_layer_ids=(37, 38, 39), tie_word_embeddings=False, max_model_len=1 << 20,
        architecture="DeepseekV41ForCausalLM",
    ).validate()


PRESETS = {"tiny": tiny, "full": full}


def preset(name: str) -> DrafterConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    return PRESETS[name]()
