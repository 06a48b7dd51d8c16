"""A sorted table of non-overlapping address ranges, for finding what lives at a pointer."""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from typing import Generic, TypeVar

T = TypeVar("T")


class Intervals(Generic[T]):
    """Maps disjoint ranges ``[start, end)`` to values; lookup by any address inside (O(log n)), and by a range's
    start (what adding, removing and `exact` do) in one dict operation."""

    def __init__(self) -> None:
        self._starts: list[int] = []  # sorted, for the lookups by an address inside
        self._ranges: dict[int, tuple[int, T]] = {}  # start -> (end, value)

    def __len__(self) -> int:
        return len(self._starts)

    def add(self, start: int, size: int, value: T) -> None:
        """Record `[start, start + size)` (the caller knows it overlaps none: `overlaps`)."""
        insort(self._starts, start)
        self._ranges[start] = (start + size, value)

    def remove(self, start: int) -> T:
        """Drop the range that begins exactly at `start` (KeyError if none does); its value."""
        value = self._ranges.pop(start)[1]
        starts = self._starts
        del starts[bisect_left(starts, start)]
        return value

    def at(self, addr: int) -> tuple[int, int, T] | None:
        """The (start, end, value) whose range holds `addr`, or None."""
        starts = self._starts
        i = bisect_right(starts, addr)
        if i:
            start = starts[i - 1]
            end, value = self._ranges[start]
            if addr < end:
                return start, end, value
        return None

    def exact(self, start: int) -> T | None:
        """The value of the range that begins exactly at `start`, or None."""
        hit = self._ranges.get(start)
        return None if hit is None else hit[1]

    def overlaps(self, start: int, size: int) -> bool:
        starts = self._starts
        i = bisect_left(starts, start + size)
        return i > 0 and self._ranges[starts[i - 1]][0] > start
