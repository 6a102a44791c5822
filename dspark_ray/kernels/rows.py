"""What every fast-path GPU kernel shares: the row chunk, the fixed Triton tiles, in-place-readable allocators."""
from __future__ import annotations

import torch

PAD_ROWS = 32
# Fixed, never autotuned: a config picked by timing would make the bits depend on the process.
BLOCK_N = 64
BLOCK_K = 128
NUM_WARPS = 4


def rows_empty(rows: int, width: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(rows, width) at the start of whole PAD_ROWS-row chunks, so a padded linear reads it in place."""
    full = -(-max(rows, 1) // PAD_ROWS) * PAD_ROWS
    return torch.empty((full, width), dtype=dtype, device=device)[:rows]


def grouped_rows_empty(rows: int, groups: int, width: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(rows, groups, width) view of a (groups, padded rows, width) buffer, read in place by the grouped linear."""
    full = -(-max(rows, 1) // PAD_ROWS) * PAD_ROWS
    buf = torch.empty((groups, full, width), dtype=dtype, device=device)
    return buf.as_strided((rows, groups, width), (width, full * width, 1))
