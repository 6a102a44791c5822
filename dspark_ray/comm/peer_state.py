"""One rank's push peer state: its layout (`#define`d into push.cu from here), error word, host guard and memory.

One plain `cudaMalloc`, never torch's allocator: an IPC handle names a whole allocation, and expandable segments'
VMM memory may not be mapped by peer access. The peer writes payload, flags, acks and error bits; the rank reads.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ..model.collectives import CollectiveError

ERR_LOCAL_TIMEOUT = 1
ERR_PEER_TIMEOUT = 2
ERR_BAD_ID = 4
ERR_CANCELLED = 8
ERR_EXHAUSTED = 16
ERR_LAYOUT = 32        # the ranks published the same epoch for different collectives

ERROR_BITS = {
    ERR_LOCAL_TIMEOUT: "local timeout",
    ERR_PEER_TIMEOUT: "peer timeout",
    ERR_BAD_ID: "invalid received id",
    ERR_CANCELLED: "cancelled",
    ERR_EXHAUSTED: "epoch exhaustion",
    ERR_LAYOUT: "layout mismatch",
}


def decode_error_word(word: int) -> list[str]:
    """The names of the bits set in an error word, lowest first; an unknown bit is named by its value."""
    if word < 0 or word > 0xFFFFFFFF:
        raise ValueError(f"error word {word} is not a uint32")
    out = []
    for bit in range(32):
        v = 1 << bit
        if word & v:
            out.append(ERROR_BITS.get(v, f"unknown bit {v:#x}"))
    return out


def describe_error_word(word: int) -> str:
    names = decode_error_word(word)
    return f"{word:#x} ({' | '.join(names)})" if names else "0x0 (none)"


MAXB = 128          # most blocks of one push launch: flags and acks per parity
MAXX = 128          # most rows of one (max, index) / top-2 exchange: one block of threads
EPOCH_LAST = 0xFFFFFFFF  # the last epoch that may be published; one more launch fails closed (ERR_EXHAUSTED)
LAMPORT_EMPTY = 0xFFBFFFFF  # push.cu: an empty Lamport receive word (a signaling NaN: no arithmetic produces one)


@dataclass(frozen=True)
class Layout:
    max_words: int              # capacity of one all-reduce payload, fp32 words (rounded up to a multiple of 4)
    maxb: int = MAXB
    maxx: int = MAXX

    OFF_EPOCH = 0
    OFF_DONE = 4
    OFF_LASTN = 8
    OFF_ERR = 16
    OFF_ERR_EPOCH = 20
    OFF_HELLO = 24
    OFF_DBG_SKIP = 32       # fault injection: block + 1 that never sends its flag; 0 = none
    OFF_FLAGS = 256

    def __post_init__(self):
        if self.max_words <= 0 or self.max_words >= (1 << 20):
            # the flag's shape field holds 20 bits of payload length
            raise CollectiveError(f"push layout: max_words {self.max_words} outside [1, {1 << 20})")
        if not (1 <= self.maxb <= 255):
            raise CollectiveError(f"push layout: maxb {self.maxb} outside [1, 255] (8-bit field of the flag)")
        if not (1 <= self.maxx <= 128):
            raise CollectiveError(f"push layout: maxx {self.maxx} outside [1, 128] (one block of threads)")

    @property
    def words(self) -> int:
        return (self.max_words + 3) // 4 * 4

    def max_rows(self, width: int) -> int:
        """Most rows one collective carries: an all-reduce of (rows, width) fp32 partials, an exchange of maxx."""
        return min(self.maxx, self.max_words // width)

    @property
    def off_acks(self) -> int:
        return self.OFF_FLAGS + 2 * self.maxb * 8

    @property
    def off_xrecv(self) -> int:
        return _align(self.off_acks + 2 * self.maxb * 4, 4096)

    @property
    def off_recv(self) -> int:
        return _align(self.off_xrecv + 2 * self.maxx * 32, 4096)

    @property
    def control_bytes(self) -> int:
        """Everything before the all-reduce receive buffers (cleared to zero on reset)."""
        return self.off_recv

    @property
    def nbytes(self) -> int:
        return self.off_recv + 2 * self.words * 4

    def cuda_defines(self) -> str:
        d = {
            "PUSH_MAXB": self.maxb, "PUSH_MAXX": self.maxx, "PUSH_RECV4": self.words // 4,
            "OFF_EPOCH": self.OFF_EPOCH, "OFF_DONE": self.OFF_DONE, "OFF_LASTN": self.OFF_LASTN,
            "OFF_ERR": self.OFF_ERR, "OFF_ERR_EPOCH": self.OFF_ERR_EPOCH, "OFF_HELLO": self.OFF_HELLO,
            "OFF_DBG_SKIP": self.OFF_DBG_SKIP, "OFF_FLAGS": self.OFF_FLAGS, "OFF_ACKS": self.off_acks,
            "OFF_XRECV": self.off_xrecv, "OFF_RECV": self.off_recv,
        }
        return "".join(f"#define {k} {v}\n" for k, v in d.items())

    def digest(self) -> str:
        """Both ranks must compile the same layout: compared at the handle exchange."""
        return hashlib.sha256(self.cuda_defines().encode()).hexdigest()[:16]


def _align(v: int, a: int) -> int:
    return (v + a - 1) // a * a


_PROCESS_POISON: list[str] = []


def process_poison() -> list[str]:
    """Why this process may no longer run push collectives (empty when it may)."""
    return list(_PROCESS_POISON)


class HostGuard:
    """The host's half of one rank's protocol. Poison: after a timed-out idle wait or a CUDA error a collective may
    still be parked or the context hold a sticky error, so everything is refused until the process restarts
    (process-wide; nothing on the device is cleared). Epoch book: mirrors the device's count so a replay that would
    exhaust the uint32 epochs is refused before it runs."""

    def __init__(self, name: str):
        self.name = name
        self.reason: str | None = None
        self.epoch = 0                  # epochs since the last reset (= the device counter when in step)
        self.generation = 0
        self._capture_count: int | None = None

    @property
    def poisoned(self) -> bool:
        return self.reason is not None or bool(_PROCESS_POISON)

    def poison(self, why: str) -> None:
        if self.reason is None:
            self.reason = why
            _PROCESS_POISON.append(f"{self.name}: {why}")

    def refuse_if_poisoned(self, what: str) -> None:
        if self.reason is not None:
            raise CollectiveError(f"{self.name}: {what} refused: poisoned ({self.reason}); restart the process")
        if _PROCESS_POISON:
            raise CollectiveError(f"{self.name}: {what} refused: this process is poisoned ({_PROCESS_POISON[0]}); "
                                  "restart the process")

    def epochs_left(self) -> int:
        return EPOCH_LAST - self.epoch

    def count_launch(self, capturing: bool) -> None:
        if capturing:
            if self._capture_count is None:
                raise CollectiveError(f"{self.name}: a push collective was captured outside graph_capture(): its "
                                      "replays could not be counted (wrap the capture in graph_capture())")
            self._capture_count += 1
        else:
            self.epoch = min(self.epoch + 1, EPOCH_LAST + 1)

    def begin_capture(self) -> None:
        if self._capture_count is not None:
            raise CollectiveError(f"{self.name}: graph_capture() is not re-entrant")
        self._capture_count = 0

    def end_capture(self) -> int:
        n, self._capture_count = self._capture_count or 0, None
        return n

    def before_replay(self, n_collectives: int) -> None:
        self.refuse_if_poisoned("graph replay")
        if n_collectives < 0:
            raise CollectiveError(f"{self.name}: replay of {n_collectives} collectives")
        if self.epoch + n_collectives > EPOCH_LAST:
            raise CollectiveError(f"{self.name}: graph replay refused: its {n_collectives} collectives would run "
                                  f"past the last epoch ({self.epochs_left()} left): drain and reset first")
        self.epoch += n_collectives

    def after_reset(self, epoch: int = 0) -> None:
        self.epoch = epoch
        self.generation += 1


class PeerState:
    """The state allocation. The host touches it only on the control stream, and clears it only while no
    collective of either rank is in flight (reset)."""

    def __init__(self, layout: Layout, ctrl_stream, fill_u32):
        import cupy as cp
        import numpy as np
        self.layout = layout
        self._fill_u32 = fill_u32           # (ptr, value, n_words) on the control stream: the push_fill kernel
        self.rt = cp.cuda.runtime
        self.stream = ctrl_stream
        self.nbytes = layout.nbytes
        self.ptr = self.rt.malloc(self.nbytes)
        self._pinned = cp.cuda.alloc_pinned_memory(64)
        self._host = np.frombuffer(self._pinned, dtype=np.uint32, count=16)
        self.clear()

    def clear(self) -> None:
        """Zero everything but the all-reduce buffers, which get the Lamport empty pattern (the flag protocol
        never reads payload it was not flagged)."""
        lay = self.layout
        self.rt.memsetAsync(self.ptr, 0, lay.control_bytes, self.stream.ptr)
        self._fill_u32(self.ptr + lay.off_recv, LAMPORT_EMPTY, (self.nbytes - lay.off_recv) // 4)
        self.stream.synchronize()

    def read_u32(self, off: int, count: int = 1) -> list[int]:
        assert 0 <= off and off + 4 * count <= self.nbytes and count <= 16
        self.rt.memcpyAsync(self._host.ctypes.data, self.ptr + off, 4 * count, self.rt.memcpyDeviceToHost,
                            self.stream.ptr)
        self.stream.synchronize()
        return [int(v) for v in self._host[:count]]

    def write_u32(self, off: int, values: list[int]) -> None:
        assert 0 <= off and off + 4 * len(values) <= self.nbytes and len(values) <= 16
        self._host[:len(values)] = values
        self.rt.memcpyAsync(self.ptr + off, self._host.ctypes.data, 4 * len(values), self.rt.memcpyHostToDevice,
                            self.stream.ptr)
        self.stream.synchronize()

    def fill(self, off: int, nbytes: int, byte: int) -> None:
        self.rt.memsetAsync(self.ptr + off, byte, nbytes, self.stream.ptr)
        self.stream.synchronize()

    def free(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            self.rt.free(ptr)
