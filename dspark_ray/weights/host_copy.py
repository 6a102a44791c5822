"""A checkpoint's files mapped and, on a card, pinned for it in place: `cuMemHostRegister` (read-only) on the page
cache's own pages, so each tensor is one DMA copy and no bounce buffer. A spare rank opens it ahead of a restart
(docs/performance.md, "When a rank dies"); the rank reads through it as through `staging.Staging`. The pages stay
the host's one copy: every spare pins the same ones.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import time
import warnings

import torch

log = logging.getLogger("dspark_ray.weights")

_PORTABLE, _READ_ONLY = 0x01, 0x08        # CU_MEMHOSTREGISTER_*: every context; the device only reads


class HostCopy:
    def __init__(self, spans: dict[str, tuple[int, int]], device: str | torch.device):
        """`spans`: {file: (begin, end)}, the bytes to keep (Checkpoint.spans())."""
        self.device = torch.device(device)
        self.bytes_read = 0
        self._files: dict[str, tuple[int, torch.Tensor]] = {}     # file -> (offset, its bytes over the mapping)
        self._registered: list[int] = []
        # the driver API: a failed call leaves no error behind for torch's next check, as the runtime's would
        self._driver = ctypes.CDLL("libcuda.so.1") if self.device.type == "cuda" else None
        try:
            for path, (begin, end) in spans.items():
                self._open(str(path), begin, end)
        except BaseException:
            self.close()
            raise

    @classmethod
    def open(cls, spans: dict[str, tuple[int, int]], device) -> "HostCopy | None":
        """The spans pinned for `device`; None (logged) where the host or its driver refuses."""
        t0 = time.time()
        try:
            copy = cls(spans, device)
        except (OSError, EOFError) as e:
            log.warning("checkpoint files not pinned for %s (%s): a restart reads them through buffers", device, e)
            return None
        gib = sum(t.numel() for _, t in copy._files.values()) / 2**30
        log.info("checkpoint files pinned for %s: %.1f GiB in %.1f s", device, gib, time.time() - t0)
        return copy

    def _open(self, path: str, begin: int, end: int) -> None:
        offset = begin - begin % mmap.ALLOCATIONGRANULARITY
        if end <= offset:
            return
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < end:
                raise EOFError(f"{path} ends before byte {end}")
            m = mmap.mmap(f.fileno(), end - offset, access=mmap.ACCESS_READ, offset=offset)
        with warnings.catch_warnings():          # read-only memory: nothing here writes to it
            warnings.simplefilter("ignore")
            t = torch.frombuffer(m, dtype=torch.uint8)
        self._files[path] = (offset, t)
        if self._driver is not None:
            torch.cuda.synchronize(self.device)  # the runtime's context current on this thread, for the driver call
            addr = t.data_ptr()
            whole_pages = -(-t.numel() // mmap.PAGESIZE) * mmap.PAGESIZE      # (the mapping's own extent)
            rc = self._driver.cuMemHostRegister_v2(ctypes.c_void_p(addr), ctypes.c_size_t(whole_pages),
                                                   ctypes.c_uint(_PORTABLE | _READ_ONLY))
            if rc != 0:
                raise OSError(f"cuMemHostRegister of {path} ({t.numel()} bytes): CUresult {rc}")
            self._registered.append(addr)

    def read(self, path: str | os.PathLike, begin: int, end: int) -> torch.Tensor:
        """Bytes [begin, end) of `path` as a uint8 tensor on the device, ready on the current stream only."""
        offset, t = self._files[str(path)]
        if begin < offset or end > offset + t.numel():
            raise ValueError(f"{path}: bytes [{begin}, {end}) are outside the pinned span [{offset}, "
                             f"{offset + t.numel()})")
        out = torch.empty(end - begin, dtype=torch.uint8, device=self.device)
        out.copy_(t[begin - offset:end - offset], non_blocking=True)
        self.bytes_read += end - begin
        return out

    def close(self) -> None:
        if self._registered:
            torch.cuda.synchronize(self.device)     # no copy still reading the pages
            for addr in self._registered:
                self._driver.cuMemHostUnregister(ctypes.c_void_p(addr))
            self._registered.clear()
        self._files.clear()                         # each mapping goes with the last tensor over it

    def __enter__(self) -> "HostCopy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
