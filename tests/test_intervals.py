"""The address-range table the runtime finds allocations, reservations and mappings by, against a plain model."""

from __future__ import annotations

import random

import pytest

from vmmshare.intervals import Intervals


def test_it_answers_as_a_list_of_ranges_does() -> None:
    rng = random.Random(7)
    table: Intervals[int] = Intervals()
    model: dict[int, tuple[int, int]] = {}  # start -> (end, value)

    def overlaps(start: int, end: int) -> bool:
        return any(s < end and start < e for s, (e, _) in model.items())

    for step in range(3000):
        start, size = rng.randrange(0, 400) * 8, rng.randrange(1, 12) * 8
        if rng.random() < 0.55:
            assert table.overlaps(start, size) == overlaps(start, start + size)
            if not overlaps(start, start + size):
                table.add(start, size, step)
                model[start] = (start + size, step)
        elif model and rng.random() < 0.7:
            gone = rng.choice(sorted(model))
            assert table.remove(gone) == model.pop(gone)[1]
        else:
            with pytest.raises(KeyError):
                table.remove(start if start not in model else -1)
        addr = rng.randrange(0, 3300)
        inside = [(s, e, v) for s, (e, v) in model.items() if s <= addr < e]
        assert table.at(addr) == (inside[0] if inside else None)
        assert table.exact(addr) == (model[addr][1] if addr in model else None)
        assert len(table) == len(model)
