"""The per-step threads' scheduling (each rank's step loop, the front-end's TCP threads): priority, pinning, and
the thread facts the latency bench records. Ray starts workers at niceness 15, where these threads lose their core
to any nice-0 work; they ask for 0 (a new thread inherits its creator's niceness and affinity), while loading,
capture and restarts keep 15 (docs/engine.md, "The step path's threads"; docs/performance.md).
"""
from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("dspark_ray.scheduling")

TARGET_NICENESS = 0


def raise_priority(who: str) -> int:
    """Set the calling thread's niceness to TARGET_NICENESS when it is higher; returns the niceness it runs at."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    if before <= TARGET_NICENESS:
        return before
    try:
        os.setpriority(os.PRIO_PROCESS, 0, TARGET_NICENESS)
    except OSError as e:
        log.warning("%s: runs at niceness %d (Ray's worker default), cannot lower it to %d (%s): start Ray with "
                    "RAY_worker_niceness=0 for the per-step path's latency", who, before, TARGET_NICENESS, e)
        return before
    log.info("%s: niceness %d -> %d (on the per-step path)", who, before, TARGET_NICENESS)
    return TARGET_NICENESS


def pin_thread(cpus, who: str) -> set[int] | None:
    """Restrict the calling thread to `cpus` (None or empty: leave it); returns the set, or None when refused."""
    if not cpus:
        return None
    want = {int(c) for c in cpus}
    try:
        os.sched_setaffinity(0, want)       # pid 0: the calling thread
    except (OSError, ValueError) as e:
        log.warning("%s: cannot pin to vCPUs %s (%s); it runs on %s", who, sorted(want), e,
                    sorted(os.sched_getaffinity(0)))
        return None
    log.info("%s: pinned to vCPUs %s", who, sorted(want))
    return want


_TICK_MS = 1e3 / os.sysconf("SC_CLK_TCK")


def _thread_stat(native_id: int) -> dict | None:
    """A thread's last core, niceness, allowed cores, CPU time, time waited for a core and preemptions (from
    /proc), or None."""
    try:
        base = f"/proc/self/task/{native_id}"
        with open(f"{base}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()      # from field 3 on (the name may hold spaces)
        with open(f"{base}/schedstat") as f:
            run_delay_ns = int(f.read().split()[1])
        with open(f"{base}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        preempted = int(status["nonvoluntary_ctxt_switches"])
        return {"cpu": int(fields[36]), "allowed": status["Cpus_allowed_list"].strip(), "nice": int(fields[16]),
                "cpu_ms": round((int(fields[11]) + int(fields[12])) * _TICK_MS, 1),
                "run_delay_ms": round(run_delay_ns / 1e6, 3), "preempted": preempted}
    except (OSError, IndexError, ValueError, KeyError):
        return None


def process_facts() -> dict:
    """The cores this process may run on, the load, and each thread's `_thread_stat`."""
    return {"cpus_allowed": len(os.sched_getaffinity(0)), "load_1m": round(os.getloadavg()[0], 2),
            "threads": {t.name: _thread_stat(t.native_id) for t in threading.enumerate() if t.native_id}}


def thread_deltas(before: dict, after: dict) -> dict:
    """Per thread present in both `process_facts()` readings: CPU time used, time waited for a core, preemptions."""
    out = {}
    for name, b in before["threads"].items():
        a = after["threads"].get(name)
        if a and b:
            out[name] = {k: round(a[k] - b[k], 3) for k in ("cpu_ms", "run_delay_ms", "preempted")}
    return out


def threads_named(facts: dict | None, prefix: str) -> list[dict]:
    """The threads in a `process_facts()` reading (None: none) whose names start with `prefix`, as it read them."""
    return [v for k, v in ((facts or {}).get("threads") or {}).items() if k.startswith(prefix) and v]


def thread_niceness(facts: dict, prefix: str) -> list[int]:
    """The niceness of the threads in `process_facts()` whose names start with `prefix`."""
    return [t["nice"] for t in threads_named(facts, prefix)]
