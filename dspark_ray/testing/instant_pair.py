"""A pair that answers every batch at once with fixed results: what the front-end's `StepService` costs by itself,
without the ring or the ranks (bench/host_path.py, bench/tcp_roundtrip.py --service)."""
from __future__ import annotations

import numpy as np

from dspark_ray.protocol import contract as C


class InstantPair:
    """Answers a batch at once with fixed results: StepService's own cost, without the ring."""

    def __init__(self):
        self.last_seq = 0

    def run(self, batch, deadline_ns=None):
        self.last_seq += 1
        r = C.EntryResult(drafts=np.arange(5, dtype="<i4").tobytes(), confidences=np.full(5, 0.75, "<f4").tobytes(),
                          confident_len=5)
        return [r for _ in batch.entries]
