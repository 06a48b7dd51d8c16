"""What the processes of each user hold in the broker, against that user's quotas (config.Quotas), and the file
descriptors the broker holds for all of them against its own limit. Plain counters, no I/O.

A refusal is a LedgerError whose code says which kind of limit was hit: 207001 for device memory, 207005
(ACL_ERROR_RT_RESOURCE_ALLOC_FAIL) for connections, exports, allocations, trustlist entries and file descriptors.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .. import constants as C
from ..config import Quotas
from ..errors import AclError

FDS_PER_CONNECTION = 2  # its socket and the pidfd that names its process


class LedgerError(AclError):
    """A refused request: the client gets an Error reply with this code and message. An AclError, made as every
    one is (message, then code), so that a refusal travels one way from the book up."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message, code)


@dataclass
class Tally:
    """One user's holdings."""

    connections: int = 0
    exports: int = 0
    holds: int = 0
    trust: int = 0
    memory: Counter[int] = field(default_factory=Counter)  # device -> bytes charged

    def empty(self) -> bool:
        return not (self.connections or self.exports or self.holds or self.trust or any(self.memory.values()))


class Usage:
    """Per-user tallies against `quotas`, and the broker's file descriptors against `fd_budget` (None: no limit)."""

    def __init__(self, quotas: Quotas, capacity: int, fd_budget: int | None = None) -> None:
        self.quotas = quotas
        self.memory_quota = min(capacity, quotas.memory) if quotas.memory is not None else None
        self.fd_budget = fd_budget
        self.fds = 0  # held for clients: connections and exports
        self.users: dict[int, Tally] = {}
        self.remote_holds: Counter[tuple[int, int]] = Counter()  # (server id, uid) -> holds of another server's user

    def trust_entries(self) -> int:
        """Trustlist entries held by all users."""
        return sum(t.trust for t in self.users.values())

    def of(self, uid: int) -> Tally:
        tally = self.users.get(uid)
        if tally is None:
            tally = self.users[uid] = Tally()
        return tally

    def _tidy(self, uid: int) -> None:
        tally = self.users.get(uid)
        if tally is not None and tally.empty():
            del self.users[uid]

    def _refuse(self, uid: int, what: str, held: int, limit: int, variable: str) -> LedgerError:
        return LedgerError(
            f"uid {uid} holds {held} {what} in the broker, its limit ({variable}={limit}, read when the broker "
            "started): release some first",
            C.ACL_ERROR_RT_RESOURCE_ALLOC_FAIL,
        )

    def _fds_for(self, count: int) -> None:
        if self.fd_budget is not None and self.fds + count > self.fd_budget:
            raise LedgerError(
                f"the broker holds {self.fds} file descriptors for its clients, all that its open-file limit leaves "
                "(raise the broker's `ulimit -n`, or release exports and close connections)",
                C.ACL_ERROR_RT_RESOURCE_ALLOC_FAIL,
            )

    # ---------------------------------------------------------------- connections

    def connect(self, uid: int) -> None:
        tally = self.of(uid)
        try:
            if tally.connections >= self.quotas.connections:
                raise self._refuse(uid, "connections", tally.connections, self.quotas.connections,
                                   "VMMSHARE_QUOTA_CONNECTIONS")
            self._fds_for(FDS_PER_CONNECTION)
        except LedgerError:
            self._tidy(uid)
            raise
        tally.connections += 1
        self.fds += FDS_PER_CONNECTION

    def disconnect(self, uid: int) -> None:
        self.of(uid).connections -= 1
        self.fds -= FDS_PER_CONNECTION
        self._tidy(uid)

    # ---------------------------------------------------------------- holds and memory

    def add_hold(self, uid: int, server: int | None = None) -> None:
        """One more hold of `uid` (of another server's `uid`, with `server`: a user of this node is not charged
        for what a same-numbered user elsewhere imports)."""
        if server is not None:
            held = self.remote_holds[(server, uid)]
            if held >= self.quotas.holds:
                raise self._refuse(uid, f"imports from server {server:#x}", held, self.quotas.holds,
                                   "VMMSHARE_QUOTA_HOLDS")
            self.remote_holds[(server, uid)] += 1
            return
        tally = self.users.get(uid) or self.of(uid)
        if tally.holds >= self.quotas.holds:
            raise self._refuse(uid, "allocations and imports", tally.holds, self.quotas.holds, "VMMSHARE_QUOTA_HOLDS")
        tally.holds += 1

    def drop_hold(self, uid: int, server: int | None = None) -> None:
        if server is not None:
            self.remote_holds[(server, uid)] -= 1
            if not self.remote_holds[(server, uid)]:
                del self.remote_holds[(server, uid)]
            return
        tally = self.users.get(uid) or self.of(uid)
        tally.holds -= 1
        if not tally.holds and tally.empty():  # holding anything else, the user keeps its tally
            del self.users[uid]

    def check_memory(self, uid: int, device: int, size: int) -> None:
        if self.memory_quota is None:
            return
        charged = self.users[uid].memory[device] if uid in self.users else 0
        if size > self.memory_quota - charged:
            raise LedgerError(
                f"uid {uid} has {charged} bytes charged on device {device}; {size} more would pass its limit of "
                f"{self.memory_quota} bytes a device (VMMSHARE_QUOTA_MEMORY, read when the broker started)",
                C.ACL_ERROR_RT_MEMORY_ALLOCATION,
            )

    def memory(self, uid: int, device: int, delta: int) -> None:
        tally = self.of(uid)
        tally.memory[device] += delta
        if not tally.memory[device]:
            del tally.memory[device]
        self._tidy(uid)

    # ---------------------------------------------------------------- exports and trustlists

    def check_export(self, uid: int) -> None:
        exports = self.users[uid].exports if uid in self.users else 0
        if exports >= self.quotas.exports:
            raise self._refuse(uid, "exports", exports, self.quotas.exports, "VMMSHARE_QUOTA_EXPORTS")
        self._fds_for(1)

    def add_export(self, uid: int, trust: int) -> None:
        tally = self.of(uid)
        tally.exports += 1
        tally.trust += trust
        self.fds += 1

    def drop_export(self, uid: int, trust: int) -> None:
        tally = self.of(uid)
        tally.exports -= 1
        tally.trust -= trust
        self.fds -= 1
        self._tidy(uid)

    def check_trust(self, uid: int, new: int) -> None:
        held = self.users[uid].trust if uid in self.users else 0
        if new and held + new > self.quotas.trustlist:
            raise self._refuse(uid, "trustlist entries", held, self.quotas.trustlist, "VMMSHARE_QUOTA_TRUSTLIST")

    def add_trust(self, uid: int, count: int) -> None:
        self.of(uid).trust += count
