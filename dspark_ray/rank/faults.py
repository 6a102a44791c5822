"""Fault injection for tests, chaos runs and demos, armed per rank at run time. At the rank's next step(s):
`raise` after its last collective (the pair stays in step); `raise_early` before its first (the peer waits out the
collective timeout); `collective_timeout` sleeps in its first collective past it; `stall` sleeps `seconds` (the
watchdog fires); `kill` exits; `flag_never_raised` (push only) loses a store, so the peer's bounded wait fires.
"""
from __future__ import annotations

import os
import time

KINDS = ("raise", "raise_early", "collective_timeout", "stall", "kill", "flag_never_raised")


class InjectedFault(RuntimeError):
    pass


def install(worker, kind: str | None, count: int | None = None, seconds: float = 30.0) -> str:
    """Arm `kind` on a RankWorker's engine for `count` steps (None: until disarmed with kind None)."""
    eng = worker.engine
    eng.fault_hook = None
    eng.coll.fault = None
    push = getattr(eng.coll.inner, "name", "") == "push"
    if push and not eng.coll.inner.poisoned:
        eng.coll.inner.set_lost_flag(None)
    if kind is None:
        return f"rank {worker.rank}: faults cleared"
    if kind not in KINDS:
        raise ValueError(f"fault kind {kind!r}: choose one of {', '.join(KINDS)}")
    left = [count if count is not None else -1]

    def fire() -> bool:
        if left[0] == 0:
            return False
        left[0] -= 1
        return True

    if kind == "flag_never_raised":
        if not push:
            raise ValueError("fault flag_never_raised needs the push collectives (backend push)")
        eng.coll.inner.set_lost_flag(0)                 # block 0 of every all-reduce, eager and graph replays
        return f"rank {worker.rank}: fault {kind} armed (until cleared or the pair restarts)"
    if kind == "kill":
        eng.fault_hook = lambda phase: os._exit(17) if phase == "start" and fire() else None
    elif kind == "stall":
        eng.fault_hook = lambda phase: time.sleep(seconds) if phase == "start" and fire() else None
    elif kind in ("raise", "raise_early"):
        at = "end" if kind == "raise" else "start"

        def hook(phase):
            if phase == at and fire():
                raise InjectedFault(f"injected fault on rank {worker.rank} ({kind})")
        eng.fault_hook = hook
    else:   # collective_timeout: hold the first collective of the step past its bound
        timeout = worker.spec.collective_timeout_s

        def coll_fault(count_in_step):
            if count_in_step == 0 and fire():
                time.sleep(timeout * 1.5)
        eng.coll.fault = coll_fault
    return f"rank {worker.rank}: fault {kind} armed (count {count if count is not None else 'unbounded'})"
