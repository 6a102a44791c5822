"""The finite check of fp16 taps, shared by the contract (wire bytes) and the drafter (CPU tensors)."""
from __future__ import annotations

import numpy as np

_U2, _I2 = np.dtype("<u2"), np.dtype("<i2")


def first_nonfinite_row(taps, width: int) -> int | None:
    """The first row of fp16 `taps` (any buffer) with an inf or nan, else None. Two integer maxes over the raw bits
    (docs/engine.md, "The host path"): a +inf/nan reads as int16 >= 0x7C00, a -inf/nan as uint16 >= 0xFC00."""
    bits = np.frombuffer(taps, _U2)
    if bits.size == 0 or (int(bits.view(_I2).max()) < 0x7C00 and int(bits.max()) < 0xFC00):
        return None
    return int(np.argmax(((bits & 0x7FFF) >= 0x7C00).reshape(-1, width).any(axis=1)))
