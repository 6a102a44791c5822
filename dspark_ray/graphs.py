"""CUDA graphs of one rank's step: the draft for every (requests 1..4) x (n_out 1..B) x (plain, margins) bucket, wider
batches in the buckets of WIDE_BUCKETS (padded, n_out B), and the context insert for row buckets up to 128, captured
once at start-up over static buffers.

The set owns its slots: every slot's main-kv ring lives in one pool tensor (one spare slot takes the pad rows of
an insert bucket), so a captured graph reads and writes any slot by index. A step's inputs travel in one pinned
host buffer, which each graph uploads (the prefix it reads) in one host-to-device copy:

    int64  seeds, p0 (R each); the pool rows of the windows (blocks x R x W) | insert positions (T); the pool rows
           the insert writes (blocks x T)
    bool   window-valid flags (R*W)
    fp16   the insert's taps (T rows)

(R = max requests, W = window, T = the largest insert bucket; a pool row is ((slot * blocks) + block) * capacity +
ring row, computed by the host). The insert graph computes the rows' main-kv and writes them into the pool (one
index_copy_ per block); the draft graph gathers the windows (one index_select), runs `Drafter.forward`, and packs
drafts, confidences, margins and confident lengths into one fp64 tensor that comes back in one device-to-host copy
(int64 ids and fp32 scores are exact in fp64). Between the two replays the host stages the draft's inputs, while the
GPU runs the inserts (the draft graph uploads them itself).

A decode round's STEP brings both: each request's seed and accepted drafts to insert, then its draft. Each draft key
also has a step graph that runs both in one replay (`DSPARK_STEP_GRAPHS=0`, `settings.py`, leaves them out). The insert of up to 8 rows
per request (STEP_INSERT_ROWS) runs beside the draft on a stream of its own, block by block, each block's rows
followed by the gather of its windows (which reads them); each drafter block's attention joins its own part
(`ops.branch_parts`, `ops.joined`). The insert's GEMMs (main_proj: 157 MB on the full preset) then read their
weights while the draft's latency-bound kernels leave the memory idle, and the step is staged and launched once.
Rows past that (a prefill) go through the insert graphs first.

The copies are part of the graphs themselves: each graph starts with the upload of the bytes it reads and the
draft graph ends with the download of its packed outputs and of the collectives' control words (the fail-closed
check reads them there: `Collectives.status_region`). A step on the host is then: write the pinned buffer, launch,
synchronise, read. (A torch `copy_` costs 50-75 us of host time per call on the GPU host; a captured copy nothing.
The copies are a kernel that reads and writes the pinned buffers directly (`kernels/host_copy.py`; a memcpy node
started several us after the kernel before it), or, without Triton, CuPy's `cudaMemcpyAsync` nodes, which torch's
pinned-memory bookkeeping does not see; with neither the graphs leave them out and the host issues them around
the replays.)

Replaying a graph runs the very kernels the eager path runs (`Drafter.forward`, `Drafter.context_rows`), so a replay
gives the eager bits; a bucket with more rows than the request needs pads with rows whose results are dropped (every
dense layer is row-invariant, so a real row's bits do not depend on the padding).

On a CPU (tests) the same buffers and functions run without capture, so the packing, gather and scatter are
checked against the eager path in CI.

A restart need not wait for all of them: `capture(first=...)` takes the draft keys a live batch needs (the
front-end's recent batches) and captures only their draft and step graphs, the insert graphs and the launch
rehearsal's; the rest stay `pending`. The rank's step loop captures them one at a time between steps
(`capture_next`), and a step that needs one not captured yet captures it first (`run`), before it stages its
inputs: a pending graph is captured with harmless inputs staged (every insert row aimed at the scratch slot), as
the set's start-up warm-up runs them, so its warm-up run changes no slot. `recapture` makes every graph pending
again (the old ones serve until replaced): after the Markov rows a restarted rank makes once it serves.

Collectives are recorded through `coll.graph_capture()` and replayed through `coll.replay(graph, n)`: the push
backend keeps its epoch book that way (each replay advances the device epochs by the graph's collective count), and
a backend that cannot be captured (gloo, the emulated pair's threads) refuses at capture time. Both ranks of a pair
build the same set in the same order, so their warm-up collectives pair up and their graphs hold the same
collective sequence.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .model import ops
from .records import STEP_INSERT_ROWS
from .model.drafter import DraftOut, Drafter
from .model.state import SlotState
from .observers import RankObserver
from .settings import current as settings

INSERT_BUCKETS = (8, 16, 32, 64, 128)
# Batches of 1-4 requests have a graph each for every (n_out, margins). A wider batch is padded to the next of these
# buckets, which draft n_out = block size only (an entry's answer is the first n_out drafts of a wider draft: the
# n_out prefix property). The full preset drafts 5 rows a request and pads its dense layers' rows to chunks of 32
# (kernels/gemm.py): 6 requests still take one chunk, 8-12 two, 16 three, where four replays of 4 read every weight
# four times.
EXACT_REQUESTS = 4
WIDE_BUCKETS = (6, 8, 12, 16)
MAX_REQUESTS = 16


def step_graphs_enabled() -> bool:
    """Whether graph sets capture step graphs: on unless `DSPARK_STEP_GRAPHS=0` (the separate insert and draft graphs
    only: 40 fewer graphs, ~60 MiB less graph memory on the full preset, ~70 us more per decode round)."""
    return settings().step_graphs


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


def _copier(like: torch.Tensor) -> Callable[..., None] | None:
    """copy(*(dst, src, nbytes)): capturable copies on torch's current stream between pinned host memory and the
    device. Every segment in one kernel where Triton runs (`kernels/host_copy.py`: a memcpy node waits for a copy
    engine, several us per copy), else a memcpy node per segment through CuPy; None without either."""
    try:
        from .kernels.host_copy import copy_bytes
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


@dataclass
class HostDraft:
    """A batch's drafts on the host in the contract's dtypes: what the engine answers from, converted once per batch
    (per-entry torch calls, several us each with the caches cold after the GPU wait, were most of a step's answers).
    `run(..., host=True)` gives it straight from the downloaded outputs; `of` converts a `DraftOut`."""
    drafts: np.ndarray                  # (bsz, n_out) int32
    confidences: np.ndarray             # (bsz, n_out) fp32
    margins: np.ndarray | None          # (bsz, n_out) fp32, when asked for
    confident_len: list[int]

    @staticmethod
    def of(out: DraftOut) -> "HostDraft":
        def host(t, dtype):
            return (t if t.device.type == "cpu" else t.cpu()).numpy().astype(dtype, copy=False)
        return HostDraft(host(out.drafts, np.int32), host(out.confidences, np.float32),
                         host(out.margins, np.float32) if out.margins is not None else None,
                         host(out.confident_len, np.int64).tolist())


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None     # None on a CPU: `fn` runs directly
    fn: Callable[[], object]
    out: object
    n_collectives: int


class _Inputs:
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
        `idle(ready)` between the polls (a `keep_warm.KeepWarm`: the host path after the wait stays warm)."""
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


class GraphSet:
    def __init__(self, drafter: Drafter, n_slots: int = 16, max_requests: int = MAX_REQUESTS,
                 n_outs: tuple[int, ...] | None = None, insert_buckets: tuple[int, ...] = INSERT_BUCKETS,
                 observer: RankObserver | None = None):
        """`observer`: the rank's (observers.RankObserver): a run's stamps, and its wait for the draft polls with the
        observer's `idle` (the rank's rehearsals)."""
        self.d = drafter
        self.observer = observer or RankObserver()
        self.coll = drafter.coll
        c = drafter.cfg
        dev = drafter.device
        self.cuda = dev.type == "cuda"
        # A batch never holds a slot twice, so no batch is wider than the slots; nor than one collective carries.
        max_requests = min(max_requests, n_slots)
        if (rows := self.coll.max_rows(c.hidden_size)) is not None:
            max_requests = min(max_requests, rows // c.block_size)
        self.max_requests = max_requests = max(1, max_requests)
        self.n_outs = n_outs or tuple(range(1, c.block_size + 1))
        # The request buckets: 1..EXACT_REQUESTS exactly, then WIDE_BUCKETS up to max_requests (the last one
        # max_requests itself); _bucket[n] is the bucket a batch of n requests runs in.
        exact = list(range(1, min(EXACT_REQUESTS, max_requests) + 1))
        wide = [b for b in WIDE_BUCKETS if exact[-1] < b < max_requests]
        wide += [max_requests] if max_requests > exact[-1] else []
        self.wide_buckets = tuple(wide)
        self.request_buckets = tuple(exact + wide)
        self._bucket = [0] + [min(b for b in exact + wide if b >= n) for n in range(1, max_requests + 1)]
        self.insert_buckets = insert_buckets
        self.W = c.sliding_window
        # Every slot's ring in one tensor; the last slot is the scratch that takes an insert bucket's pad rows.
        proto = drafter.new_slot()
        self.pool = torch.zeros((n_slots + 1,) + tuple(proto.kv.shape), dtype=torch.float16, device=dev)
        self.capacity = proto.capacity
        self.slots = [SlotState(c.n_blocks, self.W, proto.max_rows, c.head_dim, dev, kv=self.pool[i], index=i)
                      for i in range(n_slots)]
        self.scratch = n_slots
        self.n_blocks, self.T = c.n_blocks, max(insert_buckets)
        # The staging's tables, made once so that a step copies slices instead of computing indices (each numpy call
        # costs several us on the GPU host with the caches cold after the wait for a step). The pool row of (slot,
        # block, ring row), with the ring unrolled past its end: any run of consecutive positions, wrapped or not,
        # is one slice (a window: W rows from ring row (p0 - W) % capacity; an insert chunk: <= T rows).
        self._row0 = ((np.arange(n_slots + 1)[:, None] * c.n_blocks + np.arange(c.n_blocks)[None, :])
                      * self.capacity)[..., None]
        self._ring_rows = self._row0 + np.arange(self.capacity + max(self.W, self.T)) % self.capacity
        # A window's valid flags when the slot holds h history rows (the newest h of W): _valid_from[h:h + W].
        self._valid_from = np.arange(2 * self.W) >= self.W
        self._rows = np.arange(max(insert_buckets))      # an insert chunk's row offsets
        self._bucket_for = [min(b for b in insert_buckets if b >= n) for n in range(self.T + 1)]   # by row count
        self.inp = _Inputs(max_requests, self.W, self.T, c.n_blocks, c.n_taps * c.hidden_size, dev)
        h = self.inp.h                                   # shaped views of the pinned buffer, made once
        self._win_h = [h["win_rows"][:c.n_blocks * b * self.W].reshape(c.n_blocks, b, self.W)
                       for b in range(max_requests + 1)]
        self._valid_h = h["valid"].reshape(-1, self.W)
        self._ins_dst = h["ins_rows"].reshape(c.n_blocks, self.T)
        self._ins_taps = h["taps"].reshape(-1, self.inp.width)
        self._scratch_rows = np.repeat(self._row0[self.scratch], self.T, axis=1)    # pad rows' target: ring row 0
        self._ins_dst[:] = self._scratch_rows
        self.inp.upload(self.inp.nbytes)
        n_out_max = max(self.n_outs)
        self.out_host = torch.zeros(max_requests * (3 * n_out_max + 1), dtype=torch.float64, pin_memory=self.cuda)
        self._out_np = self.out_host.numpy()             # the unpacking reads the download through it
        # The copies inside the graphs (module docstring); the collectives' control words land in status_host.
        self.memcpy = _copier(self.inp.dev) if self.cuda else None
        # A one-kernel fence after each graph's upload (`_with_copies`).
        self._fence = torch.zeros(1, dtype=torch.int32, device=self.inp.dev.device) if self.memcpy else None
        self.status = self.coll.status_region() if self.memcpy else None
        self.status_host = torch.zeros(max(self.status[1], 1) if self.status else 1, dtype=torch.uint8,
                                       pin_memory=self.cuda)
        self._status_np = self.status_host.numpy()       # what the fail-closed check reads, a view made once
        self._status_fresh = False
        self.draft_graphs: dict[tuple[int, int, bool], _Graph] = {}
        self.insert_graphs: dict[int, _Graph] = {}
        # The step graphs: a draft key's draft with an insert of up to step_rows[requests] rows beside it.
        on = step_graphs_enabled()
        self.step_rows = {b: min(STEP_INSERT_ROWS * b, self.T) for b in exact + wide} if on else {}
        self.step_graphs: dict[tuple[int, int, bool], _Graph] = {}
        self.mempool = None
        self._noop: torch.cuda.CUDAGraph | None = None      # for rehearse_launch, captured with the set on a GPU
        self.capture_seconds = 0.0
        self.captured_first = 0             # graphs captured by `capture` (before serving)
        self.graph_bytes = 0
        # Graphs left for later ((kind, key) -> fn): captured between steps or when a step needs them (`capture`).
        self.pending: dict[tuple[str, object], Callable[[], object]] = {}

    # -- what the graphs run -------------------------------------------------------------------------------------
    def _draft_fn(self, bsz: int, n_out: int, margins: bool, insert_rows: int = 0) -> torch.Tensor:
        """Gather the windows from the pool, draft, pack the outputs: (bsz, n_out * (2 or 3) + 1) fp64. With
        `insert_rows`, a step graph's: the insert of that many staged rows runs block by block beside the draft,
        each block's rows followed by the gather of its windows (which reads them), and each block's attention
        joins its own part (the insert's GEMMs read their weights while the draft's latency-bound kernels leave the
        memory idle)."""
        v = self.inp.dev_view
        if insert_rows:
            windows = ops.branch_parts(self._insert_by_block, self.pool, insert_rows, bsz)
            valid = self._valid(bsz)
        else:
            windows, valid = self._windows(bsz)
        out = self.d.forward(v("seeds")[:bsz], v("p0")[:bsz], windows, valid, n_out, margins)
        pack = self.d.kernels.fused("pack_outputs")
        if pack is not None:
            return pack(out.drafts, out.confidences, out.margins if margins else None, out.confident_len)
        parts = [out.drafts, out.confidences] + ([out.margins] if margins else []) + [out.confident_len[:, None]]
        return torch.cat([p.to(torch.float64) for p in parts], dim=1)

    def _windows(self, bsz: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The staged requests' windows, per block (bsz, W, D), and their valid flags (bsz, W): what
        `Drafter.window_inputs` gives for the same slots."""
        rows = self._flat_pool().index_select(0, self._window_rows(bsz).flatten())
        return list(rows.view(self.n_blocks, bsz, self.W, -1).unbind(0)), self._valid(bsz)

    def _flat_pool(self) -> torch.Tensor:
        return self.pool.view(-1, self.pool.shape[-1])

    def _window_rows(self, bsz: int) -> torch.Tensor:
        """The staged pool rows of the windows, (blocks, bsz * W)."""
        return self.inp.dev_view("win_rows")[:self.n_blocks * bsz * self.W].view(self.n_blocks, bsz * self.W)

    def _valid(self, bsz: int) -> torch.Tensor:
        return self.inp.dev_view("valid")[:bsz * self.W].view(bsz, self.W)

    def _insert_fn(self, rows: int) -> None:
        """The main-kv of `rows` tap rows, scattered into the pool at (slot, block, ring row)."""
        for _ in self._scatter_by_block(rows):
            pass

    def _scatter_by_block(self, rows: int):
        """`_insert_fn` block by block: yields each block's index once its rows are in the pool."""
        v = self.inp.dev_view
        taps = v("taps")[:rows * self.inp.width].view(rows, self.inp.width)
        flat, dst = self._flat_pool(), v("ins_rows").view(self.n_blocks, self.T)
        for b, kv in enumerate(self.d.context_rows_by_block(taps, v("ins_pos")[:rows])):
            flat.index_copy_(0, dst[b, :rows], kv)      # pad rows all land on the scratch slot's row 0
            yield b

    def _insert_by_block(self, pool: torch.Tensor, rows: int, bsz: int):
        """`_insert_fn`, each block's rows followed by the gather of that block's windows as `_windows` gathers
        them (a generator of the windows; `pool`, the set's own, names the device to `ops.branch_parts`)."""
        win = self._window_rows(bsz)
        for b in self._scatter_by_block(rows):
            yield self._flat_pool().index_select(0, win[b]).view(bsz, self.W, -1)

    # -- capture ---------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, progress: Callable[[int, int], None] | None = None,
                first: list[tuple[int, int, bool]] | None = None) -> None:
        """Capture every graph (warm-up on a side stream first: kernels loaded, caches built, no lazy loading
        inside a capture). On a CPU, only record the functions. With `first` (batches as (requests, n_out,
        margins)): only what those batches need now, the rest left `pending` (module docstring)."""
        t0 = time.monotonic()
        fns = self._graph_fns()
        if first is not None:
            self.pending = {kk: fn for kk, fn in fns if not self._first(kk, first)}
            fns = [(kk, fn) for kk, fn in fns if kk not in self.pending]
        # No garbage collection inside a capture: an unreachable object collected there (an earlier graph set's
        # graphs, pinned buffers, events) frees CUDA memory or queries events, which invalidates the capture (seen
        # once in the gpu tests: "operation failed due to a previous error during capture"). Collected before.
        gc.collect()
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            with ops.using(self.d.kernels):     # the set's own ops (branches, the PDL scope): the drafter's kernels
                self._capture_all(fns, progress)
        finally:
            if gc_was_on:
                gc.enable()
        self.capture_seconds = time.monotonic() - t0
        self.captured_first = self.n_graphs

    def _capture_all(self, fns, progress) -> None:
        total, done = len(fns), 0
        with ops.graph_launches():       # the fast path's kernels launch with PDL here (Hopper and later)
            if self.cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()     # cached free blocks would hide the graphs' memory from the device count
                free0 = torch.cuda.mem_get_info()[0]
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for (kind, key), fn in fns:      # every shape once: a kernel specialised by shape compiles here
                        self._with_copies(fn, self._upload_bytes(kind, key), kind != "insert")
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
            for (kind, key), fn in fns:
                upload = self._upload_bytes(kind, key)
                g = self._capture(fn, upload, kind != "insert") if self.cuda else _Graph(None, fn, None, 0)
                self._store(kind, key, g)
                done += 1
                if progress:
                    progress(done, total)
        if self.cuda:
            self._noop = self._capture_noop()
            torch.cuda.synchronize()
            self.graph_bytes = max(0, free0 - torch.cuda.mem_get_info()[0])

    def _graph_fns(self) -> list[tuple[tuple[str, object], Callable[[], object]]]:
        """Every graph of the set, ((kind, key), what it runs), in capture order."""
        keys = [(b, k, m) for b in range(1, min(EXACT_REQUESTS, self.max_requests) + 1) for k in self.n_outs
                for m in (False, True)]
        keys += [(b, max(self.n_outs), m) for b in self.wide_buckets for m in (False, True)]
        fns = [(("draft", key), lambda key=key: self._draft_fn(*key)) for key in keys]
        fns += [(("insert", rows), lambda rows=rows: self._insert_fn(rows)) for rows in self.insert_buckets]
        fns += [(("step", key), lambda key=key: self._draft_fn(*key, self.step_rows[key[0]]))
                for key in keys if self.step_rows]
        return fns

    def _first(self, kk: tuple[str, object], first: list[tuple[int, int, bool]]) -> bool:
        """Whether graph `kk` is one the batches `first` need at once: an insert, or their draft or step graph."""
        return kk[0] == "insert" or kk[1] in {self._key(n, k, m) for n, k, m in first if 1 <= n <= self.max_requests}

    def recapture(self, first: list[tuple[int, int, bool]] | None = None) -> None:
        """Every graph captured again between steps (`capture_next`), `first`'s before the rest: after a change
        of what the graphs bake in (the Markov rows a restarted rank makes once it serves). Until its turn, each
        graph serves as it was captured (the same bits)."""
        fns = self._graph_fns()
        fns.sort(key=lambda item: not self._first(item[0], first or []))      # (stable)
        self.pending = dict(fns)

    def capture_next(self) -> bool:
        """Capture one pending graph (between steps); whether any is still pending."""
        if self.pending:
            self._capture_pending(next(iter(self.pending)))
        return bool(self.pending)

    def _capture_pending(self, kk: tuple[str, object]) -> None:
        """Capture the pending graph `kk` now: harmless inputs staged (every insert row into the scratch slot), its
        warm-up run on the side stream, then the capture; nothing left in flight."""
        t0 = time.monotonic()
        fn = self.pending.pop(kk)
        kind, key = kk
        upload, download = self._upload_bytes(kind, key), kind != "insert"
        if not self.cuda:
            self._store(kind, key, _Graph(None, fn, None, 0))
            return
        self._ins_dst[:] = self._scratch_rows
        self.inp.h["ins_pos"][:] = 0
        gc_was_on = gc.isenabled()
        gc.disable()                         # (nothing collected inside a capture: `capture`)
        try:
            with torch.inference_mode(), ops.using(self.d.kernels), ops.graph_launches():
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._with_copies(fn, upload, download)
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
                g = self._capture(fn, upload, download)
                torch.cuda.synchronize()
        finally:
            if gc_was_on:
                gc.enable()
        self._store(kind, key, g)
        self.inp.in_use = False
        self.capture_seconds += time.monotonic() - t0

    def _graphs(self, kind: str) -> dict:
        return {"draft": self.draft_graphs, "insert": self.insert_graphs, "step": self.step_graphs}[kind]

    def _store(self, kind: str, key, g: _Graph) -> None:
        self._graphs(kind)[key] = g

    def _capture_noop(self) -> torch.cuda.CUDAGraph:
        """A graph of one kernel on a buffer of its own, for `rehearse_launch`."""
        self._noop_buf = torch.zeros(1, dtype=torch.int32, device=self.inp.dev.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._noop_buf.add_(1)                   # loaded before the capture, like every kernel of the set
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            self._noop_buf.add_(1)
        return g

    def _upload_bytes(self, kind: str, key) -> int:
        if kind == "draft":
            return self.inp.draft_bytes
        return self.inp.insert_bytes(key if kind == "insert" else self.step_rows[key[0]])

    def _with_copies(self, fn, upload: int, download: bool):
        """fn between its copies: the upload of its input bytes first; a draft's packed outputs and the control
        words last (behind its last collective), in one copy. Without in-graph copies, fn alone."""
        cp = self.memcpy
        if cp:
            cp((self.inp.dev.data_ptr(), self.inp.host.data_ptr(), upload))
            if self._fence is not None:
                # Why a kernel that does nothing useful: right after the upload, the windows' gather (whose successor
                # is a PDL kernel) started 13.5 us after the upload ended on the tiny preset, 8.6 on the full one;
                # with this kernel between them nothing waits, and the upload launched without PDL kept the wait
                # (bench/graph_nodes.py; bench/results/gpu/upload_fence_ab_h200.json).
                self._fence.add_(1)
        out = fn()
        if cp and download:
            segments = [(self.out_host.data_ptr(), out.data_ptr(), out.numel() * out.element_size())]
            if self.status:
                segments.append((self.status_host.data_ptr(), self.status[0], self.status[1]))
            cp(*segments)
        return out

    def _capture(self, fn, upload: int, download: bool) -> _Graph:
        g = torch.cuda.CUDAGraph()
        with self.coll.graph_capture() as info:
            with torch.cuda.graph(g, pool=self.mempool, capture_error_mode="thread_local"):
                out = self._with_copies(fn, upload, download)
        self.mempool = self.mempool or g.pool()
        return _Graph(g, fn, out, info.n_collectives)

    @property
    def n_graphs(self) -> int:
        return len(self.draft_graphs) + len(self.insert_graphs) + len(self.step_graphs)

    def _replay(self, g: _Graph):
        if g.graph is None:
            return g.fn()
        self.coll.replay(g.graph, g.n_collectives)
        return g.out

    # -- a step ----------------------------------------------------------------------------------------------------
    def _key(self, n: int, n_out: int, margins: bool) -> tuple[int, int, bool]:
        """The graph key of a draft of n requests: (their bucket, the n_out it drafts, margins)."""
        b = self._bucket[n]
        return b, (n_out if b <= EXACT_REQUESTS else max(self.n_outs)), margins

    def _stage_draft(self, states: list[SlotState], seeds: list[int]) -> None:
        """Write the draft's inputs into the pinned buffer (numpy into made views: no device work, no torch op).
        A bucket's pad requests repeat the first request's inputs: its window and its experts, so they add no
        distinct weight to read (every kernel is row-invariant: their answers, dropped, change no other bit)."""
        h, W = self.inp.h, self.W
        pad = self._bucket[len(states)] - len(states)
        if pad:
            states, seeds = states + states[:1] * pad, seeds + seeds[:1] * pad
        win_h = self._win_h[len(states)]
        for r, s in enumerate(states):
            h["seeds"][r], h["p0"][r] = seeds[r], s.position
            first, held = (s.position - W) % self.capacity, s.hist_len()      # the window's oldest ring row
            win_h[:, r] = self._ring_rows[s.index, :, first:first + W]
            self._valid_h[r] = self._valid_from[held:held + W]

    def run(self, inserts: list[tuple[SlotState, int, np.ndarray]], states: list[SlotState], seeds: list[int],
            n_out: int, want_margins: bool, host: bool = False) -> DraftOut | HostDraft | None:
        """One step (inputs already checked): insert each (slot, start, taps (n, width) fp16, a numpy array or a CPU
        tensor) into its slot's ring, then draft for `states` (<= max_requests; none: inserts only). The slots
        stand where the step leaves them (the caller placed them: `SlotState.place`, or `advance` by the rules), so
        the draft reads each slot's window before its position. Returns the drafts on the host: as the drafter's
        `DraftOut` (torch), or with `host` as a `HostDraft` (the engine's answers)."""
        if self.cuda:       # replays and numpy only: no torch op for inference mode to speed up (it costs ~5 us)
            return self._run(inserts, states, seeds, n_out, want_margins, host)
        # The uncaptured functions run the model's ops and the set's own, on the drafter's kernels (as `capture`)
        with torch.inference_mode(), ops.using(self.d.kernels):
            return self._run(inserts, states, seeds, n_out, want_margins, host)

    def _run(self, inserts, states, seeds, n_out, want_margins, host) -> DraftOut | HostDraft | None:
        # The observer's stamps, in order: entered, the pinned buffer free, the first replay launched (after the
        # inserts' staging), the insert replays launched, the draft's inputs staged, every replay launched, synced.
        stamp = self.observer.stamp
        stamp("run_in")
        inp = self.inp
        for s in states + [s for s, _, _ in inserts]:
            if s.index < 0 or self.slots[s.index] is not s:
                raise ValueError("GraphSet.run takes the set's own slots (GraphSet.slots)")
        self._status_fresh = False
        inp.writable()
        stamp("writable")
        chunks = list(self._chunks(inserts))
        # The last chunk runs in the draft's step graph when it fits there (a decode round's rows always do).
        beside_rows = self._beside_rows(chunks, len(states))
        beside = chunks.pop() if beside_rows else None
        if self.pending:                # graphs this step needs and the set has not captured yet: now, before staging
            need = [("insert", self._bucket_for[sum(len(t) for _, _, t in c)]) for c in chunks]
            if states:
                need.append(("step" if beside is not None else "draft", self._key(len(states), n_out, want_margins)))
            for kk in need:
                if kk in self.pending and kk[1] not in self._graphs(kk[0]):
                    self._capture_pending(kk)
        for k, chunk in enumerate(chunks):
            if k:
                inp.writable()
            rows, bucket = self._stage_insert(chunk)
            self._upload(inp.insert_bytes(rows))
            self.observer.stamp_first("first_launch")
            self._replay(self.insert_graphs[bucket])
            stamp("insert_launched")
            inp.mark()
        if not states:
            return None
        key = self._key(len(states), n_out, want_margins)
        if beside is not None:          # one graph: the insert beside the draft; both staged before it starts
            if chunks:
                inp.writable()
            self._stage_insert(beside, beside_rows)
            self._stage_draft(states, seeds)
            stamp("draft_staged")
            for k in ("first_launch", "insert_launched"):
                self.observer.stamp_first(k, like="draft_staged")
            self._upload(inp.insert_bytes(beside_rows))
            packed = self._replay(self.step_graphs[key])
        else:
            # Staged while the GPU runs the inserts, off the step's critical path. The insert graphs' uploads cover
            # the draft's region too but never read it, so what they copy of it does not matter; the draft graph
            # uploads its own region when it starts, behind the inserts in stream order, after these writes.
            self._stage_draft(states, seeds)
            stamp("draft_staged")
            self._upload(inp.draft_bytes)
            self.observer.stamp_first("first_launch")
            packed = self._replay(self.draft_graphs[key])
        stamp("launched")
        inp.mark()
        return self._unpack(packed, len(states), n_out, key[1], want_margins, host)

    def rehearse(self, inserts: list[tuple[SlotState, int, np.ndarray]], states: list[SlotState],
                 seeds: list[int], n_out: int, want_margins: bool) -> None:
        """What `run` does on the host for these arguments, without a replay, a stamp or a change to a slot: keeps
        that code warm between steps (keep_warm.py). The staging writes the pinned buffer only while no upload
        can read it (every step stages all it uploads before it launches); the outputs are read, not used."""
        if not self.inp.in_use:
            chunks = list(self._chunks(inserts))
            if chunks:
                self._stage_insert(chunks[-1], self._beside_rows(chunks, len(states)))
            if states:
                self._stage_draft(states, seeds)
        if states:
            b, drafted, _ = self._key(len(states), n_out, want_margins)
            self._read_outputs(b * ((2 + want_margins) * drafted + 1), len(states), n_out, drafted, want_margins, True)

    def rehearse_launch(self) -> None:
        """Launch a graph of one tiny kernel while no step is in flight (the GPU is idle between steps): keeps the
        driver's launch path warm for the next step's replay (keep_warm.py), which took 50-125 us of the rank's
        step when launched cold. Through the collectives' guard, so a poisoned rank launches nothing (it raises,
        and the keep-warm drops the piece). Nothing a step reads is touched; on a CPU, nothing to do."""
        if self._noop is not None and not self.inp.in_use:
            self.coll.replay(self._noop, 0)

    def _beside_rows(self, chunks: list, n_states: int) -> int | None:
        """The rows of the step graph the last chunk runs in, beside the draft of `n_states` requests, when it fits
        there; else None (it runs in an insert graph)."""
        rows = self.step_rows.get(self._bucket[n_states], 0) if n_states <= self.max_requests else 0
        if chunks and rows and sum(len(t) for _, _, t in chunks[-1]) <= rows:
            return rows
        return None

    def _upload(self, end: int) -> None:
        if not self.memcpy:              # the graphs upload their inputs themselves when they can
            self.inp.upload(end)

    def fresh_status(self) -> np.ndarray | None:
        """The collectives' control words as the last run's draft graph left them (it has been synchronised), or
        None when that run downloaded none (no draft, or no in-graph copies)."""
        return self._status_np if self._status_fresh else None

    def _chunks(self, inserts):
        """The inserts' rows in chunks of at most the largest bucket, as runs (slot, first position, taps rows);
        an entry may straddle two chunks (a row's kv depends on that row alone, so chunking changes no bit)."""
        top = self.insert_buckets[-1]
        chunk, used = [], 0
        for s, start, taps in inserts:
            t = np.asarray(taps)             # (a view: the ring's slot, or a CPU tensor's memory)
            i = 0
            while i < t.shape[0]:
                k = min(t.shape[0] - i, top - used)
                chunk.append((s, start + i, t[i:i + k]))
                used, i = used + k, i + k
                if used == top:
                    yield chunk
                    chunk, used = [], 0
        if chunk:
            yield chunk

    def _stage_insert(self, chunk, bucket: int | None = None) -> tuple[int, int]:
        """Write a chunk's positions, slots, ring rows and taps into the pinned buffer, the rows of `bucket` (by
        default the smallest insert bucket that holds it) past them padded (they go to the scratch slot); returns
        (the chunk's rows, bucket)."""
        pos, dst, taps = self.inp.h["ins_pos"], self._ins_dst, self._ins_taps
        at = 0
        for s, p, t in chunk:
            n, first = t.shape[0], p % self.capacity
            np.add(self._rows[:n], p, out=pos[at:at + n])
            dst[:, at:at + n] = self._ring_rows[s.index, :, first:first + n]
            taps[at:at + n] = t
            at += n
        bucket = bucket or self._bucket_for[at]
        pos[at:bucket] = 0
        dst[:, at:bucket] = self._scratch_rows[:, at:bucket]
        return at, bucket

    def _unpack(self, packed: torch.Tensor, n: int, n_out: int, drafted: int, want_margins: bool,
                host_draft: bool) -> DraftOut | HostDraft:
        size = packed.numel()
        if not self.memcpy:              # else the draft graph has downloaded it
            self.out_host[:size].copy_(packed.reshape(-1), non_blocking=True)
            self.inp.mark()
        if self.cuda:
            self.inp.synchronize(self.observer.idle)   # the event recorded behind the draft replay and its download
            self._status_fresh = self.status is not None
        self.observer.stamp("synced")
        return self._read_outputs(size, n, n_out, drafted, want_margins, host_draft)

    def _read_outputs(self, size: int, n: int, n_out: int, drafted: int, want_margins: bool,
                      host_draft: bool) -> DraftOut | HostDraft:
        """The first n requests' answers from the download of a bucket that drafted `drafted` >= n_out: the
        first n_out drafts, scores and margins, and the confident prefix cut at n_out (the prefix of the first
        n_out drafts: the loop never looks ahead)."""
        k = drafted
        a = self._out_np[:size].reshape(-1, (2 + want_margins) * k + 1)[:n]
        drafts, confs, lens = a[:, :n_out], a[:, k:k + n_out], a[:, (2 + want_margins) * k]
        if n_out < k:
            lens = np.minimum(lens, n_out)
        margins = a[:, 2 * k:2 * k + n_out] if want_margins else None
        # (astype copies: the pinned buffer is the next step's)
        if host_draft:
            return HostDraft(drafts.astype(np.int32), confs.astype(np.float32),
                             margins.astype(np.float32) if want_margins else None, lens.astype(np.int64).tolist())
        return DraftOut(drafts=torch.from_numpy(drafts.astype(np.int64)),
                        confidences=torch.from_numpy(confs.astype(np.float32)),
                        confident_len=torch.from_numpy(lens.astype(np.int64)),
                        margins=torch.from_numpy(margins.astype(np.float32)) if want_margins else None, logits=None)
