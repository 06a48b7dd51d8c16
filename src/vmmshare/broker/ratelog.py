"""Logging that a flood cannot turn into a flood of log lines: each kind of message is written at most `burst`
times a `period`, then once more with the number left out."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class RateLimitedLog:
    """`log(level, key, message, *args)` writes at most `burst` messages of each `key` per `period` seconds."""

    MAX_KEYS = 1024  # kinds of message remembered at once (keys come from a small fixed set in practice)

    def __init__(self, logger: logging.Logger, period: float = 10.0, burst: int = 5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.period, self.burst, self.clock = logger, period, burst, clock
        self._windows: dict[str, list[float]] = {}  # key -> [window start, written, left out]

    def log(self, level: int, key: str, message: str, *args: object) -> None:
        now = self.clock()
        window = self._windows.get(key)
        if window is None or now - window[0] >= self.period:
            if window is not None and window[2]:
                self.logger.log(level, "(%d more like %r in the last %.0f s)", int(window[2]), key, now - window[0])
            if len(self._windows) >= self.MAX_KEYS:
                self._windows.clear()
            window = self._windows[key] = [now, 0, 0]
        if window[1] < self.burst:
            window[1] += 1
            self.logger.log(level, message, *args)
        else:
            window[2] += 1
