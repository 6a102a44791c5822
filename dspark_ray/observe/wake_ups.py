"""Counting the STEPs that found a party asleep (its wait outlasted `PairSpec.spin_us`; each pays a wake-up per
hop), and one log line, at most every 10 minutes, when most recent STEPs did: the engine's rounds come further apart
than the spin.
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
