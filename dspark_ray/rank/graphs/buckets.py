"""Which graph runs a step. Batches of 1-4 requests have a graph per (n_out, margins); a wider batch pads to the
next of the WIDE_BUCKETS, drafting n_out = block size (an answer is the first n_out drafts of a wider draft). An
insert runs in the smallest of the INSERT_BUCKETS that holds it; a decode round's rows run beside the draft.
"""
from __future__ import annotations

from ...protocol.records import STEP_INSERT_ROWS
from ...settings import current as settings

INSERT_BUCKETS = (8, 16, 32, 64, 128)
EXACT_REQUESTS = 4
WIDE_BUCKETS = (6, 8, 12, 16)
MAX_REQUESTS = 16

DraftKey = tuple[int, int, bool]        # (request bucket, the n_out it drafts, margins)


def step_graphs_enabled() -> bool:
    """Whether graph sets capture step graphs: on unless `DSPARK_STEP_GRAPHS=0` (the separate insert and draft graphs
    only: fewer graphs and less graph memory, a slower decode round; docs/engine.md)."""
    return settings().step_graphs


class Buckets:
    """A graph set's buckets for batches of up to `max_requests` requests drafting `n_outs`, inserts in
    `insert_buckets`, and with `step_graphs` a step graph per draft key."""

    def __init__(self, max_requests: int, n_outs: tuple[int, ...], insert_buckets: tuple[int, ...],
                 step_graphs: bool):
        self.max_requests, self.n_outs, self.inserts = max_requests, n_outs, insert_buckets
        # 1..EXACT_REQUESTS exactly, then WIDE_BUCKETS up to max_requests (the last one max_requests itself).
        exact = list(range(1, min(EXACT_REQUESTS, max_requests) + 1))
        wide = [b for b in WIDE_BUCKETS if exact[-1] < b < max_requests]
        wide += [max_requests] if max_requests > exact[-1] else []
        self.exact, self.wide, self.requests = tuple(exact), tuple(wide), tuple(exact + wide)
        self.of_requests = [0] + [min(b for b in self.requests if b >= n) for n in range(1, max_requests + 1)]
        self.T = max(insert_buckets)                      # the largest insert: the rows a chunk holds
        self.of_rows = [min(b for b in insert_buckets if b >= n) for n in range(self.T + 1)]
        # A draft key's step graph takes an insert of up to step_rows[its request bucket] rows beside the draft.
        self.step_rows = {b: min(STEP_INSERT_ROWS * b, self.T) for b in self.requests} if step_graphs else {}

    def key(self, n: int, n_out: int, margins: bool) -> DraftKey:
        """The graph key of a draft of n requests: (their bucket, the n_out it drafts, margins)."""
        b = self.of_requests[n]
        return b, (n_out if b <= EXACT_REQUESTS else max(self.n_outs)), margins

    def draft_keys(self) -> list[DraftKey]:
        """Every draft key, in capture order."""
        keys = [(b, k, m) for b in self.exact for k in self.n_outs for m in (False, True)]
        return keys + [(b, max(self.n_outs), m) for b in self.wide for m in (False, True)]

    def step_rows_for(self, n_requests: int) -> int:
        """The insert rows the step graph of a draft of `n_requests` takes beside it (0: none)."""
        return self.step_rows.get(self.of_requests[n_requests], 0) if n_requests <= self.max_requests else 0

    def needed_first(self, kk: tuple[str, object], first: list[tuple[int, int, bool]]) -> bool:
        """Whether graph `kk` is one the batches `first` need at once: an insert, or their draft or step graph."""
        return kk[0] == "insert" or kk[1] in {self.key(n, k, m) for n, k, m in first if 1 <= n <= self.max_requests}
