"""The CPU pair: two processes over torch.distributed's gloo backend (also the push pair's start-up channel)."""
from __future__ import annotations

import atexit
import datetime

import torch

from ..model.collectives import CollectiveError, Collectives, combine_max, combine_top2, fold, reduce_in_rank_order


class GlooCollectives(Collectives):
    """Each exchange is an all-gather, so both ranks add P0 + P1 in rank order themselves: the sum's bits do not
    depend on gloo's reduction order."""

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
                # A process exiting with its gloo group alive can abort in the group's C++ destructor
                # ("terminate called without an active exception").
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
