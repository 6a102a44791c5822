"""A sequence's last context rows (token ids and taps) on the host: what a fresh slot's insert needs."""
from __future__ import annotations

import numpy as np


class RowWindow:
    """The rows at positions [first, end), at most `2 * keep`, compacted to the last `keep` once every `keep` rows."""

    def __init__(self, width: int, keep: int, first: int = 0):
        self.keep = keep
        self._ids = np.empty(2 * keep, np.int32)
        self._taps = np.empty((2 * keep, width), np.float16)
        self.first, self.n = first, 0

    @property
    def ids(self) -> np.ndarray:
        return self._ids[:self.n]

    @property
    def taps(self) -> np.ndarray:
        return self._taps[:self.n]

    @property
    def end(self) -> int:
        return self.first + self.n

    def restart(self, at: int) -> None:
        """Hold nothing, the next row at `at`."""
        self.first, self.n = at, 0

    def rows(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(ids, taps) views of positions [a, b), or None when the window does not hold them all."""
        if a < self.first or b > self.end:
            return None
        return self.ids[a - self.first:b - self.first], self.taps[a - self.first:b - self.first]

    def append(self, start: int, ids: np.ndarray, taps: np.ndarray) -> None:
        """Rows from position `start`; a gap (or an overlap) starts the window again there."""
        if start != self.end:
            self.restart(start)
        if len(ids) > self.keep:                     # only the last `keep` can ever be sent
            cut = len(ids) - self.keep
            ids, taps, start = ids[cut:], taps[cut:], start + cut
            self.restart(start)
        k = len(ids)
        if self.n + k > len(self._ids):
            drop = self.n + k - self.keep
            self._ids[:self.n - drop] = self._ids[drop:self.n]
            self._taps[:self.n - drop] = self._taps[drop:self.n]
            self.first, self.n = self.first + drop, self.n - drop
        self._ids[self.n:self.n + k] = ids
        self._taps[self.n:self.n + k] = taps
        self.n += k
