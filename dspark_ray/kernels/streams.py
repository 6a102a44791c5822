"""Concurrent branches of the draft step on the GPU: a side stream per device that a branch forks onto and joins
back from (`model.ops.branch`, installed by the fast path).

Why: at one request most of a block's kernels are latency bound (a few programs each), so the GPU idles between
them. Work that does not depend on what runs beside it (the shared expert beside the router and its top-k, the kv
row's norm beside the q path) can overlap. Inside CUDA-graph capture the fork and join are event edges, so the
captured graph holds the two branches as parallel nodes; eagerly they are two streams.

A generator's parts (`branch_parts`: an insert beside the draft, block by block) run on a second side stream, each
part joined alone where it is read.

Bits: each branch's kernels are the same kernels on the same inputs, and no branch reads what the other writes
before the join, so the results are those of the serial order (tested: graph == eager, pair == emulated).
Memory: a branch's tensors are allocated on the side stream; the next fork makes the side stream wait for
everything queued on the main stream, so a freed block is never rewritten before its last reader ran. The branch's
arguments are held until the join, after which the main stream waits for the side.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from ..model.ops import Ready

_SIDE: dict[tuple[int, int], torch.cuda.Stream] = {}


def _side(device: torch.device, lane: int = 0) -> torch.cuda.Stream:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    s = _SIDE.get((idx, lane))
    if s is None:
        s = _SIDE[(idx, lane)] = torch.cuda.Stream(device=idx)
    return s


class Branch:
    """fn(*args) queued on the device's side stream after everything already queued on the current stream."""

    def __init__(self, fn: Callable[..., Any], args: tuple, dev: torch.device):
        self.main = torch.cuda.current_stream(dev)
        side = _side(dev)
        side.wait_stream(self.main)
        with torch.cuda.stream(side):
            self.value = fn(*args)
        self.done = side.record_event()     # the join waits for this branch, not for what is queued after it
        self.args = args        # held to the join: the main stream must not reuse their memory while the side reads

    def join(self) -> Any:
        """The branch's result, with the current stream made to wait for it (at the first join: a later one finds
        it done)."""
        if self.args is not None:
            self.main.wait_event(self.done)
            self.args = None
        return self.value


class _Part(Branch):
    """One value a `branch_parts` generator yielded, and where its lane stood then."""

    def __init__(self, main: torch.cuda.Stream, value: Any, done: torch.cuda.Event, args: tuple):
        self.main, self.value, self.done, self.args = main, value, done, args


def branch(fn: Callable[..., Any], *args) -> Branch | Ready:
    """`ops.branch` on the fast path: a side-stream branch for CUDA tensors, else run at once."""
    dev = _device(args)
    return Branch(fn, args, dev) if dev is not None else Ready(fn(*args))


def branch_parts(fn: Callable[..., Iterator], *args) -> list[Branch | Ready]:
    """`ops.branch_parts` on the fast path: the generator fn(*args) runs on a lane of its own (the model's branches
    do not queue behind it), and each value it yields is joined alone, waiting only for the work queued before it."""
    dev = _device(args)
    if dev is None:
        return [Ready(v) for v in fn(*args)]
    main = torch.cuda.current_stream(dev)
    lane = _side(dev, lane=1)
    lane.wait_stream(main)
    parts = []
    with torch.cuda.stream(lane):
        for v in fn(*args):
            parts.append(_Part(main, v, lane.record_event(), args))
    return parts


def _device(args: tuple) -> torch.device | None:
    return next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
