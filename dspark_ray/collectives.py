"""Where the two halves of the pair meet: one interface, one backend per way of meeting.

The drafter holds the shards of the ranks that live in this process (`local_ranks`: both in `emulated`, one in
`pair` / `solo`, the single unsplit rank in `tp1`) and hands the collectives one partial per local shard, in rank
order. Three operations, all exact:

* `all_reduce(parts)`: the fp32 sum P0 + P1 of the two ranks' fp32 partials, added in rank order with no further
  rounding, so both ranks hold the same bits and the replicated residual streams never diverge.
* `max_exchange(parts)`: per row the global (max, index) of the split vocabulary; a tie goes to the lower id,
  i.e. rank 0, whose ids are lower (as one card would pick with torch.argmax).
* `top2_exchange(parts)`: per row (top1, top2, index) of the union, for the margins the client may ask for.

Backends here: `LocalCollectives` (every shard in one caller: tp1, and the split reference that computes both
partials itself), `ThreadCollectives` (the emulated pair: both ranks in one process, each on its own thread,
meeting through shared tensors), `SoloCollectives` (one rank of a pair with local stand-ins, to time one rank's
compute), `GlooCollectives` (two processes over torch.distributed gloo: the CPU pair). The NVLink push backend lives in `kernels/`. Choosing a backend is a
start-up decision (`make_collectives`), never an `if` on the hot path.
"""
from __future__ import annotations

import contextlib
import atexit
import datetime
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


class _Rendezvous:
    """Where the two threads of an emulated pair meet: each posts its payload, both read both."""

    def __init__(self, world_size: int, timeout_s: float):
        import threading
        self.slots: list = [None] * world_size
        self.barrier = threading.Barrier(world_size)
        self.timeout_s = timeout_s

    def exchange(self, rank: int, payload):
        import threading
        self.slots[rank] = payload
        try:
            self.barrier.wait(self.timeout_s)
            got = list(self.slots)
            self.barrier.wait(self.timeout_s)       # nobody overwrites a slot before both have read it
        except threading.BrokenBarrierError:
            self.barrier.abort()
            raise CollectiveError(f"emulated pair: rank {rank} waited {self.timeout_s} s for its peer") from None
        return got


class ThreadCollectives(Collectives):
    """One rank of the emulated pair. Both ranks run in this process, each on its own thread, and combine the
    exchanged payloads with the same tensor ops in the same rank order as the real pair."""

    name = "emulated"

    def __init__(self, rank: int, rendezvous: _Rendezvous):
        self.world_size = len(rendezvous.slots)
        self.local_ranks = (rank,)
        self.rank, self.rv = rank, rendezvous

    @staticmethod
    def pair(timeout_s: float = 30.0) -> list["ThreadCollectives"]:
        rv = _Rendezvous(2, timeout_s)
        return [ThreadCollectives(0, rv), ThreadCollectives(1, rv)]

    def all_reduce(self, parts):
        self.check_parts(parts)
        return reduce_in_rank_order(self.rv.exchange(self.rank, parts[0]))

    def max_exchange(self, parts):
        self.check_parts(parts)
        return fold(self.rv.exchange(self.rank, parts[0]), combine_max)

    def top2_exchange(self, parts):
        self.check_parts(parts)
        return fold(self.rv.exchange(self.rank, parts[0]), combine_top2)

    def close(self) -> None:
        self.rv.barrier.abort()


class SoloCollectives(Collectives):
    """One rank of a pair, alone: the collectives become local stand-ins (the partial is doubled, the local argmax
    wins). The numbers are not the pair's; the compute time is one rank's share, which is what `solo` measures."""

    name = "solo"
    capturable = True

    def __init__(self, rank: int = 0):
        self.world_size = 2
        self.local_ranks = (rank,)

    def all_reduce(self, parts):
        self.check_parts(parts)
        return parts[0] + parts[0]

    def max_exchange(self, parts):
        self.check_parts(parts)
        return parts[0]

    def top2_exchange(self, parts):
        self.check_parts(parts)
        return parts[0]


class GlooCollectives(Collectives):
    """The CPU pair: two processes meeting through torch.distributed's gloo backend.

    Each exchange is an all-gather of the local payload (so both ranks add P0 + P1 in rank order themselves: the
    sum's bits do not depend on gloo's reduction order). A gloo failure or timeout raises `CollectiveError`.
    """

    name = "gloo"

    def __init__(self, rank: int, world_size: int = 2, *, init_method: str | None = None,
                 group=None, timeout_s: float = 30.0):
        import torch.distributed as dist
        self.dist = dist
        self.world_size = world_size
        self.rank = rank
        self.local_ranks = (rank,)
        self._own_pg = False
        if group is None:
            if not dist.is_initialized():
                dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                                        timeout=datetime.timedelta(seconds=timeout_s))
                self._own_pg = True
                # A process that exits with its gloo group alive aborts in the group's C++ destructor ("terminate
                # called without an active exception": its threads are still joinable), after its work is done;
                # seen in 2 of ~27 two-process runs, and in 7 of 15 of a plain all-reduce loop that never closed.
                atexit.register(self.close)
            group = dist.group.WORLD
        self.group = group

    def _gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        try:
            self.dist.all_gather(out, t, group=self.group)
        except Exception as e:      # gloo raises RuntimeError on timeouts and peer loss
            raise CollectiveError(f"gloo all_gather failed on rank {self.rank}: {e}") from e
        return out

    def all_reduce(self, parts):
        self.check_parts(parts)
        return reduce_in_rank_order(self._gather(parts[0]))

    def max_exchange(self, parts):
        self.check_parts(parts)
        m, i = parts[0]
        packed = torch.stack([m.double(), i.double()])        # fp32 and int < 2^53 travel exactly as fp64
        return fold([(p[0].float(), p[1].long()) for p in self._gather(packed)], combine_max)

    def top2_exchange(self, parts):
        self.check_parts(parts)
        t1, t2, i = parts[0]
        g = self._gather(torch.stack([t1.double(), t2.double(), i.double()]))
        return fold([(p[0].float(), p[1].float(), p[2].long()) for p in g], combine_top2)

    def close(self) -> None:
        if self._own_pg and self.dist.is_initialized():
            self._own_pg = False
            self.dist.destroy_process_group()
        atexit.unregister(self.close)
