"""Exit of the drafter (spec 3c, 3d): the trunk head, the sequential Markov loop that picks the drafts, the
confidence head. Vocabulary shards each give their (max, first argmax); the collectives combine them, ties to the
lower id (the lower shard); a NaN logit never wins (-inf before the argmax).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import torch

from .collectives import Collectives
from . import ops
from .ops import f16, linear, sigmoid


@dataclass
class VocabShard:
    head: torch.Tensor                  # (V_r, h) fp16
    markov_w2: torch.Tensor             # (V_r, r) fp16
    markov_b2: torch.Tensor | None
    start: int                          # global id of local row 0
    markov_rows: torch.Tensor | None = None     # (n, V_r) fp16 cached Markov bias rows


@dataclass
class HeadOut:
    drafts: torch.Tensor
    confidences: torch.Tensor           # (bsz, n_out) fp32 sigmoid scores
    confident_len: torch.Tensor         # (bsz,) int64: longest all-confident prefix
    margins: torch.Tensor | None        # (bsz, n_out) fp32 top-1 minus top-2
    logits: torch.Tensor | None         # (bsz, n_out, sum of local V_r) fp32


# "auto"'s share of the card's memory free after the weights, for cached Markov bias rows.
MARKOV_CACHE_AUTO_SHARE = 0.5


def markov_cache_rows(choice: str | int, vocab: int, row_bytes: int = 0, free_bytes: int | None = None) -> int:
    """Rows to cache (ids [0, rows)) for `choice`: "off" / 0, "all", a row count, or "auto" (all that fit in the
    share of `free_bytes`, in whole 256-row tiles; none where free_bytes is None, as on a CPU)."""
    if choice == "auto":
        if free_bytes is None or row_bytes <= 0:
            return 0
        fit = int(MARKOV_CACHE_AUTO_SHARE * free_bytes) // row_bytes
        return vocab if fit >= vocab else fit // 256 * 256
    if choice == "all":
        return vocab
    if choice == "off":
        return 0
    try:
        n = int(choice)
    except (TypeError, ValueError):
        raise ValueError(f"markov cache {choice!r}: auto, all, off or a row count") from None
    if n < 0:
        raise ValueError(f"markov cache {n}: a row count >= 0")
    return min(n, vocab)


def confident_prefix(conf: torch.Tensor, threshold: float) -> torch.Tensor:
    """Length of the longest prefix with score >= threshold along the last dim."""
    return torch.cumprod((conf >= threshold).to(torch.int64), dim=-1).sum(dim=-1)


def _local_top(l: torch.Tensor, start: int, want_top2: bool):
    l = torch.where(torch.isnan(l), torch.full_like(l, -torch.inf), l)
    m, i = l.max(dim=-1)                # torch returns the first maximal index
    gi = i + start
    if not want_top2:
        return (m, gi)
    rest = l.scatter(-1, i[:, None], -torch.inf)
    return (m, rest.amax(dim=-1), gi)


class DraftHead:
    def __init__(self, shards: list[VocabShard], markov_w1: torch.Tensor, conf_w: torch.Tensor,
                 conf_b: torch.Tensor | None, coll: Collectives, threshold: float = 0.5):
        self.shards, self.markov_w1, self.conf_w, self.conf_b = shards, markov_w1, conf_w, conf_b
        self.coll, self.threshold = coll, threshold
        self.markov_map: torch.Tensor | None = None     # (V,) int32: a token's cached row, or -1

    def drop_markov_rows(self) -> None:
        self.markov_map = None
        for s in self.shards:
            s.markov_rows = None

    def cache_markov_rows(self, tokens: torch.Tensor) -> int:
        """Cache the Markov bias rows of distinct `tokens` on every shard; returns their bytes. A row is made by
        the live step's own (batch-invariant) sum, so a step reading it gets the same bits."""
        for _ in self.build_markov_rows(tokens):
            pass
        return sum(s.markov_rows.numel() * s.markov_rows.element_size() for s in self.shards)

    def build_markov_rows(self, tokens: torch.Tensor) -> Iterator[None]:
        """`cache_markov_rows`, yielding after each chunk; the old rows go at once, the new serve once all are made."""
        V = self.markov_w1.shape[0]
        dev = self.markov_w1.device
        tokens = tokens.to(device=dev, dtype=torch.int64)
        if not tokens.numel() or (int(tokens.min()) < 0 or int(tokens.max()) >= V
                                  or tokens.unique().numel() != tokens.numel()):
            raise ValueError(f"Markov cache tokens must be distinct ids in [0, {V}), at least one")
        self.drop_markov_rows()
        if tokens.numel() == V:          # row t is token t's: the kernel needs no map
            tokens = torch.arange(V, device=dev)
        cmap = torch.full((V,), -1, dtype=torch.int32, device=dev)
        cmap[tokens] = torch.arange(tokens.numel(), dtype=torch.int32, device=dev)
        build = ops.fused("markov_rows")
        made = []
        for s in self.shards:
            rows = torch.empty((tokens.numel(), s.markov_w2.shape[0]), dtype=torch.float16, device=dev)
            step = 8192 if build is not None else 32
            for c in range(0, tokens.numel(), step):
                if build is not None:
                    build(tokens[c:c + step], self.markov_w1, s.markov_w2, s.markov_b2, out=rows[c:c + step])
                else:
                    rows[c:c + step] = self._bias(f16(self.markov_w1[tokens[c:c + step]]), s)
                yield
            made.append(rows)
        for s, rows in zip(self.shards, made):
            s.markov_rows = rows
        self.markov_map = cmap

    def __call__(self, normed: torch.Tensor, prenorm: torch.Tensor, seeds: torch.Tensor, n_out: int,
                 want_margins: bool, keep_logits: bool = False) -> HeadOut:
        """normed (bsz, B, h) fp16 final-norm output; prenorm (bsz, B, h) fp32 HyperHead output."""
        fused_step, fused_conf = ops.fused("markov_step"), ops.fused("confidence")
        # The confidence's prenorm half needs nothing from the Markov loop: beside the head GEMM.
        conf_part = (ops.branch(ops.fused("confidence_prenorm"), prenorm, self.conf_w, n_out)
                     if fused_conf is not None else None)
        if fused_step is None:
            lg = [linear(normed[:, :n_out], s.head).float() for s in self.shards]
            step = self._step
        else:
            lg = [linear(normed[:, :n_out], s.head) for s in self.shards]
            step = partial(self._fused_step, fused_step)
        embs = torch.empty((normed.shape[0], n_out, self.markov_w1.shape[1]), dtype=torch.float16,
                           device=normed.device)
        prev = seeds.to(torch.int64)
        drafts, margins, logits = [], [], []
        for i in range(n_out):                    # each draft feeds the next step's Markov embedding
            tops, ls = step(lg, i, prev, embs[:, i], want_margins, keep_logits)
            if keep_logits:
                logits.append(torch.cat(ls, dim=-1))
            if want_margins:
                top1, top2, prev = self.coll.top2_exchange(tops)
                margins.append(top1 - top2)
            else:
                _, prev = self.coll.max_exchange(tops)
            drafts.append(prev)
        if fused_conf is not None:
            conf, lens = fused_conf(ops.joined(conf_part), embs, self.conf_w, self.conf_b, self.threshold)
        else:
            ci = torch.cat((f16(prenorm[:, :n_out]), embs), dim=-1)
            c = linear(ci, self.conf_w, bias=self.conf_b)[..., 0]
            conf = sigmoid(c.float())
            lens = confident_prefix(conf, self.threshold)
        return HeadOut(
            drafts=torch.stack(drafts, dim=1),
            confidences=conf,
            confident_len=lens,
            margins=torch.stack(margins, dim=1) if want_margins else None,
            logits=torch.stack(logits, dim=1) if keep_logits else None,
        )

    def _step(self, lg, i, prev, me, want_top2: bool, keep_logits: bool):
        e = f16(self.markov_w1[prev])                                               # bf16 -> fp16
        me.copy_(e)
        ls = [lg[k][:, i] + self._cached_bias(e, prev, s).float() for k, s in enumerate(self.shards)]
        return [_local_top(l, s.start, want_top2) for l, s in zip(ls, self.shards)], ls

    @staticmethod
    def _bias(e: torch.Tensor, s: VocabShard) -> torch.Tensor:
        """(n, V_r) fp16 Markov bias: the live step's and the cache's."""
        return linear(e, s.markov_w2, bias=s.markov_b2)

    def _cached_bias(self, e: torch.Tensor, prev: torch.Tensor, s: VocabShard) -> torch.Tensor:
        """The cached row where the token has one, else the live bias; both computed: the exact twin of the rows."""
        live = self._bias(e, s)
        if self.markov_map is None:
            return live
        row = self.markov_map[prev]
        return torch.where((row >= 0)[:, None], s.markov_rows[row.clamp(min=0).long()], live)

    def _fused_step(self, kernel, lg, i, prev, me, want_top2: bool, keep_logits: bool):
        """The same step on the fused `markov_step` kernel (its own sum order); each shard writes the same me."""
        tops, ls = [], []
        for k, s in enumerate(self.shards):
            cache = (self.markov_map, s.markov_rows) if self.markov_map is not None else None
            _, top1, top2, idx, l = kernel(lg[k], i, prev, self.markov_w1, s.markov_w2, s.markov_b2, s.start,
                                           keep_logits, me_out=me, cache=cache)
            tops.append((top1, top2, idx) if want_top2 else (top1, idx))
            ls.append(l)
        return tops, ls
