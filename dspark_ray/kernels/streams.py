"""Concurrent branches of the draft step on the GPU: a side stream per device that a branch forks onto and joins
back from (`model.ops.branch`, installed by the fast path).

Why: at one request most of a block's kernels are latency bound (a few programs each), so the GPU idles between
them. Work that does not depend on what runs beside it (the shared expert beside the router and its top-k, the kv
row's norm beside the q path) can overlap. Inside CUDA-graph capture the fork and join are event edges, so the
captured graph holds the two branches as parallel nodes; eagerly they are two streams.

Bits: each branch's kernels are the same kernels on the same inputs, and no branch reads what the other writes
before the join, so the results are those of the serial order (tested: graph == eager, pair == emulated).
Memory: a branch's tensors are allocated on the side stream; the next fork makes the side stream wait for
everything queued on the main stream, so a freed block is never rewritten before its last reader ran. The branch's
arguments are held until the join, after which the main stream waits for the side.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..model.ops import Ready

_SIDE: dict[int, torch.cuda.Stream] = {}


def _side(device: torch.device) -> torch.cuda.Stream:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    s = _SIDE.get(idx)
    if s is None:
        s = _SIDE[idx] = torch.cuda.Stream(device=idx)
    return s


class Branch:
    """fn(*args) queued on the device's side stream after everything already queued on the current stream."""

    def __init__(self, fn: Callable[..., Any], args: tuple, dev: torch.device):
        self.main = torch.cuda.current_stream(dev)
        self.side = _side(dev)
        self.side.wait_stream(self.main)
        with torch.cuda.stream(self.side):
            self.value = fn(*args)
        self.args = args        # held to the join: the main stream must not reuse their memory while the side reads

    def join(self) -> Any:
        """The branch's result, with the current stream made to wait for it (at the first join: the later ones,
        e.g. each block reading its part of an insert's windows, find it done)."""
        if self.args is not None:
            self.main.wait_stream(self.side)
            self.args = None
        return self.value


def branch(fn: Callable[..., Any], *args) -> Branch | Ready:
    """`ops.branch` on the fast path: a side-stream branch for CUDA tensors, else run at once."""
    dev = next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
    return Branch(fn, args, dev) if dev is not None else Ready(fn(*args))
