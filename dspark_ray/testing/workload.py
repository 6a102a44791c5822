"""A seeded STEP workload: what a serving engine would send over many decode rounds.

Each request starts with a prompt insert (a short one, so the first drafts see a partial window, or the last rows
of a long prompt at a far position), then every round inserts the rows the trunk accepted (seed + accepted drafts,
1..B+1 rows), now and then rolls back a few rows first, and asks for n_out drafts with a fresh seed token. Used by
the tests, the parity report, the demo and the benchmarks, so they all speak of the same inputs.
"""
from __future__ import annotations

import itertools
from typing import Iterator

import torch

from dspark_ray.protocol import contract as C
from dspark_ray.config import DrafterConfig

from .batches import entry


def make_taps(cfg: DrafterConfig, rows: int, gen: torch.Generator) -> torch.Tensor:
    """Synthetic trunk taps: fp16 stream means of unit scale, (rows, n_taps * hidden)."""
    return torch.randn(rows, cfg.n_taps * cfg.hidden_size, generator=gen).to(torch.float16)


def rounds(cfg: DrafterConfig, *, seed: int = 0, n_requests: int = 2, n_rounds: int = 40,
           first_rows: tuple[int, ...] = (6, 3), far_start: int | None = None, rollback_every: int = 7,
           vary_n_out: bool = True, margins_every: int = 3) -> list[list[C.Entry]]:
    """`n_rounds` batches of `n_requests` entries (contract records at generation 0; request i uses slot i): the
    first rounds of `stream`."""
    return list(itertools.islice(stream(cfg, seed=seed, n_requests=n_requests, first_rows=first_rows,
                                        far_start=far_start, rollback_every=rollback_every, vary_n_out=vary_n_out,
                                        margins_every=margins_every), n_rounds))


def stream(cfg: DrafterConfig, *, seed: int = 0, n_requests: int = 2, first_rows: tuple[int, ...] = (6, 3),
           far_start: int | None = None, rollback_every: int = 7, vary_n_out: bool = True,
           margins_every: int = 3) -> Iterator[list[C.Entry]]:
    """Batches of `n_requests` entries (request i uses slot i), one per round, without end: a load that runs as
    long as its driver needs (bench/restart.py). Request 0's first insert is short (partial window); with
    `far_start`, request 1 starts at that position (a long prompt's last rows)."""
    g = torch.Generator().manual_seed(seed)
    B = cfg.block_size
    pos = [0] * n_requests
    for r in itertools.count():
        batch = []
        for i in range(n_requests):
            rollback = -1
            if r == 0:
                n = first_rows[i % len(first_rows)]
                start = far_start if (far_start is not None and i == 1) else 0
            else:
                n = int(torch.randint(1, B + 2, (1,), generator=g))
                start = pos[i]
                if rollback_every and r % rollback_every == rollback_every - 1 and pos[i] - 2 > 0:
                    rollback = pos[i] - int(torch.randint(1, 3, (1,), generator=g))
                    start = rollback
            ids = torch.randint(0, cfg.vocab_size, (n,), generator=g)
            n_out = int(torch.randint(1, B + 1, (1,), generator=g)) if vary_n_out else B
            batch.append(entry(
                slot=i, seed_token=int(torch.randint(0, cfg.vocab_size, (1,), generator=g)), n_out=n_out,
                start_pos=start, token_ids=ids, taps=make_taps(cfg, n, g), rollback_to=rollback,
                want_margins=bool(margins_every) and r % margins_every == 0))
            pos[i] = start + n
        yield batch


# The exl3 parity bench's rounds (bench/parity_exl3.py), also what tools/exl3_device_check.py replays.
def _taps_and_seed(cfg, n: int, g: torch.Generator):
    """One request's round: n rows of fp16 taps, then its seed token, drawn from g in that order."""
    taps = torch.randn(n, cfg.n_taps * cfg.hidden_size, generator=g).to(torch.float16)
    return taps, int(torch.randint(0, cfg.vocab_size, (1,), generator=g))


def rounds_for(cfg, n_rounds: int, seed: int):
    """(start, rows, taps, seed token) per round: 6 rows first, then 1..B rows."""
    g = torch.Generator().manual_seed(seed)
    pos, out = 0, []
    for r in range(n_rounds):
        n = 6 if r == 0 else int(torch.randint(1, cfg.block_size + 1, (1,), generator=g))
        out.append((pos, n, *_taps_and_seed(cfg, n, g)))
        pos += n
    return out


def lockstep_rounds(cfg, n_rounds: int, seeds: list[int]):
    """rounds_for of the first seed; each other seed draws its own taps and seed token for the same rows a round.
    One list of (start, rows, [taps per seed], [seed token per seed]) a round."""
    lead = rounds_for(cfg, n_rounds, seeds[0])
    gens = [torch.Generator().manual_seed(s) for s in seeds[1:]]
    out = []
    for start, n, taps, tok in lead:
        more = [_taps_and_seed(cfg, n, g) for g in gens]
        out.append((start, n, [taps] + [t for t, _ in more], [tok] + [k for _, k in more]))
    return out
