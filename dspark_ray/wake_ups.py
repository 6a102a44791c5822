"""Counting the STEPs that found a party asleep.

Between two STEPs the ranks and the front-end's connection threads spin for `PairSpec.spin_us` (100 ms on a GPU
host), then sleep. A STEP that comes later than that pays a wake-up on every hop, tenths of a ms in all on the H200
pair (docs/engine.md, "Measurements behind the step path"). Each party (its recorder, recorders.py) counts its STEPs
and those whose wait slept, reports both in its status (the front-end's also as a Prometheus counter, metrics.py),
and logs one line, at most every 10 minutes, when most recent STEPs found it asleep: the serving engine's rounds are
further apart than the spin.
"""
from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("dspark_ray.wake_ups")

WINDOW = 100              # STEPs per look at the share that slept
HINT_EVERY_S = 600.0


class WakeUps:
    def __init__(self, party: str, spin_us: float):
        self.party = party
        self.spin_us = spin_us
        self.steps = 0
        self.after_sleep = 0
        self._window_start = (0, 0)         # (steps, after_sleep) at the window's start
        self._hinted = -HINT_EVERY_S
        self._lock = threading.Lock()       # a front-end's connection threads count into one

    def add(self, slept: bool) -> None:
        with self._lock:
            self.steps += 1
            self.after_sleep += slept
            if self.steps - self._window_start[0] < WINDOW:
                return
            share = (self.after_sleep - self._window_start[1]) / (self.steps - self._window_start[0])
            self._window_start = (self.steps, self.after_sleep)
            t = time.monotonic()
            if share <= 0.5 or t - self._hinted < HINT_EVERY_S:
                return
            self._hinted = t
        log.info("%s: %.0f%% of the last %d STEPs found it asleep: they come more than the spin (%.0f ms) apart, "
                 "and each pays a wake-up; a longer spin (serve --spin-ms) keeps it awake through the trunk's "
                 "forward", self.party, 100 * share, WINDOW, self.spin_us / 1e3)

    def status(self) -> dict:
        return {"steps": self.steps, "after_sleep": self.after_sleep, "spin_ms": self.spin_us / 1e3}
