"""The calls exllamav3 1.6.5's generator makes on a DSpark drafter, made on plain tensors (no exllamav3, no CUDA).

What `generator/job.py` and `generator/generator.py` hand the drafter, reproduced: a sequence's physical cache pages
(256 positions each) from a shared pool, its block table row; after each prefill chunk
`update_kv_from_target(taps, cache, {block_table: the sequence's row, cache_seqlens: [chunk start]})`; each round
`forward(seed ids (rows, 1), {block_table, cache_seqlens: kv positions})` then `sample_from_state`, and after the
verification `update_kv_from_target(taps (rows, 1 + window, hidden) per tapped layer, lengths=accepted)`. The trunk
here is a stand-in: random taps, and it accepts the number of drafts the test says, then samples a random bonus token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

PAGE = 256


@dataclass
class Sequence:
    tokens: list[int]                            # the whole context, the last one the next seed
    taps: list[np.ndarray] = field(default_factory=list)     # one (taps_width,) fp16 row per position with a row
    pages: list[int] = field(default_factory=list)

    @property
    def kv(self) -> int:
        """Positions with rows (the generator's kv_position): every token but the seed."""
        return len(self.taps)

    def block_row(self) -> torch.Tensor:
        return torch.tensor(self.pages, dtype=torch.int32)


class GeneratorCalls:
    """`drafter` is set after construction: the drafter takes `token_ids` (this engine's token source)."""

    def __init__(self, n_taps: int, hidden: int, vocab: int, n_pages: int = 64, seed: int = 0):
        self.drafter = None
        self.n_taps, self.hidden, self.vocab = n_taps, hidden, vocab
        self.rng = np.random.default_rng(seed)
        self.free = [int(p) for p in self.rng.permutation(n_pages)]
        self.live: list[Sequence] = []
        self.cache = object()

    def _rows(self, n: int) -> np.ndarray:
        return (0.5 * self.rng.standard_normal((n, self.n_taps * self.hidden))).astype(np.float16)

    def _layers(self, taps: np.ndarray) -> list[torch.Tensor]:
        """(rows, positions, taps_width) -> one (rows, positions, hidden) tensor per tapped layer."""
        t = torch.from_numpy(taps)
        return [t[..., k * self.hidden:(k + 1) * self.hidden].contiguous() for k in range(self.n_taps)]

    def token_ids(self, block_row, start: int, n: int) -> np.ndarray:
        """The drafter's token source: rows [start, start + n) of the live sequence holding the row's page there."""
        page = int(block_row[start // PAGE])
        (s,) = [s for s in self.live if len(s.pages) > start // PAGE and s.pages[start // PAGE] == page]
        return np.asarray(s.tokens[start:start + n])

    def start(self, prompt_len: int, max_len: int = 600, chunk: int = 2048) -> Sequence:
        """A new job: pages for `max_len` positions, its prompt prefilled (all but the last token, the first seed)
        in chunks of `chunk` rows."""
        n_pages = -(-max_len // PAGE)
        seq = Sequence(tokens=[int(t) for t in self.rng.integers(0, self.vocab, prompt_len)],
                       pages=[self.free.pop() for _ in range(n_pages)])
        self.live.append(seq)
        rows = self._rows(prompt_len - 1)
        for a in range(0, prompt_len - 1, chunk):
            b = min(a + chunk, prompt_len - 1)
            self.drafter.update_kv_from_target(self._layers(rows[None, a:b]), self.cache,
                                               {"block_table": seq.block_row()[None],
                                                "cache_seqlens": torch.tensor([a], dtype=torch.int32)})
            seq.taps += list(rows[a:b])
        return seq

    def end(self, seq: Sequence) -> None:
        self.live.remove(seq)
        self.free += seq.pages
        seq.pages = []

    def params(self, seqs) -> dict:
        width = max(len(s.pages) for s in seqs)
        table = torch.zeros((len(seqs), width), dtype=torch.int32)
        for i, s in enumerate(seqs):
            table[i, :len(s.pages)] = s.block_row()
        return {"block_table": table, "cache_seqlens": torch.tensor([s.kv for s in seqs], dtype=torch.int32),
                "cache": self.cache}

    def draft(self, seqs) -> tuple[torch.Tensor, int | None]:
        """One draft call for the batch: (drafts (rows, block), draft_confidence_len)."""
        params = self.params(seqs)
        state = self.drafter.forward(torch.tensor([[s.tokens[-1]] for s in seqs]), params)
        ids = self.drafter.sample_from_state(state, params)
        assert ids.shape == (len(seqs), self.drafter.config.block_size)
        assert ids[:, 0].tolist() == [s.tokens[-1] for s in seqs]       # column 0: the seed
        return ids[:, 1:], params.get("draft_confidence_len")

    def verify(self, seqs, drafts: torch.Tensor | None, accepted: list[int]) -> None:
        """The trunk's verification: row i keeps its seed and `accepted[i]` drafts (the generator's length counts
        the seed: lengths = accepted + 1), samples a bonus token, and the drafter is handed the kept rows' taps."""
        window = 0 if drafts is None else drafts.shape[1]
        params = self.params(seqs)
        taps = np.zeros((len(seqs), 1 + window, self.n_taps * self.hidden), np.float16)
        lengths = []
        for i, s in enumerate(seqs):
            a = accepted[i] if drafts is not None else 0
            kept = self._rows(1 + a)
            taps[i, :1 + a] = kept
            s.taps += list(kept)
            s.tokens += [int(t) for t in drafts[i, :a]] if a else []
            s.tokens.append(int(self.rng.integers(0, self.vocab)))
            lengths.append(1 + a)
        self.drafter.update_kv_from_target(self._layers(taps), self.cache, params, lengths=lengths)
