"""How the processes on the per-step path (the front-end and the ranks) are scheduled: their priority, and the
facts about their threads and cores that the latency bench records.

Ray's raylet starts every worker process at niceness 15 (its `worker_niceness` setting), so that a busy worker
never starves the raylet. Our front-end and ranks are the latency path of every STEP: at niceness 15 they lose the
CPU to any nice-0 process on their core, and the host path measured 2-4x slower inside the actors than the same
code in plain processes on the GPU host (bench/step_latency.py's timeline against bench/host_path.py). So each
of these actors asks for niceness 0 at start-up. Lowering a niceness needs CAP_SYS_NICE (root has it); without it
the actor logs once how to get it: start Ray with `RAY_worker_niceness=0` (cluster/dspark.env sets it).
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("dspark_ray.scheduling")

TARGET_NICENESS = 0


def raise_priority(who: str) -> int:
    """Set this process's niceness to TARGET_NICENESS when it is higher; returns the niceness it runs at."""
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


def _last_cpu(native_id: int) -> int | None:
    """The core a thread of this process last ran on (/proc: field 39 of its stat line), or None."""
    try:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return None


def process_facts() -> dict:
    """This process's niceness, the cores it may run on, and each thread with the core it last ran on: what to
    look at when a hop of the step's timeline is slower inside the actor than in a plain process."""
    import threading
    return {"niceness": os.getpriority(os.PRIO_PROCESS, 0), "cpus_allowed": len(os.sched_getaffinity(0)),
            "load_1m": round(os.getloadavg()[0], 2),
            "threads": {t.name: _last_cpu(t.native_id) for t in threading.enumerate() if t.native_id}}
