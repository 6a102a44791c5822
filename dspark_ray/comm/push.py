"""`PushCollectives`: the NVLink one-shot push backend of `Collectives` (one rank per process, CUDA IPC peer state).

Start-up: build (compiles, preloads), swap `export_handle()`s, `connect` (nonce handshake), capture inside
`graph_capture()`. Each step: `replay`, then `check()`; an error word fails the step closed until `reset` on both
ranks, and a poisoned rank refuses everything until its process restarts. Protocol: `push.cu`; docs/collectives.md.
"""
from __future__ import annotations

import contextlib
import secrets
import time
from typing import Callable, Sequence

import numpy as np

from ..model.collectives import CaptureInfo, CollectiveError, Collectives, MaxPart, Top2Part
from .ipc import PeerHandle, HANDLE_VERSION, check_peer_handle, close_ipc_handle, export_ipc_handle, \
    open_ipc_handle, this_host, this_pid
from .peer_state import MAXB, HostGuard, Layout, PeerState, describe_error_word, process_poison

# A live pair meets in microseconds: a wait past 2 s has a dead, hung or diverged peer, and a failed STEP must
# answer INTERNAL long before a client gives up. DSPARK_PUSH_TIMEOUT_MS overrides it.
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_MAX_WORDS = 128 * 5120       # 128 rows of the hidden size 5120, fp32
U32_MAX = 0xFFFFFFFF


def max_rows(hidden_size: int) -> int:
    """Most rows one push collective of the default layout carries, before one is built."""
    return Layout(DEFAULT_MAX_WORDS).max_rows(hidden_size)


def push_unavailable_reason(device: int | None = None) -> str | None:
    """None when the push backend can run on this device, else why not (for the start-up log)."""
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is a hard dependency
        return f"torch is not importable ({e})"
    if not torch.cuda.is_available():
        return "CUDA is not available (torch.cuda.is_available() is False)"
    try:
        import cupy  # noqa: F401
    except Exception as e:
        return f"cupy is not importable ({type(e).__name__}: {e}); install cupy-cuda13x"
    idx = torch.cuda.current_device() if device is None else device
    if idx >= torch.cuda.device_count():
        return f"device {idx} does not exist ({torch.cuda.device_count()} visible)"
    cc = torch.cuda.get_device_capability(idx)
    if cc < (7, 0):
        return f"compute capability {cc[0]}.{cc[1]} < 7.0 (system-scope acquire / release needs sm_70)"
    return None


# NaN + NaN calibration: case t = 2 * (P0 signaling) + (P1 signaling); quiet(P0), quiet(P1), canonical all differ.
_NAN_Q0, _NAN_S0, _NAN_Q1, _NAN_S1 = 0x7FC00011, 0x7F800011, 0xFFC00022, 0xFF800022
NAN_CALIBRATION_P0 = (_NAN_Q0, _NAN_Q0, _NAN_S0, _NAN_S0)
NAN_CALIBRATION_P1 = (_NAN_Q1, _NAN_S1, _NAN_Q1, _NAN_S1)
CANONICAL_NAN = 0x7FFFFFFF


def nan_rule_from_results(results: Sequence[int]) -> int:
    """The kernel's 8-bit NaN + NaN rule from what torch's add returned for the four calibration pairs: per case
    two bits, 1 quiet(P0), 2 quiet(P1), 3 canonical NaN, 0 none of these (the kernel then keeps its FFMA)."""
    rule = 0
    for t, (a, b, r) in enumerate(zip(NAN_CALIBRATION_P0, NAN_CALIBRATION_P1, results)):
        r &= 0xFFFFFFFF
        code = 1 if r == a | 0x00400000 else 2 if r == b | 0x00400000 else 3 if r == CANONICAL_NAN else 0
        rule |= code << (2 * t)
    return rule


def torch_nan_rule(device) -> int:
    """Which NaN torch's `P0 + P1` returns on this device when both are NaN (the oracle's bits, exactly)."""
    import torch
    p0 = torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in NAN_CALIBRATION_P0], dtype=torch.int32)
    p1 = torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in NAN_CALIBRATION_P1], dtype=torch.int32)
    r = (p0.view(torch.float32).to(device) + p1.view(torch.float32).to(device)).view(torch.int32).cpu()
    return nan_rule_from_results([int(v) for v in r])


def ar_launch_config(n_words: int, maxb: int = MAXB, variant: str = "flag") -> tuple[int, int]:
    """(blocks, threads) of an all-reduce of n_words fp32 (docs/collectives.md, "Launch shape")."""
    n4 = (n_words + 3) // 4
    if n4 <= 256:
        return 1, max(32, (n4 + 31) // 32 * 32)
    threads = 512 if n4 >= 8192 else 256
    if variant == "lamport" and n4 <= 16384:
        return min(maxb, 32, max(1, (n4 + 127) // 128)), 256
    return max(1, min(maxb, 32, (n4 + threads - 1) // threads)), threads


def exchange_threads(n_rows: int) -> int:
    return max(32, (n_rows + 31) // 32 * 32)


CONTROL_WORDS = 6       # u32 from Layout.OFF_EPOCH: epoch, done, last nblk (2), error word, first failing epoch
ERROR_WORD = (Layout.OFF_ERR - Layout.OFF_EPOCH) // 4


class PushCollectives(Collectives):
    """One rank of an NVLink pair meeting the other through push kernels over CUDA IPC peer memory."""

    name = "push"
    capturable = True

    def __init__(self, rank: int, *, max_words: int = DEFAULT_MAX_WORDS, timeout_s: float | None = None,
                 allreduce: str = "flag", exchange: str = "tagged",
                 peer_id_range: tuple[int, int] = (0, U32_MAX), check_each: bool = False,
                 strict_acks: bool = False, ack_release: bool = False, device: int | None = None):
        if rank not in (0, 1):
            raise CollectiveError(f"push: rank {rank}: a pair has ranks 0 and 1")
        if allreduce not in ("flag", "lamport"):
            raise CollectiveError(f"push: allreduce {allreduce!r}: one of 'flag' (default), 'lamport'")
        if exchange not in ("tagged", "flag"):
            raise CollectiveError(f"push: exchange {exchange!r}: one of 'tagged' (default), 'flag'")
        reason = push_unavailable_reason(device)
        if reason:
            raise CollectiveError(f"push: not usable here: {reason}")
        if process_poison():
            raise CollectiveError(f"push: refused: this process is poisoned ({process_poison()[0]}); restart it")
        import cupy as cp
        import torch
        from .source import compile_module

        self.rank = rank
        self.world_size = 2
        self.local_ranks = (rank,)
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None else device)
        self.layout = Layout(max_words)
        self.allreduce_variant = allreduce
        self.exchange_variant = exchange
        self._k_ar = "push_all_reduce" if allreduce == "flag" else "push_all_reduce_lamport"
        if timeout_s is None:
            from ..settings import current
            ms = current().push_timeout_ms
            timeout_s = DEFAULT_TIMEOUT_S if ms is None else ms / 1000
        self.set_timeout(timeout_s)
        self.set_peer_id_range(peer_id_range)
        self.check_each = check_each
        self.strict_acks = bool(strict_acks)
        self.ack_release = bool(ack_release)
        self.guard = HostGuard(f"push rank {rank}")
        self._cp = cp
        self._torch = torch
        self._cpdev = cp.cuda.Device(self.device.index)
        with self._cpdev:
            self.ctrl = cp.cuda.Stream(non_blocking=True)
            self.cancel_stream = cp.cuda.Stream(non_blocking=True)   # pre-created: cancel must not need a new stream
            self.k = compile_module(self.layout, {"PUSH_ACK_RELAXED": 0 if ack_release else 1})
            self.state = PeerState(self.layout, self.ctrl, self._fill_u32)
        self.nan_rule = torch_nan_rule(self.device)
        self.peer_ptr = 0
        self._opened_ptr = 0
        self._nonce = secrets.randbits(31) | 1
        self._ext: dict[int, object] = {}
        self._streams: dict[int, object] = {}    # streams that ran eager launches / replays: drained before reset
        self._eager_since_check = 0              # > 0: check_status falls back to the full check
        self._debug_skip_flag_block = -1
        self.preload()

    def set_timeout(self, timeout_s: float) -> None:
        """Bound of every device-side wait; a captured graph keeps the value it was captured with."""
        if not (0 < timeout_s <= 600):
            raise CollectiveError(f"push: timeout_s {timeout_s}: must be in (0, 600]")
        self.timeout_s = float(timeout_s)
        self.timeout_ns = int(timeout_s * 1e9)

    def set_peer_id_range(self, r: tuple[int, int]) -> None:
        """Ids the peer may send in an exchange: [lo, hi) of its vocabulary slice (anything else: ERR_BAD_ID)."""
        lo, hi = int(r[0]), int(r[1])
        if not (0 <= lo < hi <= U32_MAX):
            raise CollectiveError(f"push: peer_id_range {r}: need 0 <= lo < hi <= {U32_MAX} (ids travel as u32)")
        self.peer_id_range = (lo, hi)

    def preload(self) -> None:
        """Launch every kernel once, doing nothing: a lazy load at a first launch may synchronize the context, which
        deadlocks against a collective spinning on the same device."""
        z, i32 = np.uint64(0), np.int32
        try:
            with self._cpdev, self.ctrl:
                for name in ("push_all_reduce", "push_all_reduce_lamport"):
                    self.k[name]((1,), (32,), (z, z, i32(-1), i32(0), z, z, z, i32(-1), i32(0), np.float32(1),
                                               np.uint32(0)))
                self.k["push_exchange"]((1,), (32,), (z, z, z, z, z, z, i32(-1), i32(0), i32(0), i32(0), z, z, z,
                                                     np.int64(0), np.int64(0), i32(0)))
                self.k["push_cancel"]((1,), (1,), (z, z))
                self.k["push_hello"]((1,), (1,), (z, z, np.uint32(0)))
                self.k["push_fill"]((1,), (32,), (z, np.uint32(0), z))
            self.ctrl.synchronize()
        except Exception as e:
            self._poison(f"preload failed: {e}")

    def _fill_u32(self, ptr: int, value: int, n: int) -> None:
        with self._cpdev, self.ctrl:
            self.k["push_fill"]((min(1024, max(1, (n + 255) // 256)),), (256,),
                                (np.uint64(ptr), np.uint32(value), np.uint64(n)))

    def export_handle(self) -> PeerHandle:
        name = self._torch.cuda.get_device_name(self.device)
        try:
            uuid = str(self._torch.cuda.get_device_properties(self.device).uuid)
        except Exception:
            uuid = "?"
        with self._cpdev:
            h = export_ipc_handle(self.state.ptr)
        return PeerHandle(version=HANDLE_VERSION, rank=self.rank, ipc_handle=h, nbytes=self.state.nbytes,
                          layout_digest=self.layout.digest(), max_words=self.layout.max_words, nonce=self._nonce,
                          pid=this_pid(), host=this_host(), device=f"{name} {uuid}", protocol=self.protocol)

    @property
    def protocol(self) -> str:
        return (f"allreduce={self.allreduce_variant} exchange={self.exchange_variant} strict={int(self.strict_acks)}"
                f" ack_release={int(self.ack_release)} nan_rule={self.nan_rule:#04x}")

    def connect(self, peer: PeerHandle | dict, barrier: Callable[[], None]) -> None:
        """Map the peer's state and prove stores through it arrive: each rank writes the peer's nonce into the
        peer's hello word; after `barrier()` each reads its own."""
        if isinstance(peer, dict):
            peer = PeerHandle.from_dict(peer)
        if self.peer_ptr:
            raise CollectiveError(f"{self.guard.name}: already connected")
        check_peer_handle(self.export_handle(), peer)
        with self._cpdev:
            ptr = open_ipc_handle(peer.ipc_handle)
        self._opened_ptr = ptr
        self._hello(ptr, peer.nonce)
        barrier()
        self._check_hello(f"peer process {peer.pid} ({peer.device})")
        self.peer_ptr = ptr

    def connect_local(self, other: "PushCollectives") -> None:
        """Both ranks in this process (single-card mode: one card, two streams; or one process on two cards)."""
        if other.rank != 1 - self.rank or other.layout != self.layout or other.protocol != self.protocol:
            raise CollectiveError(f"push: connect_local: ranks {self.rank}/{other.rank}, layouts "
                                  f"{self.layout.digest()}/{other.layout.digest()}, protocols {self.protocol!r}/"
                                  f"{other.protocol!r}: need ranks 0 and 1, one layout, one protocol")
        self._hello(other.state.ptr, other._nonce)
        other._hello(self.state.ptr, self._nonce)
        self._check_hello("the local peer")
        other._check_hello("the local peer")
        self.peer_ptr, other.peer_ptr = other.state.ptr, self.state.ptr

    def _hello(self, peer_ptr: int, nonce: int) -> None:
        try:
            with self._cpdev, self.ctrl:
                self.k["push_hello"]((1,), (1,), (np.uint64(self.state.ptr), np.uint64(peer_ptr), np.uint32(nonce)))
            self.ctrl.synchronize()
        except Exception as e:
            self._poison(f"handshake store failed: {e}")

    def _check_hello(self, who: str) -> None:
        got = self.state.read_u32(Layout.OFF_HELLO)[0]
        if got != self._nonce:
            raise CollectiveError(f"{self.guard.name}: handshake failed: expected nonce {self._nonce:#x} from "
                                  f"{who} in my state, found {got:#x}: its stores do not reach this card")

    def all_reduce(self, parts: Sequence, *, nblocks: int | None = None, threads: int | None = None):
        torch = self._torch
        self.check_parts(parts)
        x = parts[0]
        self._check_tensor("all_reduce", "partial", x, torch.float32)
        n = x.numel()
        if n > self.layout.max_words:
            raise CollectiveError(f"push all_reduce: partial of {n} words > max_words {self.layout.max_words}")
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        if n == 0:
            return out
        x = x.contiguous()
        if x.data_ptr() % 16:
            x = x.clone()                    # float4 loads need 16-byte alignment; a fresh tensor has it
        dnb, dthr = ar_launch_config(n, self.layout.maxb, self.allreduce_variant)
        nb, thr = nblocks or dnb, threads or dthr
        if not (1 <= nb <= self.layout.maxb) or thr % 32 or not (32 <= thr <= 1024):
            raise CollectiveError(f"push all_reduce: launch ({nb} blocks, {thr} threads): blocks in "
                                  f"[1, {self.layout.maxb}], threads a multiple of 32 in [32, 1024]")
        self._launch(self._k_ar, nb, thr,
                     (np.uint64(x.data_ptr()), np.uint64(out.data_ptr()), np.int32(n), np.int32(self.rank),
                      np.uint64(self.state.ptr), np.uint64(self.peer_ptr), np.uint64(self.timeout_ns),
                      np.int32(self._debug_skip_flag_block), np.int32(self.strict_acks), np.float32(1.0),
                      np.uint32(self.nan_rule)))
        return out

    def max_exchange(self, parts: Sequence[MaxPart]) -> MaxPart:
        self.check_parts(parts)
        m, i = parts[0]
        o1, _, oi = self._exchange("max_exchange", m, None, i)
        return o1, oi

    def top2_exchange(self, parts: Sequence[Top2Part]) -> Top2Part:
        self.check_parts(parts)
        t1, t2, i = parts[0]
        return self._exchange("top2_exchange", t1, t2, i)

    def _exchange(self, op, v1, v2, idx):
        torch = self._torch
        self._check_tensor(op, "values", v1, torch.float32)
        self._check_tensor(op, "index", idx, torch.int64)
        n = v1.numel()
        if v1.dim() != 1 or idx.shape != v1.shape or (v2 is not None and v2.shape != v1.shape):
            raise CollectiveError(f"push {op}: shapes {tuple(v1.shape)}, {tuple(idx.shape)}"
                                  f"{'' if v2 is None else ', ' + str(tuple(v2.shape))}: need equal 1-D shapes")
        if v2 is not None:
            self._check_tensor(op, "top2", v2, torch.float32)
        if n > self.layout.maxx:
            raise CollectiveError(f"push {op}: {n} rows > {self.layout.maxx} (the exchange is one block)")
        o1 = torch.empty(n, dtype=torch.float32, device=v1.device)
        oi = torch.empty(n, dtype=torch.int64, device=v1.device)
        o2 = torch.empty(n, dtype=torch.float32, device=v1.device) if v2 is not None else None
        if n == 0:
            return o1, o2, oi
        v1, idx = v1.contiguous(), idx.contiguous()
        v2c = v2.contiguous() if v2 is not None else v1
        lo, hi = self.peer_id_range
        self._launch("push_exchange", 1, exchange_threads(n),
                     (np.uint64(v1.data_ptr()), np.uint64(v2c.data_ptr()), np.uint64(idx.data_ptr()),
                      np.uint64(o1.data_ptr()), np.uint64((o2 if o2 is not None else o1).data_ptr()),
                      np.uint64(oi.data_ptr()), np.int32(n), np.int32(self.rank), np.int32(v2 is not None),
                      np.int32(self.exchange_variant == "flag"), np.uint64(self.state.ptr),
                      np.uint64(self.peer_ptr), np.uint64(self.timeout_ns), np.int64(lo), np.int64(hi),
                      np.int32(self.strict_acks)))
        return o1, o2, oi

    def _check_tensor(self, op, what, t, dtype):
        torch = self._torch
        if not isinstance(t, torch.Tensor) or not t.is_cuda:
            raise CollectiveError(f"push {op}: {what} must be a CUDA tensor, got {type(t).__name__}"
                                  f"{'' if not isinstance(t, torch.Tensor) else ' on ' + str(t.device)}")
        if t.device.index != self.device.index:
            raise CollectiveError(f"push {op}: {what} on {t.device}, this rank runs on {self.device}")
        if t.dtype != dtype:
            raise CollectiveError(f"push {op}: {what} dtype {t.dtype}, need {dtype}")

    def _stream(self):
        ts = self._torch.cuda.current_stream(self.device)
        ptr = ts.cuda_stream
        cs = self._ext.get(ptr)
        if cs is None:
            cs = self._ext[ptr] = self._cp.cuda.ExternalStream(ptr)
        return ptr, cs

    def _launch(self, name, nb, thr, args) -> None:
        self.guard.refuse_if_poisoned("launch")
        if not self.peer_ptr:
            raise CollectiveError(f"{self.guard.name}: not connected to a peer (connect() first)")
        capturing = self._torch.cuda.is_current_stream_capturing()
        self.guard.count_launch(capturing)        # refuses a capture outside graph_capture() before launching
        ptr, cs = self._stream()
        try:
            with self._cpdev, cs:
                self.k[name]((nb,), (thr,), args)
        except Exception as e:
            self._poison(f"{name} launch failed: {e}")
        if not capturing:
            self._streams[ptr] = cs
            self._eager_since_check += 1
            if self.check_each:
                self.check_error()

    def set_lost_flag(self, block: int | None) -> None:
        """Fault injection: block `block` of every all-reduce never sends its flag / payload (None: normal). A
        device word, so replays obey it too; a reset clears it."""
        self.guard.refuse_if_poisoned("fault injection")
        self.state.write_u32(Layout.OFF_DBG_SKIP, [0 if block is None else block + 1])

    @contextlib.contextmanager
    def graph_capture(self):
        """Wrap a capture of push collectives and count them: each replay advances the device epochs by that count."""
        self.guard.refuse_if_poisoned("graph capture")
        info = CaptureInfo()
        self.guard.begin_capture()
        try:
            yield info
        finally:
            info.n_collectives = self.guard.end_capture()

    def replay(self, graph, n_collectives: int) -> None:
        """Replay on torch's current stream; refused when poisoned or when it would run past the last epoch."""
        self.guard.before_replay(n_collectives)
        ptr, cs = self._stream()
        self._streams[ptr] = cs
        try:
            graph.replay()
        except Exception as e:
            self._poison(f"graph replay failed: {e}")

    def max_rows(self, width: int) -> int:
        return self.layout.max_rows(width)

    @property
    def poisoned(self) -> bool:
        return self.guard.poisoned

    def read_control(self) -> dict:
        """The control words in one small D2H."""
        try:
            w = self.state.read_u32(Layout.OFF_EPOCH, CONTROL_WORDS)
        except Exception as e:
            self._poison(f"control read failed: {e}")
        return self._control(w)

    @staticmethod
    def _control(w) -> dict:
        return {"epoch": int(w[0]), "last_nblk": (int(w[2]), int(w[3])), "error": int(w[ERROR_WORD]),
                "error_epoch": int(w[ERROR_WORD + 1])}

    def status_region(self) -> tuple[int, int]:
        """The control words, which a captured step copies to the host behind its last collective."""
        return self.state.ptr + Layout.OFF_EPOCH, 4 * CONTROL_WORDS

    def check_status(self, words) -> None:
        """check() from the step's copied control words (no drain, no round trip); after eager launches, which may
        have run on other streams, the full check."""
        self.guard.refuse_if_poisoned("error check")
        if self._eager_since_check:
            return self.check_error()
        w = np.frombuffer(words, np.uint32, CONTROL_WORDS)
        if w[ERROR_WORD]:
            self._raise_if_failed(self._control(w))

    def error_word(self) -> int:
        """The error word as the device holds it now: call it once the step's stream is idle."""
        return self.read_control()["error"]

    def device_epoch(self) -> int:
        return self.read_control()["epoch"]

    def check(self) -> None:
        self.check_error()

    def check_error(self, timeout_s: float | None = None) -> None:
        """Drain (bounded), then raise CollectiveError if the error word has any bit set."""
        self.guard.refuse_if_poisoned("error check")
        self.drain(timeout_s)
        self._raise_if_failed(self.read_control())
        self._eager_since_check = 0

    def _raise_if_failed(self, c: dict) -> None:
        if c["error"]:
            raise CollectiveError(f"{self.guard.name}: collective failed: error word {describe_error_word(c['error'])}"
                                  f", first at epoch {c['error_epoch']} (device epoch {c['epoch']}, generation "
                                  f"{self.guard.generation}); outputs refused: drain and reset the pair")

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait until every stream this rank launched on is idle. A collective gives up after timeout_s by itself,
        so a stream still busy at timeout_s + 2 s means the device cannot be trusted: that poisons."""
        if self._torch.cuda.is_current_stream_capturing():
            raise CollectiveError(f"{self.guard.name}: drain() inside a graph capture")
        limit = self.timeout_s + 2.0 if timeout_s is None else timeout_s
        cp = self._cp
        ptr, cs = self._stream()
        streams = dict(self._streams)
        streams[ptr] = cs
        try:
            with self._cpdev:
                events = []
                for sp, s in streams.items():
                    ev = cp.cuda.Event(disable_timing=True)
                    ev.record(s)
                    events.append((sp, ev))
            deadline = time.monotonic() + limit
            for sp, ev in events:
                self._await(ev, deadline, f"drain: stream {sp:#x} still busy after {limit:.3g} s")
        except CollectiveError:
            raise
        except Exception as e:
            self._poison(f"drain failed: {e}")

    def _await(self, ev, deadline: float, why: str) -> None:
        """Poll `ev` until it has run, poisoning past `deadline`. Spin the first 2 ms: an idle stream's event
        completes within microseconds, and a sleep per poll would cost the step far more."""
        spin_until = time.monotonic() + 0.002
        while not ev.done:
            now = time.monotonic()
            if now > deadline:
                self._poison(why)
            if now > spin_until:
                time.sleep(0.0001)

    def cancel(self, timeout_s: float = 1.0) -> None:
        """Raise ERR_CANCELLED here and at the peer: a collective parked on another stream sees it at its next poll.
        Allowed on a poisoned rank (it only sets bits)."""
        if not self.peer_ptr:
            raise CollectiveError(f"{self.guard.name}: cancel: not connected")
        try:
            with self._cpdev:
                with self.cancel_stream:
                    self.k["push_cancel"]((1,), (1,), (np.uint64(self.state.ptr), np.uint64(self.peer_ptr)))
                ev = self._cp.cuda.Event(disable_timing=True)
                ev.record(self.cancel_stream)
            self._await(ev, time.monotonic() + timeout_s, f"cancel kernel did not run within {timeout_s} s")
        except CollectiveError:
            raise
        except Exception as e:
            self._poison(f"cancel failed: {e}")

    def reset(self, barrier: Callable[[], None] | None = None) -> None:
        """Drain, clear the state, start a new generation at epoch 0. Both ranks must be idle before either clears
        (the peer writes into this state): pass the pair's barrier, or in one process drain() both first."""
        self.guard.refuse_if_poisoned("reset")
        self.drain()
        if barrier is not None:
            barrier()
        try:
            self.state.clear()
        except Exception as e:
            self._poison(f"state clear failed: {e}")
        self.guard.after_reset()
        if barrier is not None:
            barrier()

    def _poison(self, why: str):
        self.guard.poison(why)
        raise CollectiveError(f"{self.guard.name}: poisoned: {why}; launches, replays and resets are refused "
                              "until the process restarts")

    def _debug_force_epoch(self, epoch: int) -> None:
        """Tests only, right after a reset (no ack to wait for): set the device epoch counter."""
        self.drain()
        if self.read_control()["last_nblk"] != (0, 0):
            raise CollectiveError("_debug_force_epoch: only right after reset()")
        self.state.write_u32(Layout.OFF_EPOCH, [epoch & U32_MAX])
        self.guard.epoch = epoch

    def describe(self) -> str:
        return (f"push rank {self.rank} on {self.device} (all-reduce {self.allreduce_variant}, exchange "
                f"{self.exchange_variant}, strict acks {self.strict_acks}, ack release {self.ack_release}, "
                f"NaN rule {self.nan_rule:#04x}, max_words {self.layout.max_words}, "
                f"timeout {self.timeout_s} s, generation {self.guard.generation}{', POISONED' if self.poisoned else ''})")

    def close(self) -> None:
        """Unmap the peer and free the state. Only once both ranks are idle (the peer writes into this state);
        a poisoned rank keeps its memory (a free could fault against a parked peer)."""
        if self.poisoned:
            return
        try:
            self.drain()
            with self._cpdev:
                if self._opened_ptr:
                    close_ipc_handle(self._opened_ptr)
                    self._opened_ptr = 0
                self.peer_ptr = 0
                self.state.free()
        except CollectiveError:
            pass


def make_single_card_pair(device: int | None = None, **kw) -> tuple[PushCollectives, PushCollectives]:
    """Both ranks in this process on one card; drive each rank on its own stream (own thread, or interleaved)."""
    a = PushCollectives(0, device=device, **kw)
    b = PushCollectives(1, device=device, **kw)
    a.connect_local(b)
    return a, b


def connect_over(group, rank: int, peer_id_range: tuple[int, int], timeout_s: float = 2.0,
                 allreduce: str = "lamport") -> PushCollectives:
    """One rank of a pair in its own process: build, swap IPC handles over a torch.distributed group (start-up
    only) and connect. The service runs the Lamport all-reduce (docs/collectives.md, "Decisions")."""
    import torch.distributed as dist
    pc = PushCollectives(rank, timeout_s=min(timeout_s, 2.0), peer_id_range=peer_id_range, allreduce=allreduce)
    handles: list = [None, None]
    dist.all_gather_object(handles, pc.export_handle().to_dict(), group=group)
    pc.connect(handles[1 - rank], barrier=lambda: dist.barrier(group=group))
    return pc
