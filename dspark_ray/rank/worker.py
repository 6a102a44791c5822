"""One rank of a pair, as a plain object (`actors/rank.py` is the Ray actor around it). Start-up, in the
front-end's order: `load()` on both ranks at once, `connect()` on both at once (the collectives' handshake),
`serve()` (the step loop on the ring; no Ray call per step). Each phase is stamped in `startup` for
bench/restart.py. A restarted one-card rank serves first and makes the rest between steps (docs/engine.md,
"A restart").
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
import time

import torch

from . import IMPORTS_BEGAN
from ..protocol import records as M
from ..model import ops
from ..scheduling import pin_thread, process_facts, raise_priority
from .engine import EngineBroken, RankEngine, StepFailed
from ..observe.observers import RankObserver
from ..settings import current as settings
from ..spec import SAFE_ENV, PairSpec

log = logging.getLogger("dspark_ray.rank")


class RankWorker:
    def __init__(self, spec: PairSpec | dict, rank: int, observer: RankObserver | None = None):
        from ..transport.ring import process_started_at
        now_s = time.time()
        self.spec = spec if isinstance(spec, PairSpec) else PairSpec(**spec)
        self.rank = rank
        born = process_started_at(os.getpid()) or IMPORTS_BEGAN
        self.startup: dict[str, list[float]] = {"process": [born, IMPORTS_BEGAN], "imports": [IMPORTS_BEGAN, now_s]}
        torch.set_num_threads(self.spec.torch_threads)
        self.loaded = 0
        self.total = 0
        self.weights = None
        self.ckpt = None                 # the checkpoint's description, once prepared
        self.host_copy = None            # a spare's checkpoint files, pinned for the card (weights/host_copy.py)
        self._prepare_lock = threading.Lock()
        self.engine: RankEngine | None = None
        self.markov_cache: dict | None = None      # {"rows", "bytes"} once connected
        self.kernels = ops.EXACT                   # the drafter's (load() picks them by the spec)
        self.reader = None
        self._later = None               # a restart's work left for between steps (_after_serving)
        self._thread: threading.Thread | None = None
        self._stop = False
        self.observer = observer or RankObserver()

    @contextlib.contextmanager
    def _phase(self, name: str):
        t0 = time.time()
        yield
        self.startup[name] = [t0, time.time()]

    # -- start-up --------------------------------------------------------------------------------------------------
    def prepare(self, pin_files: bool = False) -> None:
        """The start-up's part before the weights (imports, CUDA context, checkpoint, kernels): a spare rank
        (actors/pair.py) does it ahead of a restart, and with `pin_files` pins the checkpoint's files for the card."""
        with self._prepare_lock:
            if self.ckpt is not None:
                return
            for module in ("..comm.factory", "..model.drafter", "..model.layout", ".modes", "..weights.staging"):
                importlib.import_module(module, __package__)
            from ..weights.loader import Checkpoint
            cuda = self.spec.device.startswith("cuda")
            if cuda:
                with self._phase("cuda_context"):
                    torch.cuda.init()
                    torch.empty(1, device=self.spec.device)
                    torch.cuda.synchronize()
            ck = Checkpoint(self.spec.checkpoint)
            if cuda or self.spec.matmul != "auto":
                from ..kernels.gemm import dense_for, describe, kernels_for
                with self._phase("kernels"):
                    cfg = ck.config
                    self.kernels = kernels_for(self.spec.matmul,
                                               dense_for(self.spec.batch_limit(cfg) * cfg.block_size,
                                                         self.spec.dense))
                log.info("rank %d: matmul %s", self.rank, describe(self.kernels))
            if cuda and pin_files:
                from ..weights.host_copy import HostCopy
                self.host_copy = HostCopy.open(ck.spans(), self.spec.device)
            self.ckpt = ck

    def load(self) -> dict:
        from ..model.layout import Layout
        from .modes import read_rank
        from ..weights.staging import Staging
        self.prepare()
        cuda = self.spec.device.startswith("cuda")
        t0 = time.time()
        ck = self.ckpt
        self.total = len(ck.names())
        layout = Layout(ck.config, self.spec.tp)

        def tick(n):
            self.loaded += n

        # A spare's pinned files, kept pinned (unpinning 29 GiB would stall the first steps; the other spares pin
        # the same pages), else bounce buffers on a card; on a CPU straight into the tensors.
        if self.host_copy is not None:
            source = contextlib.nullcontext(self.host_copy)
        else:
            source = Staging(self.spec.device) if cuda else contextlib.nullcontext()
        with self._phase("weights"):
            with source as staging:
                self.weights = read_rank(ck, layout, self.rank, self.spec.device, progress=tick, staging=staging)
            if cuda:
                torch.cuda.synchronize()
        self.layout = layout
        nbytes = sum(t.nbytes for t in self.weights.values())
        took = self.startup["weights"][1] - self.startup["weights"][0]
        log.info("rank %d: loaded %d tensors (%.1f MiB) in %.2f s (%.1f GB/s, %s)", self.rank, self.total,
                 nbytes / 2**20, took, nbytes / max(took, 1e-9) / 1e9,
                 "pinned files" if self.host_copy is not None else "bounce buffers" if cuda else "direct")
        return {"rank": self.rank, "tensors": self.total, "bytes": nbytes, "seconds": time.time() - t0}

    def progress(self) -> tuple[int, int]:
        return self.loaded, self.total

    def connect(self, init_method: str | None, first: list[tuple[int, int, bool]] | None = None) -> str:
        """Meet the peer (both ranks at once) and build the engine. `first` (a restart: the last batches' (requests,
        n_out, margins)): a one-card rank captures only their graphs before it serves. A pair captures everything
        first: its captures run collectives, so both ranks must capture the same graph at the same point."""
        from ..comm.factory import connect
        from ..model.drafter import Drafter
        cfg = self.ckpt.config
        with self._phase("connect"):
            coll = connect(self.spec.backend, self.rank, self.spec.tp, init_method=init_method,
                           peer_ids=self.layout.vocab_range(1 - self.rank) if self.spec.tp == 2 else (0, 0),
                           timeout_s=self.spec.collective_timeout_s)
        with self._phase("drafter"):
            drafter = Drafter(cfg, [self.weights], [self.layout.vocab_range(self.rank)[0]], coll,
                              kernels=self.kernels, consume=True)
            self.weights = None      # the drafter holds what it uses (routed experts stacked: the originals go)
        cuda = self.spec.device.startswith("cuda")
        graphs = self.spec.graphs is not False
        later = first is not None and self.spec.tp == 1 and graphs
        with self._phase("markov_rows"):
            if later:
                markov_rows = drafter.markov_rows_for(self.spec.markov_cache)      # sized now, made later
                self.markov_cache = {"rows": 0, "bytes": 0, "later": markov_rows}
            else:
                self._cache_markov(drafter)

        def progress(done, total):
            if done == total or done % 10 == 0:
                log.info("rank %d: %s %d / %d graphs", self.rank, "captured" if cuda else "recorded", done, total)
        # The front-end checked every entry and placed its slot: the engine checks nothing.
        with self._phase("graphs"):
            self.engine = RankEngine(drafter, self.spec.n_slots, self.rank, graphs=graphs, progress=progress,
                                     max_batch=self.spec.batch_limit(cfg), first=first if later else None,
                                     observer=self.observer)
            self.observer.seam_engine(self.engine)     # a recorder looks in on the engine's step (seams.py)
            if cuda:
                torch.cuda.synchronize()
        self._later = self._after_serving(drafter, markov_rows, first) if later else None
        log.info("rank %d: engine ready%s", self.rank, f"; {self.engine.status()['graphs']}" if graphs else "")
        return coll.describe()

    def _after_serving(self, drafter, markov_rows: int, first):
        """A restarted one-card rank's work between steps, a piece each `next`: its Markov rows a chunk at a time,
        then every graph captured again on them (the old ones serve until replaced), then the graphs not captured."""
        t0 = time.time()
        graphs = self.engine.graphs
        if markov_rows:
            for _ in drafter.cache_markov_in_steps(markov_rows):
                yield
            self.markov_cache = {"rows": markov_rows, "bytes": drafter.markov_cache_bytes}
            self.startup["markov_rows_later"] = [t0, time.time()]
            graphs.recapture(first)
        while graphs.capture_next():
            yield
        self.startup["graphs_later"] = [t0, time.time()]
        log.info("rank %d: made after serving in %.2f s: %s; every graph captured (%d, %.2f s of capture)",
                 self.rank, time.time() - t0, f"{markov_rows} Markov rows" if markov_rows else "no Markov rows",
                 graphs.n_graphs, graphs.capture_seconds)

    def _cache_markov(self, drafter) -> None:
        """The Markov bias rows the spec asks for, sized against what the card has left after the weights."""
        t0 = time.time()
        rows = drafter.cache_markov_for(self.spec.markov_cache)
        if rows:
            log.info("rank %d: Markov bias rows of %d / %d ids cached (%.2f GiB) in %.2f s", self.rank, rows,
                     drafter.cfg.vocab_size, drafter.markov_cache_bytes / 2**30, time.time() - t0)
        self.markov_cache = {"rows": rows, "bytes": drafter.markov_cache_bytes}

    def serve(self, ring_handle) -> None:
        from ..transport.ring import StepRing
        with self._phase("serve"):
            # The ring as the loop uses it: with a recorder, its seam (seams.RingIn) stamps what crosses it.
            self.reader = self.observer.seam_ring(StepRing.attach(ring_handle, self.rank))
            self._thread = threading.Thread(target=self._loop, name=f"dspark-rank{self.rank}", daemon=True)
            self._thread.start()

    # -- the step loop ---------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        from ..transport.ring import RingClosed, RingTimeout
        raise_priority(f"rank {self.rank} step loop")     # this thread only: loading and capture stay at Ray's 15
        if self.spec.rank_cpus:
            pin_thread([self.spec.rank_cpus[self.rank]], f"rank {self.rank} step loop")
        ring = self.reader
        spin_us, last_step = self.spec.spin_us, time.monotonic()
        while not self._stop:
            try:
                if self._later is not None:  # a restart's work left: a look at the ring, else one more piece
                    seq, view = ring.next(timeout_s=0.0, spin_us=0.0)
                else:
                    # The spin counts from the last step: an idle rank that wakes from a timeout sleeps again at once.
                    left_us = max(0.0, spin_us - (time.monotonic() - last_step) * 1e6)
                    seq, view = ring.next(timeout_s=1.0, spin_us=left_us)
            except RingTimeout:
                if self._later is not None:
                    self._work_later()
                continue
            except RingClosed:
                break
            status, payload = M.STATUS_OK, b""
            try:
                # The entries view the ring's slot: it stays ours until complete() below.
                batch = M.decode_batch(view)
                results = self.engine.step(batch)
                if self.rank == 0:
                    payload = M.encode(M.RingReply(results))
            except StepFailed as e:
                status, payload = M.STATUS_STEP_FAILED, M.encode(M.RingReply([], str(e)))
            except EngineBroken as e:
                status, payload = M.STATUS_BROKEN, M.encode(M.RingReply([], str(e)))
            except Exception as e:               # decoding or anything unforeseen: latch, the pair may be split
                self.engine.broken = f"{type(e).__name__}: {e}"
                status, payload = M.STATUS_BROKEN, M.encode(M.RingReply([], self.engine.broken))
            ring.complete(seq, status, payload)
            last_step = time.monotonic()

    def _work_later(self) -> None:
        """One piece of `_after_serving`; one that fails closes the engine's latch (the pair is restarted)."""
        try:
            next(self._later)
        except StopIteration:
            self._later = None
        except Exception as e:
            self._later = None
            self.engine.broken = f"start-up work between steps failed: {type(e).__name__}: {e}"
            log.error("rank %d: %s", self.rank, self.engine.broken)

    def status(self) -> dict:
        st = self.engine.status() if self.engine else {"rank": self.rank, "loading": self.progress()}
        st["pid"] = os.getpid()
        st["matmul"] = matmul_status(self.engine.drafter.kernels if self.engine else self.kernels)
        if self.markov_cache is not None:
            st["markov_cache"] = self.markov_cache
        st["startup"] = self.startup
        st["work_left"] = self._later is not None     # a restart's Markov rows and graphs still being made
        st["process"] = process_facts()
        st["env"] = {k: os.environ.get(k) for k in SAFE_ENV}
        st["settings"] = settings().to_dict()
        return st

    def stop(self) -> None:
        self._stop = True
        if self._thread:
            self._thread.join(3)
        if self.reader:
            self.reader.close()


def matmul_status(kernels: ops.Kernels) -> dict:
    """The drafter's kernels: the matmul mode, and on the fast path the dense kernel (else None)."""
    return {"mode": kernels.mode, "dense": kernels.dense}
