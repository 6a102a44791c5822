"""CUDA graphs of one rank's step: the draft for every (requests 1..4) x (n_out 1..B) x (plain, margins) bucket and the
context insert for row buckets up to 128, captured once at start-up over static input buffers.

Replaying a graph runs the very kernels the eager path runs (`Drafter.forward`, `Drafter.context_rows`), so a replay
gives the eager bits; a bucket with more rows than the request needs pads with rows whose results are dropped (every
dense layer is row-invariant, so a real row's bits do not depend on the padding). The scalar inputs of a step
(seeds, p0, window masks) live in one int64 device buffer filled by one host-to-device copy per step.

Collectives are recorded through `coll.graph_capture()` and replayed through `coll.replay(graph, n)`: the push
backend keeps its epoch book that way (each replay advances the device epochs by the graph's collective count), and
a backend that cannot be captured (gloo, the emulated pair's threads) refuses at capture time. Both ranks of a pair
build the same set in the same order, so their warm-up collectives pair up and their graphs hold the same
collective sequence.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from .model.drafter import DraftOut, Drafter
from .model.state import SlotState

INSERT_BUCKETS = (8, 16, 32, 64, 128)


class GraphSet:
    def __init__(self, drafter: Drafter, max_requests: int = 4, n_outs: tuple[int, ...] | None = None,
                 insert_buckets: tuple[int, ...] = INSERT_BUCKETS):
        self.d = drafter
        self.coll = drafter.coll
        c = drafter.cfg
        dev = drafter.device
        self.max_requests = max_requests
        self.n_outs = n_outs or tuple(range(1, c.block_size + 1))
        self.insert_buckets = insert_buckets
        W, D = c.sliding_window, c.head_dim
        R = max_requests
        # One packed int64 buffer: seeds (R), p0 (R), window-valid flags (R*W). One upload per step.
        self.packed = torch.zeros(2 * R + R * W, dtype=torch.int64, device=dev)
        self.host = torch.zeros_like(self.packed, device="cpu").pin_memory()
        self.uploaded = torch.cuda.Event()         # marks when the pinned buffer's last upload is done
        self.windows = [torch.zeros(R, W, D, dtype=torch.float16, device=dev) for _ in range(c.n_blocks)]
        self.taps = torch.zeros(max(insert_buckets), c.n_taps * c.hidden_size, dtype=torch.float16, device=dev)
        self.pos = torch.zeros(max(insert_buckets), dtype=torch.int64, device=dev)
        self.draft_graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, DraftOut, int]] = {}
        self.insert_graphs: dict[int, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], int]] = {}
        self.pool = None
        self.capture_seconds = 0.0
        self.graph_bytes = 0

    def _views(self, bsz: int):
        R, W = self.max_requests, self.d.cfg.sliding_window
        seeds = self.packed[:bsz]
        p0 = self.packed[R:R + bsz]
        valid = self.packed[2 * R:2 * R + bsz * W].view(bsz, W) != 0
        return seeds, p0, [w[:bsz] for w in self.windows], valid

    @torch.inference_mode()
    def capture(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Capture every graph (warm-up on a side stream first: kernels loaded, caches built, no lazy loading
        inside a capture)."""
        t0 = time.monotonic()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()     # cached free blocks would hide the graphs' memory from the device-level count
        free0 = torch.cuda.mem_get_info()[0]
        keys = [(b, k, m) for b in range(1, self.max_requests + 1) for k in self.n_outs for m in (False, True)]
        total, done = len(keys) + len(self.insert_buckets), 0
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for b, k, m in keys:         # every shape once: a kernel specialised by shape compiles here, not in capture
                self.d.forward(*self._views(b), k, m)
            for rows in self.insert_buckets:
                self.d.context_rows(self.taps[:rows], self.pos[:rows])
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for b, k, m in keys:
            g, out, n = self._capture(lambda: self.d.forward(*self._views(b), k, m))
            self.draft_graphs[(b, k, m)] = (g, out, n)
            done += 1
            if progress:
                progress(done, total)
        for rows in self.insert_buckets:
            g, out, n = self._capture(lambda: self.d.context_rows(self.taps[:rows], self.pos[:rows]))
            self.insert_graphs[rows] = (g, out, n)
            done += 1
            if progress:
                progress(done, total)
        torch.cuda.synchronize()
        self.capture_seconds = time.monotonic() - t0
        self.graph_bytes = max(0, free0 - torch.cuda.mem_get_info()[0])

    def _capture(self, fn):
        g = torch.cuda.CUDAGraph()
        with self.coll.graph_capture() as info:
            with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):
                out = fn()
        self.pool = self.pool or g.pool()
        return g, out, info.n_collectives

    @property
    def n_graphs(self) -> int:
        return len(self.draft_graphs) + len(self.insert_graphs)

    # -- replays -----------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, states: list[SlotState], seeds: list[int], n_out: int, want_margins: bool) -> DraftOut:
        """The graph twin of `Drafter.draft` (inputs already checked): fill the static buffers, replay, and return
        copies (the graph's output buffers are rewritten by the next replay)."""
        bsz, R, W = len(states), self.max_requests, self.d.cfg.sliding_window
        h = self.host
        self.uploaded.synchronize()        # the last step's upload has left the pinned buffer before we rewrite it
        h.zero_()
        h[:bsz] = torch.tensor(seeds)
        h[R:R + bsz] = torch.tensor([s.position for s in states])
        for r, s in enumerate(states):           # the window's valid flags, from the host-side cursor (no D2H)
            h[2 * R + r * W: 2 * R + (r + 1) * W] = s.window_valid().to(torch.int64)
        self.packed.copy_(h, non_blocking=True)
        self.uploaded.record()
        for n, buf in enumerate(self.windows):
            for r, s in enumerate(states):
                s.copy_window(n, buf[r])
        g, out, n = self.draft_graphs[(bsz, n_out, want_margins)]
        self.coll.replay(g, n)
        return DraftOut(**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in vars(out).items()})

    @torch.inference_mode()
    def context_rows(self, taps: torch.Tensor, pos: torch.Tensor) -> list[torch.Tensor]:
        """The graph twin of `Drafter.context_rows`: rows go in chunks of the largest bucket, each chunk through the
        smallest bucket that holds it (a row's kv depends on that row alone, so chunking changes no bit)."""
        top = self.insert_buckets[-1]
        if taps.shape[0] > top:
            parts = [self.context_rows(taps[i:i + top], pos[i:i + top]) for i in range(0, taps.shape[0], top)]
            return [torch.cat(blk) for blk in zip(*parts)]
        n = taps.shape[0]
        bucket = next(b for b in self.insert_buckets if b >= n)
        self.taps[:n].copy_(taps, non_blocking=True)
        self.pos[:n].copy_(pos, non_blocking=True)
        g, rows, k = self.insert_graphs[bucket]
        self.coll.replay(g, k)
        return [r[:n].clone() for r in rows]
