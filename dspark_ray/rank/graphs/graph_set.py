"""`GraphSet`: one rank's step as CUDA graphs over static buffers. Every slot's kv ring lives in one pool tensor
(a spare slot, the scratch, takes an insert bucket's pad rows), so a captured graph reads and writes any slot by
index. A step stages its inputs into the pinned buffer, launches the graphs it needs and reads the download.
"""
from __future__ import annotations

import numpy as np
import torch

from ...model import ops
from ...model.drafter import DraftOut, Drafter
from ...model.state import SlotState
from ...observe.observers import RankObserver
from .buckets import INSERT_BUCKETS, MAX_REQUESTS, Buckets, step_graphs_enabled
from .capture import GraphCapture
from .copies import Copies
from .inputs import StepInputs
from .outputs import HostDraft, read_outputs
from .step_functions import StepFunctions


class GraphSet(GraphCapture):
    def __init__(self, drafter: Drafter, n_slots: int = 16, max_requests: int = MAX_REQUESTS,
                 n_outs: tuple[int, ...] | None = None, insert_buckets: tuple[int, ...] = INSERT_BUCKETS,
                 observer: RankObserver | None = None):
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
        self.buckets = b = Buckets(max_requests, self.n_outs, insert_buckets, step_graphs_enabled())
        self.request_buckets, self.wide_buckets, self.insert_buckets = b.requests, b.wide, b.inserts
        self.step_rows = b.step_rows
        self.W = c.sliding_window
        # Every slot's ring in one tensor; the last slot is the scratch that takes an insert bucket's pad rows.
        proto = drafter.new_slot()
        self.pool = torch.zeros((n_slots + 1,) + tuple(proto.kv.shape), dtype=torch.float16, device=dev)
        self.capacity = proto.capacity
        self.slots = [SlotState(c.n_blocks, self.W, proto.max_rows, c.head_dim, dev, kv=self.pool[i], index=i)
                      for i in range(n_slots)]
        self.scratch = n_slots
        self.n_blocks, self.T = c.n_blocks, b.T
        # Tables made once, so a step copies slices instead of computing indices (a numpy call costs us when cold).
        # The pool row of (slot, block, ring row), the ring unrolled past its end: any run of positions is one slice.
        self._row0 = ((np.arange(n_slots + 1)[:, None] * c.n_blocks + np.arange(c.n_blocks)[None, :])
                      * self.capacity)[..., None]
        self._ring_rows = self._row0 + np.arange(self.capacity + max(self.W, self.T)) % self.capacity
        # A window's valid flags when the slot holds h history rows (the newest h of W): _valid_from[h:h + W].
        self._valid_from = np.arange(2 * self.W) >= self.W
        self._rows = np.arange(self.T)                   # an insert chunk's row offsets
        self.inp = StepInputs(max_requests, self.W, self.T, c.n_blocks, c.n_taps * c.hidden_size, dev)
        h = self.inp.h                                   # shaped views of the pinned buffer, made once
        self._win_h = [h["win_rows"][:c.n_blocks * r * self.W].reshape(c.n_blocks, r, self.W)
                       for r in range(max_requests + 1)]
        self._valid_h = h["valid"].reshape(-1, self.W)
        self._ins_dst = h["ins_rows"].reshape(c.n_blocks, self.T)
        self._ins_taps = h["taps"].reshape(-1, self.inp.width)
        self._scratch_rows = np.repeat(self._row0[self.scratch], self.T, axis=1)    # pad rows' target: ring row 0
        self._ins_dst[:] = self._scratch_rows
        self.inp.upload(self.inp.nbytes)
        self.copies = Copies(self.inp, self.coll, max_requests * (3 * max(self.n_outs) + 1), self.cuda)
        self._status_fresh = False
        self.fns = StepFunctions(drafter, self.pool, self.inp, self.W, c.n_blocks, self.T)
        self._init_capture()

    # -- staging (a step's host work; keep_warm.py rehearses it between steps) -----------------------------------------
    def stage_draft(self, states: list[SlotState], seeds: list[int]) -> None:
        """Write the draft's inputs into the pinned buffer. Pad requests repeat the first request's inputs, so they
        read no other experts' weights (every kernel is row-invariant: their dropped answers change no bit)."""
        h, W = self.inp.h, self.W
        pad = self.buckets.of_requests[len(states)] - len(states)
        if pad:
            states, seeds = states + states[:1] * pad, seeds + seeds[:1] * pad
        win_h = self._win_h[len(states)]
        for r, s in enumerate(states):
            h["seeds"][r], h["p0"][r] = seeds[r], s.position
            first, held = (s.position - W) % self.capacity, s.hist_len()      # the window's oldest ring row
            win_h[:, r] = self._ring_rows[s.index, :, first:first + W]
            self._valid_h[r] = self._valid_from[held:held + W]

    def chunks(self, inserts):
        """The inserts' rows in chunks of at most the largest bucket, as runs (slot, first position, taps rows);
        an entry may straddle two chunks (a row's kv depends on that row alone, so chunking changes no bit)."""
        top = self.buckets.inserts[-1]
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

    def stage_insert(self, chunk, bucket: int | None = None) -> tuple[int, int]:
        """Stage a chunk into the pinned buffer, padded to `bucket` (default: the smallest that holds it) with rows
        aimed at the scratch slot; returns (the chunk's rows, bucket)."""
        pos, dst, taps = self.inp.h["ins_pos"], self._ins_dst, self._ins_taps
        at = 0
        for s, p, t in chunk:
            n, first = t.shape[0], p % self.capacity
            np.add(self._rows[:n], p, out=pos[at:at + n])
            dst[:, at:at + n] = self._ring_rows[s.index, :, first:first + n]
            taps[at:at + n] = t
            at += n
        bucket = bucket or self.buckets.of_rows[at]
        pos[at:bucket] = 0
        dst[:, at:bucket] = self._scratch_rows[:, at:bucket]
        return at, bucket

    def _stage_harmless(self) -> None:
        """Inputs that change no slot: every insert row aimed at the scratch slot (a pending graph's capture)."""
        self._ins_dst[:] = self._scratch_rows
        self.inp.h["ins_pos"][:] = 0

    def beside_rows(self, chunks: list, n_states: int) -> int | None:
        """The step graph's insert rows for the last chunk beside a draft of `n_states`, or None (an insert graph)."""
        rows = self.buckets.step_rows_for(n_states)
        if chunks and rows and sum(len(t) for _, _, t in chunks[-1]) <= rows:
            return rows
        return None

    def _upload(self, end: int) -> None:
        if not self.copies.memcpy:       # the graphs upload their inputs themselves when they can
            self.inp.upload(end)

    # -- a step ----------------------------------------------------------------------------------------------------
    def run(self, inserts: list[tuple[SlotState, int, np.ndarray]], states: list[SlotState], seeds: list[int],
            n_out: int, want_margins: bool, host: bool = False) -> DraftOut | HostDraft | None:
        """Insert each (slot, start, taps (n, width) fp16) into its slot's ring, then draft for `states` (none:
        inserts only). The caller placed the slots where the step leaves them. Returns a `DraftOut`, or with `host`
        a `HostDraft`."""
        if self.cuda:       # replays and numpy only: no torch op for inference mode to speed up
            return self._run(inserts, states, seeds, n_out, want_margins, host)
        # The uncaptured functions run the model's ops and the set's own, on the drafter's kernels (as `capture`)
        with torch.inference_mode(), ops.using(self.d.kernels):
            return self._run(inserts, states, seeds, n_out, want_margins, host)

    def _run(self, inserts, states, seeds, n_out, want_margins, host) -> DraftOut | HostDraft | None:
        stamp = self.observer.stamp
        stamp("run_in")
        inp = self.inp
        for s in states + [s for s, _, _ in inserts]:
            if s.index < 0 or self.slots[s.index] is not s:
                raise ValueError("GraphSet.run takes the set's own slots (GraphSet.slots)")
        self._status_fresh = False
        inp.writable()
        stamp("writable")
        chunks = list(self.chunks(inserts))
        # The last chunk runs in the draft's step graph when it fits there (a decode round's rows always do).
        beside_rows = self.beside_rows(chunks, len(states))
        beside = chunks.pop() if beside_rows else None
        key = self.buckets.key(len(states), n_out, want_margins) if states else None
        if self.pending:                # graphs this step needs and the set has not captured yet: now, before staging
            need = [("insert", self.buckets.of_rows[sum(len(t) for _, _, t in c)]) for c in chunks]
            if states:
                need.append(("step" if beside is not None else "draft", key))
            for kk in need:
                if kk in self.pending and kk[1] not in self._graphs(kk[0]):
                    self._capture_pending(kk)
        for k, chunk in enumerate(chunks):
            if k:
                inp.writable()
            rows, bucket = self.stage_insert(chunk)
            self._upload(inp.insert_bytes(rows))
            self.observer.stamp_first("first_launch")
            self._replay(self.insert_graphs[bucket])
            stamp("insert_launched")
            inp.mark()
        if not states:
            return None
        if beside is not None:          # one graph: the insert beside the draft; both staged before it starts
            if chunks:
                inp.writable()
            self.stage_insert(beside, beside_rows)
            self.stage_draft(states, seeds)
            stamp("draft_staged")
            for k in ("first_launch", "insert_launched"):
                self.observer.stamp_first(k, like="draft_staged")
            self._upload(inp.insert_bytes(beside_rows))
            packed = self._replay(self.step_graphs[key])
        else:
            # Staged while the GPU runs the inserts: their uploads copy this region but never read it, and the draft
            # graph uploads it behind them in stream order, after these writes.
            self.stage_draft(states, seeds)
            stamp("draft_staged")
            self._upload(inp.draft_bytes)
            self.observer.stamp_first("first_launch")
            packed = self._replay(self.draft_graphs[key])
        stamp("launched")
        inp.mark()
        return self._unpack(packed, len(states), n_out, key[1], want_margins, host)

    def _unpack(self, packed: torch.Tensor, n: int, n_out: int, drafted: int, want_margins: bool,
                host_draft: bool) -> DraftOut | HostDraft:
        size, copies = packed.numel(), self.copies
        if not copies.memcpy:            # else the draft graph has downloaded it
            copies.out_host[:size].copy_(packed.reshape(-1), non_blocking=True)
            self.inp.mark()
        if self.cuda:
            self.inp.synchronize(self.observer.idle)   # the event recorded behind the draft replay and its download
            self._status_fresh = copies.status is not None
        self.observer.stamp("synced")
        return read_outputs(copies.out_np, size, n, n_out, drafted, want_margins, host_draft)

    def fresh_status(self) -> np.ndarray | None:
        """The collectives' control words the last run's draft graph downloaded, or None."""
        return self.copies.status_np if self._status_fresh else None
