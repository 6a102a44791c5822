"""A checkpoint's bytes onto the device fast: threads `os.preadv` byte ranges (no GIL) into pinned buffers and copy
each on a stream of their own, instead of safetensors' one-thread mapping and pageable copy (docs/engine.md, "A GPU
rank at a glance"). The bytes are the file's exactly; on a CPU they go straight into the destination.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

CHUNK_BYTES = 32 << 20        # one preadv and one copy; large enough to run both near their peak rate
THREADS = 4


class Staging:
    def __init__(self, device: str | torch.device, threads: int = THREADS, chunk_bytes: int = CHUNK_BYTES):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.chunk_bytes = chunk_bytes
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="dspark-staging")
        self._local = threading.local()
        self._streams: list[torch.cuda.Stream] = []
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self.bytes_read = 0

    def read(self, path: str | os.PathLike, begin: int, end: int) -> torch.Tensor:
        """Bytes [begin, end) of `path` as a uint8 tensor on the device, ready on the current stream only."""
        n = end - begin
        out = torch.empty(n, dtype=torch.uint8, device=self.device)
        if n == 0:
            return out
        fd = self._fd(str(path))
        spans = [(at, min(at + self.chunk_bytes, n)) for at in range(0, n, self.chunk_bytes)]
        list(self._pool.map(lambda span: self._chunk(fd, begin, out, *span), spans))
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            for s in self._streams:
                current.wait_stream(s)
        self.bytes_read += n
        return out

    def _chunk(self, fd: int, base: int, out: torch.Tensor, lo: int, hi: int) -> None:
        if not self.cuda:
            _pread_all(fd, out[lo:hi].numpy(), base + lo)
            return
        st = self._thread_state()
        buf, done = st["bufs"][st["next"]], st["done"][st["next"]]
        st["next"] ^= 1
        done.synchronize()                   # the buffer's last copy has finished
        _pread_all(fd, buf[:hi - lo].numpy(), base + lo)
        with torch.cuda.stream(st["stream"]):
            out[lo:hi].copy_(buf[:hi - lo], non_blocking=True)
            done.record(st["stream"])

    def _thread_state(self) -> dict:
        """This thread's two pinned buffers (one filling while the other copies), their events, its stream."""
        st = getattr(self._local, "st", None)
        if st is None:
            stream = torch.cuda.Stream(self.device)
            st = {"stream": stream, "next": 0, "bufs": [torch.empty(self.chunk_bytes, dtype=torch.uint8,
                                                                    pin_memory=True) for _ in range(2)],
                  "done": [torch.cuda.Event() for _ in range(2)]}
            for e in st["done"]:
                e.record(stream)
            with self._lock:
                self._streams.append(stream)
            self._local.st = st
        return st

    def _fd(self, path: str) -> int:
        with self._lock:
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY)
            return self._fds[path]

    def close(self) -> None:
        if self.cuda:
            for s in self._streams:
                s.synchronize()
        self._pool.shutdown(wait=True)
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> "Staging":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _pread_all(fd: int, into, offset: int) -> None:
    """Fill `into` from `fd` at `offset`; a short file is an error, never silent zeros."""
    view = memoryview(into).cast("B")
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise EOFError(f"file ends {len(view) - got} bytes before the tensor's end (offset {offset + got})")
        got += n


def prefetch(paths) -> None:
    """POSIX_FADV_WILLNEED: the kernel reads the files into the page cache in the background; returns at once."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)
