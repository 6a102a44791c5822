"""The front-end's Prometheus metrics, exported through Ray's metrics agent off the step path.

A `ray.util.metrics` call costs microseconds in a Ray worker, so a few calls per STEP would be a few per cent of a
STEP's host path (docs/operations.md, "How they are kept, and what it costs"). So the step path only bumps
plain ints (`StepService.stats`, `TcpServer.counts`) and appends its latency to a deque (`StepService.step_ns`);
`Exporter`, a daemon thread of the front-end actor, wakes every second and turns what changed into Counter.inc(delta),
one Histogram.observe per STEP drained from the deque, and Gauge.set. No `status` call is needed for any of it.

Ray prefixes every name with "ray_" on each node's Prometheus endpoint (`ray.nodes()`'s "MetricsExportPort") and
adds its own labels (WorkerId, NodeAddress, ...); each metric carries a `pair` label, the front-end's name.
docs/operations.md lists them.
"""
from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("dspark_ray.metrics")

# What the step path counts (StepService.stats keys), as counters of their own.
SERVICE_COUNTERS = {"steps": "STEPs past the STEP-level checks",
                    "entries": "entries run on the pair",
                    "batches": "batches run on the pair"}
# One answer per entry, and one per request refused whole, by its code (the `code` label; StepService.stats keys).
ANSWER_CODES = ("ok", "bad_entry", "stale", "internal", "unavailable", "deadline", "overloaded")
TCP_COUNTERS = {"connections": "connections accepted by the STEP endpoint",
                "bad_frames": "connections closed for a bad frame",
                "connections_refused": "connections refused at the endpoint's limit (serve --max-connections)",
                "idle_sessions_closed": "sessions closed after serve --idle-timeout without a request"}
# A STEP's time in the front-end, its frame's arrival to its reply built: ~80 us of host path on an instant pair,
# 1-2 ms on the H200 pair, tens of ms for the CPU test pair.
STEP_SECONDS_BOUNDS = [5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.5, 2.0]
RESTART_SECONDS_BOUNDS = [1, 2, 5, 10, 20, 60]
# The exporter holds the interpreter lock while it observes; every OBSERVE_SLICE observations (~50 us) it sleeps
# briefly, so that a STEP thread waiting for the lock waits one slice at most (else up to the 5 ms switch interval).
OBSERVE_SLICE = 32
SLICE_PAUSE_S = 50e-6
ERROR_LOG_EVERY_S = 600.0


class Exporter:
    """Exports a front-end's counts, levels and step latencies every `interval_s`. `metrics`: the module holding
    Counter, Gauge and Histogram (ray.util.metrics by default; the tests pass fakes)."""

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
        self._sent: dict[str, int] = {}          # what each count stood at when last exported
        self._restarts_seen = 0                  # restart durations observed (Supervisor.restart_seconds)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error_logged = -ERROR_LOG_EVERY_S
        self.exports = 0
        self.cpu_ns = 0                          # the exports' CPU time (their cost, on a core beside the step path's)

    def start(self) -> "Exporter":
        self._thread = threading.Thread(target=self._loop, name=f"dspark-metrics:{self.pair}", daemon=True)
        self._thread.start()
        log.info("pair %s: exporting dspark_* metrics every %g s through Ray's metrics agent", self.pair,
                 self.interval_s)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread, after one last export of what is counted by now."""
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
        """One export: counters by what they grew since the last, one observation per STEP answered since, the
        levels as they are now. Reads the step path's plain values without its locks (a level read mid-change is
        off by one for a second; a count is a single int)."""
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
            new = sup.restart_seconds[self._restarts_seen:]      # appended, never changed (Supervisor._restart)
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
        # Exactly the STEPs appended since the last export, each once: popleft takes what the step path appended.
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
