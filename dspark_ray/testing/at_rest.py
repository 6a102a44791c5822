"""A deployed worker at rest: its spare rank sets ready, so nothing starting up shares its card and cores with what
a bench times next (bench/restart.py, bench/step_latency.py)."""
from __future__ import annotations

import time


def spares_pending(st: dict) -> bool:
    """Whether a worker's spare rank sets (its FrontEnd.status() `st`) are still being made."""
    return st.get("spares_ready", 0) < st.get("spares", 0)


def wait_for_spares(fe, limit_s: float, poll_s: float = 0.5) -> tuple[dict, float]:
    """Look at the front-end `fe` every `poll_s` until its spares are ready or `limit_s` has passed: the last status
    and the seconds waited (the caller decides what a worker still pending means)."""
    import ray
    t0 = time.monotonic()
    while True:
        st = ray.get(fe.status.remote(), timeout=30)
        if not spares_pending(st) or time.monotonic() - t0 >= limit_s:
            return st, time.monotonic() - t0
        time.sleep(poll_s)
