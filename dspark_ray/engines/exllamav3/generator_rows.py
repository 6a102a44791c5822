"""Which of a generator's sequences each row of a drafter call is, read from the generator itself.

exllamav3 1.6.5 names a row only by its cache pages and position. Its batch is built in one order everywhere
(`generator.py`): the active jobs whose prefill is done, in `active_jobs` order, one row per sequence; a prefill
chunk's call hands the prefilling sequence's own block row. A row is taken for that sequence only when its position
and first page agree with it; the others draft nothing that round.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(eq=False)
class Row:
    job: object
    seq: object                 # the generator's Sequence: `sequence_ids`, `kv_position`, `block_index_tensor`

    def ids(self, a: int, b: int) -> np.ndarray:
        return token_ids(self.seq, a, b)

    @property
    def ended(self) -> bool:
        """The job hit a stop condition in this round's sampling: it leaves the batch after it."""
        return bool(getattr(self.job, "is_finished", False))


class GeneratorRows:
    def __init__(self, generator):
        self.generator = generator

    def batch(self, block_table, positions: list[int]) -> list[Row | None]:
        """The rows of a draft or verification call. `positions`: each row's `kv_position` now (in a verification
        call: the round's start plus its accepted length). None where the generator's sequence does not agree."""
        rows = [Row(job, seq) for job in self.generator.active_jobs if job.is_prefill_done()
                for seq in job.sequences]
        if len(rows) != len(positions):
            return [None] * len(positions)
        return [r if len(r.job.sequences) == 1 and _agrees(r.seq, block_table[i], positions[i]) else None
                for i, r in enumerate(rows)]

    def prefilling(self, block_row) -> Row | None:
        """The sequence whose prefill chunk this is (the generator hands its own block row)."""
        for job in self.generator.active_jobs:
            for seq in job.sequences:
                if seq.block_index_tensor is block_row:
                    return Row(job, seq)
        for job in self.generator.active_jobs:
            if not job.is_prefill_done() and len(job.sequences) == 1:
                pages = job.sequences[0].block_index_tensor
                if pages.shape == block_row.shape and bool((pages == block_row).all()):
                    return Row(job, job.sequences[0])
        return None

    def live(self) -> set[int]:
        """The ids of the generator's live sequences."""
        return {id(seq) for job in self.generator.active_jobs for seq in job.sequences}


def token_ids(seq, a: int, b: int) -> np.ndarray:
    """The generator's sequence `seq`'s token ids at positions [a, b)."""
    return seq.sequence_ids.torch_slice(a, b).reshape(-1).numpy().astype(np.int32, copy=False)


def _agrees(seq, block_row, position: int) -> bool:
    pages = seq.block_index_tensor
    return seq.kv_position == position and pages.shape[-1] > 0 and int(pages[0, 0]) == int(block_row[0])
