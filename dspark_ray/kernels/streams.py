"""Side-stream branches of the draft step on the GPU (`model.ops.branch`): latency-bound work that does not depend
on its neighbour overlaps it; under graph capture the fork and join are event edges. No branch reads what the
other writes before the join, so the bits are the serial order's. A fork waits for everything queued on the main
stream, and a branch's args are held to the join, so no freed block is rewritten before its last reader ran.
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
        """The branch's result; the first join makes the main stream wait for it."""
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
    """`ops.branch_parts` on the fast path: fn(*args) runs on a second side stream (the model's branches do not
    queue behind it); each yielded value is joined alone."""
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
