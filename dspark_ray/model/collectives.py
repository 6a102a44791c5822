"""The reductions the model takes from outside: the interface every backend implements (the backends live in
`comm/`, which imports this; the model imports nothing of `comm/`), the exact rules by which two ranks' partials
combine (sums in rank order with no further rounding, so replicated residuals never diverge; argmax ties to the
lower id, rank 0), and `LocalCollectives`, the model's own default when every shard is in the caller's hands.
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
    out = parts[0]
    for p in parts[1:]:
        out = combine(out, p)
    return out


def reduce_in_rank_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """P0 + P1 (+ ...) added in rank order, no further rounding: the same bits on every rank."""
    return fold(parts)


@dataclass
class CaptureInfo:
    n_collectives: int = 0          # push keeps its epoch book by it


class Collectives(ABC):
    """One way for the ranks of a pair to meet. `local_ranks` are the ranks whose partials this process passes."""

    # Device ops and the push kernels can be recorded in a CUDA graph; host-side meetings (gloo, threads) cannot.
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
        """Raise CollectiveError if a collective of the step failed (device backends read their error word here)."""

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return f"{self.name} (world {self.world_size}, local ranks {list(self.local_ranks)})"

    def max_rows(self, width: int) -> int | None:
        """Most rows of `width` values one collective carries (None: no bound); no graph set drafts wider."""
        return None

    @contextlib.contextmanager
    def graph_capture(self):
        if not self.capturable:
            raise CollectiveError(f"{self.name} collectives cannot be captured in a CUDA graph")
        yield CaptureInfo()

    def replay(self, graph, n_collectives: int) -> None:
        graph.replay()

    def status_region(self) -> tuple[int, int] | None:
        """(device address, bytes) of the words saying whether the step's collectives failed; a captured step
        downloads them with its outputs for check_status, saving a round trip. None: check() only."""
        return None

    def check_status(self, words) -> None:
        """check() from the status_region() words, copied behind the step's work on a synchronised stream."""
        self.check()


class LocalCollectives(Collectives):
    """Every shard of the group is in the caller's hands: `tp1` (one unsplit rank), or the split reference (one
    caller computing both ranks' partials and adding them in rank order, as the pair does)."""

    capturable = True

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.local_ranks = tuple(range(world_size))
        self.name = "tp1" if world_size == 1 else "split"

    def all_reduce(self, parts):
        self.check_parts(parts)
        return reduce_in_rank_order(parts)

    def max_exchange(self, parts):
        self.check_parts(parts)
        return fold(parts, combine_max)

    def top2_exchange(self, parts):
        self.check_parts(parts)
        return fold(parts, combine_top2)
