"""Targets of the spawned children of test_event_pythonic.py and test_torch_events.py (a module of their own: a
spawned child imports the module its target lives in, and a test module's conftest would point the child at another
broker), and the held stream both use."""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import threading
from collections.abc import Iterator
from typing import Any


def consumer(q: multiprocessing.Queue[Any], back: multiprocessing.Queue[Any]) -> None:
    """Receive (memory, event, event), say whether the event is done and whether both arrivals are one object,
    wait on it, then read the memory."""
    memory, ev, ev_again = q.get()
    m = memory.map()
    back.put(("opened", ev.done, ev is ev_again))
    ev.wait()
    back.put(("read", ctypes.string_at(m.ptr, 18)))
    m.close()
    memory.close()
    ev.close()


def tensor_consumer(q: multiprocessing.Queue[Any], back: multiprocessing.Queue[Any]) -> None:
    """Receive a reduced tensor (or, with install(), a tensor), say so, rebuild it (waiting for its event), and
    send back its sum."""
    got = q.get()
    back.put("got")
    t = got[0](*got[1]) if isinstance(got, tuple) else got
    back.put(float(t.sum().item()))


def installed_consumer(q: Any, back: Any) -> None:
    """A torch.multiprocessing child: the tensor arrives through install()'s reduction (its rebuild waits)."""
    back.put("ready")
    t = q.get()
    back.put(float(t.sum().item()))


@contextlib.contextmanager
def held_stream() -> Iterator[tuple[int, threading.Event]]:
    """A stream of this thread's context, busy with a task the test holds until the block ends."""
    from vmmshare._process import runtime

    rt = runtime()
    rt.devices.set(0)
    stream = rt.devices.create_stream()
    gate = threading.Event()
    rt.devices.stream(stream).submit("a task the test holds", gate.wait)
    try:
        yield stream, gate
    finally:
        gate.set()
        rt.devices.destroy_stream(stream)
        rt.devices.reset(0)
