"""The broker wire format, encode/decode only (no I/O), so it can be tested and fuzzed on its own.

One frame is one SOCK_SEQPACKET packet: a 12-byte header (magic ``b"VB"``, version, message type,
request id, body length) and a body made of a fixed struct and, for some types, a tail (bytes, a u32
array or UTF-8 text). Each message type is a dataclass (messages.py) whose fields are the fixed fields in
wire order, then the tail. Decoding is strict: an unknown type, a wrong version, a length that disagrees
with the packet, trailing bytes or the wrong number of attached file descriptors raise ProtocolError.

Every import crosses this codec four times, so each type's header and fixed fields are packed and unpacked by
one struct, worked out once.
"""

from __future__ import annotations

import enum
import functools
import operator
import struct
from collections.abc import Callable
from dataclasses import fields
from typing import Any, NamedTuple

from .messages import (
    BareTgid,
    Charge,
    ChargeGpu,
    Error,
    Export,
    Exported,
    Import,
    Imported,
    List,
    Listing,
    Mem,
    MemInfo,
    Message,
    Msg,
    Ok,
    Pid,
    Release,
    RemoteImport,
    RemoteImported,
    Revoke,
    SetPids,
    SetRemotePids,
    Token,
)

__all__ = [
    "HEADER",
    "LAYOUTS",
    "MAGIC",
    "MAX_BODY",
    "MAX_FDS",
    "MAX_FRAME",
    "MAX_PIDS",
    "VERSION",
    "BareTgid",
    "Charge",
    "ChargeGpu",
    "Error",
    "Export",
    "Exported",
    "Frame",
    "Import",
    "Imported",
    "Layout",
    "List",
    "Listing",
    "Mem",
    "MemInfo",
    "Message",
    "Msg",
    "Ok",
    "Pid",
    "ProtocolError",
    "Release",
    "RemoteImport",
    "RemoteImported",
    "Revoke",
    "SetPids",
    "SetRemotePids",
    "Tail",
    "Token",
    "decode",
    "encode",
    "peek_request_id",
]

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


class Tail(enum.Enum):
    NONE = 0
    BYTES = 1
    U32 = 2
    TEXT = 3


class Frame(NamedTuple):
    """One decoded packet: the request id it answers or asks under, and the message."""

    req: int
    message: Message


# ---------------------------------------------------------------- layouts


class Layout:
    """How one message type lies on the wire: its fixed struct, its tail, and the fds that travel with it.

    Everything encode and decode need per type is worked out here once, not per call: `whole` is the header and
    the fixed fields as one struct.
    """

    def __init__(self, message: type[Message], fmt: str, tail: Tail = Tail.NONE, max_tail: int = 0,
                 fds: int = 0) -> None:
        self.type = message.TYPE
        self.message = message
        self.new: Callable[..., Message] = message  # the dataclass's own __init__ (fields in wire order)
        self.fixed = struct.Struct(fmt)
        self.whole = struct.Struct(HEADER.format + fmt.lstrip("<"))
        self.tail, self.max_tail, self.fds = tail, max_tail, fds
        names = tuple(f.name for f in fields(message))  # type: ignore[arg-type]
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

    def build(self, values: tuple[Any, ...], tail: Any = None) -> Message:
        """The message of these fixed values (and tail, for a type that has one)."""
        return self.new(*values) if self.tail is Tail.NONE else self.new(*values, tail)


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
    Msg.REMOTE_IMPORTED: Layout(RemoteImported, "<QQB" + PROP + "QH16s", Tail.TEXT, max_tail=255),
}
_BY_NUMBER: dict[int, Layout] = {int(k): v for k, v in LAYOUTS.items()}
_BY_CLASS: dict[type[Message], Layout] = {v.message: v for v in LAYOUTS.values()}
_frame = tuple.__new__  # Frame(req, message) without the Python-level __new__ of a NamedTuple
_KIND = 3  # the header's message type byte, after the 2-byte magic and the version


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
    req = request_id & 0xFFFFFFFF
    try:
        if layout.tail is Tail.NONE:
            return layout.whole.pack(MAGIC, VERSION, layout.type, req, layout.fixed.size, *values)
        body = layout.fixed.pack(*values)
    except struct.error as exc:
        raise ProtocolError(f"{layout.type.name}: {exc}") from None
    body += _encode_tail(layout, getattr(message, layout.tail_field))
    return HEADER.pack(MAGIC, VERSION, layout.type, req, len(body)) + body


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
        if isinstance(tail, str):
            text = tail
        elif isinstance(tail, (bytes, bytearray, memoryview)):
            text = bytes(tail).decode("utf-8", "replace")
        else:
            raise ProtocolError(f"{layout.type.name} text must be str or bytes, not {type(tail).__name__}")
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
    if len(packet) >= HEADER.size:
        layout = _BY_NUMBER.get(packet[_KIND])
        # the common case, a tail-less message of the right length: header and fields in one unpack
        if layout is not None and layout.tail is Tail.NONE and len(packet) == layout.whole.size and nfds == layout.fds:
            got = layout.whole.unpack(packet)
            if got[0] == MAGIC and got[1] == VERSION and got[4] == layout.fixed.size:
                return _frame(Frame, (got[3], layout.new(*got[5:])))
    return _decode_checked(packet, nfds)


def _decode_checked(packet: bytes, nfds: int) -> Frame:
    """Decode any packet, saying exactly what is wrong with one that does not follow the protocol."""
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
