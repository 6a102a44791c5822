"""Per-step timestamps on the host path: where a STEP's round trip goes, hop by hop.

Every party of a step (the client, the TCP connection thread, the front-end's service and ring writer, each rank's
loop and engine) keeps the stamps of its recent steps. `time.monotonic_ns` reads CLOCK_MONOTONIC, one clock for every
process of a host, so stamps taken in different processes line up and their differences are the hops between them
(`bench/step_latency.py` joins them: by the ring's sequence number between the front-end and the ranks, by the
frame's arrival time between the connection thread and the service). A stamp costs ~0.1 us; a step takes ~10.
"""
from __future__ import annotations

import collections
import time

now = time.monotonic_ns


class Stamps:
    """The last `maxlen` steps' stamps of one party: one dict (stamp name -> ns, plus join keys) per step."""

    def __init__(self, maxlen: int = 2000):
        self.rows: collections.deque[dict] = collections.deque(maxlen=maxlen)

    def add(self, row: dict) -> None:
        self.rows.append(row)

    def recent(self) -> list[dict]:
        return list(self.rows)

    def durations_ms(self, start: str, end: str) -> list[float]:
        """end - start of every recent step that has both stamps, in ms."""
        return [(r[end] - r[start]) / 1e6 for r in list(self.rows) if start in r and end in r]
