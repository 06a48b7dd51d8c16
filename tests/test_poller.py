"""The broker's selector (sockets/poller.py) reports what the standard library's epoll selector reports, for the
same registrations and the same events, and refuses what it refuses."""

from __future__ import annotations

import os
import selectors
import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from vmmshare.sockets.poller import Poller

R, W = selectors.EVENT_READ, selectors.EVENT_WRITE


@pytest.fixture(params=["poller", "stdlib"])
def make(request: pytest.FixtureRequest) -> Callable[[], selectors.BaseSelector]:
    return Poller if request.param == "poller" else selectors.EpollSelector  # type: ignore[return-value]


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    yield a, b
    a.close()
    b.close()


def _seen(sel: selectors.BaseSelector, timeout: float | None = 0) -> set[tuple[Any, int, Any]]:
    return {(key.fileobj, mask, key.data) for key, mask in sel.select(timeout)}


def _scenario(make: Callable[[], selectors.BaseSelector]) -> list[Any]:
    """One run of registrations and events; what each select said."""
    seen: list[Any] = []
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    sel = make()
    try:
        sel.register(b, R, "b")
        sel.register(r, R, "pipe")
        seen.append(sorted(map(repr, _seen(sel))))  # nothing readable
        a.send(b"x")
        os.write(w, b"y")
        seen.append(sorted((str(d), m) for _, m, d in _seen(sel)))
        sel.modify(b, R | W, "b2")  # readable and writable now
        seen.append(sorted((str(d), m) for _, m, d in _seen(sel)))
        sel.modify(b, R | W, "b3")  # the same events, new data
        seen.append(sorted((str(d), m) for _, m, d in _seen(sel)))
        sel.modify(b, W, "w")
        seen.append(sorted((str(d), m) for _, m, d in _seen(sel)))
        a.close()  # a hang-up: readable and writable, masked by what was asked for
        seen.append(sorted((str(d), m) for _, m, d in _seen(sel)))
        sel.unregister(b)
        seen.append(sorted((str(d), m) for _, m, d in _seen(sel)))
        seen.append((len(sel.get_map()), sel.get_map()[r].data, r in sel.get_map(), b in sel.get_map()))
        b.close()
        os.read(r, 1)
        seen.append(sorted((str(d), m) for _, m, d in _seen(sel)))
    finally:
        sel.close()
        for fd in (r, w):
            os.close(fd)
        a.close()
        b.close()
    return seen


def test_it_reports_what_the_standard_library_reports() -> None:
    assert _scenario(Poller) == _scenario(selectors.EpollSelector)


def test_a_timeout_waits_at_least_that_long_and_none_returns_what_is_ready(make: Any, pair: Any) -> None:
    import time

    a, b = pair
    sel = make()
    with sel:
        sel.register(b, R, 7)
        start = time.monotonic()
        assert sel.select(0.01) == []
        assert time.monotonic() - start >= 0.0099
        a.send(b"x")
        [(key, mask)] = sel.select(None)
        assert (key.fileobj, key.data, mask) == (b, 7, R)


def test_bad_registrations_get_the_standard_library_s_errors(make: Any, pair: Any) -> None:
    a, b = pair
    sel = make()
    with sel:
        sel.register(b, R)
        with pytest.raises(KeyError):
            sel.register(b, R)
        with pytest.raises(ValueError):
            sel.register(a, 0)
        with pytest.raises(ValueError):
            sel.register(a, 4)
        with pytest.raises(ValueError):
            sel.register(-1, R)
        with pytest.raises(ValueError):
            sel.register("not a file", R)
        with pytest.raises(KeyError):
            sel.unregister(a)
        with pytest.raises(KeyError):
            sel.modify(a, R)
        with pytest.raises(KeyError):
            sel.get_map()[a]
        assert len(sel.get_map()) == 1


def test_a_closed_fd_can_still_be_unregistered(make: Any) -> None:
    """The broker unregisters a connection whose socket the closer has let go already."""
    a, b = socket.socketpair()
    sel = make()
    with sel:
        fd = b.fileno()
        sel.register(fd, R, "gone")
        b.close()
        assert sel.unregister(fd).data == "gone"
        assert len(sel.get_map()) == 0
    a.close()
