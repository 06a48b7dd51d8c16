"""The broker's messages: one dataclass per message type, its fields in wire order (the tail last).

Messages are values: built once, by a sender or by the decoder, and never changed. They are not frozen because
every import builds several of them, and a frozen dataclass takes eight times as long to build.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar


class Msg(enum.IntEnum):
    """The message type numbers: part of the format (both ends of a socket may run different builds)."""

    CHARGE = 1
    RELEASE = 2
    MEM_INFO = 3
    EXPORT = 4
    REVOKE = 5
    SET_PIDS = 6
    IMPORT = 7
    BARE_TGID = 8
    LIST = 9
    CHARGE_GPU = 10
    REMOTE_IMPORT = 11
    SET_REMOTE_PIDS = 12
    OK = 64
    ERROR = 65
    TOKEN = 66
    MEM = 67
    EXPORTED = 68
    IMPORTED = 69
    PID = 70
    LISTING = 71
    REMOTE_IMPORTED = 72


class Message:
    """Base of the message dataclasses below; TYPE is the message's number on the wire."""

    __slots__ = ()
    TYPE: ClassVar[Msg]


# ---------------------------------------------------------------- requests (client -> broker)


@dataclass(slots=True)
class Charge(Message):
    """Charge `size` bytes of host-backed memory to `device`'s capacity (-1: host memory, not capped)."""

    TYPE: ClassVar[Msg] = Msg.CHARGE
    device: int
    size: int


@dataclass(slots=True)
class ChargeGpu(Message):
    """Record `size` bytes of GPU memory on GPU `device` (the driver caps it, the broker only counts it)."""

    TYPE: ClassVar[Msg] = Msg.CHARGE_GPU
    device: int
    size: int


@dataclass(slots=True)
class Release(Message):
    """Give up a hold (a charge or an import); an exporter's release revokes its export."""

    TYPE: ClassVar[Msg] = Msg.RELEASE
    hold: int


@dataclass(slots=True)
class MemInfo(Message):
    TYPE: ClassVar[Msg] = Msg.MEM_INFO
    device: int


@dataclass(slots=True)
class Export(Message):
    """Export the memory of a charge (one fd attached: a host memfd, or a CUDA allocation's fd)."""

    TYPE: ClassVar[Msg] = Msg.EXPORT
    hold: int
    size: int
    flags: int  # 1: DISABLE_PID_VALIDATION
    share_type: int  # 1 DEFAULT, 2 FABRIC
    server_id: int  # the exporter's server, written into a FABRIC handle
    memory_kind: int  # 0 host memfd, 1 CUDA allocation
    handle_type: int
    allocation_type: int
    mem_attr: int
    location_type: int
    location_id: int
    pids: tuple[int, ...] = ()  # the initial trustlist


@dataclass(slots=True)
class Revoke(Message):
    """The exporter withdraws its export: no new imports (importers keep what they hold)."""

    TYPE: ClassVar[Msg] = Msg.REVOKE
    hold: int


@dataclass(slots=True)
class SetPids(Message):
    """Add `pids` to the trustlist of an export (the exporter's act)."""

    TYPE: ClassVar[Msg] = Msg.SET_PIDS
    shareable: int
    share_type: int
    pids: tuple[int, ...] = ()


@dataclass(slots=True)
class Import(Message):
    """Import an export by its node-local 64-bit value; FABRIC imports present the handle's 32-byte secret."""

    TYPE: ClassVar[Msg] = Msg.IMPORT
    shareable: int
    share_type: int
    secret: bytes


@dataclass(slots=True)
class BareTgid(Message):
    """The caller's pid as the broker's kernel sees it."""

    TYPE: ClassVar[Msg] = Msg.BARE_TGID


@dataclass(slots=True)
class List(Message):
    """One page of the node's exports, from export number `offset`."""

    TYPE: ClassVar[Msg] = Msg.LIST
    offset: int


@dataclass(slots=True)
class RemoteImport(Message):
    """Import a FABRIC handle of another server: this node's broker asks the exporting node's broker for it."""

    TYPE: ClassVar[Msg] = Msg.REMOTE_IMPORT
    handle: bytes  # the 128 bytes


@dataclass(slots=True)
class SetRemotePids(Message):
    """Add pids of the processes of server `server` to the trustlist of an export (the exporter's act)."""

    TYPE: ClassVar[Msg] = Msg.SET_REMOTE_PIDS
    shareable: int
    share_type: int
    server: int
    pids: tuple[int, ...] = ()


# ---------------------------------------------------------------- replies (broker -> client)


@dataclass(slots=True)
class Ok(Message):
    TYPE: ClassVar[Msg] = Msg.OK


@dataclass(slots=True)
class Error(Message):
    TYPE: ClassVar[Msg] = Msg.ERROR
    code: int
    message: str


@dataclass(slots=True)
class Token(Message):
    """The hold id of a new charge."""

    TYPE: ClassVar[Msg] = Msg.TOKEN
    hold: int


@dataclass(slots=True)
class Mem(Message):
    TYPE: ClassVar[Msg] = Msg.MEM
    free: int
    total: int


@dataclass(slots=True)
class Exported(Message):
    TYPE: ClassVar[Msg] = Msg.EXPORTED
    shareable: bytes  # the handle's bytes: 8 (DEFAULT) or 128 (FABRIC)


@dataclass(slots=True)
class Imported(Message):
    """An import's hold id, the memory and the exporter's properties (the memory's fd attached)."""

    TYPE: ClassVar[Msg] = Msg.IMPORTED
    hold: int
    size: int
    memory_kind: int
    handle_type: int
    allocation_type: int
    mem_attr: int
    location_type: int
    location_id: int


@dataclass(slots=True)
class Pid(Message):
    TYPE: ClassVar[Msg] = Msg.PID
    pid: int


@dataclass(slots=True)
class Listing(Message):
    TYPE: ClassVar[Msg] = Msg.LISTING
    page: str  # JSON text


@dataclass(slots=True)
class RemoteImported(Message):
    """A remote import's hold id, the memory and its properties, and where the exporting node's engine serves it
    (no fd: the memory stays on its server)."""

    TYPE: ClassVar[Msg] = Msg.REMOTE_IMPORTED
    hold: int
    size: int
    memory_kind: int
    handle_type: int
    allocation_type: int
    mem_attr: int
    location_type: int
    location_id: int
    address: int  # the memory's address in the serving engine
    metadata_port: int  # the node's metadata service (127.0.0.1) ...
    metadata_token: bytes  # ... and this process's namespace there, where its engine finds `segment`
    data_port: int  # where the serving engine takes transfers, on the handle's fabric address (the C library's copies)
    segment: str  # the hold's segment, named only under this process's token
