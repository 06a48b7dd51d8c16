"""Streams: asynchronous work that runs in order, on a worker thread of the stream's own, done at synchronize.

A task's arguments are checked when it is queued; what fails while it runs is kept and reported by the next
synchronize of the stream, and the tasks queued behind a failed one do not run (the stream is in error until then),
except the records of events and notifies, which mark a point of the stream that waiters in other processes wait
for.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

from .. import constants as C
from ..errors import AclError, InternalError, InvalidHandleError, error_from_code

log = logging.getLogger("vmmshare.runtime")
Task = Callable[[], None]


class Stream:
    """One stream: a queue of tasks and the thread that runs them (started with the first task)."""

    def __init__(self, handle: int, context: int, device: int) -> None:
        self.handle = handle
        self.context = context  # the handle of the context it was created in
        self.device = device
        self._cv = threading.Condition()
        self._queue: collections.deque[tuple[str, Task, bool]] = collections.deque()
        self._running = False
        self._error: AclError | None = None
        self._skipped = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        self.aborted = False  # destroyed by force: a task blocked in a wait gives up (see `interrupts`)
        self.interrupts: set[Callable[[], None]] = set()  # how to wake the tasks blocked in a wait now

    def submit(self, what: str, task: Task, always: bool = False) -> None:
        """Queue `task` (named `what` in a failure's message) behind everything queued before it; with `always` it
        runs even behind a failure (an event's or a notify's record: a waiter must not wait forever for it)."""
        with self._cv:
            if self._closed:
                raise InvalidHandleError(f"stream {self.handle:#x} is destroyed")
            self._queue.append((what, task, always))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=f"vmmshare-stream-{self.handle:#x}",
                                                daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def run_or_submit(self, what: str, task: Task) -> None:
        """Run `task` now when nothing is queued or running on the stream (it has reached this point, and nothing
        queued later can pass it: the stream's lock is held), else queue it to run even behind a failure. `task`
        must be short and must not block (an event's or a notify's record)."""
        with self._cv:
            if not self._closed and not self._queue and not self._running:
                task()
                return
        self.submit(what, task, always=True)

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                what, task, always = self._queue.popleft()
                self._running = True
                skip = self._error is not None and not always
            failure: AclError | None = None
            try:
                if not skip:
                    task()
            except AclError as exc:
                failure = error_from_code(exc.code, f"{what} on stream {self.handle:#x} failed: {exc.message}")
            except Exception as exc:  # a bug, not a user error: report it as the runtime's internal error
                log.exception("task %s on stream %#x", what, self.handle)
                failure = InternalError(f"{what} on stream {self.handle:#x} failed: {exc!r}")
            with self._cv:
                self._running = False
                if failure is not None and self._error is None:
                    self._error = failure
                self._skipped += skip
                self._cv.notify_all()

    def idle(self) -> bool:
        return not self._queue and not self._running

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait until every queued task has run (at most `timeout` seconds); raise the first failure since the last
        synchronize, if any."""
        with self._cv:
            if not self._cv.wait_for(self.idle, timeout):
                raise AclError(f"stream {self.handle:#x} still has {len(self._queue) + self._running} task(s) after "
                               f"{timeout} s", C.ACL_ERROR_RT_STREAM_SYNC_TIMEOUT)
            error, skipped = self._error, self._skipped
            self._error, self._skipped = None, 0
        if error is not None:
            later = f"; {skipped} task(s) queued after it did not run" if skipped else ""
            raise error_from_code(error.code, error.message + later)

    def busy(self) -> bool:
        with self._cv:
            return not self.idle()

    def close(self, force: bool = False) -> None:
        """Stop the stream: let the queued tasks run (with `force`, drop those not started and wake a task blocked
        in a wait, which then fails), then end its thread."""
        with self._cv:
            dropped = len(self._queue) if force else 0
            if force:
                self._queue.clear()
                self.aborted = True
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
            wake = list(self.interrupts) if force else []
        for fn in wake:  # a task blocked in a wait (an event's or a notify's) returns, so the thread ends
            fn()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        if dropped:
            log.info("stream %#x destroyed with %d task(s) not run", self.handle, dropped)
        if self._error is not None:
            log.warning("stream %#x destroyed before a synchronize reported: %s", self.handle, self._error.message)
