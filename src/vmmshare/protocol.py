"""The broker wire format, encode/decode only (no I/O), so it can be tested and fuzzed on its own.

One frame is one SOCK_SEQPACKET packet: a 12-byte header (magic ``b"VB"``, version, message type,
request id, body length) and a body made of a fixed struct and, for some types, a tail (bytes, a u32
array or UTF-8 text). Each message type is a frozen dataclass whose fields are the fixed fields in wire
order, then the tail. Decoding is strict: an unknown type, a wrong version, a length that disagrees
with the packet, trailing bytes or the wrong number of attached file descriptors raise ProtocolError.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import operator
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

MAGIC = b"VB"
VERSION = 1
HEADER = struct.Struct("<2sBBII")
MAX_FRAME = 64 * 1024
MAX_BODY = MAX_FRAME - HEADER.size
MAX_FDS = 1
MAX_PIDS = 4096  # u32s in a pid tail
PROP = "BBBBi"  # handleType, allocationType, memAttr, location.type, location.id


class ProtocolError(ValueError):
    """A frame that does not follow the protocol; the peer gets an error reply, never a crash."""


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


class Tail(enum.Enum):
    NONE = 0
    BYTES = 1
    U32 = 2
    TEXT = 3


class Message:
    """Base of the message dataclasses below; TYPE is the message's number on the wire."""

    __slots__ = ()
    TYPE: ClassVar[Msg]


# ---------------------------------------------------------------- requests (client -> broker)


@dataclass(frozen=True, slots=True)
class Charge(Message):
    """Charge `size` bytes of host-backed memory to `device`'s capacity (-1: host memory, not capped)."""

    TYPE: ClassVar[Msg] = Msg.CHARGE
    device: int
    size: int


@dataclass(frozen=True, slots=True)
class ChargeGpu(Message):
    """Record `size` bytes of GPU memory on GPU `device` (the driver caps it, the broker only counts it)."""

    TYPE: ClassVar[Msg] = Msg.CHARGE_GPU
    device: int
    size: int


@dataclass(frozen=True, slots=True)
class Release(Message):
    """Give up a hold (a charge or an import); an exporter's release revokes its export."""

    TYPE: ClassVar[Msg] = Msg.RELEASE
    hold: int


@dataclass(frozen=True, slots=True)
class MemInfo(Message):
    TYPE: ClassVar[Msg] = Msg.MEM_INFO
    device: int


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
class Revoke(Message):
    """The exporter withdraws its export: no new imports (importers keep what they hold)."""

    TYPE: ClassVar[Msg] = Msg.REVOKE
    hold: int


@dataclass(frozen=True, slots=True)
class SetPids(Message):
    """Add `pids` to the trustlist of an export (the exporter's act)."""

    TYPE: ClassVar[Msg] = Msg.SET_PIDS
    shareable: int
    share_type: int
    pids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Import(Message):
    """Import an export by its node-local 64-bit value; FABRIC imports present the handle's 32-byte secret."""

    TYPE: ClassVar[Msg] = Msg.IMPORT
    shareable: int
    share_type: int
    secret: bytes


@dataclass(frozen=True, slots=True)
class BareTgid(Message):
    """The caller's pid as the broker's kernel sees it."""

    TYPE: ClassVar[Msg] = Msg.BARE_TGID


@dataclass(frozen=True, slots=True)
class List(Message):
    """One page of the node's exports, from export number `offset`."""

    TYPE: ClassVar[Msg] = Msg.LIST
    offset: int


@dataclass(frozen=True, slots=True)
class RemoteImport(Message):
    """Import a FABRIC handle of another server: this node's broker asks the exporting node's broker for it."""

    TYPE: ClassVar[Msg] = Msg.REMOTE_IMPORT
    handle: bytes  # the 128 bytes


@dataclass(frozen=True, slots=True)
class SetRemotePids(Message):
    """Add pids of the processes of server `server` to the trustlist of an export (the exporter's act)."""

    TYPE: ClassVar[Msg] = Msg.SET_REMOTE_PIDS
    shareable: int
    share_type: int
    server: int
    pids: tuple[int, ...] = ()


# ---------------------------------------------------------------- replies (broker -> client)


@dataclass(frozen=True, slots=True)
class Ok(Message):
    TYPE: ClassVar[Msg] = Msg.OK


@dataclass(frozen=True, slots=True)
class Error(Message):
    TYPE: ClassVar[Msg] = Msg.ERROR
    code: int
    message: str


@dataclass(frozen=True, slots=True)
class Token(Message):
    """The hold id of a new charge."""

    TYPE: ClassVar[Msg] = Msg.TOKEN
    hold: int


@dataclass(frozen=True, slots=True)
class Mem(Message):
    TYPE: ClassVar[Msg] = Msg.MEM
    free: int
    total: int


@dataclass(frozen=True, slots=True)
class Exported(Message):
    TYPE: ClassVar[Msg] = Msg.EXPORTED
    shareable: bytes  # the handle's bytes: 8 (DEFAULT) or 128 (FABRIC)


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
class Pid(Message):
    TYPE: ClassVar[Msg] = Msg.PID
    pid: int


@dataclass(frozen=True, slots=True)
class Listing(Message):
    TYPE: ClassVar[Msg] = Msg.LISTING
    page: str  # JSON text


@dataclass(frozen=True, slots=True)
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
    segment: str  # the serving engine's name, "<address>:<port>"


class Frame(NamedTuple):
    """One decoded packet: the request id it answers or asks under, and the message."""

    req: int
    message: Message


# ---------------------------------------------------------------- layouts


class Layout:
    """How one message type lies on the wire: its fixed struct, its tail, and the fds that travel with it.

    Everything encode and decode need per type is worked out here once, not per call.
    """

    def __init__(self, message: type[Message], fmt: str, tail: Tail = Tail.NONE, max_tail: int = 0,
                 fds: int = 0) -> None:
        self.type = message.TYPE
        self.message = message
        self.fixed = struct.Struct(fmt)
        self.tail, self.max_tail, self.fds = tail, max_tail, fds
        names = tuple(f.name for f in dataclasses.fields(message))  # type: ignore[arg-type]
        self.fields = names[:-1] if tail is not Tail.NONE else names
        self.tail_field = names[-1] if tail is not Tail.NONE else ""
        zeros = self.fixed.unpack(bytes(self.fixed.size))
        if len(zeros) != len(self.fields):
            raise AssertionError(f"{message.__name__}: {fmt} packs {len(zeros)} fields, the class has {self.fields}")
        # fixed-size bytes fields: struct would silently cut or pad those
        self.sized = tuple((i, len(z)) for i, z in enumerate(zeros) if isinstance(z, bytes))
        self.values: Callable[[Message], tuple[Any, ...]]  # the fixed fields of a message, in wire order
        if not self.fields:
            self.values = lambda m: ()
        elif len(self.fields) == 1:
            one = operator.attrgetter(self.fields[0])
            self.values = lambda m: (one(m),)
        else:
            self.values = operator.attrgetter(*self.fields)
        self._new = _constructor(message, names)

    def build(self, values: tuple[Any, ...], tail: Any = None) -> Message:
        """The message of these fixed values (and tail, for a type that has one)."""
        return self._new(*values) if self.tail is Tail.NONE else self._new(*values, tail)


def _constructor(cls: type[Message], names: tuple[str, ...]) -> Callable[..., Message]:
    """A constructor of `cls` that fills its slots directly, for decode: it builds one message per packet, and a
    frozen dataclass's own __init__ looks up object.__setattr__ for every field (twice the time)."""
    args = ", ".join(f"v{i}" for i in range(len(names)))
    sets = "".join(f"    set{i}(m, v{i})\n" for i in range(len(names)))
    scope: dict[str, Any] = {"new": object.__new__, "cls": cls}
    scope.update({f"set{i}": getattr(cls, name).__set__ for i, name in enumerate(names)})
    exec(f"def build({args}):\n    m = new(cls)\n{sets}    return m\n", scope)
    built: Callable[..., Message] = scope["build"]
    return built


LAYOUTS: dict[Msg, Layout] = {
    Msg.CHARGE: Layout(Charge, "<iQ"),
    Msg.RELEASE: Layout(Release, "<Q"),
    Msg.MEM_INFO: Layout(MemInfo, "<I"),
    Msg.EXPORT: Layout(Export, "<QQBBIB" + PROP, Tail.U32, max_tail=MAX_PIDS * 4, fds=1),
    Msg.REVOKE: Layout(Revoke, "<Q"),
    Msg.SET_PIDS: Layout(SetPids, "<QB", Tail.U32, max_tail=MAX_PIDS * 4),
    Msg.IMPORT: Layout(Import, "<QB32s"),
    Msg.BARE_TGID: Layout(BareTgid, "<"),
    Msg.LIST: Layout(List, "<I"),
    Msg.CHARGE_GPU: Layout(ChargeGpu, "<IQ"),
    Msg.REMOTE_IMPORT: Layout(RemoteImport, "<128s"),
    Msg.SET_REMOTE_PIDS: Layout(SetRemotePids, "<QBI", Tail.U32, max_tail=MAX_PIDS * 4),
    Msg.OK: Layout(Ok, "<"),
    Msg.ERROR: Layout(Error, "<I", Tail.TEXT, max_tail=4096),
    Msg.TOKEN: Layout(Token, "<Q"),
    Msg.MEM: Layout(Mem, "<QQ"),
    Msg.EXPORTED: Layout(Exported, "<", Tail.BYTES, max_tail=128),
    Msg.IMPORTED: Layout(Imported, "<QQB" + PROP, fds=1),
    Msg.PID: Layout(Pid, "<I"),
    Msg.LISTING: Layout(Listing, "<", Tail.TEXT, max_tail=MAX_BODY),
    Msg.REMOTE_IMPORTED: Layout(RemoteImported, "<QQB" + PROP + "Q", Tail.TEXT, max_tail=255),
}
_BY_NUMBER: dict[int, Layout] = {int(k): v for k, v in LAYOUTS.items()}
_BY_CLASS: dict[type[Message], Layout] = {v.message: v for v in LAYOUTS.values()}
_frame = tuple.__new__  # Frame(req, message) without the Python-level __new__ of a NamedTuple


@functools.cache
def _u32s(n: int) -> struct.Struct:
    """The struct of an n-pid tail (n <= MAX_PIDS: both sides check the length first)."""
    return struct.Struct(f"<{n}I")


# ---------------------------------------------------------------- encode / decode


def encode(message: Message, request_id: int) -> bytes:
    """One frame; raises ProtocolError if the message's values do not fit its type."""
    layout = _BY_CLASS.get(type(message))
    if layout is None:
        raise ProtocolError(f"{type(message).__name__} is not a message of this protocol")
    values = layout.values(message)
    for index, size in layout.sized:
        value = values[index]
        if not isinstance(value, (bytes, bytearray)) or len(value) != size:
            raise ProtocolError(f"{layout.type.name}: field {layout.fields[index]} must be {size} bytes")
    try:
        body = layout.fixed.pack(*values)
    except struct.error as exc:
        raise ProtocolError(f"{layout.type.name}: {exc}") from None
    if layout.tail is not Tail.NONE:
        body += _encode_tail(layout, getattr(message, layout.tail_field))
    return HEADER.pack(MAGIC, VERSION, layout.type, request_id & 0xFFFFFFFF, len(body)) + body


def _encode_tail(layout: Layout, tail: Any) -> bytes:
    if layout.tail is Tail.U32:
        try:
            count = len(tail)
            if count * 4 > layout.max_tail:
                raise ProtocolError(f"{layout.type.name} tail of {count * 4} bytes exceeds {layout.max_tail}")
            extra = _u32s(count).pack(*tail)
        except (struct.error, TypeError) as exc:
            raise ProtocolError(f"{layout.type.name} tail: {exc}") from None
    elif layout.tail is Tail.TEXT:
        text = tail if isinstance(tail, str) else bytes(tail).decode("utf-8", "replace")
        extra = text.encode("utf-8", "replace")
        if len(extra) > layout.max_tail:  # cut on a character boundary, so the peer can decode it
            extra = extra[: layout.max_tail].decode("utf-8", "ignore").encode("utf-8")
    elif isinstance(tail, (bytes, bytearray, memoryview)):
        extra = bytes(tail)
    else:
        raise ProtocolError(f"{layout.type.name} tail must be bytes, not {type(tail).__name__}")
    if len(extra) > layout.max_tail:
        raise ProtocolError(f"{layout.type.name} tail of {len(extra)} bytes exceeds {layout.max_tail}")
    return extra


def peek_request_id(packet: bytes) -> int:
    """The request id of a packet whose header at least parses (0 otherwise), for addressing error replies."""
    if len(packet) >= HEADER.size:
        return int(HEADER.unpack_from(packet)[3])
    return 0


def decode(packet: bytes, nfds: int = 0) -> Frame:
    """Decode one whole packet that arrived with `nfds` file descriptors."""
    if len(packet) < HEADER.size:
        raise ProtocolError(f"frame of {len(packet)} bytes is shorter than the {HEADER.size}-byte header")
    if len(packet) > MAX_FRAME:
        raise ProtocolError(f"frame of {len(packet)} bytes exceeds the {MAX_FRAME}-byte limit")
    magic, version, kind, req, length = HEADER.unpack_from(packet)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} is not supported (this side speaks {VERSION})")
    layout = _BY_NUMBER.get(kind)
    if layout is None:
        raise ProtocolError(f"unknown message type {kind}")
    name = layout.type.name
    if length != len(packet) - HEADER.size:
        raise ProtocolError(f"body length {length} disagrees with the {len(packet) - HEADER.size} bytes received")
    if nfds != layout.fds:
        raise ProtocolError(f"{name} carries {layout.fds} file descriptor(s), got {nfds}")
    fixed = layout.fixed.size
    if length < fixed:
        raise ProtocolError(f"{name} body of {length} bytes is shorter than {fixed}")
    values = layout.fixed.unpack_from(packet, HEADER.size)
    rest = length - fixed
    if layout.tail is Tail.NONE:
        if rest:
            raise ProtocolError(f"{name} has {rest} trailing bytes")
        return _frame(Frame, (req, layout.build(values)))
    if rest > layout.max_tail:
        raise ProtocolError(f"{name} tail of {rest} bytes exceeds {layout.max_tail}")
    raw = packet[HEADER.size + fixed :]
    tail: bytes | str | tuple[int, ...]
    if layout.tail is Tail.U32:
        if rest % 4:
            raise ProtocolError(f"{name} tail of {rest} bytes is not a whole number of u32s")
        tail = _u32s(rest // 4).unpack(raw)
    elif layout.tail is Tail.TEXT:
        try:
            tail = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"{name} text is not UTF-8: {exc}") from None
    else:
        tail = bytes(raw)
    return _frame(Frame, (req, layout.build(values, tail)))
