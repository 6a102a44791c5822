"""A step's inputs: one pinned host buffer that each graph uploads (the prefix it reads) in one host-to-device copy.

    int64  seeds, p0 (R each); the pool rows of the windows (blocks x R x W) | insert positions (T); the pool rows
           the insert writes (blocks x T)
    bool   window-valid flags (R*W)
    fp16   the insert's taps (T rows)

(R = max requests, W = window, T = the largest insert bucket; a pool row is ((slot * blocks) + block) * capacity +
ring row, computed by the host.) A draft reads everything before the taps, an insert that and its rows of taps.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch


class StepInputs:
    """The step's input buffer: one uint8 tensor on the device, its pinned host twin, and typed views of both."""

    def __init__(self, R: int, W: int, T: int, NB: int, width: int, device: torch.device):
        sizes = {"seeds": R, "p0": R, "win_rows": NB * R * W, "ins_pos": T, "ins_rows": NB * T}
        self.off: dict[str, tuple[int, int]] = {}
        o = 0
        for k, n in sizes.items():
            self.off[k] = (o, n)
            o += 8 * n
        self.off["valid"] = (o, R * W)
        o += -(-R * W // 8) * 8
        self.off["taps"] = (o, T * width)
        self.width = width
        self.nbytes = o + 2 * T * width
        self.dev = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        cuda = device.type == "cuda"
        self.host = torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=cuda)
        self.host_np = self.host.numpy()
        self.uploaded = torch.cuda.Event() if cuda else None
        self.in_use = False
        self.h = {k: self.host_view(k) for k in self.off}       # the host views, made once (the step writes them)

    _DTYPES = {"valid": (torch.bool, np.bool_), "taps": (torch.float16, np.float16)}      # the rest: int64

    def _span(self, k: str):
        o, n = self.off[k]
        td, nd = self._DTYPES.get(k, (torch.int64, np.int64))
        return o, o + n * np.dtype(nd).itemsize, td, nd

    def dev_view(self, k: str) -> torch.Tensor:
        a, b, td, _ = self._span(k)
        return self.dev[a:b].view(td)

    def host_view(self, k: str) -> np.ndarray:
        a, b, _, nd = self._span(k)
        return self.host_np[a:b].view(nd)

    def writable(self) -> None:
        """Wait until the last upload has left the pinned buffer (its copy runs asynchronously); nothing to wait
        for once `synchronize` has returned and nothing was queued since (a driver call saved per step)."""
        if self.uploaded is not None and self.in_use:
            self.synchronize()

    def synchronize(self, idle: Callable[[Callable[[], bool]], None] | None = None) -> None:
        """Wait for all the work queued up to the last `mark`; with `idle`, by polling the event and running
        `idle(ready)` between the polls (the rank's rehearsals: the host path after the wait stays warm)."""
        if idle is not None:
            done = self.uploaded.query
            while not done():
                idle(done)
        self.uploaded.synchronize()
        self.in_use = False

    def upload(self, end: int) -> None:
        """Copy bytes [0, end) to the device in one copy."""
        self.dev[:end].copy_(self.host[:end], non_blocking=True)
        self.mark()

    def mark(self) -> None:
        """The buffer is in use by the work queued so far (an upload, or a graph that uploads it itself)."""
        if self.uploaded is not None:
            self.uploaded.record()
            self.in_use = True

    @property
    def draft_bytes(self) -> int:
        """What a draft reads: everything before the taps."""
        return self.off["taps"][0]

    def insert_bytes(self, rows: int) -> int:
        return self.off["taps"][0] + 2 * rows * self.width
