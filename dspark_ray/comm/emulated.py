"""The emulated pair: both ranks in one process, each on its own thread, meeting through shared Python objects
(the CPU tests' pair, bit for bit the real pair's arithmetic)."""
from __future__ import annotations

from ..model.collectives import CollectiveError, Collectives, combine_max, combine_top2, fold, reduce_in_rank_order


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
    """One rank of the emulated pair: the same tensor ops in the same rank order as the real pair."""

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
