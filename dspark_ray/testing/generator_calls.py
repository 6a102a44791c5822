"""exllamav3 1.6.5's generator as a DSpark drafter meets it, on plain tensors (no exllamav3, no CUDA).

What `generator/generator.py` and `generator/job.py` hold and hand the drafter, reproduced: jobs with one sequence
each (`sequence_ids`, `kv_position`, `block_index_tensor` holding only the pages that job was given: its prompt plus
`max_new_tokens` plus a draft window, so widths differ from job to job), `active_jobs` in start order, a page pool
with a prefix cache (a new job's full prompt pages that an earlier job filled with the same tokens are reused, and
its prefill starts after them). Each round (`iterate`): at most one prefill chunk for a job still ingesting its
prompt (`update_kv_from_target` without lengths, its own block row), then for the jobs whose prefill is done the
draft call (`forward` then `sample_from_state`, the batch's block table padded to 16 pages with zeros) and the
verification (`update_kv_from_target` with the accepted lengths, after every row was sampled; jobs that hit a stop
token or `max_new_tokens` are still in the batch then, and leave `active_jobs` after it).

The trunk is a stand-in: a row's taps are a function of its position and the tokens up to it (a repeated prefix has
the same taps, as a real trunk's would), it accepts as many drafts as the test says, and samples a bonus token from
the test's stream.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

PAGE = 256
TABLE_PAGES = 16          # the batch block table's width is padded to a multiple of this (generator.py)


class SequenceIds:
    """The part of exllamav3's SequenceIds the drafter reads."""

    def __init__(self, ids):
        self.ids = [int(t) for t in ids]

    def __len__(self) -> int:
        return len(self.ids)

    def torch_slice(self, a: int, b: int | None) -> torch.Tensor:
        """As exllamav3's (a `narrow`): a range past the end raises."""
        return torch.tensor([self.ids], dtype=torch.long).narrow(1, a, (len(self.ids) if b is None else b) - a)

    def append(self, t: int) -> None:
        self.ids.append(int(t))


@dataclass(eq=False)
class Sequence:
    sequence_ids: SequenceIds
    pages: list[int]
    kv_position: int = 0
    taps: list[np.ndarray] = field(default_factory=list)     # the trunk's row at each position below kv_position

    def __post_init__(self):
        self.block_index_tensor = torch.tensor([self.pages], dtype=torch.int32)

    @property
    def tokens(self) -> list[int]:
        return self.sequence_ids.ids


@dataclass(eq=False)
class Job:
    sequences: list[Sequence]
    identifier: int
    max_new_tokens: int
    stop_tokens: frozenset = frozenset()
    new_tokens: int = 0
    is_finished: bool = False
    cached_positions: int = 0        # prompt positions the prefix cache already held

    @property
    def seq(self) -> Sequence:
        return self.sequences[0]

    def is_prefill_done(self) -> bool:
        return all(s.kv_position == len(s.sequence_ids) - 1 for s in self.sequences)


@dataclass
class Round:
    """What one iterate did: the drafting rows (jobs), their drafts and the confidence length the generator read
    (None: no draft call this round), and the jobs it ended."""
    jobs: list[Job]
    drafts: torch.Tensor | None
    confidence_len: int | None
    ended: list[Job]


class GeneratorCalls:
    """The generator; `draft_model` is set by the test (the drafter's `bind` checks it)."""

    def __init__(self, n_taps: int, hidden: int, vocab: int, n_pages: int = 96, seed: int = 0,
                 chunk: int = 2048, window: int = 5):
        self.draft_model = None
        self.cpu_page_cache = None
        self.n_taps, self.hidden, self.vocab, self.chunk, self.window = n_taps, hidden, vocab, chunk, window
        self.rng = np.random.default_rng(seed)
        self.free = [int(p) for p in self.rng.permutation(n_pages)]
        self.hashed: dict[bytes, int] = {}           # prefix hash of a full page -> the page holding it
        self.page_hash: dict[int, bytes] = {}
        self.active_jobs: list[Job] = []
        self.cache = object()
        self._serial = 0

    @property
    def drafter(self):
        return self.draft_model

    # ---- the trunk's stand-in ---------------------------------------------------------------------------------
    def row(self, tokens: list[int], p: int) -> np.ndarray:
        """The trunk's taps at position p: a function of p and the tokens up to it."""
        key = hashlib.blake2b(np.asarray(tokens[max(0, p - 3):p + 1], np.int64).tobytes() + p.to_bytes(8, "little"),
                              digest_size=8).digest()
        r = np.random.default_rng(int.from_bytes(key, "little"))
        return (0.5 * r.standard_normal(self.n_taps * self.hidden)).astype(np.float16)

    def _layers(self, taps: np.ndarray) -> list[torch.Tensor]:
        """(rows, positions, taps_width) -> one (rows, positions, hidden) tensor per tapped layer."""
        t = torch.from_numpy(np.ascontiguousarray(taps))
        return [t[..., k * self.hidden:(k + 1) * self.hidden].contiguous() for k in range(self.n_taps)]

    # ---- jobs and pages -------------------------------------------------------------------------------------
    def prompt(self, n: int) -> list[int]:
        return [int(t) for t in self.rng.integers(0, self.vocab, n)]

    def start(self, prompt, max_new: int = 200, stop=(), prefill: bool = True) -> Job:
        """A new job (`prompt`: its token ids, or a length for random ones) with pages for the prompt, `max_new`
        tokens and a draft window, full prompt pages taken from the prefix cache where they match; `prefill`: ingest
        the whole prompt now (else one chunk a round, from `iterate`)."""
        tokens = self.prompt(prompt) if isinstance(prompt, int) else [int(t) for t in prompt]
        total = len(tokens) + max_new + self.window + 1
        pages, cached = [], 0
        for k in range((len(tokens) - 1) // PAGE):          # full pages below the seed
            page = self.hashed.get(self._prefix_hash(tokens, (k + 1) * PAGE))
            if page is None or page in pages:
                break
            pages.append(page)
            if page in self.free:
                self.free.remove(page)
            cached = (k + 1) * PAGE
        while len(pages) * PAGE < total:
            page = self.free.pop(0)
            self._forget_hash(page)
            pages.append(page)
        seq = Sequence(SequenceIds(tokens), pages, kv_position=cached)
        seq.taps = [self.row(tokens, p) for p in range(cached)]
        self._serial += 1
        job = Job([seq], self._serial, max_new, frozenset(stop), cached_positions=cached)
        self.active_jobs.append(job)
        while prefill and not job.is_prefill_done():
            self._prefill_chunk(job)
        return job

    def _prefill_chunk(self, job: Job) -> None:
        seq = job.seq
        a = seq.kv_position
        b = min(a + self.chunk, len(seq.tokens) - 1)
        rows = np.stack([self.row(seq.tokens, p) for p in range(a, b)])
        self.draft_model.update_kv_from_target(self._layers(rows[None]), self.cache,
                                               {"block_table": seq.block_index_tensor,
                                                "cache_seqlens": torch.tensor([a], dtype=torch.int32)})
        seq.taps += list(rows)
        seq.kv_position = b
        self._hash_full_pages(seq)

    def _prefix_hash(self, tokens, n: int) -> bytes:
        return hashlib.blake2b(np.asarray(tokens[:n], np.int64).tobytes(), digest_size=16).digest()

    def _hash_full_pages(self, seq: Sequence) -> None:
        for k in range(seq.kv_position // PAGE):
            h = self._prefix_hash(seq.tokens, (k + 1) * PAGE)
            if h not in self.hashed:
                self.hashed[h], self.page_hash[seq.pages[k]] = seq.pages[k], h

    def _forget_hash(self, page: int) -> None:
        h = self.page_hash.pop(page, None)
        if h is not None:
            self.hashed.pop(h, None)

    def cancel(self, job: Job) -> None:
        """The generator's `cancel`: the job leaves between rounds, without a last verification."""
        self._end(job)

    def _end(self, job: Job) -> None:
        self.active_jobs.remove(job)
        shared = {p for j in self.active_jobs for p in j.seq.pages}
        self.free += [p for p in job.seq.pages if p not in shared and p not in self.free]

    # ---- one round ------------------------------------------------------------------------------------------
    def batch_params(self, jobs: list[Job], kv: list[int]) -> dict:
        width = -(-max(len(j.seq.pages) for j in jobs) // TABLE_PAGES) * TABLE_PAGES
        table = torch.zeros((len(jobs), width), dtype=torch.int32)
        for i, j in enumerate(jobs):
            table[i, :len(j.seq.pages)] = j.seq.block_index_tensor[0]
        return {"block_table": table, "cache_seqlens": torch.tensor(kv, dtype=torch.int32), "cache": self.cache}

    def iterate(self, accept: Callable[[Job], int] | int = 0, bonus: Callable[[Job], int] | None = None,
                draft: bool = True, check: Callable[[Round], None] | None = None) -> Round:
        """One generator iteration. `accept(job)`: drafts the trunk accepts for that row (capped by the verified
        window); `bonus(job)`: the token it samples after them (default: random); `draft` False: a round without
        a draft call (the generator's row ceiling left no window). `check(round)` sees the drafts before the
        verification."""
        accept_of = accept if callable(accept) else (lambda j, a=accept: a)
        prefilling = [j for j in self.active_jobs if not j.is_prefill_done()]
        if prefilling:
            self._prefill_chunk(prefilling[0])
        jobs = [j for j in self.active_jobs if j.is_prefill_done()]
        if not jobs:
            return Round([], None, None, [])
        drafts = conf = None
        if draft:
            params = self.batch_params(jobs, [j.seq.kv_position for j in jobs])
            state = self.draft_model.forward(torch.tensor([[j.seq.tokens[-1]] for j in jobs]), params)
            ids = self.draft_model.sample_from_state(state, params)
            assert ids.shape == (len(jobs), self.draft_model.config.block_size)
            assert ids[:, 0].tolist() == [j.seq.tokens[-1] for j in jobs]          # column 0: the seed
            conf = params.get("draft_confidence_len")
            drafts = ids[:, 1:]
        rnd = Round(jobs, drafts, conf, [])
        if check is not None:
            check(rnd)
        window = 0 if drafts is None or conf == 0 else min(self.window, conf if conf is not None else self.window)
        kv0 = [j.seq.kv_position for j in jobs]
        params = self.batch_params(jobs, kv0)
        taps = np.zeros((len(jobs), 1 + window, self.n_taps * self.hidden), np.float16)
        lengths = []
        for i, j in enumerate(jobs):
            seq, n = j.seq, 0
            taps[i, 0] = self.row(seq.tokens, seq.kv_position)        # the seed's row
            want = min(accept_of(j), window)
            sampled = [int(t) for t in drafts[i, :want]] if want else []
            sampled.append(int(bonus(j)) if bonus is not None else int(self.rng.integers(0, self.vocab)))
            for t in sampled:                       # receive_sample, token by token: stop at a stop condition
                seq.sequence_ids.append(t)
                seq.kv_position += 1
                j.new_tokens += 1
                n += 1
                if n > 1:
                    taps[i, n - 1] = self.row(seq.tokens, seq.kv_position - 1)
                if t in j.stop_tokens or j.new_tokens >= j.max_new_tokens:
                    j.is_finished = True
                    break
            seq.taps += list(taps[i, :n])
            self._hash_full_pages(seq)
            lengths.append(n)
        self.draft_model.update_kv_from_target(self._layers(taps), self.cache,
                                               {"block_table": params["block_table"],
                                                "cache_seqlens": params["cache_seqlens"]}, lengths=lengths)
        rnd.ended = [j for j in jobs if j.is_finished]
        for j in rnd.ended:
            self._end(j)
        return rnd

    def run(self, **kw) -> list[Round]:
        """Iterate until no job is left."""
        rounds = []
        while self.active_jobs:
            rounds.append(self.iterate(**kw))
        return rounds
