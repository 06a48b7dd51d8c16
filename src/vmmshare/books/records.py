"""The broker's records, as plain data: who a client is, what memory is charged, the holds on it, its export, and
the pid lookups a trustlist is bound with. The ledger (ledger.py) keeps them; nothing here does I/O."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..backends.base import MemoryKind

Identity = tuple[int | None, int | None]  # a process: (start time in clock ticks, pidfs inode)
KIND_HOST, KIND_GPU = int(MemoryKind.HOST), int(MemoryKind.GPU)  # a charge's kind, as the wire carries it
NOBODY: Identity = (None, None)  # the identity of a pid that no process has


@dataclass
class Lookups:
    """Who had each pid when it was looked up, and the pids whose lookup failed (with the error)."""

    ids: dict[int, Identity] = field(default_factory=dict)
    failed: dict[int, OSError] = field(default_factory=dict)


@dataclass(eq=False)
class Client:
    """Who sends requests: a process as the kernel named it (pid, uid, identity), apart from any socket."""

    pid: int
    uid: int
    identity: Identity
    holds: set[int] = field(default_factory=set)  # hold ids
    server: int | None = None  # another server's process (a remote importer, as its own broker named it)


@dataclass(eq=False)
class ChargedMemory:
    """One allocation charged to the node, alive while any hold on it is."""

    charger: Client  # who charged it (the exporter, if it is exported)
    device: int  # -1: host memory (not capped)
    size: int
    kind: int = KIND_HOST  # a memfd, counted against the node's capacity; or KIND_GPU, which the driver caps
    holders: int = 1
    share: Share | None = None  # once exported
    gone: Callable[[], None] | None = None  # called when the last hold goes (memory held on another server)


@dataclass(eq=False)
class Share:
    """An export: the handle value that names it on the node, the memory's fd, and who may import it."""

    handle: int
    memory: ChargedMemory
    fd: int  # -1 once revoked
    share_type: int
    flags: int
    prop: tuple[int, int, int, int, int]  # handleType, allocationType, memAttr, location type, location id
    exporter: Client
    secret: bytes  # a FABRIC handle's; zeros for DEFAULT
    trust: dict[int, Identity] = field(default_factory=dict)  # pid -> the process it was bound to
    remote_trust: set[tuple[int, int]] = field(default_factory=set)  # (server id, pid) of other servers' processes
    importers: dict[int, Client] = field(default_factory=dict)  # hold id -> importer


@dataclass(eq=False)
class Hold:
    """One client's claim on charged memory: its charge, or one import of it."""

    client: Client
    memory: ChargedMemory

def same_process(bound: Identity, peer: Identity) -> bool:
    """Whether `peer` is the process a trustlist entry was bound to (pid reuse is refused).

    The pidfs inode decides where both sides have one (it is never reused); the start time otherwise,
    which cannot tell apart two processes started in the same clock tick.
    """
    if bound[1] is not None:
        return bound[1] == peer[1]
    return bound[0] is None or bound[0] == peer[0]
