"""A sorted table of non-overlapping address ranges, for finding what lives at a pointer."""

from __future__ import annotations

import bisect
from typing import Generic, TypeVar

T = TypeVar("T")


class Intervals(Generic[T]):
    """Maps disjoint ranges ``[start, end)`` to values; lookup by any address inside (O(log n))."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._values: list[T] = []

    def __len__(self) -> int:
        return len(self._starts)

    def add(self, start: int, size: int, value: T) -> None:
        i = bisect.bisect_left(self._starts, start)
        self._starts.insert(i, start)
        self._ends.insert(i, start + size)
        self._values.insert(i, value)

    def remove(self, start: int) -> T:
        i = bisect.bisect_left(self._starts, start)
        if i == len(self._starts) or self._starts[i] != start:
            raise KeyError(start)
        del self._starts[i], self._ends[i]
        return self._values.pop(i)

    def at(self, addr: int) -> tuple[int, int, T] | None:
        """The (start, end, value) whose range holds `addr`, or None."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0 and addr < self._ends[i]:
            return self._starts[i], self._ends[i], self._values[i]
        return None

    def exact(self, start: int) -> T | None:
        """The value of the range that begins exactly at `start`, or None."""
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] == start:
            return self._values[i]
        return None

    def overlaps(self, start: int, size: int) -> bool:
        i = bisect.bisect_left(self._starts, start + size)
        return i > 0 and self._ends[i - 1] > start
