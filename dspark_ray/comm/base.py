"""The interface every way of meeting implements, and the exact rules by which two ranks' partials combine.

The drafter holds the shards of the ranks that live in this process (`local_ranks`: both in `emulated`, one in
`pair` / `solo`, the single unsplit rank in `tp1`) and hands the collectives one partial per local shard, in rank
order. Three operations, all exact:

* `all_reduce(parts)`: the fp32 sum P0 + P1 of the two ranks' fp32 partials, added in rank order with no further
  rounding, so both ranks hold the same bits and the replicated residual streams never diverge.
* `max_exchange(parts)`: per row the global (max, index) of the split vocabulary; a tie goes to the lower id,
  i.e. rank 0, whose ids are lower (as one card would pick with torch.argmax).
* `top2_exchange(parts)`: per row (top1, top2, index) of the union, for the margins the client may ask for.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import torch

MaxPart = tuple[torch.Tensor, torch.Tensor]                   # (max fp32 (n,), global index int64 (n,))
Top2Part = tuple[torch.Tensor, torch.Tensor, torch.Tensor]    # (top1, top2 fp32 (n,), index of top1 int64 (n,))


class CollectiveError(RuntimeError):
    """A collective did not complete. Its output must never be used: the step fails closed."""


def _b_wins(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (b > a) | (torch.isnan(a) & ~torch.isnan(b))


def combine_max(a: MaxPart, b: MaxPart) -> MaxPart:
    """(max, index) of rank 0's part `a` and rank 1's part `b`. `b` wins only if strictly larger: rank 0 holds
    the lower ids, so a tie goes to the lower id. A NaN never wins over a number; both NaN keeps rank 0."""
    take_b = _b_wins(a[0], b[0])
    return torch.where(take_b, b[0], a[0]), torch.where(take_b, b[1], a[1])


def combine_top2(a: Top2Part, b: Top2Part) -> Top2Part:
    """Top-1, top-2 and top-1's index of the union of two disjoint vocab slices (rank 0's `a` first)."""
    take_b = _b_wins(a[0], b[0])
    top1 = torch.where(take_b, b[0], a[0])
    idx = torch.where(take_b, b[2], a[2])
    # The runner-up is the larger of the loser's top1 and the winner's top2.
    top2 = torch.where(take_b, torch.maximum(a[0], b[1]), torch.maximum(a[1], b[0]))
    return top1, top2, idx


def fold(parts: Sequence, combine=lambda a, b: a + b):
    """Combine the ranks' payloads in rank order: P0 + P1 for sums, combine_max / combine_top2 for the argmax."""
    out = parts[0]
    for p in parts[1:]:
        out = combine(out, p)
    return out


def reduce_in_rank_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """P0 + P1 (+ ...) added in rank order, no further rounding: the same bits on every rank."""
    return fold(parts)


@dataclass
class CaptureInfo:
    n_collectives: int = 0          # how many collectives a captured graph holds (push keeps its epoch book by it)


class Collectives(ABC):
    """One way for the ranks of a pair to meet. `local_ranks` are the ranks whose partials this process passes."""

    # Whether a CUDA graph may record these collectives: pure device ops (tp1, split, solo) and the push kernels
    # can; host-side meetings (gloo, the emulated pair's threads) cannot.
    capturable: bool = False

    name: str = "?"
    world_size: int = 1
    local_ranks: tuple[int, ...] = (0,)

    def check_parts(self, parts: Sequence) -> None:
        if len(parts) != len(self.local_ranks):
            raise CollectiveError(f"{self.name}: got {len(parts)} partials for local ranks {self.local_ranks}")

    @abstractmethod
    def all_reduce(self, parts: Sequence[torch.Tensor]) -> torch.Tensor: ...

    @abstractmethod
    def max_exchange(self, parts: Sequence[MaxPart]) -> MaxPart: ...

    @abstractmethod
    def top2_exchange(self, parts: Sequence[Top2Part]) -> Top2Part: ...

    def check(self) -> None:
        """Raise CollectiveError if a collective of the step failed. Backends whose collectives run asynchronously
        on a device (push) read their error word here, once per step; the host backends raise inline."""

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return f"{self.name} (world {self.world_size}, local ranks {list(self.local_ranks)})"

    def max_rows(self, width: int) -> int | None:
        """Most rows one collective carries for rows of `width` values (an all-reduce of (rows, width) partials, an
        exchange of `rows` tops); None: no bound. A graph set drafts no wider batch (graphs.GraphSet)."""
        return None

    @contextlib.contextmanager
    def graph_capture(self):
        """Wrap a torch.cuda.graph capture of a step (push counts the collectives recorded)."""
        if not self.capturable:
            raise CollectiveError(f"{self.name} collectives cannot be captured in a CUDA graph")
        yield CaptureInfo()

    def replay(self, graph, n_collectives: int) -> None:
        """Replay a graph captured under graph_capture() (push checks and advances its epoch book first)."""
        graph.replay()

    def status_region(self) -> tuple[int, int] | None:
        """(device address, bytes) of words that say whether the step's collectives failed. A captured step copies
        them to the host behind its last collective, in the same download as its outputs, and hands them to
        check_status: the fail-closed check without a device round trip of its own. None: check() only."""
        return None

    def check_status(self, words) -> None:
        """check(), judged from the words status_region() names, copied after the step's work on a stream the
        caller has synchronised."""
        self.check()
