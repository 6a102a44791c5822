"""One rank of a pair timed alone: the collectives become local stand-ins."""
from __future__ import annotations

from ..model.collectives import Collectives


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
