"""The copies a graph starts and ends with: the upload of the inputs it reads, and a draft's download of its packed
outputs and of the collectives' control words (the fail-closed check reads them there:
`Collectives.status_region`).

They are part of the graphs themselves, so a step on the host is: write the pinned buffer, launch, synchronise,
read (a torch `copy_` costs tens of us of host time per call on the GPU host, a captured copy nothing). The copies
are a kernel that reads and writes the pinned buffers directly (`kernels/host_copy.py`; a memcpy node starts
several us after the kernel before it), or, without Triton, CuPy's `cudaMemcpyAsync` nodes, which torch's
pinned-memory bookkeeping does not see; with neither (and on a CPU) the graphs leave them out and the host issues
them around the replays.
"""
from __future__ import annotations

from typing import Callable

import torch

from .inputs import StepInputs


def _raw_memcpy() -> Callable[[int, int, int], None] | None:
    """cudaMemcpyAsync(dst, src, nbytes) on torch's current stream: capturable both ways between pinned host memory
    and the device. None without CuPy."""
    try:
        from cupy.cuda import runtime
    except ImportError:
        return None

    def copy(dst: int, src: int, nbytes: int) -> None:
        runtime.memcpyAsync(dst, src, nbytes, runtime.memcpyDefault, torch.cuda.current_stream().cuda_stream)
    return copy


def copier(like: torch.Tensor) -> Callable[..., None] | None:
    """copy(*(dst, src, nbytes)): capturable copies on torch's current stream between pinned host memory and the
    device. Every segment in one kernel where Triton runs (`kernels/host_copy.py`: a memcpy node waits for a copy
    engine, several us per copy), else a memcpy node per segment through CuPy; None without either."""
    try:
        from ..kernels.host_copy import copy_bytes
    except ImportError:             # no Triton
        copy_bytes = None
    if copy_bytes is not None:
        return lambda *segments: copy_bytes(like, *segments)
    memcpy = _raw_memcpy()
    if memcpy is None:
        return None

    def copy(*segments) -> None:
        for seg in segments:
            memcpy(*seg)
    return copy


class Copies:
    """A graph set's copies: `inp`'s upload, the download of up to `out_size` packed fp64 outputs (`out_host`) and
    of the collectives' control words (`status_host`). `memcpy` is None where the graphs hold no copies."""

    def __init__(self, inp: StepInputs, coll, out_size: int, cuda: bool):
        self.inp = inp
        self.out_host = torch.zeros(out_size, dtype=torch.float64, pin_memory=cuda)
        self.out_np = self.out_host.numpy()              # the unpacking reads the download through it
        self.memcpy = copier(inp.dev) if cuda else None
        # A one-kernel fence after each graph's upload (`around`).
        self.fence = torch.zeros(1, dtype=torch.int32, device=inp.dev.device) if self.memcpy else None
        self.status = coll.status_region() if self.memcpy else None
        self.status_host = torch.zeros(max(self.status[1], 1) if self.status else 1, dtype=torch.uint8,
                                       pin_memory=cuda)
        self.status_np = self.status_host.numpy()        # what the fail-closed check reads, a view made once

    def around(self, fn, upload: int, download: bool):
        """fn between its copies: the upload of its input bytes first; a draft's packed outputs and the control
        words last (behind its last collective), in one copy. Without in-graph copies, fn alone."""
        cp = self.memcpy
        if cp:
            cp((self.inp.dev.data_ptr(), self.inp.host.data_ptr(), upload))
            if self.fence is not None:
                # Right after the upload, the windows' gather (whose successor is a PDL kernel) started several us
                # after the upload ended; with this kernel between them nothing waits (docs/engine.md).
                self.fence.add_(1)
        out = fn()
        if cp and download:
            segments = [(self.out_host.data_ptr(), out.data_ptr(), out.numel() * out.element_size())]
            if self.status:
                segments.append((self.status_host.data_ptr(), self.status[0], self.status[1]))
            cp(*segments)
        return out
