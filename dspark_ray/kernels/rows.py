"""What every GPU kernel of the fast path shares, in one leaf module (no kernel imports another through gemm):
the row chunk the dense linears pad to, the fixed Triton tiles, and the allocators whose buffers a padded linear
reads in place."""
from __future__ import annotations

import torch

PAD_ROWS = 32
# Fixed Triton config. No autotune: autotuning picks the fastest config by timing in each process, so the
# reduction blocking, and with it the bits, would depend on the process and the load of the card.
BLOCK_N = 64
BLOCK_K = 128
NUM_WARPS = 4


def rows_empty(rows: int, width: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised (rows, width) tensor at the start of storage holding whole PAD_ROWS-row chunks: a padded
    linear reading it takes its chunks in place instead of copying (`gemm._padded_rows`). The fused kernels whose
    outputs feed linears allocate with this."""
    full = -(-max(rows, 1) // PAD_ROWS) * PAD_ROWS
    return torch.empty((full, width), dtype=dtype, device=device)[:rows]


def grouped_rows_empty(rows: int, groups: int, width: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised (rows, groups, width) view of a (groups, padded rows, width) buffer: the grouped linear's
    input layout (`gemm.padded_grouped_linear` reads it in place instead of copying each group's rows into it)."""
    full = -(-max(rows, 1) // PAD_ROWS) * PAD_ROWS
    buf = torch.empty((groups, full, width), dtype=dtype, device=device)
    return buf.as_strided((rows, groups, width), (width, full * width, 1))
