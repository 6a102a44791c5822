"""The failure policy (docs/contract.md, "Supervision"): when a failed batch becomes a pair restart.

"step" failures (the pair still in step) restart after `threshold` in a row; "broken", "hung" and "dead" at once,
since the ranks' replicated state may have diverged. `restart` runs on its own thread; entries answer UNAVAILABLE.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from .step_service import PairFailure, StepService

log = logging.getLogger("dspark_ray.supervisor")


class Supervisor:
    def __init__(self, service: StepService, restart: Callable[[], None], threshold: int = 3):
        self.service, self.restart_fn, self.threshold = service, restart, threshold
        self.consecutive = 0
        self.restarts = 0
        self.restart_seconds: list[float] = []     # append-only: metrics.py reads it from a cursor
        self.attempts = 3
        self.last_restart: dict = {}               # wall-clock stamps: failure seen, each attempt, serving again
        self._lock = threading.Lock()
        self._restarting = False
        service.on_failure = self.observe

    def observe(self, failure: PairFailure | None, slots: list[int]) -> None:
        with self._lock:
            if failure is None:
                self.consecutive = 0
                return
            self.consecutive += 1
            immediate = failure.kind != "step"
            if not (immediate or self.consecutive >= self.threshold) or self._restarting:
                log.info("failure %d of %d in a row (%s): no restart yet", self.consecutive, self.threshold,
                         failure.kind)
                return
            why = (f"{failure.kind}: {failure.reason}" if immediate
                   else f"{self.consecutive} consecutive failed steps (threshold {self.threshold})")
            self._restarting = True
            self.service.unavailable = f"restarting ({why})"
            self.last_restart = {"failure_seen": time.time(), "why": why, "attempts": []}
        threading.Thread(target=self._restart, args=(why,), name="dspark-restart", daemon=True).start()

    def _restart(self, why: str) -> None:
        t0 = time.monotonic()
        log.warning("restarting the pair: %s", why)
        ok = False
        for attempt in range(self.attempts):
            self.last_restart["attempts"].append(time.time())
            try:
                self.restart_fn()
                ok = True
                break
            except Exception as e:
                log.error("pair restart attempt %d failed: %s: %s", attempt + 1, type(e).__name__, e)
                self.service.last_errors = (self.service.last_errors + [f"restart failed: {e}"])[-10:]
                # The second attempt at once: a rank killed while it started is a new failure, not a slow resource.
                if attempt:
                    time.sleep(min(5.0, 0.5 * 2 ** (attempt - 1)))
        dt = time.monotonic() - t0
        with self._lock:
            self._restarting = False
            self.consecutive = 0
            if ok:
                self.restarts += 1
                self.restart_seconds.append(dt)
                self.service.worker_generation += 1
                self.service.resync_all()
                self.service.unavailable = None
                self.last_restart["serving"] = time.time()
                log.warning("pair restarted in %.2f s (worker generation %d)", dt,
                            self.service.worker_generation)
            else:
                self.service.unavailable = f"restart failed: {why}"

    def status(self) -> dict:
        return {"consecutive_failures": self.consecutive, "threshold": self.threshold, "restarts": self.restarts,
                "restart_seconds": [round(s, 3) for s in self.restart_seconds[-10:]],
                "restarting": self._restarting, "last_restart": self.last_restart}
