"""Allocator of KV-pool slots: one slot holds one token's cached state in every layer.

The engine's memory budget is `max_total_tokens` slots; the model's KV cache is sized to match.
"""

from __future__ import annotations

import numpy as np


class TokenPool:
    def __init__(self, size: int) -> None:
        self.size = size
        self._free = np.arange(size - 1, -1, -1, dtype=np.int64)  # a stack: pop from the end
        self._top = size

    @property
    def available(self) -> int:
        return self._top

    def alloc(self, n: int) -> np.ndarray | None:
        """n free slots, or None when fewer are free (the caller evicts or retracts, then retries)."""
        if n > self._top:
            return None
        self._top -= n
        return self._free[self._top:self._top + n][::-1].copy()

    def free(self, slots: np.ndarray) -> None:
        n = len(slots)
        self._free[self._top:self._top + n] = slots
        self._top += n
