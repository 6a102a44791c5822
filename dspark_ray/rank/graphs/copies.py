"""The copies inside a graph: the upload of its inputs and a draft's download of its outputs and the collectives'
control words, so a step on the host is write, launch, synchronise, read (a torch `copy_` costs tens of us of host
time). One Triton kernel on the pinned buffers (`kernels/host_copy.py`), else CuPy memcpy nodes; with neither, the
host issues them around the replays.
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
    """copy(*(dst, src, nbytes)): capturable host-device copies, one kernel with Triton (a memcpy node waits for a
    copy engine), else CuPy memcpy nodes; None without either."""
    try:
        from ...kernels.host_copy import copy_bytes
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
        """fn between its upload and (a draft's) download of outputs and control words; fn alone without copies."""
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
