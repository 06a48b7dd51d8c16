"""Requests whose trustlists need many pid lookups (one `pidfd_open` each), spread over the turns of the broker's
loop: each turn gives them at most JOB_SECONDS, a few pids of each in turn, so that the other clients are served
in between (docs/security.md, T9). The connection of a deferred request is not read until it is answered."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .. import protocol as P
from .ledger import Ledger, Lookups

log = logging.getLogger("vmmshare.broker")
JOB_SECONDS = 0.0005  # lookups per turn of the loop, for all deferred requests together
JOB_BATCH = 32  # pids of one deferred request looked up before the next one's turn
T = TypeVar("T")


@dataclass(eq=False)
class Job(Generic[T]):
    """A request waiting for its pid lookups, and whose it is (`owner`: the server's connection)."""

    owner: T
    req: int
    request: P.Message
    fd: int  # the fd that came with it (an export's memory), the job's until it is handed to the ledger
    sender: int
    todo: list[int]
    found: Lookups = field(default_factory=Lookups)


class Jobs(Generic[T]):
    """The deferred requests, looked up round-robin."""

    def __init__(self, ledger: Ledger, close_fd: Callable[[int], None]) -> None:
        self.ledger, self.close_fd = ledger, close_fd
        self.pending: list[Job[T]] = []
        self._next = 0

    def __bool__(self) -> bool:
        return bool(self.pending)

    def add(self, job: Job[T]) -> None:
        self.pending.append(job)

    def cancel(self, job: Job[T]) -> None:
        """Forget a job whose client left, closing the fd it holds."""
        self.pending.remove(job)
        if job.fd >= 0:
            self.close_fd(job.fd)

    def step(self) -> list[Job[T]]:
        """Look up pids for at most JOB_SECONDS; the jobs now complete (no longer pending), ready to be served."""
        done: list[Job[T]] = []
        deadline = time.perf_counter() + JOB_SECONDS
        while self.pending and time.perf_counter() < deadline:
            self._next = (self._next + 1) % len(self.pending)
            job = self.pending[self._next]
            batch = job.todo[-JOB_BATCH:]
            del job.todo[-JOB_BATCH:]
            try:
                self.ledger.look_up(batch, job.found)
            except Exception:  # a bug must not take the node's broker down: the request is answered with it
                log.exception("internal error looking up pids for a deferred request")
                job.todo = []
            if not job.todo:
                self.pending.remove(job)
                done.append(job)
        return done
