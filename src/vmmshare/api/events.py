"""`Event`: the Pythonic IPC event. A producer writes, then records; a consumer waits, then reads. It travels with
the memory it guards: pickled (a multiprocessing Queue, Pipe or Process argument, or `vmmshare.torch`'s sharing),
the receiver opens it by its 64-byte handle.

    ev = vmmshare.Event()              # producer
    ... write the shared memory ...
    ev.record()                        # what this thread wrote is ready (or ev.record(stream): when the stream is)
    queue.put((memory, ev))
    memory, ev = queue.get()           # consumer
    ev.wait()                          # returns once the producer's record completed (AclError if it died first)
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref

from .. import constants as C
from .._process import runtime
from ..errors import InvalidParamError
from ..runtime.events import HANDLE_SIZE
from ..wire.props import check_device, check_int, check_ptr
from ._finalize import Finalizer
from ._owned import Owned

__all__ = ["Event"]


class Event(Owned):
    """An IPC event (ACL_EVENT_IPC) of this process: made here (`Event(device)`) or opened from another's handle."""

    _finalizer: Finalizer
    _handle: int
    _bytes: bytes  # its IPC handle (a forked child opens it by these bytes)
    opened = False  # opened from another process's handle (not made here)

    def __init__(self, device: int = 0) -> None:
        events = runtime().events
        self._handle = events.create(C.ACL_EVENT_IPC, True, check_device(device))
        self._own(_destroy_quietly, self._handle)
        self._bytes = events.ipc_handle(self._handle)  # exported now (as the runtime's IPC event is at creation)

    @classmethod
    def open(cls, handle: bytes) -> Event:
        """The event another process's `handle` (64 bytes: `Event.handle`, or acl.rt.ipc_get_event_handle's)
        names; opened once per process, however many times it arrives."""
        data = _handle_bytes(handle)
        with _opened_lock:
            known = _opened.get(data)
            if known is not None and not known.closed:
                return known
            self = cls.__new__(cls)
            self._handle = runtime().events.ipc_open(data)
            self._bytes, self.opened = data, True
            self._own(_destroy_quietly, self._handle)
            _opened[data] = self
            return self

    def _live(self) -> int:
        if self.closed:
            raise InvalidParamError("this Event is closed")
        if self._forked:  # inherited across fork: the child opens it again (its runtime starts empty)
            opened = runtime().events.ipc_open(self.handle)
            self._finalizer.detach()
            self._handle, self._forked = opened, False
            self._own(_destroy_quietly, opened)
        return self._handle

    @property
    def handle(self) -> bytes:
        """The 64 bytes another process opens this event by (they travel by value)."""
        return self._bytes

    def record(self, stream: int | None = None) -> None:
        """Mark the point waiters wait for: now (None: what this thread wrote before is ready), or when `stream`
        (an acl.rt stream of this thread's context; 0 its default stream) gets here."""
        rt = runtime()
        handle = self._live()
        if stream is None:
            rt.events.record(handle, None)
            return
        st = check_ptr("stream", stream)
        rt.devices.current()
        rt.events.record(handle, rt.devices.stream_here(st))

    def wait(self, timeout: float | None = None) -> None:
        """Return once the last record (made before this call) completed, at once if there is none; raises
        AclError 507047 after `timeout` seconds, 507057 if the process that recorded it exited first."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout >= 0):  # (NaN too)
            raise InvalidParamError(f"timeout must be None or seconds >= 0, got {timeout!r}")
        runtime().events.synchronize(self._live(), None if timeout == math.inf else timeout)

    def wait_on(self, stream: int) -> None:
        """Make work queued on `stream` after this wait for the event's last record."""
        st = check_ptr("stream", stream)
        rt = runtime()
        rt.devices.current()
        rt.events.stream_wait(rt.devices.stream_here(st), self._live())

    @property
    def done(self) -> bool:
        """Whether the last record completed (or none was made)."""
        return runtime().events.query_status(self._live()) == C.ACL_EVENT_RECORDED_STATUS_COMPLETE

    def close(self) -> None:
        """Destroy this process's event (an opened one: this process's open of it)."""
        if self._finalizer.cancel() and not self._forked:
            runtime().events.destroy(self._handle)

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("opened" if self.opened else "made here")
        return f"<Event {state}>"

    def __reduce__(self) -> tuple[object, ...]:
        if self.closed:
            raise TypeError("this Event is closed: there is nothing to send")
        return (Event.open, (self.handle,))


def _handle_bytes(handle: object) -> bytes:
    if not isinstance(handle, (bytes, bytearray, memoryview)):
        raise InvalidParamError(f"an event handle is {HANDLE_SIZE} bytes, got {type(handle).__name__}")
    data = bytes(handle)
    check_int("len(handle)", len(data), HANDLE_SIZE, HANDLE_SIZE)
    return data


def _destroy_quietly(handle: int) -> None:
    """The finalizer of an Event dropped unclosed: destroy it, quietly (at exit the runtime may be going)."""
    with contextlib.suppress(Exception):
        rt = runtime()

        def destroy() -> None:
            with contextlib.suppress(Exception):
                rt.events.destroy(handle)

        rt.when_safe(destroy)


# the events opened here, by handle: one open serves every arrival of the same event
_opened: weakref.WeakValueDictionary[bytes, Event] = weakref.WeakValueDictionary()
_opened_lock = threading.RLock()
