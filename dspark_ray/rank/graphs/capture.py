"""Capturing a graph set's CUDA graphs (on a CPU: recorded and run uncaptured, so CI checks the packing against
the eager path). Each shape warms up on a side stream first, so nothing loads lazily inside a capture. A restart
captures only what live batches need (`first`) and the rest between steps (`capture_next`), each with harmless
inputs staged so its warm-up changes no slot. Collectives go through `coll.graph_capture()` / `coll.replay()` (push
keeps its epoch book so); both ranks build the same set in the same order, so their collectives pair up.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ...model import ops


@dataclass
class Graph:
    graph: torch.cuda.CUDAGraph | None     # None on a CPU: `fn` runs directly
    fn: Callable[[], object]
    out: object
    n_collectives: int


class GraphCapture:
    """The capture half of `graph_set.GraphSet` (which calls `_init_capture` as it is built)."""

    def _init_capture(self) -> None:
        self.draft_graphs: dict[tuple[int, int, bool], Graph] = {}
        self.insert_graphs: dict[int, Graph] = {}
        # The step graphs: a draft key's draft with an insert of up to buckets.step_rows[requests] rows beside it.
        self.step_graphs: dict[tuple[int, int, bool], Graph] = {}
        self.mempool = None
        self.noop: torch.cuda.CUDAGraph | None = None       # keep_warm.rehearse_launch, captured with the set on a GPU
        self.capture_seconds = 0.0
        self.captured_first = 0             # graphs captured by `capture` (before serving)
        self.graph_bytes = 0
        # Graphs left for later ((kind, key) -> fn): captured between steps or when a step needs them (`capture`).
        self.pending: dict[tuple[str, object], Callable[[], object]] = {}

    @property
    def n_graphs(self) -> int:
        return len(self.draft_graphs) + len(self.insert_graphs) + len(self.step_graphs)

    def _replay(self, g: Graph):
        if g.graph is None:
            return g.fn()
        self.coll.replay(g.graph, g.n_collectives)
        return g.out

    @torch.inference_mode()
    def capture(self, progress: Callable[[int, int], None] | None = None,
                first: list[tuple[int, int, bool]] | None = None) -> None:
        """Capture every graph (warm-up on a side stream first). On a CPU, only record the functions. With `first`
        (batches as (requests, n_out, margins)): only what those batches need now, the rest left `pending`."""
        t0 = time.monotonic()
        fns = self._graph_fns()
        if first is not None:
            self.pending = {kk: fn for kk, fn in fns if not self.buckets.needed_first(kk, first)}
            fns = [(kk, fn) for kk, fn in fns if kk not in self.pending]
        # No garbage collection inside a capture: collecting an old graph, buffer or event there invalidates it.
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
                        self.copies.around(fn, self._upload_bytes(kind, key), kind != "insert")
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
            for (kind, key), fn in fns:
                upload = self._upload_bytes(kind, key)
                g = self._capture(fn, upload, kind != "insert") if self.cuda else Graph(None, fn, None, 0)
                self._store(kind, key, g)
                done += 1
                if progress:
                    progress(done, total)
        if self.cuda:
            self.noop = self._capture_noop()
            torch.cuda.synchronize()
            self.graph_bytes = max(0, free0 - torch.cuda.mem_get_info()[0])

    def _graph_fns(self) -> list[tuple[tuple[str, object], Callable[[], object]]]:
        """Every graph of the set, ((kind, key), what it runs), in capture order."""
        keys, fns, step_rows = self.buckets.draft_keys(), self.fns, self.buckets.step_rows
        out = [(("draft", key), lambda key=key: fns.draft(*key)) for key in keys]
        out += [(("insert", rows), lambda rows=rows: fns.insert(rows)) for rows in self.buckets.inserts]
        out += [(("step", key), lambda key=key: fns.draft(*key, step_rows[key[0]])) for key in keys if step_rows]
        return out

    def recapture(self, first: list[tuple[int, int, bool]] | None = None) -> None:
        """Every graph captured again between steps, `first`'s first, after what they bake in changed (the Markov
        rows); until its turn each serves as captured (the same bits)."""
        fns = self._graph_fns()
        fns.sort(key=lambda item: not self.buckets.needed_first(item[0], first or []))      # (stable)
        self.pending = dict(fns)

    def capture_next(self) -> bool:
        """Capture one pending graph (between steps); whether any is still pending."""
        if self.pending:
            self._capture_pending(next(iter(self.pending)))
        return bool(self.pending)

    def _capture_pending(self, kk: tuple[str, object]) -> None:
        """Capture the pending graph `kk` now (harmless inputs, warm-up, capture; nothing left in flight)."""
        t0 = time.monotonic()
        fn = self.pending.pop(kk)
        kind, key = kk
        upload, download = self._upload_bytes(kind, key), kind != "insert"
        if not self.cuda:
            self._store(kind, key, Graph(None, fn, None, 0))
            return
        self._stage_harmless()
        gc_was_on = gc.isenabled()
        gc.disable()                         # (nothing collected inside a capture: `capture`)
        try:
            with torch.inference_mode(), ops.using(self.d.kernels), ops.graph_launches():
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self.copies.around(fn, upload, download)
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

    def _store(self, kind: str, key, g: Graph) -> None:
        self._graphs(kind)[key] = g

    def _capture_noop(self) -> torch.cuda.CUDAGraph:
        """A graph of one kernel on a buffer of its own, for keep_warm.rehearse_launch."""
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
        return self.inp.insert_bytes(key if kind == "insert" else self.buckets.step_rows[key[0]])

    def _capture(self, fn, upload: int, download: bool) -> Graph:
        g = torch.cuda.CUDAGraph()
        with self.coll.graph_capture() as info:
            with torch.cuda.graph(g, pool=self.mempool, capture_error_mode="thread_local"):
                out = self.copies.around(fn, upload, download)
        self.mempool = self.mempool or g.pool()
        return Graph(g, fn, out, info.n_collectives)
