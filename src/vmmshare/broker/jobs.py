"""Requests with long trustlists, finished over the turns of the broker's loop.

Each pid of such a request is pinned as soon as the request is read (a pidfd for the process that has it then, one
`pidfd_open` each, before the request is decoded and before anything else is served), so that every entry is bound
to the process that had the pid at that moment whatever happens later; naming each pinned process (its pidfs inode)
and closing its pidfd is what is spread over the loop's turns: each turn gives it at most JOB_SECONDS, a few pids of
each request in turn, so that the other clients are served in between (docs/security.md, T9). The connection of a
deferred request is not read until it is answered."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ..books.records import NOBODY, Identity, Lookups
from ..wire import local as P
from .identity import identity_of_pinned
from .identity import pin_all as identity_pin_all

log = logging.getLogger("vmmshare.broker")
JOB_SECONDS = 0.0005  # naming pinned processes, per turn of the loop, for all deferred requests together
JOB_BATCH = 32  # pids of one deferred request named before the next one's turn
T = TypeVar("T")


@dataclass(eq=False)
class Job(Generic[T]):
    """A request whose pids are pinned and still to be named, and whose it is (`owner`: the server's connection)."""

    owner: T
    req: int
    request: P.Message
    fd: int  # the fd that came with it (an export's memory), the job's until it is handed to the ledger
    sender: int
    todo: list[tuple[int, int]] = field(default_factory=list)  # (pid, pidfd) still to name
    found: Lookups = field(default_factory=Lookups)


@dataclass(eq=False)
class Pins:
    """The pids of a request pinned when it was read: pid -> pidfd, for each pid a process had (any other pid of
    the request had none), or the pid whose pin failed and why (then nothing is pinned)."""

    fds: dict[int, int]
    failed: tuple[int, OSError] | None = None


class Jobs(Generic[T]):
    """The deferred requests, named round-robin, and the pidfds they pin (`pinned`, counted against the broker's
    fds by the server)."""

    def __init__(self, close_fd: Callable[[int], None],
                 name: Callable[[int, int], Identity] = identity_of_pinned,
                 pin_all: Callable[[Iterable[int], set[int] | None], tuple[dict[int, int], tuple[int, OSError] | None]]
                 = identity_pin_all) -> None:
        self.close_fd, self.name, self.pin_all = close_fd, name, pin_all
        self.pending: list[Job[T]] = []  # changed in place, never rebound: the broker's loop holds this list
        self.pinned = 0
        self._next = 0

    def __bool__(self) -> bool:
        return bool(self.pending)

    def pin_now(self, pids: Iterable[int], alive: set[int] | None = None) -> Pins:
        """Pin every pid of a request as it is read, before it is decoded or checked (`identity.pin_all`); the
        pins are counted in `pinned` until `adopt` hands them to a job or `unpin` lets them go."""
        fds, failed = self.pin_all(pids, alive)
        pins = Pins(fds, failed)
        self.pinned += len(pins.fds)
        return pins

    def adopt(self, job: Job[T], need: list[int], pins: Pins) -> None:
        """Give `job` the pins of the pids it needs (a pid no process had is bound to nobody now) and close the
        others. Where pinning failed (out of fds) every needed pid fails with that error, so that the request is
        refused whole (fail closed)."""
        fds = pins.fds
        if pins.failed is not None:
            _pid, exc = pins.failed
            job.found.failed.update(dict.fromkeys(need, exc))
        else:
            for pid in need:
                fd = fds.pop(pid, -1)
                if fd >= 0:
                    job.todo.append((pid, fd))
                else:
                    job.found.ids[pid] = NOBODY
        self.unpin(pins)

    def unpin(self, pins: Pins) -> None:
        """Close the pins no job took."""
        for fd in pins.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.pinned -= len(pins.fds)
        pins.fds = {}

    def add(self, job: Job[T]) -> None:
        self.pending.append(job)

    def _unpin(self, job: Job[T]) -> None:
        for _pid, fd in job.todo:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.pinned -= len(job.todo)
        job.todo = []

    def cancel(self, job: Job[T]) -> None:
        """Forget a job whose client left, closing the fds it holds."""
        self.pending.remove(job)
        self._unpin(job)
        if job.fd >= 0:
            self.close_fd(job.fd)

    def step(self) -> list[Job[T]]:
        """Name pinned processes for at most JOB_SECONDS; the jobs now complete (no longer pending), to be served."""
        done: list[Job[T]] = []
        deadline = time.perf_counter() + JOB_SECONDS
        while self.pending and time.perf_counter() < deadline:
            self._next = (self._next + 1) % len(self.pending)
            job = self.pending[self._next]
            batch = job.todo[-JOB_BATCH:]
            del job.todo[-JOB_BATCH:]
            for pid, fd in batch:
                try:
                    job.found.ids[pid] = self.name(pid, fd)
                except OSError as exc:
                    job.found.failed[pid] = exc
                except Exception as exc:  # a bug must not take the node's broker down: the request is refused
                    log.exception("internal error naming pid %d for a deferred request", pid)
                    job.found.failed[pid] = OSError(0, repr(exc))
                finally:
                    os.close(fd)
                    self.pinned -= 1
            if not job.todo:
                self.pending.remove(job)
                done.append(job)
        return done
