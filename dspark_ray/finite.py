"""The finite check of fp16 taps, shared by the contract (wire bytes) and the drafter (CPU tensors)."""
from __future__ import annotations

import numpy as np


def first_nonfinite_row(taps, width: int) -> int | None:
    """The first row of fp16 `taps` (any buffer: bytes, a contiguous array) holding an inf or nan, else None.

    An fp16 inf/nan has all exponent bits set: (bits & 0x7FFF) >= 0x7C00. One integer max is ~5x faster than
    np.isfinite on fp16 and ~14x faster than torch.isfinite on a CPU fp16 tensor (measured: 5 us vs 10 us for 6
    rows x 768; 0.5 ms vs 3.7 ms for 128 rows x 15360; 11 us vs 157 us for 3 rows x 15360 against torch)."""
    bits = np.frombuffer(taps, np.dtype("<u2")) & 0x7FFF
    if bits.size == 0 or int(bits.max()) < 0x7C00:
        return None
    return int(np.argmax((bits >= 0x7C00).reshape(-1, width).any(axis=1)))
