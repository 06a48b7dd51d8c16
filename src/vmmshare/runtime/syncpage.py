"""Cross-process wake-ups on a page of shared memory: the state of an event or a notify, waited on with futex(2).

A page holds little-endian words. Word 0 is the futex word every waiter sleeps on: its low 30 bits are the state
(an event's last completed record, a notify's flag), bit 31 (`DEAD`) says the producers a waiter needs are gone,
and bit 30 (`KICK`) is flipped to wake every waiter without a change of state (a waiter of a stream destroyed by
force must look again; the others go back to sleep).
Every change of word 0 is made under the page's lock (a POSIX record lock on the memfd, which a dying process
drops, and a lock per file within the process) and followed by a FUTEX_WAKE of every waiter, so a waiter that read
the word, found it wanting and sleeps on that value cannot miss a change: the kernel compares before it sleeps.

Producers (the process that recorded an event last; every process that imported a notify) are listed on the page
as (pid, pid namespace, start time). A waiter asks this process's `Watcher` to watch them: one thread polls a
pidfd per producer, and when one exits, it takes the producer off the list and, if that leaves what the waiters
need undeliverable, sets `DEAD` and wakes them, so they return the runtime's error instead of waiting forever.
No wait polls or sleeps: a waiter is in futex(2) until word 0 changes or its timeout ends, the watcher in poll(2).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import platform
import select
import struct
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..backends import mman

log = logging.getLogger("vmmshare.runtime")

PAGE = 4096
DEAD = 1 << 31
KICK = 1 << 30
STATE = KICK - 1
# word offsets
WORD, ISSUED, MAGIC, DEVICE, COUNT = 0, 4, 8, 12, 20
HOLDERS, HOLDER_SIZE, MAX_HOLDERS = 64, 24, 64
_HOLDER = struct.Struct("<IIQQ")  # pid, unused, pid namespace inode, start time (clock ticks since boot)

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "riscv64": 98, "ppc64le": 221, "ppc64": 221, "s390x": 238}
_FUTEX = _SYS_FUTEX.get(platform.machine(), 202)
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_WAKE_ALL = 0x7FFFFFFF
_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p,
                     ctypes.c_int]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


MAX_WAIT = float(2**31 - 1)  # seconds: a longer limit is none (and would not fit the timespec)


def futex_wait(addr: int, expected: int, timeout: float | None) -> bool:
    """Sleep while the u32 at `addr` is `expected` (at most `timeout` seconds); False when the time ran out."""
    spec = ts = None
    if timeout is not None:
        timeout = min(timeout, MAX_WAIT)
        whole = int(timeout)
        spec = _Timespec(whole, int((timeout - whole) * 1e9))
        ts = ctypes.addressof(spec)  # (`spec` lives until the call returns)
    rc = _syscall(_FUTEX, addr, _FUTEX_WAIT, expected, ts, None, 0)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EAGAIN, errno.EINTR):
        return True
    if err == errno.ETIMEDOUT:
        return False
    raise OSError(err, f"futex wait: {os.strerror(err)}")


def futex_wake(addr: int) -> None:
    """Wake every waiter on the u32 at `addr`, in every process that maps it."""
    _syscall(_FUTEX, addr, _FUTEX_WAKE, _WAKE_ALL, None, None, 0)


# ---------------------------------------------------------------- who a process is


@dataclass(frozen=True)
class Ident:
    """A process as a page lists it: its pid, its pid namespace and its start time (a reused pid differs)."""

    pid: int
    ns: int
    start: int


def _start_time(pid: int) -> int:
    """The start time of `pid` (clock ticks since boot, /proc/<pid>/stat field 22); 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return 0
    fields = text[text.rfind(b")") + 2:].split()
    return int(fields[19]) if len(fields) > 19 else 0


def _pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


_me: Ident | None = None


def me() -> Ident:
    """This process (computed once per process; a forked child computes its own)."""
    global _me
    if _me is None or _me.pid != os.getpid():
        _me = Ident(os.getpid(), _pid_ns(), _start_time(os.getpid()))
    return _me


# ---------------------------------------------------------------- the page


_file_locks: dict[tuple[int, int], list[Any]] = {}  # file -> [its lock, the pages of it mapped here]
_file_locks_guard = threading.Lock()


def _lock_for(fd: int) -> tuple[threading.Lock, tuple[int, int] | None]:
    """One lock per file in this process (a record lock is the process's, so threads take turns here first), and
    the file's key to let it go by (`_let_go`) when the page is unmapped."""
    if fd < 0:
        return threading.Lock(), None
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino)
    with _file_locks_guard:
        entry = _file_locks.setdefault(key, [threading.Lock(), 0])
        entry[1] += 1
        return entry[0], key


def _let_go(key: tuple[int, int] | None) -> None:
    if key is None:
        return
    with _file_locks_guard:
        entry = _file_locks.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del _file_locks[key]


class _Guard:
    """A page's lock as a `with` block (a class, not a generator: it is taken on every record and wake). The fd is
    read when it is taken: a page closed meanwhile has none, and only the thread lock is taken."""

    __slots__ = ("locked_fd", "page")

    def __init__(self, page: SyncPage) -> None:
        self.page, self.locked_fd = page, -1

    def __enter__(self) -> None:
        page = self.page
        page._lock.acquire()
        fd = page.fd
        if fd >= 0:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX, 1, 0)
            except BaseException:
                page._lock.release()
                raise
        self.locked_fd = fd

    def __exit__(self, *exc: object) -> None:
        try:
            if self.locked_fd >= 0:
                fcntl.lockf(self.locked_fd, fcntl.LOCK_UN, 1, 0)
        finally:
            self.page._lock.release()


class SyncPage:
    """One mapped page of an event's or a notify's state; `fd` is its memfd (-1: a page of this process only)."""

    def __init__(self, addr: int, fd: int) -> None:
        self.addr, self.fd = addr, fd
        self._lock, self._file = _lock_for(fd)
        self._word = ctypes.c_uint32.from_address(addr)
        self.pending: Callable[[SyncPage], bool] = _always  # whether a waiter still needs a producer (see DEAD)
        self._guard = _Guard(self)
        self._watched: list[Ident] = []  # the producers this process's watcher was last asked to watch for it

    @classmethod
    def private(cls) -> SyncPage:
        """A page no other process maps (an event without ACL_EVENT_IPC)."""
        return cls(mman.map_anonymous(PAGE), -1)

    @classmethod
    def of_fd(cls, fd: int) -> SyncPage:
        return cls(mman.map_file(fd, PAGE), fd)

    def close(self, close_fd: bool = False) -> None:
        """Unmap the page (and close its fd with `close_fd`), under the file's lock: a record lock is dropped when
        the process closes any fd of the file, so no thread of this process may hold it then. The watcher's
        thread never reads the page afterwards."""
        with self._lock:
            if self.addr:
                addr, self.addr = self.addr, 0
                mman.unmap(addr, PAGE)
                _let_go(self._file)
            if close_fd and self.fd >= 0:
                fd, self.fd = self.fd, -1
                os.close(fd)

    # words
    def word(self) -> int:
        return int(self._word.value)

    def get(self, offset: int) -> int:
        return int(ctypes.c_uint32.from_address(self.addr + offset).value)

    def put(self, offset: int, value: int) -> None:
        ctypes.c_uint32.from_address(self.addr + offset).value = value & 0xFFFFFFFF

    def set_word(self, value: int) -> None:
        """Change word 0 (under the lock) and wake every waiter on it."""
        self._word.value = value & 0xFFFFFFFF
        futex_wake(self.addr)

    def kick(self) -> None:
        """Wake every waiter to look again (flip KICK): a waiter that is to give up sees why and returns."""
        with self.locked():
            if self.addr:
                self.set_word(self.word() ^ KICK)

    def locked(self) -> _Guard:
        """The page's lock, for a `with` block: this process's lock of the file, then the record lock."""
        return self._guard

    # the producers' list
    def holders(self) -> list[Ident]:
        count = min(self.get(COUNT), MAX_HOLDERS)
        if not count:
            return []
        table = ctypes.string_at(self.addr + HOLDERS, count * HOLDER_SIZE)
        return [Ident(pid, ns, start) for pid, _, ns, start in _HOLDER.iter_unpack(table) if pid]

    def _write_holder(self, i: int, ident: Ident | None) -> None:
        data = _HOLDER.pack(ident.pid, 0, ident.ns, ident.start) if ident else bytes(HOLDER_SIZE)
        ctypes.memmove(self.addr + HOLDERS + i * HOLDER_SIZE, data, HOLDER_SIZE)

    def set_holders(self, idents: list[Ident]) -> None:
        """Replace the list (under the lock); at most MAX_HOLDERS, the last ones kept."""
        idents = idents[-MAX_HOLDERS:]
        for i in range(max(len(idents), min(self.get(COUNT), MAX_HOLDERS))):
            self._write_holder(i, idents[i] if i < len(idents) else None)
        self.put(COUNT, len(idents))

    def add_holder(self, ident: Ident) -> None:
        """Add `ident` to the list (under the lock), once; a full list drops its oldest entry."""
        have = self.holders()
        if ident not in have:
            self.set_holders([*have, ident])

    def remove_holder(self, ident: Ident) -> bool:
        have = self.holders()
        if ident not in have:
            return False
        self.set_holders([h for h in have if h != ident])
        return True

    # waiting
    def wait(self, ready: Callable[[int], bool], timeout: float | None, cancelled: Callable[[], bool]) -> str:
        """Wait until `ready(word)`: "ready", "dead" (DEAD set first), "timeout" or "cancelled". The producers on the
        list are watched meanwhile (`Watcher`), the list read again after each wake-up."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            w = self.word()
            if ready(w):
                return "ready"
            if w & DEAD:
                return "dead"
            if cancelled():
                return "cancelled"
            if self.fd >= 0:
                now = self.holders()
                if now != self._watched:
                    self._watched = now
                    watcher().watch(self, now)
                    continue  # a producer found dead already has set DEAD: read the word again
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return "timeout"
            futex_wait(self.addr, w, left)

    def producer_died(self, ident: Ident) -> None:
        """`ident` exited: take it off the list; if that leaves no producer while a waiter still needs one
        (`pending`: a record in flight, a notify not set), set DEAD and wake the waiters. Whoever sees a producer
        exit does this, waiting or not: it is a fact about the page."""
        with self._lock:
            if not self.addr:
                return
            fcntl.lockf(self.fd, fcntl.LOCK_EX, 1, 0)
            try:
                if not self.remove_holder(ident):
                    return
                w = self.word()
                if not self.holders() and not w & DEAD and self.pending(self):
                    self.set_word(w | DEAD)
            finally:
                fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, 0)


# ---------------------------------------------------------------- the watcher


@dataclass(eq=False)
class _Watched:
    ident: Ident
    pidfd: int
    pages: weakref.WeakSet[SyncPage]  # the pages it is a producer of, that this process waited on


class Watcher:
    """This process's watch over the producers its waiters have needed: a thread in poll(2) on one pidfd each.

    A wait asks for its page's producers to be watched once (`watch`); the pidfd stays open and polled after the
    wait ends (up to MAX_PIDFDS, the least recently asked for dropped first), so a process that waits on the same
    producer again and again pays a dictionary lookup, and the thread wakes only when a producer exits or the set
    of pidfds changes. When one exits, each page it was watched for learns it (`SyncPage.producer_died`)."""

    MAX_PIDFDS = 256

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_ident: collections.OrderedDict[Ident, _Watched] = collections.OrderedDict()
        self._by_fd: dict[int, _Watched] = {}
        self._efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._thread: threading.Thread | None = None

    def watch(self, page: SyncPage, idents: list[Ident]) -> None:
        """Watch `idents` as producers of `page` (this process itself, and processes of another pid namespace,
        are not); one found exited already is reported to the page at once."""
        mine = me()
        gone: list[Ident] = []
        changed = False
        with self._lock:
            for ident in idents:
                if ident == mine or ident.ns != mine.ns:  # another pid namespace: its pid is not ours to watch
                    continue
                entry = self._by_ident.get(ident)
                if entry is None:
                    fd = _open_pidfd(ident)
                    if fd == _GONE:
                        gone.append(ident)
                    if fd < 0:
                        continue
                    entry = self._by_ident[ident] = self._by_fd[fd] = _Watched(ident, fd, weakref.WeakSet())
                    changed = True
                else:
                    self._by_ident.move_to_end(ident)
                entry.pages.add(page)
            while len(self._by_ident) > self.MAX_PIDFDS:
                oldest = next(iter(self._by_ident.values()))
                for watched in oldest.pages:  # no longer watched: their next wait asks again
                    watched._watched = []
                self._drop(oldest)
                changed = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="vmmshare-sync-watch", daemon=True)
                self._thread.start()
        if changed:
            os.eventfd_write(self._efd, 1)
        for ident in gone:
            page.producer_died(ident)

    def _drop(self, entry: _Watched) -> None:
        del self._by_ident[entry.ident]
        del self._by_fd[entry.pidfd]
        os.close(entry.pidfd)

    def _run(self) -> None:
        poller = select.poll()
        polled: set[int] = set()
        poller.register(self._efd, select.POLLIN)
        while True:
            with self._lock:  # (which process each fd was polled for: one evicted meanwhile may name another)
                idents = {fd: entry.ident for fd, entry in self._by_fd.items()}
                fds = set(idents)
            for fd in polled - fds:
                with contextlib.suppress(KeyError):
                    poller.unregister(fd)
            for fd in fds - polled:
                poller.register(fd, select.POLLIN)
            polled = fds
            try:
                events = poller.poll()
            except InterruptedError:
                continue
            for fd, _ in events:
                if fd == self._efd:
                    with contextlib.suppress(BlockingIOError):
                        os.eventfd_read(self._efd)
                    continue
                with self._lock:
                    entry = self._by_fd.get(fd)
                    if entry is None or entry.ident != idents.get(fd):
                        continue
                    pages = list(entry.pages)
                    self._drop(entry)
                    poller.unregister(fd)
                    polled.discard(fd)
                for page in pages:
                    try:
                        page.producer_died(entry.ident)
                    except Exception:  # a page unmapped meanwhile: its waiters are gone
                        log.debug("producer %d of a page that went away", entry.ident.pid, exc_info=True)


def _always(page: SyncPage) -> bool:
    return True


_GONE, _UNWATCHABLE = -1, -2


def _open_pidfd(ident: Ident) -> int:
    """A pidfd of `ident`; _GONE when it has exited (or its pid now names another process), _UNWATCHABLE when
    the kernel will not say (no pidfd_open): then its waiters wait as the runtime's do, up to their timeout."""
    try:
        fd = os.pidfd_open(ident.pid)
    except ProcessLookupError:
        return _GONE
    except OSError as exc:
        log.debug("cannot watch pid %d: %s", ident.pid, exc)
        return _UNWATCHABLE
    if _start_time(ident.pid) != ident.start:
        os.close(fd)
        return _GONE
    return fd


_watcher: Watcher | None = None
_watcher_lock = threading.Lock()


def watcher() -> Watcher:
    global _watcher
    with _watcher_lock:
        if _watcher is None:
            _watcher = Watcher()
        return _watcher


def _forget_in_child() -> None:
    global _watcher, _me
    _watcher, _me = None, None
    _file_locks.clear()


os.register_at_fork(after_in_child=_forget_in_child)
