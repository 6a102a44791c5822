"""The front-end's Prometheus metrics through Ray's metrics agent (docs/operations.md, "Metrics"). A metrics call
per STEP would cost a few per cent of its host path, so the step path bumps plain ints and a deque, and `Exporter`
turns what changed into metric calls once a second.
"""
from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("dspark_ray.metrics")

SERVICE_COUNTERS = {"steps": "STEPs past the STEP-level checks",
                    "entries": "entries run on the pair",
                    "batches": "batches run on the pair"}
ANSWER_CODES = ("ok", "bad_entry", "stale", "internal", "unavailable", "deadline", "overloaded")
TCP_COUNTERS = {"connections": "connections accepted by the STEP endpoint",
                "bad_frames": "connections closed for a bad frame",
                "connections_refused": "connections refused at the endpoint's limit (serve --max-connections)",
                "idle_sessions_closed": "sessions closed after serve --idle-timeout without a request",
                "unauthorized": "HELLOs refused UNAUTHORIZED: no token, or not the deployment's"}
# From an instant pair's host path to the CPU test pair's tens of ms.
STEP_SECONDS_BOUNDS = [5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.5, 2.0]
RESTART_SECONDS_BOUNDS = [1, 2, 5, 10, 20, 60]
# A pause every slice of observations: a STEP thread waits one slice for the GIL, not the 5 ms switch interval.
OBSERVE_SLICE = 32
SLICE_PAUSE_S = 50e-6
ERROR_LOG_EVERY_S = 600.0


class Exporter:
    """Exports a front-end's counts, levels and step latencies every `interval_s`; `metrics`: ray.util.metrics."""

    def __init__(self, pair: str, service, supervisor, server, interval_s: float = 1.0, metrics=None):
        if metrics is None:
            from ray.util import metrics
        self.pair, self.service, self.supervisor, self.server = pair, service, supervisor, server
        self.interval_s = interval_s
        by_pair, by_code = ("pair",), ("pair", "code")
        self.counters = {k: metrics.Counter(f"dspark_{k}_total", d, tag_keys=by_pair)
                         for k, d in {**SERVICE_COUNTERS, **TCP_COUNTERS}.items()}
        self.counters["restarts"] = metrics.Counter("dspark_restarts_total", "pair restarts", tag_keys=by_pair)
        self.counters["steps_after_sleep"] = metrics.Counter(
            "dspark_steps_after_sleep_total", "STEPs that found the endpoint's thread asleep (wake_ups.py)",
            tag_keys=by_pair)
        self.answers = metrics.Counter("dspark_answers_total", "answers by code: one per entry, one per request "
                                       "refused whole", tag_keys=by_code)
        self.gauges = {k: metrics.Gauge(f"dspark_{k}", d, tag_keys=by_pair) for k, d in {
            "slots_held": "slots held by sessions", "sessions": "open sessions",
            "queue_depth": "entries waiting for the pair", "worker_generation": "the pair's worker generation",
            "unavailable": "1 while the pair is starting or restarting (STEPs answer UNAVAILABLE), else 0"}.items()}
        self.step_seconds = metrics.Histogram("dspark_step_seconds", "a STEP's time in the front-end, its frame's "
                                              "arrival to its reply built", boundaries=STEP_SECONDS_BOUNDS,
                                              tag_keys=by_pair)
        self.restart_seconds = metrics.Histogram("dspark_restart_seconds", "time to serve again after a restart",
                                                 boundaries=RESTART_SECONDS_BOUNDS, tag_keys=by_pair)
        for m in (*self.counters.values(), self.answers, *self.gauges.values(), self.step_seconds,
                  self.restart_seconds):
            m.set_default_tags({"pair": pair})
        self._sent: dict[str, int] = {}          # each count when last exported
        self._restarts_seen = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error_logged = -ERROR_LOG_EVERY_S
        self.exports = 0
        self.cpu_ns = 0                          # the exports' CPU time

    def start(self) -> "Exporter":
        self._thread = threading.Thread(target=self._loop, name=f"dspark-metrics:{self.pair}", daemon=True)
        self._thread.start()
        log.info("pair %s: exporting dspark_* metrics every %g s through Ray's metrics agent", self.pair,
                 self.interval_s)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._export_logged()
        self._export_logged()

    def _export_logged(self) -> None:
        t0 = time.thread_time_ns()
        try:
            self.export()
        except Exception:         # a metrics failure must not stop the exports, nor flood the log
            t = time.monotonic()
            if t - self._error_logged >= ERROR_LOG_EVERY_S:
                self._error_logged = t
                log.exception("pair %s: metrics export failed (logged at most every %g s)", self.pair,
                              ERROR_LOG_EVERY_S)
        self.cpu_ns += time.thread_time_ns() - t0

    def export(self) -> None:
        """Reads the step path's values without its locks: a level read mid-change is off by one for a second."""
        svc, sup = self.service, self.supervisor
        stats = svc.stats
        for k in SERVICE_COUNTERS:
            self._inc(self.counters[k], k, stats[k])
        for code in ANSWER_CODES:
            self._inc(self.answers, f"answers:{code}", stats[code], {"code": code})
        if self.server is not None:
            for k in TCP_COUNTERS:
                self._inc(self.counters[k], k, self.server.counts[k])
            self._inc(self.counters["steps_after_sleep"], "steps_after_sleep", self.server.wake_ups.after_sleep)
        if sup is not None:
            new = sup.restart_seconds[self._restarts_seen:]      # append-only
            self._restarts_seen += len(new)
            self._inc(self.counters["restarts"], "restarts", self._restarts_seen)
            for s in new:
                self.restart_seconds.observe(s)
        g = self.gauges
        g["slots_held"].set(sum(s.owner is not None for s in svc.slots))
        g["sessions"].set(len(svc.sessions))
        g["queue_depth"].set(len(svc.queue))
        g["worker_generation"].set(svc.worker_generation)
        g["unavailable"].set(1 if svc.unavailable else 0)
        # popleft: each STEP observed exactly once.
        lat = svc.step_ns
        for i in range(len(lat)):
            self.step_seconds.observe(lat.popleft() / 1e9)
            if i % OBSERVE_SLICE == OBSERVE_SLICE - 1:
                time.sleep(SLICE_PAUSE_S)
        self.exports += 1

    def _inc(self, counter, key: str, value: int, tags: dict | None = None) -> None:
        delta = value - self._sent.get(key, 0)
        if delta > 0:                # Counter.inc refuses 0
            counter.inc(delta, tags=tags)
            self._sent[key] = value
