"""Events (aclrtCreateEvent*, record, synchronize, query, stream wait, destroy) and IPC events
(aclrtIpcGetEventHandle / aclrtIpcOpenEventHandle), as the runtime's `IpcEvent` behaves (ipc_event.cc).

An event's state is a page (`SyncPage`): word ISSUED counts the records made (a ticket each), word 0 holds the
ticket of the last record the stream reached. A record takes the next ticket at once and completes when its stream
gets there: at once on an idle stream, else behind the work queued before it. A wait (synchronize, or a stream
waiting on the event) waits for the ticket last issued when it was called; an event never recorded, or whose last
record completed, is complete (a wait returns at once, as `IpcEventSync` and `IpcEventWait` do). An IPC event's page
is a memfd exported through the broker without pid validation (as the runtime exports its IPC event memory):
whoever holds the 64-byte handle opens it, and both sides record and wait. The process that recorded last is the
producer a waiter's watcher watches: if it exits before its record completes, waiters fail with 507057.
"""

from __future__ import annotations

import itertools
import struct
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import constants as C
from ..errors import AclError, FeatureNotSupportedError, InvalidHandleError, InvalidParamError
from . import syncshare
from .syncpage import DEAD, ISSUED, STATE, SyncPage, me

if TYPE_CHECKING:
    from .shared import Shared
    from .streams import Stream

HANDLE_SIZE = C.ACL_IPC_EVENT_HANDLE_SIZE
_HANDLE = struct.Struct("<QII")  # the broker's handle value, the server that made it, MAGIC_EVENT; zeros after
_HALF = 1 << 29  # tickets compare as serial numbers of 30 bits
_EX_FLAGS = C.ACL_EVENT_SYNC | C.ACL_EVENT_CAPTURE_STREAM_PROGRESS | 0x4 | C.ACL_EVENT_TIME_LINE | C.ACL_EVENT_IPC
_FLAGS = C.ACL_EVENT_SYNC | C.ACL_EVENT_CAPTURE_STREAM_PROGRESS | 0x4 | C.ACL_EVENT_TIME_LINE | \
    C.ACL_EVENT_DEVICE_USE_ONLY | C.ACL_EVENT_EXTERNAL
_ALONE = (C.ACL_EVENT_DEVICE_USE_ONLY, C.ACL_EVENT_EXTERNAL, C.ACL_EVENT_IPC)
DEFAULT_FLAGS = 0x0E  # aclrtCreateEvent's: RT_EVENT_DDSYNC | RT_EVENT_TIME_LINE | RT_EVENT_STREAM_MARK


def newer(a: int, b: int) -> bool:
    """Whether ticket `a` comes after ticket `b` (30-bit serial numbers)."""
    d = (a - b) & STATE
    return 0 < d < _HALF


@dataclass(eq=False)
class Event:
    handle: int
    flags: int
    device: int
    page: SyncPage
    backing: syncshare.Backing | None  # an IPC event's shared page
    users: int = 0  # waits and stream tasks still using the page
    destroyed: bool = False


def _pending(page: SyncPage) -> bool:
    """Whether the event's last record has not completed (its recorder is needed)."""
    return newer(page.get(ISSUED), page.word() & STATE)


class Events:
    """This process's events by handle."""

    def __init__(self, s: Shared) -> None:
        self.s = s
        self.live: dict[int, Event] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    # ------------------------------------------------------------ create, open, destroy

    def check_flags(self, flags: int, ex: bool) -> None:
        """The runtime's checks of a creation flag (`ApiErrorDecorator::EventCreate` / `EventCreateEx`): 107000."""
        for alone in _ALONE:
            if flags & alone and flags & ~alone:
                raise InvalidParamError(f"flag={flags:#x}: {alone:#x} must be used alone")
        allowed = _EX_FLAGS if ex else _FLAGS
        if not flags & allowed or flags > allowed:
            what = "ACL_EVENT_SYNC, CAPTURE_STREAM_PROGRESS and TIME_LINE combined"
            raise InvalidParamError(
                f"flag={flags:#x}: use {what}, or ACL_EVENT_IPC (0x40) alone" if ex else
                f"flag={flags:#x}: use {what} (create_event_ex_with_flag takes ACL_EVENT_IPC)")

    def create(self, flags: int, ex: bool, device: int | None = None) -> int:
        """A new event of `device` (None: the current device, 107002 without one)."""
        self.check_flags(flags, ex)
        if flags in (C.ACL_EVENT_DEVICE_USE_ONLY, C.ACL_EVENT_EXTERNAL):
            raise FeatureNotSupportedError(f"flag={flags:#x}: vmmshare has no device-only or graph-external events "
                                           "(no kernels or ACL graphs run here)")
        device = self.s.devices.current() if device is None else self.s.devices.device_id(device)
        if flags == C.ACL_EVENT_IPC:
            backing: syncshare.Backing | None = syncshare.create(self.s, syncshare.MAGIC_EVENT)
            assert backing is not None
            page = backing.page
        else:
            backing, page = None, SyncPage.private()
        page.pending = _pending
        return self._add(Event(0, flags, device, page, backing))

    def _add(self, ev: Event) -> int:
        with self._lock:
            ev.handle = 0xE700_0000 + next(self._ids)
            self.live[ev.handle] = ev
        return ev.handle

    def destroy(self, handle: int) -> None:
        """Forget the event; its page goes once no wait or stream task uses it (an exporter's export goes with
        it: openers keep theirs)."""
        with self._lock:
            ev = self._live(handle)
            del self.live[handle]
            ev.destroyed = True
            done = ev.users == 0
        if done:
            self._release(ev)

    def _release(self, ev: Event) -> None:
        if ev.backing is not None:
            ev.backing.close(self.s)
        else:
            ev.page.close()

    def _live(self, handle: int) -> Event:
        ev = self.live.get(handle)
        if ev is None:
            raise InvalidHandleError(f"event {handle:#x} is not a live event of this process (destroyed, or a "
                                     "handle of another kind)")
        return ev

    def _use(self, handle: int) -> Event:
        with self._lock:
            ev = self._live(handle)
            ev.users += 1
            return ev

    def _unuse(self, ev: Event) -> None:
        with self._lock:
            ev.users -= 1
            done = ev.destroyed and ev.users == 0
        if done:
            self._release(ev)

    def close_all(self) -> None:
        """The process lets go of every event (a forked child's copy of the parent's table)."""
        with self._lock:
            self.live.clear()

    # ------------------------------------------------------------ record and wait

    def record(self, handle: int, stream: Stream | None) -> None:
        """Take the next ticket now; it completes when `stream` reaches this point (None: at once, what the calling
        thread did before is what the record marks)."""
        ev = self._use(handle)
        try:
            ticket = self._issue(ev)
        except BaseException:
            self._unuse(ev)
            raise

        def complete() -> None:
            try:
                self._complete(ev, ticket)
            finally:
                self._unuse(ev)

        if stream is None:
            complete()
            return
        try:
            stream.run_or_submit("record_event", complete)
        except BaseException:
            self._unuse(ev)
            raise

    @staticmethod
    def _issue(ev: Event) -> int:
        """The next ticket (this process the event's producer now; a DEAD left by an earlier record cleared)."""
        page = ev.page
        with page.locked():
            ticket = (page.get(ISSUED) % STATE) + 1
            page.put(ISSUED, ticket)
            if ev.backing is not None:
                page.set_holders([me()])
            w = page.word()
            if w & DEAD:  # a record that never came is superseded by this one
                page.set_word(w & ~DEAD)
        return ticket

    @staticmethod
    def _complete(ev: Event, ticket: int) -> None:
        """The stream reached the record: the state becomes its ticket, unless a newer one completed first."""
        page = ev.page
        with page.locked():
            w = page.word()
            if newer(ticket, w & STATE):
                page.set_word(ticket | (w & ~(STATE | DEAD)))

    def _wait(self, ev: Event, timeout: float | None, stream: Stream | None) -> str:
        page = ev.page
        target = page.get(ISSUED)
        cancelled = (lambda: stream.aborted) if stream is not None else (lambda: False)
        if stream is not None:
            stream.interrupts.add(page.kick)
        try:
            return page.wait(lambda w: not newer(target, w & STATE), timeout, cancelled)
        finally:
            if stream is not None:
                stream.interrupts.discard(page.kick)

    def synchronize(self, handle: int, timeout: float | None) -> None:
        """Block until the event's last record (as of now) completed: 507047 after `timeout` seconds, 507057 when
        the process that recorded it exited first."""
        ev = self._use(handle)
        try:
            got = self._wait(ev, timeout, None)
        finally:
            self._unuse(ev)
        self._raise_for(got, ev, "synchronize", timeout)

    def _raise_for(self, got: str, ev: Event, what: str, timeout: float | None) -> None:
        if got == "timeout":
            raise AclError(f"event {ev.handle:#x} did not complete within {timeout} s",
                           C.ACL_ERROR_RT_EVENT_SYNC_TIMEOUT)
        if got == "dead":
            raise AclError(f"the process that recorded event {ev.handle:#x} last exited before its stream reached "
                           "the record: it will never complete", C.ACL_ERROR_RT_SUSPECT_REMOTE_ERROR)
        if got == "cancelled":
            raise AclError(f"{what} of event {ev.handle:#x}: the stream was destroyed while it waited",
                           C.ACL_ERROR_RT_STREAM_ABORT)

    def query_status(self, handle: int) -> int:
        """ACL_EVENT_RECORDED_STATUS_COMPLETE (1) when the last record completed or there was none, else 0."""
        ev = self._live(handle)
        page = ev.page
        if newer(page.get(ISSUED), page.word() & STATE):
            return C.ACL_EVENT_RECORDED_STATUS_NOT_READY
        return C.ACL_EVENT_RECORDED_STATUS_COMPLETE

    def stream_wait(self, stream: Stream, handle: int) -> None:
        """Work queued on `stream` after this waits for the event's last record (as of now); nothing to wait for
        when it completed already or was never made."""
        ev = self._use(handle)
        page = ev.page
        if not newer(page.get(ISSUED), page.word() & STATE):
            self._unuse(ev)
            return

        def wait() -> None:
            try:
                got = self._wait(ev, None, stream)
            finally:
                self._unuse(ev)
            self._raise_for(got, ev, "stream_wait_event", None)

        try:
            stream.submit("stream_wait_event", wait)
        except BaseException:
            self._unuse(ev)
            raise

    # ------------------------------------------------------------ IPC handles

    def ipc_handle(self, handle: int) -> bytes:
        """The 64 bytes another process opens the IPC event by (its first export happens now)."""
        ev = self._live(handle)
        if ev.backing is None:  # (an IPC event's shared page)
            raise InvalidParamError(f"event {handle:#x} was created with flag {ev.flags:#x}: only an event of "
                                    "create_event_ex_with_flag(ACL_EVENT_IPC) has an IPC handle")
        backing = ev.backing
        with self._lock:
            if not backing.value:
                syncshare.export(self.s, backing, pid_validation=False)
        packed = _HANDLE.pack(backing.value, self.s.config.server_id, syncshare.MAGIC_EVENT)
        return packed + bytes(HANDLE_SIZE - len(packed))

    def ipc_open(self, data: bytes) -> int:
        """An event of this process over the page another process's handle names (107017 when it is no IPC
        event's handle, or its creator destroyed it)."""
        value, server, magic = _HANDLE.unpack_from(data)
        if magic != syncshare.MAGIC_EVENT or value == 0 or any(data[_HANDLE.size:]):
            raise InvalidHandleError("these 64 bytes are not an IPC event handle (pass what ipc_get_event_handle "
                                     "returned)")
        if server != self.s.config.server_id:
            raise FeatureNotSupportedError(f"this IPC event handle comes from server {server:#x}: an IPC event "
                                           "synchronises processes of one server")
        device = self.s.devices.current_or(0)
        backing = syncshare.open_page(self.s, value, syncshare.MAGIC_EVENT)
        backing.page.pending = _pending
        return self._add(Event(0, C.ACL_EVENT_IPC, device, backing.page, backing))
