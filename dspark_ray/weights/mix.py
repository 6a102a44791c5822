"""The `--bits` mix of `dspark-ray synth --format exl3`: which storage each Linear gets (syntax: docs/exl3.md,
"Synthetic EXL3 checkpoints"). Only what exllamav3 quantizes (GROUPS) can be EXL3 or FP8; the rest stays plain.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from .exl3 import CODEBOOKS, HALF_RATES

DEFAULT_MIX = "head=6,experts=2,wo_a=fp8,rest=4"
DEFAULT_CODEBOOK = "mul1"

GROUPS: dict[str, str] = {
    "head": "head.weight",
    "experts": "mtp.*.ffn.experts.*.weight",
    "shared": "mtp.*.ffn.shared_experts.*.weight",
    "wo_a": "mtp.*.attn.wo_a.weight",
    "wo_b": "mtp.*.attn.wo_b.weight",
    "wq_a": "mtp.*.attn.wq_a.weight",
    "wq_b": "mtp.*.attn.wq_b.weight",
    "wkv": "mtp.*.attn.wkv.weight",
    "main_proj": "mtp.0.main_proj.weight",
}


class MixError(ValueError):
    """A bad `--bits` mix."""


@dataclass(frozen=True)
class Storage:
    form: str                       # "plain" | "fp8" | "exl3"
    bits: int | float = 16
    codebook: str = ""

    def __str__(self) -> str:
        return {"plain": "16", "fp8": "fp8"}.get(self.form) or f"{self.bits}{self.codebook}"


PLAIN = Storage("plain")


def _parse_value(group: str, value: str, codebook: str) -> Storage:
    v = value.strip().lower()
    if v in ("16", "bf16", "fp16"):
        return PLAIN
    if v == "fp8":
        return Storage("fp8")
    cb = next((c for c in CODEBOOKS if v.endswith(c)), None)
    num = v[: -len(cb)].rstrip(":") if cb else v
    try:
        bits = float(num)
    except ValueError:
        raise MixError(f"--bits {group}={value}: not 16, fp8, or a bitrate with an optional codebook "
                       f"({', '.join(CODEBOOKS)})") from None
    cb = cb or codebook
    if bits.is_integer() and 1 <= bits <= 8:
        return Storage("exl3", int(bits), cb)
    if bits in HALF_RATES:
        if cb != "mul1":
            raise MixError(f"--bits {group}={value}: the half rates {HALF_RATES} exist for the mul1 codebook only, "
                           f"not {cb}")
        return Storage("exl3", bits, cb)
    raise MixError(f"--bits {group}={value}: a bitrate must be an integer 1..8 or one of {HALF_RATES}")


def parse_mix(spec: str = DEFAULT_MIX) -> dict[str, Storage]:
    """`group=value,...` -> group -> Storage; groups not named fall back to `rest` (default 4)."""
    entries: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        group, sep, value = item.partition("=")
        group = group.strip()
        if not sep:
            raise MixError(f"--bits entry {item!r}: must be group=value")
        if group not in GROUPS and group not in ("rest", "codebook"):
            raise MixError(f"--bits entry {item!r}: unknown group {group!r}; groups are "
                           f"{', '.join([*GROUPS, 'rest', 'codebook'])}")
        if group in entries:
            raise MixError(f"--bits entry {item!r}: group {group} given twice")
        entries[group] = value
    codebook = entries.pop("codebook", DEFAULT_CODEBOOK).strip().lower()
    if codebook not in CODEBOOKS:
        raise MixError(f"--bits codebook={codebook}: must be one of {', '.join(CODEBOOKS)}")
    out = {g: _parse_value(g, v, codebook) for g, v in entries.items()}
    out.setdefault("rest", Storage("exl3", 4, codebook))
    return out


def storage_of(name: str, mix: dict[str, Storage]) -> Storage:
    """The storage of one namespace tensor under the mix."""
    for group, pattern in GROUPS.items():
        if fnmatch.fnmatchcase(name, pattern):
            return mix.get(group, mix["rest"])
    return PLAIN


def quantization_config(mix: dict[str, Storage]) -> dict:
    """config.json's `quantization_config` as exllamav3 1.6.5's converter writes it; 16: unquantized."""
    def bits(s: Storage):
        return s.bits if s.form == "exl3" else 16
    rest, head = mix["rest"], mix.get("head", mix["rest"])
    codebooks = sorted({s.codebook for s in mix.values() if s.form == "exl3"})
    return {"quant_method": "exl3", "version": "1.6.5", "bits": bits(rest), "head_bits": bits(head),
            "mtp_bits": bits(rest), "codebook": codebooks[0] if len(codebooks) == 1 else "mixed"}
