"""The broker's selector: epoll behind the standard library's `selectors.BaseSelector` interface, with a `select`
that does less per call than `selectors.EpollSelector`'s (the broker calls it at least once a request).

It reports what `selectors.EpollSelector` reports (a hang-up or an error as both readable and writable, masked by
what the key asked for) and takes the same arguments; `tests/test_poller.py` runs both side by side.
"""

from __future__ import annotations

import contextlib
import math
import select
import selectors
from collections.abc import Iterator, Mapping
from typing import Any

EVENT_READ, EVENT_WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
_IN, _OUT = select.EPOLLIN, select.EPOLLOUT


def _fd_of(fileobj: Any) -> int:
    """The fd of a file object or an int, with the errors `selectors` gives."""
    if isinstance(fileobj, int):
        fd = fileobj
    else:
        try:
            fd = int(fileobj.fileno())
        except (AttributeError, TypeError, ValueError):
            raise ValueError(f"Invalid file object: {fileobj!r}") from None
    if fd < 0:
        raise ValueError(f"Invalid file descriptor: {fd}")
    return fd


def _events_of(event: int) -> int:
    """selectors' reading of an epoll event: anything but EPOLLIN counts as writable, anything but EPOLLOUT as
    readable (so a hang-up or an error wakes both a reader and a writer)."""
    return (EVENT_WRITE if event & ~_IN else 0) | (EVENT_READ if event & ~_OUT else 0)


class _Keys(Mapping[Any, selectors.SelectorKey]):
    """get_map(): the keys by file object (or fd)."""

    def __init__(self, keys: dict[int, selectors.SelectorKey]) -> None:
        self._keys = keys

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, fileobj: Any) -> selectors.SelectorKey:
        try:
            return self._keys[_fd_of(fileobj)]
        except ValueError:
            raise KeyError(fileobj) from None

    def __iter__(self) -> Iterator[Any]:
        return (key.fileobj for key in self._keys.values())


class Poller(selectors.BaseSelector):
    """An epoll selector (see the module's docstring)."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._keys: dict[int, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        if not events or events & ~(EVENT_READ | EVENT_WRITE):
            raise ValueError(f"Invalid events: {events!r}")
        fd = _fd_of(fileobj)
        if fd in self._keys:
            raise KeyError(f"{fileobj!r} (FD {fd}) is already registered")
        key = selectors.SelectorKey(fileobj, fd, events, data)
        self._epoll.register(fd, (_IN if events & EVENT_READ else 0) | (_OUT if events & EVENT_WRITE else 0))
        self._keys[fd] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        try:
            key = self._keys.pop(_fd_of(fileobj))
        except ValueError:
            raise KeyError(fileobj) from None
        with contextlib.suppress(OSError):  # closed already: the kernel dropped it from the set then
            self._epoll.unregister(key.fd)
        return key

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        try:
            key = self._keys[_fd_of(fileobj)]
        except ValueError:
            raise KeyError(fileobj) from None
        if events != key.events:
            if not events or events & ~(EVENT_READ | EVENT_WRITE):
                raise ValueError(f"Invalid events: {events!r}")
            self._epoll.modify(key.fd, (_IN if events & EVENT_READ else 0) | (_OUT if events & EVENT_WRITE else 0))
        key = key._replace(events=events, data=data)
        self._keys[key.fd] = key
        return key

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            wait = -1.0
        elif timeout <= 0:
            wait = 0.0
        else:
            wait = math.ceil(timeout * 1e3) * 1e-3  # epoll counts milliseconds: never wake before the timeout
        keys = self._keys
        try:
            got = self._epoll.poll(wait, len(keys) or 1)
        except InterruptedError:
            return []
        ready = []
        for fd, event in got:
            key = keys.get(fd)
            if key is not None:
                ready.append((key, (EVENT_READ if event == _IN else _events_of(event)) & key.events))
        return ready

    def close(self) -> None:
        self._epoll.close()
        self._keys.clear()

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return _Keys(self._keys)
