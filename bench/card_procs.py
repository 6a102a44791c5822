"""A bench's body in fresh processes, one card each, as the service's rank actors run: the pair's two ranks (rank r
sees only card r, as its cuda:0) or one card alone. Every run starts from a fresh process and allocator, whatever
ran before it. The body returns a dict; an exception in it comes back with its traceback and is raised here, naming
the process. One torch thread per process (two processes with all-core OpenMP pools stall each other), each
optionally pinned to one vCPU.

The pair's ranks get a free loopback port for their gloo rendezvous and the name of a 16-byte shared-memory block
for `draft_step.SpinBarrier`.

A spawned process imports every module anew, so what a wrapper changed in the parent's modules (a kernel variant of
`bench/dense_variants.py`) is not there: `SETUP_ENV` ("module:function:argument" in the environment, which the
children inherit) names a function each child calls with the argument before the body.
"""
from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import socket
import traceback
from multiprocessing import shared_memory


SETUP_ENV = "DSPARK_BENCH_CHILD_SETUP"


def free_port() -> int:
    """A free TCP port on the loopback for the pair's gloo rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(key: str, card: int, cpu: int | None, fn, fn_args: tuple, q) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = str(card)        # before anything initializes CUDA in this process
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    import torch
    torch.set_num_threads(1)
    try:
        setup = os.environ.get(SETUP_ENV)
        if setup:
            module, function, argument = setup.split(":", 2)
            getattr(importlib.import_module(module), function)(argument)
        q.put((key, fn(*fn_args)))
    except BaseException as e:       # noqa: BLE001 - reported to the parent
        q.put((key, {"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()[-4000:]}))


def _gather(procs: list, q, timeout_s: float) -> dict:
    for p in procs:
        p.start()
    got = dict(q.get(timeout=timeout_s) for _ in procs)
    for p in procs:
        p.join(60)
    for key, res in got.items():
        if isinstance(res, dict) and "error" in res:
            raise RuntimeError(f"{key}: {res['error']}\n{res['tb']}")
    return got


def run_alone(fn, *fn_args, cpu: int | None = None, timeout_s: float = 600) -> dict:
    """fn(*fn_args) in a process of its own that sees card 0 alone."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    return _gather([ctx.Process(target=_child, args=("one card", 0, cpu, fn, fn_args, q))], q, timeout_s)["one card"]


def run_pair(fn, *fn_args, cpus=(None, None), timeout_s: float = 600) -> tuple[dict, dict]:
    """fn(rank, port, barrier_name, *fn_args) for rank 0 on card 0 and rank 1 on card 1, at once; their results."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    shm = shared_memory.SharedMemory(create=True, size=16)
    shm.buf[:16] = bytes(16)
    try:
        procs = [ctx.Process(target=_child, args=(f"pair rank {r}", r, cpus[r], fn, (r, port, shm.name, *fn_args), q))
                 for r in (0, 1)]
        got = _gather(procs, q, timeout_s)
    finally:
        shm.close()
        shm.unlink()
    return got["pair rank 0"], got["pair rank 1"]


def pinned(cpus: str, index: int) -> int | None:
    """Entry `index` of a "--pin-cpus 2,3" list, or None when the list is empty."""
    from dspark_ray.cli import cpu_list
    return cpu_list(cpus)[index] if cpus else None
