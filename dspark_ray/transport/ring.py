"""The shared-memory step ring: one writer, N readers, on one host (vLLM's `shm_broadcast` pattern; why not Ray
RPC per step: docs/engine.md, "Measurements behind the step path"). Processes not related by fork find everything by
name (segment, doorbell FIFOs) through a picklable `RingHandle`. The segment, in 64-byte lines of uint64 words:

    control   magic, layout version, n_readers, n_slots, slot_bytes, completion_bytes, closed, write_seq
    writer    sleeping flag, pid, locked (1: the writer holds the ring's locks, below)
    reader i  ack (last consumed seq), sleeping flag, start seq, generation, pid          (one line each)
    slot k    seq, payload length, spill-name length, spill name (128-byte header) + slot_bytes of payload
    record i  seq, status, payload length (64-byte header) + completion_bytes of payload   (one per reader)

Seq numbers start at 1 (0: nothing); seq lives in slot (seq - 1) % n_slots, reused once every reader acked it. A
message larger than a slot spills to a segment of its own, named in the slot header, unlinked once acked.
Ordering: data first, its seq word last (one aligned 8-byte store); readers load the seq word first. That holds under
x86-64 TSO only: aarch64 needs a release store / acquire load (stlr / ldar) through a C helper, so `create` and
`attach` refuse other CPUs. The one reordering TSO allows (a sleeping flag against the condition) gets a full fence
on both sides. A waiter spins `spin_us`, then sleeps on its doorbell in naps of `nap_s` (the bound on a lost wake-up).
A reader acks a message by taking the next or completing it; its view is valid until then. `reset_reader(i)` moves
index i to the writer's seq and bumps its generation: a restarted reader attaches there, an old one gets RingClosed.
Each endpoint is used by one thread at a time.
The writer holds an flock on the segment's file and on a lock file among its doorbells from `create` to `unlink` (or
its death): `remove_orphans` takes a ring for an orphan only when it can take those locks, which a live owner in any
PID namespace holds (a pid in a name means nothing to a process in another namespace).
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import mmap
import os
import platform
import re
import secrets
import select
import shutil
import tempfile
import threading
import time
from multiprocessing import shared_memory
from typing import Callable

import _posixshmem  # CPython's shm_open; attaching through it bypasses the resource_tracker (see _map_existing)

__all__ = ["StepRing", "RingHandle", "RingWriter", "RingReader", "RingError", "RingTimeout", "RingClosed",
           "remove_orphans"]


class RingError(RuntimeError):
    """The ring was used against its rules (sizes, indices, a reader attached twice, an overwritten record)."""


class RingTimeout(RingError, TimeoutError):
    """A bounded wait gave up. The message says who waited for what, and the state of the party it waited on."""


class RingClosed(RingError):
    """The writer closed the ring, or reset this reader's index (a restarted reader took its place)."""


_MAGIC = 0x3147_4E49_5250_5344    # b"DSPRING1" little-endian
_VERSION = 1
_LINE = 64                        # bytes; one cache line, so each party's hot words sit on a line of their own
_WORDS_PER_LINE = _LINE // 8

# Word indices: _C_ control line, _W_ writer line, _R_ in a reader's line, _S_ slot header, _K_ completion record.
_C_MAGIC, _C_VERSION, _C_NREADERS, _C_NSLOTS, _C_SLOT_BYTES, _C_COMP_BYTES, _C_CLOSED, _C_WRITE_SEQ = range(8)
_W_SLEEPING = _WORDS_PER_LINE + 0
_W_PID = _WORDS_PER_LINE + 1
_W_LOCKED = _WORDS_PER_LINE + 2
_R_ACK, _R_SLEEPING, _R_START, _R_GEN, _R_PID = range(5)
_S_SEQ, _S_LEN, _S_SPILL = 0, 1, 2
_SLOT_HDR = 128
_SPILL_NAME_AT = 24
_SPILL_NAME_MAX = _SLOT_HDR - _SPILL_NAME_AT
_K_SEQ, _K_STATUS, _K_LEN = 0, 1, 2
_COMP_HDR = 64

_BELL_LOCK = "lock"               # the file among a ring's doorbells that its writer holds an flock on
_YOUNG_S = 60.0                   # a ring without locks this young may be one whose creator has not locked it yet
_NAME_PREFIX_MAX = 40             # keeps "<prefix>-<pid>-<hex>-x<seq>" inside the 104-byte spill-name field

# A locked instruction is a full barrier on x86, and CPython's Lock acquire/release runs one: pure Python's only fence.
_FENCE_LOCK = threading.Lock()


def _full_fence() -> None:
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()


def _words(buf) -> memoryview:
    """The uint64 word view (each item one aligned 8-byte load or store; half numpy's cost, docs/engine.md)."""
    return memoryview(buf).cast("B").cast("Q")


def _as_bytes(payload) -> tuple[bytes | memoryview, int]:
    if type(payload) is bytes:
        return payload, len(payload)
    mv = memoryview(payload)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv, mv.nbytes


def _require_x86_64() -> None:
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        raise RingError(f"StepRing: CPU {machine!r} is not x86-64; the ring's ordering relies on x86 TSO "
                        f"(see the module docstring for what aarch64 needs)")


def _round_up(n: int, to: int = _LINE) -> int:
    return (n + to - 1) // to * to


def _map_existing(name: str) -> mmap.mmap:
    """Map a segment untracked: `SharedMemory(name=...)`'s resource_tracker would unlink it at exit, and unregistering
    would cancel the creator's own registration where trackers are shared (spawn)."""
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _pid_state(pid: int) -> str:
    if pid == 0:
        return "not attached"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"pid {pid} is not running"
    except PermissionError:
        pass
    return f"pid {pid} alive"


_SHM_DIR = "/dev/shm"
# `StepRing.create`'s names: "<prefix>-<creator pid>-<8 hex>", its spills "-x<seq>", its doorbells ".bells".
_RING_NAME = re.compile(r"(?P<ring>.+-(?P<pid>\d+)-[0-9a-f]{8})(?:-x\d+|\.bells)?")


def ring_owner_pid(name: str) -> int | None:
    """The creator's pid in a name of a ring's (its segment, a spill, its doorbells), or None for another name."""
    m = _RING_NAME.fullmatch(name)
    return int(m["pid"]) if m is not None else None


def process_started_at(pid: int) -> float | None:
    """When process `pid` started (epoch seconds), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])      # field 22, starttime: clock ticks since boot
        with open("/proc/stat") as f:
            boot = next(int(ln.split()[1]) for ln in f if ln.startswith("btime "))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _running(pid: int) -> bool:
    """Whether `pid` names a process here that is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _stranded(pid: int | None, gone_gcs: str | None) -> bool:
    """Whether `pid` is a Ray worker of this host whose raylet (RAY_RAYLET_PID in its environment) no longer runs,
    or serves the cluster whose GCS, `gone_gcs`, is gone (its `--gcs-address`)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except (OSError, TypeError):
        return False
    raylet = next((e.split(b"=", 1)[1] for e in env if e.startswith(b"RAY_RAYLET_PID=")), b"")
    if not raylet.isdigit() or not _running(pid):
        return False
    try:
        with open(f"/proc/{int(raylet)}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except OSError:
        return True
    return not _running(int(raylet)) or (gone_gcs is not None and f"--gcs-address={gone_gcs}".encode() in args)


def owner_alive(pid: int, made_at: float) -> bool:
    """Whether the process that made a name at `made_at` still runs (not a younger one on its pid); in doubt, yes."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    started = process_started_at(pid)
    return started is None or started <= made_at + 1.0     # (start times have clock-tick resolution)


def remove_orphans(prefix: str = "dspark-") -> list[str]:
    """Remove (and return) this host's rings whose owner is gone (docs/operations.md, "Leftovers")."""
    return _remove_where(_rings_here(lambda n, m: n.startswith(prefix)),
                         lambda ring, paths: not _owner_may_run(ring, paths))


def _remove_where(rings: dict[str, list[str]], take) -> list[str]:
    """Remove (and return) the rings of `rings` (ring -> the paths of its names) that `take(ring, paths)` takes."""
    gone = sorted(ring for ring, paths in rings.items() if take(ring, paths))
    for ring in gone:
        _remove_names(rings[ring])
    return gone


def _rings_here(keep) -> dict[str, list[str]]:
    """This host's rings whose names `keep(name, match)` keeps: ring -> the paths of its names (segment, spills,
    doorbells)."""
    rings: dict[str, list[str]] = {}
    for where in (_SHM_DIR, tempfile.gettempdir()):
        for n in _listdir(where):
            m = _RING_NAME.fullmatch(n)
            if m is not None and keep(n, m):
                rings.setdefault(m["ring"], []).append(os.path.join(where, n))
    return rings


def _remove_names(paths: list[str]) -> None:
    for path in paths:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _owner_may_run(ring: str, paths: list[str]) -> bool:
    """Whether the writer of `ring` (its names `paths`) may still run: while it runs it holds its locks. A ring
    without them (made before rings took locks, or caught between its creation and its lock) is judged by its pid,
    and left alone while young; in doubt, yes."""
    seg = os.path.join(_SHM_DIR, ring)
    bells = [p for p in paths if p.endswith(".bells")]
    locks = [_lock_state(seg, mark_at=_W_LOCKED * 8)] + [_lock_state(os.path.join(b, _BELL_LOCK)) for b in bells]
    if "held" in locks:
        return True
    if "free" in locks:                     # its writer took the lock and let go of it: it unlinked, or died
        return False
    made_at = min((_mtime(p) for p in paths), default=None)
    if made_at is None:                     # its names went meanwhile
        return False
    return time.time() - made_at < _YOUNG_S or owner_alive(ring_owner_pid(ring), made_at)


def _lock_state(path: str, mark_at: int | None = None) -> str | None:
    """"held" or "free": the flock on `path`, which its writer took; None: no such file, or (`mark_at`: the offset
    of the writer's "locked" word) one its writer never locked."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        if mark_at is not None and os.pread(fd, 8, mark_at) != (1).to_bytes(8, "little"):
            return None
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return "free"
    except BlockingIOError:
        return "held"
    finally:
        os.close(fd)                        # (and with it the lock, if this took it)


def _mtime(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def _take_lock(path: str, flags: int = os.O_RDONLY) -> int:
    """An fd of `path` holding its flock: held until closed, or until this process dies."""
    fd = os.open(path, flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


@dataclasses.dataclass(frozen=True)
class RingHandle:
    name: str                     # shared-memory segment name; spill segments are named "<name>-x<seq>"
    n_readers: int
    n_slots: int
    slot_bytes: int
    completion_bytes: int
    bell_dir: str                 # directory of the doorbell FIFOs: "r<i>" per reader, "w" for the writer
    spin_us: float
    nap_s: float
    max_message_bytes: int

    def reader_bell(self, i: int) -> str:
        return os.path.join(self.bell_dir, f"r{i}")

    @property
    def writer_bell(self) -> str:
        return os.path.join(self.bell_dir, "w")


class _Layout:
    def __init__(self, h: RingHandle):
        self.slot_stride = _SLOT_HDR + _round_up(h.slot_bytes)
        self.comp_stride = _COMP_HDR + _round_up(h.completion_bytes)
        self.readers_at = 2 * _LINE
        self.slots_at = self.readers_at + h.n_readers * _LINE
        self.comps_at = self.slots_at + h.n_slots * self.slot_stride
        self.total = self.comps_at + h.n_readers * self.comp_stride

    def reader_word(self, i: int, k: int) -> int:
        return (self.readers_at + i * _LINE) // 8 + k

    def comp_at(self, i: int) -> int:
        return self.comps_at + i * self.comp_stride


class _Bell:
    """A doorbell: a named FIFO. The waiter keeps it open O_RDWR (so it never sees EOF and never blocks on open);
    a ringer opens it O_WRONLY|O_NONBLOCK lazily and writes one byte; a full pipe already means "wake up"."""

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None

    def open_for_wait(self) -> None:
        self._fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK)

    def sleep(self, timeout_s: float) -> None:
        r, _, _ = select.select([self._fd], [], [], timeout_s)
        if r:
            try:
                os.read(self._fd, 4096)
            except BlockingIOError:
                pass

    def ring(self) -> None:
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:              # ENXIO: no waiter has it open (not attached yet, or gone)
                if e.errno in (errno.ENXIO, errno.ENOENT):
                    return
                raise
        try:
            os.write(self._fd, b"\x01")
        except BlockingIOError:               # pipe full: wake-ups are pending anyway
            pass
        except BrokenPipeError:               # the waiter died; reopen on the next ring (a restarted one)
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _End:
    _w: memoryview
    _buf: memoryview

    def __init__(self, handle: RingHandle, label: str):
        self._h = handle
        self._lay = _Layout(handle)
        self._label = f"StepRing {handle.name!r} {label}"
        self._spin_s = handle.spin_us * 1e-6
        self._nap_s = handle.nap_s
        self.sleeps = 0           # waits that outlasted their spin and slept (each then cost a wake-up)

    @property
    def handle(self) -> RingHandle:
        return self._h

    def _check(self) -> None:
        if self._w[_C_CLOSED]:
            raise RingClosed(f"{self._label}: the ring was closed by the writer")

    def _wait(self, ready: Callable[[], bool], what: Callable[[], str], timeout_s: float,
              bell: _Bell, sleeping_word: int, spin_us: float | None = None,
              idle: Callable[[Callable[[], bool]], None] | None = None) -> None:
        """Return once `ready()` holds, else RingTimeout; `idle(ready)` runs between the spin's checks."""
        if ready():
            return
        w = self._w
        now = time.monotonic()
        deadline = now + timeout_s
        spin_until = now + (self._spin_s if spin_us is None else spin_us * 1e-6)
        slept = False
        while True:
            self._check()
            if now < spin_until:
                os.sched_yield()
                if idle is not None:
                    idle(ready)
            else:
                if not slept:
                    slept = True
                    self.sleeps += 1
                w[sleeping_word] = 1
                _full_fence()                 # the flag store must be visible before the re-check's loads
                try:
                    if not ready() and not w[_C_CLOSED]:
                        bell.sleep(max(0.0, min(self._nap_s, deadline - now)))
                finally:
                    w[sleeping_word] = 0
            if ready():
                return
            now = time.monotonic()
            if now >= deadline:
                self._check()
                raise RingTimeout(f"{self._label}: waited {timeout_s:g} s for {what()}")

    def _reader_line(self, i: int) -> str:
        lay, w = self._lay, self._w
        return (f"reader {i} (ack {w[lay.reader_word(i, _R_ACK)]}, "
                f"{_pid_state(w[lay.reader_word(i, _R_PID)])})")


class RingWriter(_End):
    """The front-end's end: `publish` steps, `wait_completions` for them, `reset_reader` after a restart."""

    def __init__(self, handle: RingHandle, shm: shared_memory.SharedMemory, locks: list[int]):
        super().__init__(handle, "writer")
        lay, n_r = self._lay, handle.n_readers
        self._shm = shm
        self._locks = locks                     # fds holding the ring's flocks until unlink (module docstring)
        self._buf = shm.buf
        self._w = _words(shm.buf[:lay.total])
        self._bell = _Bell(handle.writer_bell)
        self._bell.open_for_wait()
        self._reader_bells = [_Bell(handle.reader_bell(i)) for i in range(n_r)]
        self._spills: dict[int, shared_memory.SharedMemory] = {}
        self._seq = 0
        self._closed = False
        self._ack_words = [lay.reader_word(i, _R_ACK) for i in range(n_r)]
        self._sleep_words = [lay.reader_word(i, _R_SLEEPING) for i in range(n_r)]
        self._sleepers = list(zip(self._sleep_words, self._reader_bells))
        slots = [lay.slots_at + k * lay.slot_stride for k in range(handle.n_slots)]
        self._slot_words = [at // 8 for at in slots]
        self._slot_areas = [self._buf[at + _SLOT_HDR: at + _SLOT_HDR + handle.slot_bytes] for at in slots]
        self._spill_names = [self._buf[at + _SPILL_NAME_AT: at + _SLOT_HDR] for at in slots]
        comps = [lay.comp_at(i) for i in range(n_r)]
        self._comp_words = [at // 8 for at in comps]
        self._comp_areas = [self._buf[at + _COMP_HDR: at + _COMP_HDR + handle.completion_bytes] for at in comps]

    def _check(self) -> None:
        if self._closed:
            raise RingClosed(f"{self._label}: the writer was closed")
        super()._check()

    def dead_readers(self) -> list[int]:
        """Readers whose attached process is gone (a dead rank never completes: no need to wait out a bound)."""
        lay, w = self._lay, self._w
        return [i for i in range(self.handle.n_readers)
                if _pid_state(w[lay.reader_word(i, _R_PID)]).endswith("not running")]

    def _min_ack(self) -> int:
        w = self._w
        return min(w[k] for k in self._ack_words)

    def _free_spills(self, upto: int) -> None:
        for seq in [s for s in self._spills if s <= upto]:
            seg = self._spills.pop(seq)
            seg.close()
            seg.unlink()

    @property
    def last_seq(self) -> int:
        return self._seq

    def publish(self, payload: bytes | bytearray | memoryview, timeout_s: float = 2.0) -> int:
        """Copy `payload` (C-contiguous) into the next slot; return its seq. Waits (bounded) for the slot's acks."""
        if self._closed or self._w[_C_CLOSED]:
            self._check()
        h, w = self._h, self._w
        mv, n = _as_bytes(payload)
        seq = self._seq + 1
        need = seq - h.n_slots                  # the slot's previous message; every reader must have acked it
        if need > 0:
            for k in self._ack_words:
                if w[k] < need:
                    self._wait(lambda: self._min_ack() >= need, lambda: self._space_report(seq, need),
                               timeout_s, self._bell, _W_SLEEPING)
                    break
        if self._spills:
            self._free_spills(self._min_ack())
        slot = (seq - 1) % h.n_slots
        hw = self._slot_words[slot]
        if n <= h.slot_bytes:
            self._slot_areas[slot][:n] = mv
            w[hw + _S_SPILL] = 0
        else:
            if n > h.max_message_bytes:
                raise RingError(f"{self._label}: message of {n} bytes > max_message_bytes {h.max_message_bytes}")
            # The writer creates the spill, so its resource_tracker unlinks it should the writer die.
            sname = f"{h.name}-x{seq}"
            seg = shared_memory.SharedMemory(name=sname, create=True, size=n)
            seg.buf[:n] = mv
            self._spills[seq] = seg
            raw = sname.encode()
            self._spill_names[slot][:len(raw)] = raw
            w[hw + _S_SPILL] = len(raw)
        w[hw + _S_LEN] = n
        w[hw + _S_SEQ] = seq                    # LAST: a reader that sees seq sees the whole message (x86 TSO)
        w[_C_WRITE_SEQ] = seq
        self._seq = seq
        _full_fence()                           # seq stores before the sleeping-flag loads (store->load order)
        for k, bell in self._sleepers:
            if w[k]:
                bell.ring()
        return seq

    def _space_report(self, seq: int, need: int) -> str:
        late = [self._reader_line(i) for i, k in enumerate(self._ack_words) if self._w[k] < need]
        return f"space: publishing seq {seq} needs every reader's ack >= {need}; " + ", ".join(late)

    def wait_completions(self, seq: int, timeout_s: float = 2.0, spin_us: float | None = None,
                         idle: Callable[[Callable[[], bool]], None] | None = None) -> list[tuple[int, bytes]]:
        """[(status, payload)] of every reader's completion of `seq`, in reader order. Each reader has one record:
        collect them before a later seq overwrites it (RingError then)."""
        if self._closed or self._w[_C_CLOSED]:
            self._check()
        w, words = self._w, self._comp_words
        for k in words:
            if w[k] != seq:
                self._wait(lambda: self._completed(seq), lambda: self._completion_report(seq), timeout_s,
                           self._bell, _W_SLEEPING, spin_us, idle)
                break
        out = []
        for i, k in enumerate(words):
            n = w[k + _K_LEN]
            out.append((w[k + _K_STATUS], bytes(self._comp_areas[i][:n])))
            if w[k] != seq:                     # seqlock-style re-check: the record changed while we copied
                raise RingError(f"{self._label}: reader {i} overwrote its completion of seq {seq} while it was read")
        if self._spills:                        # a completion implies the ack: free spills now, not next publish
            self._free_spills(self._min_ack())
        return out

    def completed_so_far(self, seq: int) -> dict[int, int]:
        """{reader: status} of the readers that completed `seq` so far (a failure seen before the others end)."""
        w = self._w
        return {i: w[k + _K_STATUS] for i, k in enumerate(self._comp_words) if w[k] == seq}

    def _completed(self, seq: int) -> bool:
        w = self._w
        done = True
        for i, k in enumerate(self._comp_words):
            got = w[k]
            if got != seq:
                if got > seq:
                    raise RingError(f"{self._label}: reader {i}'s completion record already holds seq {got} > "
                                    f"{seq}: seq {seq}'s completion was overwritten before it was collected")
                done = False
        return done

    def _completion_report(self, seq: int) -> str:
        late = [f"{self._reader_line(i)} last completed seq {self._w[k]}"
                for i, k in enumerate(self._comp_words) if self._w[k] != seq]
        return f"completions of seq {seq}: " + ", ".join(late)

    def reset_reader(self, i: int) -> None:
        """Once reader `i` is gone: a restarted one attaches from the next seq, an old one gets RingClosed."""
        self._check()
        if not 0 <= i < self._h.n_readers:
            raise RingError(f"{self._label}: reader index {i} not in [0, {self._h.n_readers})")
        w, lay = self._w, self._lay
        w[lay.reader_word(i, _R_GEN)] += 1
        w[lay.reader_word(i, _R_PID)] = 0
        w[lay.reader_word(i, _R_SLEEPING)] = 0   # the old reader may have died asleep
        w[self._comp_words[i] + _K_SEQ] = 0
        w[lay.reader_word(i, _R_START)] = self._seq
        w[lay.reader_word(i, _R_ACK)] = self._seq
        if self._spills:
            self._free_spills(self._min_ack())

    def close(self) -> None:
        """Close the ring (every party wakes with RingClosed) and unmap; the names stay until `unlink()`."""
        if self._closed:
            return
        self._closed = True
        w = self._w
        w[_C_CLOSED] = 1
        _full_fence()
        for b in self._reader_bells:            # ring unconditionally: a waiter between flag and select still wakes
            b.ring()
            b.close()
        self._bell.close()
        self._free_spills(1 << 63)
        for v in self._slot_areas + self._spill_names + self._comp_areas + [w]:
            v.release()
        del self._w
        self._buf = None                        # type: ignore[assignment]
        self._shm.close()

    def unlink(self) -> None:
        """Remove the segment and doorbell names (closes first; readers' existing mappings stay valid)."""
        if not self._closed:
            self.close()
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass
        shutil.rmtree(self._h.bell_dir, ignore_errors=True)
        for fd in self._locks:                  # last: the names are gone, nothing is left to take for an orphan
            os.close(fd)
        self._locks = []

    def __enter__(self) -> "RingWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.unlink()


class RingReader(_End):
    """A rank's end: `next` message, `complete` it with a status and (rank 0) the outputs."""

    def __init__(self, handle: RingHandle, reader_index: int):
        if not 0 <= reader_index < handle.n_readers:
            raise RingError(f"StepRing {handle.name!r}: reader index {reader_index} not in [0, {handle.n_readers})")
        super().__init__(handle, f"reader {reader_index}")
        self._closed = False
        self._i = reader_index
        lay = self._lay
        self._mm = _map_existing(handle.name)
        if len(self._mm) < lay.total:
            raise RingError(f"{self._label}: segment is {len(self._mm)} bytes < {lay.total} the handle implies")
        self._buf = memoryview(self._mm)
        self._w = w = _words(self._buf[:lay.total])
        want = (_MAGIC, _VERSION, handle.n_readers, handle.n_slots, handle.slot_bytes, handle.completion_bytes)
        got = tuple(w[k] for k in (_C_MAGIC, _C_VERSION, _C_NREADERS, _C_NSLOTS, _C_SLOT_BYTES, _C_COMP_BYTES))
        if got != want:
            raise RingError(f"{self._label}: segment header (magic, version, n_readers, n_slots, slot_bytes, "
                            f"completion_bytes) = {got} != handle {want}")
        self._ack_word = lay.reader_word(reader_index, _R_ACK)
        self._sleep_word = lay.reader_word(reader_index, _R_SLEEPING)
        self._gen_word = lay.reader_word(reader_index, _R_GEN)
        self._pid_word = lay.reader_word(reader_index, _R_PID)
        pid = w[self._pid_word]
        if pid and not _pid_state(pid).endswith("not running"):
            raise RingError(f"{self._label}: index already attached by live pid {pid}")
        start = w[lay.reader_word(reader_index, _R_START)]
        if w[self._ack_word] != start:
            raise RingError(f"{self._label}: index was used before (ack {w[self._ack_word]} != start {start}); "
                            f"the writer must call reset_reader({reader_index}) before a restarted reader attaches")
        slots = [lay.slots_at + k * lay.slot_stride for k in range(handle.n_slots)]
        self._slot_words = [at // 8 for at in slots]
        self._slot_areas = [self._buf[at + _SLOT_HDR: at + _SLOT_HDR + handle.slot_bytes].toreadonly()
                            for at in slots]
        at = lay.comp_at(reader_index)
        self._comp_word = at // 8
        self._comp_area = self._buf[at + _COMP_HDR: at + _COMP_HDR + handle.completion_bytes]
        self._gen = w[self._gen_word]
        self._start = start
        self._cursor = start                  # last seq handed out
        self._acked = start
        self._held = None                     # spill mapping of the current message (dropped at ack)
        self._bell = _Bell(handle.reader_bell(reader_index))
        self._bell.open_for_wait()
        self._writer_bell = _Bell(handle.writer_bell)
        w[self._pid_word] = os.getpid()

    @property
    def index(self) -> int:
        return self._i

    def _check(self) -> None:
        if self._closed:
            raise RingClosed(f"{self._label}: this reader was closed")
        super()._check()
        if self._w[self._gen_word] != self._gen:
            raise RingClosed(f"{self._label}: this index was reset by the writer (a restarted reader replaced it)")

    def _ack(self, ring: bool = True) -> None:
        """Publish that the current message's slot (and spill) may be reused. Its view must no longer be used."""
        self._held = None
        self._acked = self._cursor
        w = self._w
        w[self._ack_word] = self._cursor
        if ring:
            _full_fence()
            if w[_W_SLEEPING]:
                self._writer_bell.ring()

    def next(self, timeout_s: float, spin_us: float | None = None,
             idle: Callable[[Callable[[], bool]], None] | None = None) -> tuple[int, memoryview]:
        """(seq, a read-only view of the payload) of the next message. The view is valid until the next `next()`
        or `complete()`, which ack it. RingTimeout, or RingClosed on close or reset."""
        w = self._w if not self._closed else None
        if w is None or w[_C_CLOSED] or w[self._gen_word] != self._gen:
            self._check()
        if self._acked != self._cursor:
            self._ack()
        want = self._cursor + 1
        slot = (want - 1) % self._h.n_slots
        hw = self._slot_words[slot]
        got = w[hw + _S_SEQ]
        if got != want:
            if got > want:                    # cannot happen while the writer honours our ack
                raise RingError(f"{self._label}: slot holds seq {got} while seq {want} was expected")
            self._wait(lambda: w[hw + _S_SEQ] == want,
                       lambda: f"message seq {want} (writer published up to {w[_C_WRITE_SEQ]})",
                       timeout_s, self._bell, self._sleep_word, spin_us, idle)
        n = w[hw + _S_LEN]
        spill = w[hw + _S_SPILL]
        if spill:
            at = hw * 8
            sname = bytes(self._buf[at + _SPILL_NAME_AT: at + _SPILL_NAME_AT + spill]).decode()
            mm = _map_existing(sname)
            self._held = mm
            view = memoryview(mm)[:n].toreadonly()
        else:
            view = self._slot_areas[slot][:n]
        self._cursor = want
        return want, view

    def complete(self, seq: int, status: int = 0, payload: bytes | bytearray | memoryview = b"") -> None:
        """Post this reader's completion of `seq` (acks it too): a uint32 `status` (0 ok), up to `completion_bytes`."""
        w = self._w if not self._closed else None
        if w is None or w[_C_CLOSED] or w[self._gen_word] != self._gen:
            self._check()
        if not 0 <= status < 1 << 32:
            raise RingError(f"{self._label}: status {status} is not a uint32")
        if seq != self._cursor or seq == self._start:
            raise RingError(f"{self._label}: complete(seq {seq}) but the message in hand is seq {self._cursor}"
                            + (" (none yet)" if self._cursor == self._start else ""))
        mv, n = _as_bytes(payload)
        if n > self._h.completion_bytes:
            raise RingError(f"{self._label}: completion payload of {n} bytes > completion_bytes "
                            f"{self._h.completion_bytes}")
        if self._acked != self._cursor:
            self._ack(ring=False)             # the fence and the ring below cover the ack too
        hw = self._comp_word
        self._comp_area[:n] = mv
        w[hw + _K_STATUS] = status
        w[hw + _K_LEN] = n
        w[hw + _K_SEQ] = seq                  # LAST (x86 TSO: the writer sees status and payload with it)
        _full_fence()
        if w[_W_SLEEPING]:
            self._writer_bell.ring()

    def close(self) -> None:
        """Detach (the ring stays; the writer owns it). Idempotent. Views handed out keep their mapping alive."""
        if self._closed:
            return
        self._closed = True
        w = self._w
        try:
            if w[self._gen_word] == self._gen:
                w[self._pid_word] = 0
        finally:
            self._bell.close()
            self._writer_bell.close()
            self._held = None
            for v in self._slot_areas + [self._comp_area, w, self._buf]:
                v.release()
            del self._w
            try:
                self._mm.close()
            except BufferError:               # a caller still holds a payload view: unmapped when it goes
                pass

    def __enter__(self) -> "RingReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StepRing:
    @staticmethod
    def create(name_prefix: str, n_readers: int, slot_bytes: int = 1 << 20, n_slots: int = 4,
               completion_bytes: int = 64 << 10, spin_us: float = 50.0, nap_s: float = 0.02,
               max_message_bytes: int = 1 << 30) -> RingWriter:
        """A ring named "<name_prefix>-<pid>-<random>". `spin_us`: how long a waiter checks before it sleeps (short
        for a 2-core host); `nap_s`: the longest sleep between re-checks."""
        _require_x86_64()
        if not (1 <= n_readers and 1 <= n_slots and 1 <= slot_bytes and 0 <= completion_bytes):
            raise RingError(f"StepRing: need n_readers >= 1, n_slots >= 1, slot_bytes >= 1, completion_bytes >= 0; "
                            f"got {n_readers}, {n_slots}, {slot_bytes}, {completion_bytes}")
        if not name_prefix or len(name_prefix) > _NAME_PREFIX_MAX or "/" in name_prefix:
            raise RingError(f"StepRing: name_prefix {name_prefix!r} must be 1..{_NAME_PREFIX_MAX} chars without '/'")
        name = f"{name_prefix}-{os.getpid()}-{secrets.token_hex(4)}"
        bell_dir = os.path.join(tempfile.gettempdir(), f"{name}.bells")
        h = RingHandle(name, n_readers, n_slots, slot_bytes, completion_bytes, bell_dir, float(spin_us),
                       float(nap_s), max(int(max_message_bytes), slot_bytes))
        # The segment first, locked, then the doorbells: whoever sees any name of the ring sees a held lock.
        shm = shared_memory.SharedMemory(name=name, create=True, size=_Layout(h).total)
        locks: list[int] = []
        try:
            locks.append(_take_lock(os.path.join(_SHM_DIR, name)))
            w = _words(shm.buf)
            w[_W_LOCKED] = 1
            w.release()
            os.mkdir(bell_dir, 0o700)
            locks.append(_take_lock(os.path.join(bell_dir, _BELL_LOCK), os.O_RDWR | os.O_CREAT | os.O_EXCL))
            for i in range(n_readers):
                os.mkfifo(h.reader_bell(i), 0o600)
            os.mkfifo(h.writer_bell, 0o600)
        except BaseException:
            shutil.rmtree(bell_dir, ignore_errors=True)
            shm.close()
            shm.unlink()
            for fd in locks:
                os.close(fd)
            raise
        w = _words(shm.buf)
        w[_C_VERSION] = _VERSION
        w[_C_NREADERS] = n_readers
        w[_C_NSLOTS] = n_slots
        w[_C_SLOT_BYTES] = slot_bytes
        w[_C_COMP_BYTES] = completion_bytes
        w[_W_PID] = os.getpid()
        w[_C_MAGIC] = _MAGIC                  # last: a reader that sees the magic sees the sizes
        w.release()
        return RingWriter(h, shm, locks)

    @staticmethod
    def attach(handle: RingHandle, reader_index: int) -> RingReader:
        """Attach as reader `reader_index`, from its start seq (0, or the writer's seq at `reset_reader`)."""
        _require_x86_64()
        return RingReader(handle, reader_index)


def remove_rings(prefix: re.Pattern, gone_gcs: str | None = None) -> tuple[list[str], list[str]]:
    """This host's rings whose `StepRing.create` prefix fullmatches `prefix`: (those removed, their owner gone or
    stranded; those left, their owner may still serve). Another cluster's deployment of the same name on this host
    keeps its rings: a ring is taken only when its locks are free, or its owner is a Ray worker whose raylet is gone
    or serves the cluster of `gone_gcs` (it waits out Ray's minute for its GCS, then aborts, removing nothing)."""
    found = _rings_here(lambda n, m: prefix.fullmatch(m["ring"][:m.start("pid") - 1]))
    gone = _remove_where(found, lambda ring, paths: not _owner_may_run(ring, paths)
                         or _stranded(ring_owner_pid(ring), gone_gcs))
    return gone, sorted(set(found) - set(gone))
