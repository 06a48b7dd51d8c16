"""Targets of the spawned children of test_event_pythonic.py (a module of their own: a spawned child imports the
module its target lives in, and a test module's conftest would point the child at another broker)."""

from __future__ import annotations

import ctypes
import multiprocessing
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
