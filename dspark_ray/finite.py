"""The finite check of fp16 taps, shared by the contract (wire bytes) and the drafter (CPU tensors)."""
from __future__ import annotations

import numpy as np

_U2, _I2 = np.dtype("<u2"), np.dtype("<i2")


def first_nonfinite_row(taps, width: int) -> int | None:
    """The first row of fp16 `taps` (any buffer: bytes, a contiguous array) holding an inf or nan, else None.

    An fp16 inf/nan has all exponent bits set: (bits & 0x7FFF) >= 0x7C00. Integer maxes are several times faster
    than np.isfinite or torch.isfinite on fp16 (docs/engine.md, "The host path"). The scan takes two maxes over the
    bytes as they are instead of masking the sign into a temporary first: with the sign set, the bits read as int16
    are negative, so a positive inf/nan is an int16 >= 0x7C00 and a negative one a uint16 >= 0xFC00 (checked on all
    65536)."""
    bits = np.frombuffer(taps, _U2)
    if bits.size == 0 or (int(bits.view(_I2).max()) < 0x7C00 and int(bits.max()) < 0xFC00):
        return None
    return int(np.argmax(((bits & 0x7FFF) >= 0x7C00).reshape(-1, width).any(axis=1)))
