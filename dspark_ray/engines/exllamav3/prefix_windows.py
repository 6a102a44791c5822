"""The last window of rows before each cache-page boundary a sequence crossed, found again by the tokens before it.

exllamav3 starts a prompt whose leading pages it holds already (its prefix cache: a repeated prompt, a requeued
job, a shared system prompt) on those pages: the trunk never runs over them again, so the drafter is never handed
their rows. exllamav3's own drafter reads them from its draft cache's pages; this store gives the adapter the same
history for the window the service drafts from. Page boundaries only: the prefix cache holds whole pages.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


def prefix_key(tokens: np.ndarray) -> bytes:
    """The tokens before a boundary name the rows there: the trunk's taps are a function of them."""
    return hashlib.blake2b(np.ascontiguousarray(tokens, np.int64).tobytes(), digest_size=16).digest()


class PrefixWindows:
    """At most `capacity` windows, the least recently used dropped first (0: keeps none)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._windows: OrderedDict[bytes, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._windows)

    def put(self, key: bytes, ids: np.ndarray, taps: np.ndarray) -> None:
        if self.capacity <= 0:
            return
        self._windows[key] = (ids.copy(), taps.copy())
        self._windows.move_to_end(key)
        while len(self._windows) > self.capacity:
            self._windows.popitem(last=False)

    def get(self, key: bytes) -> tuple[np.ndarray, np.ndarray] | None:
        """(ids, taps) of the rows just before the boundary, or None."""
        found = self._windows.get(key)
        if found is not None:
            self._windows.move_to_end(key)
        return found

    def clear(self) -> None:
        self._windows.clear()
