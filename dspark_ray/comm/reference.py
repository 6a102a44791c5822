"""The push collectives' debug oracle: gather both payloads through a callable, combine by the model's rules
(`model/collectives.py`: torch's fp32 add in rank order, `combine_max`, `combine_top2`). Eager only; the push
kernels must equal it bit for bit.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..model.collectives import CollectiveError, Collectives, combine_max, combine_top2, reduce_in_rank_order

Gather = Callable[[torch.Tensor], list]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality of the bits (NaN payloads and signed zeros included), which torch.equal is not for NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == torch.float32:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    return torch.equal(a, b)


class ReferenceCollectives(Collectives):
    name = "reference"

    def __init__(self, rank: int, gather: Gather, world_size: int = 2):
        self.rank = rank
        self.world_size = world_size
        self.local_ranks = (rank,)
        self._gather_fn = gather

    def _gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        if t.is_cuda and torch.cuda.is_current_stream_capturing():
            raise CollectiveError("reference collectives are eager only (a gather cannot be captured)")
        got = self._gather_fn(t.contiguous())
        return [g.to(t.device) for g in got]

    def all_reduce(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        self.check_parts(parts)
        return reduce_in_rank_order(self._gather(parts[0]))

    def max_exchange(self, parts):
        self.check_parts(parts)
        m, i = parts[0]
        gm, gi = self._gather(m), self._gather(i)
        out = (gm[0], gi[0])
        for r in range(1, self.world_size):
            out = combine_max(out, (gm[r], gi[r]))
        return out

    def top2_exchange(self, parts):
        self.check_parts(parts)
        t1, t2, i = parts[0]
        g1, g2, gi = self._gather(t1), self._gather(t2), self._gather(i)
        out = (g1[0], g2[0], gi[0])
        for r in range(1, self.world_size):
            out = combine_top2(out, (g1[r], g2[r], gi[r]))
        return out


def gloo_gather(group=None) -> Gather:
    """A gather over torch.distributed (gloo): host copies, all_gather, back to the caller's device."""
    import torch.distributed as dist

    def gather(t: torch.Tensor) -> list[torch.Tensor]:
        host = t.detach().cpu()
        out = [torch.empty_like(host) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, host, group=group)
        return out
    return gather
