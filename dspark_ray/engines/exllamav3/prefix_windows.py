"""The last window of rows before each cache-page boundary a sequence crossed, found again by the tokens before it.

exllamav3 starts a prompt whose leading pages it holds already (its prefix cache: a repeated prompt, a requeued
job, a shared system prompt) on those pages: the trunk never runs over them again, so the drafter is never handed
their rows. exllamav3's own drafter reads them from its draft cache's pages; this store gives the adapter the same
history for the window the service drafts from. Page boundaries only: the prefix cache holds whole pages.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Callable

import numpy as np

PAGE_SIZE = 256              # exllamav3's cache page (generator/pagetable.py)


class PrefixKeys:
    """One sequence's keys, page by page: a boundary's key hashes the one before it and the page's tokens (the
    trunk's taps are a function of the tokens before them), so each page is hashed once however long the prompt."""

    def __init__(self, tokens: Callable[[int, int], np.ndarray]):
        self.tokens = tokens                 # token ids at positions [a, b)
        self.reset()

    def reset(self) -> None:
        """The tokens may have changed (a rewind): hash from the start again."""
        self.at, self.key = 0, b""

    def at_boundary(self, b: int) -> bytes:
        if b < self.at:
            self.reset()
        ids = np.ascontiguousarray(self.tokens(self.at, b), np.dtype("<i8"))
        for p in range(0, b - self.at, PAGE_SIZE):
            self.key = hashlib.blake2b(self.key + ids[p:p + PAGE_SIZE].tobytes(), digest_size=16).digest()
        self.at = b
        return self.key


class PrefixWindows:
    """At most `capacity` windows of `window` rows, the least recently used dropped first (0: keeps none)."""

    def __init__(self, capacity: int, window: int):
        self.capacity, self.window = capacity, window
        self._windows: OrderedDict[bytes, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._windows)

    def boundaries(self, start: int, end: int) -> range:
        """The page boundaries b in (start, end] with a whole window before them."""
        if self.capacity <= 0:
            return range(0)
        first = max(-(-(start + 1) // PAGE_SIZE), -(-self.window // PAGE_SIZE)) * PAGE_SIZE
        return range(first, end + 1, PAGE_SIZE)

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
