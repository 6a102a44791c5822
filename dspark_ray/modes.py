"""The ways to run the drafter, and the one place that decides which shards a process holds.

| mode       | what runs                                                    | collectives                         |
|------------|--------------------------------------------------------------|-------------------------------------|
| `tp1`      | the whole model on one card, one GEMM per layer              | none                                |
| `split`    | one caller holding both ranks' shards, adding the partials   | tensor ops in rank order            |
| `emulated` | both ranks in this process, each on its own thread           | shared tensors (the pair's oracle)  |
| `solo`     | one rank alone                                               | local stand-ins (one rank's time)   |
| `pair`     | one rank, its peer in another process                        | gloo (CPU), push (NVLink)           |

`split` is the "tp1 that computes the same two partials and adds them in rank order"; `emulated` runs the pair's
per-rank code (each rank its own replicated work) without a second process.
"""
from __future__ import annotations

import threading
from typing import Callable

from .comm.base import Collectives
from .comm.local import LocalCollectives
from .comm.solo import SoloCollectives
from .comm.emulated import ThreadCollectives
from .config import DrafterConfig
from .model.drafter import Drafter, Weights
from .model.layout import Layout

MODES = ("tp1", "split", "emulated", "solo", "pair")


def shard_weights(full: Weights, layout: Layout, rank: int) -> Weights:
    """Rank `rank`'s view of in-memory full weights through the layout table (replicated tensors are shared)."""
    out = {}
    for name, t in full.items():
        s = layout.slice_of(name, tuple(t.shape), rank)
        out[name] = t if s is None else t.narrow(s[0], s[1], s[2] - s[1]).contiguous()
    return out


def read_rank(ckpt, layout: Layout, rank: int, device="cpu", shared: Weights | None = None,
              progress: Callable[[int], None] | None = None, exl3_kernels: bool | None = None,
              staging=None) -> Weights:
    """Rank `rank`'s tensors straight from a checkpoint: only its slice of each split tensor is read. Replicated
    tensors already read for another rank can be passed in `shared` and are reused, not read again.

    EXL3 Linears stay as stored and multiply on exllamav3's kernels (`kernels/exl3_gemm.py`) when `exl3_kernels`
    (default: on a CUDA device where exllamav3 imports); otherwise, and for wo_a's group slices, they are decoded
    to fp16 (`weights/exl3.py`). `staging` (a `weights.staging.Staging`): plain tensors are read through it."""
    from .kernels import exl3_gemm             # (imports exllamav3 only when it multiplies)
    if exl3_kernels is None:        # (importing exllamav3 costs a restart seconds: only for a checkpoint that has EXL3)
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
    """One drafter of `mode` (not `emulated`: see `make_emulated`) from in-memory full weights or a checkpoint. `kw`
    goes to `Drafter` (its `kernels`: the exact reference unless handed others, `kernels.gemm.kernels_for`)."""
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
    """The emulated pair: rank 0's and rank 1's drafters, meeting through in-process collectives. Drive them with
    `run_pair` (each rank on its own thread, as each has its own process in the real pair)."""
    layout = Layout(cfg, 2)
    shards = _rank_weights(layout, [0, 1], full, ckpt, device)
    colls = ThreadCollectives.pair(timeout_s)
    return [Drafter(cfg, [shards[r]], [layout.vocab_range(r)[0]], colls[r], **kw) for r in (0, 1)]


def run_pair(fn0: Callable[[], object], fn1: Callable[[], object]) -> tuple[object, object]:
    """Run both ranks' work at once, one thread each; re-raise the first failure after both have ended."""
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
