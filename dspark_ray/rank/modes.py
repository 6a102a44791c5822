"""The ways to run the drafter, and the one place that decides which shards a process holds: `tp1` (the whole
model); `split` (both ranks' shards in one caller, partials added in rank order); `emulated` (both ranks in this
process, a thread each: the pair's oracle); `solo` (one rank, stand-in collectives: one rank's time); `pair` (one
rank, its peer in another process).
"""
from __future__ import annotations

import threading
from typing import Callable

from ..model.collectives import Collectives, LocalCollectives
from ..comm.solo import SoloCollectives
from ..comm.emulated import ThreadCollectives
from ..config import DrafterConfig
from ..model.drafter import Drafter, Weights
from ..model.layout import Layout

MODES = ("tp1", "split", "emulated", "solo", "pair")


def shard_weights(full: Weights, layout: Layout, rank: int) -> Weights:
    """Rank `rank`'s view of in-memory full weights (replicated tensors are shared)."""
    out = {}
    for name, t in full.items():
        s = layout.slice_of(name, tuple(t.shape), rank)
        out[name] = t if s is None else t.narrow(s[0], s[1], s[2] - s[1]).contiguous()
    return out


def read_rank(ckpt, layout: Layout, rank: int, device="cpu", shared: Weights | None = None,
              progress: Callable[[int], None] | None = None, exl3_kernels: bool | None = None,
              staging=None) -> Weights:
    """Rank `rank`'s slices from a checkpoint; `shared`: replicated tensors another rank read. `exl3_kernels`
    (default: on CUDA where exllamav3 imports) keeps EXL3 Linears as stored, for exllamav3's kernels."""
    from ..kernels import exl3_gemm
    if exl3_kernels is None:        # importing exllamav3 costs seconds of a restart: only for EXL3
        exl3_kernels = str(device).startswith("cuda") and any(exl3_gemm.on_kernels(ckpt, n) for n in ckpt.names()) \
            and exl3_gemm.available()
    out = {}
    for name in ckpt.names():
        s = layout.slice_of(name, tuple(ckpt.shape(name)), rank)
        if s is None and shared is not None:
            out[name] = shared[name]
        elif exl3_kernels and exl3_gemm.on_kernels(ckpt, name):
            (rec,) = ckpt.exl3(name, *(s or ()), device=device)
            out[name] = exl3_gemm.load(rec)
        else:
            out[name] = ckpt.read(name, *(s or ()), device=device, staging=staging)
        if progress:
            progress(1)
    return out


def _rank_weights(layout, ranks, full, ckpt, device) -> list[Weights]:
    if full is not None:
        return [shard_weights(full, layout, r) for r in ranks]
    out: list[Weights] = []
    for r in ranks:
        out.append(read_rank(ckpt, layout, r, device, shared=out[0] if out else None))
    return out


def make_drafter(cfg: DrafterConfig, mode: str, *, full: Weights | None = None, ckpt=None, rank: int = 0,
                 coll: Collectives | None = None, device="cpu", **kw) -> Drafter:
    """One drafter of `mode` (not `emulated`) from in-memory full weights or a checkpoint; `kw` goes to `Drafter`."""
    if mode not in MODES or mode == "emulated":
        raise ValueError(f"mode {mode!r}: choose one of tp1, split, solo, pair (emulated: make_emulated)")
    layout = Layout(cfg, 1 if mode == "tp1" else 2)
    ranks = [0, 1] if mode == "split" else [rank]
    shards = _rank_weights(layout, ranks, full, ckpt, device)
    if coll is None:
        if mode == "pair":
            raise ValueError("mode 'pair' needs the collectives that meet the peer")
        coll = SoloCollectives(rank) if mode == "solo" else LocalCollectives(len(ranks))
    return Drafter(cfg, shards, [layout.vocab_range(r)[0] for r in ranks], coll, **kw)


def make_emulated(cfg: DrafterConfig, *, full: Weights | None = None, ckpt=None, device="cpu",
                  timeout_s: float = 30.0, **kw) -> list[Drafter]:
    """The emulated pair's two drafters, meeting through in-process collectives; drive them with `run_pair`."""
    layout = Layout(cfg, 2)
    shards = _rank_weights(layout, [0, 1], full, ckpt, device)
    colls = ThreadCollectives.pair(timeout_s)
    return [Drafter(cfg, [shards[r]], [layout.vocab_range(r)[0]], colls[r], **kw) for r in (0, 1)]


def run_pair(fn0: Callable[[], object], fn1: Callable[[], object]) -> tuple[object, object]:
    """Run both ranks' work at once, a thread each; re-raise the first failure after both have ended."""
    results: list = [None, None]
    errors: list = [None, None]

    def go(i, fn):
        try:
            results[i] = fn()
        except BaseException as e:       # noqa: BLE001 - handed to the caller below
            errors[i] = e

    t1 = threading.Thread(target=go, args=(1, fn1), daemon=True)
    t1.start()
    go(0, fn0)
    t1.join()
    for e in errors:
        if e is not None:
            raise e
    return results[0], results[1]
