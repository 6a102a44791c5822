"""tp1 and the split reference: every shard in the caller's hands, combined in rank order."""
from __future__ import annotations

from .base import Collectives, combine_max, combine_top2, fold, reduce_in_rank_order


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
