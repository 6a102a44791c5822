"""The tensor-parallel cut as data; the loader reads each rank's slice through `Layout.slice_of`. For tp = 2, rank r:

    head, markov_w2 (+ bias)         vocab rows [0, Vs) / [Vs, V), Vs = the smallest multiple of 256 >= V/2
    attn.wq_b, attn.attn_sink        query heads [r H/2, (r+1) H/2) (wq_b rows head * D + d)
    attn.wo_a, attn.wo_b             rows / input columns of o_groups [r G/2, (r+1) G/2)
    experts' and shared w1, w3 / w2  intermediate rows / columns [r I/2, (r+1) I/2)
    everything else                  replicated: embedding, mHC, norms, wq_a, wkv, main_proj, router, markov_w1,
                                     confidence

Rank 0 holds the lower ids, so an argmax tie goes to the lower id as on one card; a group never straddles ranks;
every cut falls on a 128-channel boundary, so an EXL3 shard decodes to the full tensor's slice bit for bit. A config
that cannot be cut so is refused by name."""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..config import ConfigError, DrafterConfig

CHANNEL_UNIT = 128
VOCAB_TILE = 256


@dataclass(frozen=True)
class Cut:
    pattern: str
    dim: int
    unit: str          # what one indivisible piece is: "head", "group", "channel", "vocab"
    why: str


def cut_rules() -> list[Cut]:
    return [
        Cut(r"^head\.weight$", 0, "vocab", "vocab rows of the head"),
        Cut(r"markov_head\.markov_w2\.(weight|bias)$", 0, "vocab", "vocab rows of the Markov bias head"),
        Cut(r"attn\.wq_b\.weight$", 0, "head", "query heads (rows head*D + d)"),
        Cut(r"attn\.attn_sink$", 0, "head", "the sinks of those heads"),
        Cut(r"attn\.wo_a\.weight$", 0, "group", "o_groups of those heads (rows g*Ro + k)"),
        Cut(r"attn\.wo_b\.weight$", 1, "group", "input columns of those o_groups"),
        Cut(r"ffn\.(experts\.\d+|shared_experts)\.(w1|w3)\.weight$", 0, "channel", "intermediate channels"),
        Cut(r"ffn\.(experts\.\d+|shared_experts)\.w2\.weight$", 1, "channel", "intermediate channels"),
    ]


def vocab_split(vocab: int) -> int:
    half = -(-vocab // 2)
    return -(-half // VOCAB_TILE) * VOCAB_TILE


class Layout:
    def __init__(self, cfg: DrafterConfig, tp: int):
        if tp not in (1, 2):
            raise ConfigError(f"tp = {tp}: only 1 (one card) and 2 (a pair) are supported")
        self.cfg, self.tp = cfg, tp
        self.rules = [(re.compile(c.pattern), c) for c in cut_rules()]
        self.vs = vocab_split(cfg.vocab_size)
        if tp == 2:
            self._check_cuttable()

    def _check_cuttable(self) -> None:
        c = self.cfg

        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ConfigError(f"config cannot be cut for tp=2: {what}")

        need(c.num_attention_heads % 2 == 0, f"num_attention_heads = {c.num_attention_heads} is odd")
        need(c.o_groups % 2 == 0, f"o_groups = {c.o_groups} is odd (a group would straddle the ranks)")
        need((c.num_attention_heads // 2 * c.head_dim) % CHANNEL_UNIT == 0,
             f"wq_b rows per rank (H/2 * D = {c.num_attention_heads // 2 * c.head_dim}) not a multiple of 128")
        need((c.o_groups // 2 * c.o_lora_rank) % CHANNEL_UNIT == 0,
             f"wo_a rows / wo_b columns per rank (G/2 * Ro = {c.o_groups // 2 * c.o_lora_rank}) not a multiple of 128")
        need(c.moe_intermediate_size % (2 * CHANNEL_UNIT) == 0,
             f"moe_intermediate_size = {c.moe_intermediate_size}: I/2 is not a multiple of 128")
        need(c.shared_intermediate_size % (2 * CHANNEL_UNIT) == 0,
             f"shared expert width = {c.shared_intermediate_size}: half is not a multiple of 128")
        need(0 < self.vs < c.vocab_size, f"vocab_size = {c.vocab_size} too small to split at a 256 tile")

    def rule_for(self, name: str) -> Cut | None:
        for rx, cut in self.rules:
            if rx.search(name):
                return cut
        return None

    def slice_of(self, name: str, shape: tuple[int, ...], rank: int) -> tuple[int, int, int] | None:
        """(dim, start, stop) of `name` that `rank` owns, or None when the tensor is whole on every rank."""
        if self.tp == 1:
            return None
        cut = self.rule_for(name)
        if cut is None:
            return None
        size = shape[cut.dim]
        if cut.unit == "vocab":
            return (cut.dim, 0, self.vs) if rank == 0 else (cut.dim, self.vs, size)
        half = size // 2
        return cut.dim, rank * half, (rank + 1) * half

    def vocab_range(self, rank: int) -> tuple[int, int]:
        if self.tp == 1:
            return 0, self.cfg.vocab_size
        return (0, self.vs) if rank == 0 else (self.vs, self.cfg.vocab_size)

    def local_shape(self, name: str, shape: tuple[int, ...], rank: int) -> tuple[int, ...]:
        s = self.slice_of(name, shape, rank)
        if s is None:
            return tuple(shape)
        out = list(shape)
        out[s[0]] = s[2] - s[1]
        return tuple(out)


_GROUPS = [
    ("embedding", r"^embed\.weight$"),
    ("head", r"^head\.weight$"),
    ("routed experts", r"ffn\.experts\."),
    ("shared expert", r"ffn\.shared_experts\."),
    ("wq_b", r"attn\.wq_b\."),
    ("wo_a", r"attn\.wo_a\."),
    ("wo_b", r"attn\.wo_b\."),
    ("wq_a + wkv + main_proj", r"attn\.(wq_a|wkv)\.|main_proj"),
    ("router", r"ffn\.gate\."),
    ("markov_w1", r"markov_w1"),
    ("markov_w2", r"markov_w2"),
    ("mHC + HyperHead", r"\.hc_"),
    ("norms, sinks, confidence", r"."),
]


def memory_table(cfg: DrafterConfig, tp: int, specs: dict) -> list[dict]:
    """Rows {item, bytes per rank, cut} of what each rank holds; `specs`: name -> (shape, itemsize)."""
    lay = Layout(cfg, tp)
    rows = {g: [0] * tp for g, _ in _GROUPS}
    cuts = {g: "replicated" for g, _ in _GROUPS}
    rx = [(g, re.compile(p)) for g, p in _GROUPS]
    for name, (shape, itemsize) in specs.items():
        group = next(g for g, r in rx if r.search(name))
        for rank in range(tp):
            n = 1
            for d in lay.local_shape(name, tuple(shape), rank):
                n *= d
            rows[group][rank] += n * itemsize
        cut = lay.rule_for(name)
        if cut is not None and tp == 2:
            cuts[group] = f"split: {cut.why}"
    return [{"item": g, "bytes": rows[g], "cut": cuts[g]} for g, _ in _GROUPS]
