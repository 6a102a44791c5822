"""The finite check of fp16 taps (wire bytes, CPU tensors): integer maxes over the bits (docs/engine.md)."""
from __future__ import annotations

import numpy as np

_U2, _I2 = np.dtype("<u2"), np.dtype("<i2")


def first_nonfinite_row(taps, width: int) -> int | None:
    """The first row with an inf or nan, else None; +inf/nan is int16 >= 0x7C00, -inf/nan uint16 >= 0xFC00."""
    bits = np.frombuffer(taps, _U2)
    if bits.size == 0 or (int(bits.view(_I2).max()) < 0x7C00 and int(bits.max()) < 0xFC00):
        return None
    return int(np.argmax(((bits & 0x7FFF) >= 0x7C00).reshape(-1, width).any(axis=1)))
