"""What the generator takes as the drafter's cache: the state lives in the service."""
from __future__ import annotations

from types import SimpleNamespace


class DraftCache:
    """Holds nothing; defragmentation's call for its tensors (pages are about to move) frees every slot."""

    def __init__(self, cache, on_defrag):
        self.max_num_tokens = cache.max_num_tokens
        self.initialized = True
        self.max_history = 0
        self.model = SimpleNamespace(loaded_tp=False)
        self._on_defrag = on_defrag

    def get_all_tensors(self) -> list:
        self._on_defrag()
        return []

    def copy_page(self, source, from_page: int, to_page: int, num_tokens: int) -> None:
        """Nothing to copy (exllamav3 copies partial pages only for trunks without recurrent state)."""
