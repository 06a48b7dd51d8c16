"""The broker wire format, encode/decode only (no I/O), so it can be tested and fuzzed on its own.

One frame is one SOCK_SEQPACKET packet: a 12-byte header (magic ``b"VB"``, version, message type,
request id, body length) and a body made of a fixed struct and, for some types, a tail (bytes, a u32
array or UTF-8 text). Decoding is strict: an unknown type, a wrong version, a length that disagrees
with the packet, trailing bytes or the wrong number of attached file descriptors raise ProtocolError.
"""

from __future__ import annotations

import enum
import functools
import re
import struct
from dataclasses import dataclass, field

MAGIC = b"VB"
VERSION = 1
HEADER = struct.Struct("<2sBBII")
MAX_FRAME = 64 * 1024
MAX_BODY = MAX_FRAME - HEADER.size
MAX_FDS = 1
PROP = "BBBBi"  # handleType, allocationType, memAttr, location.type, location.id


class ProtocolError(ValueError):
    """A frame that does not follow the protocol; the peer gets an error reply, never a crash."""


class Msg(enum.IntEnum):
    # requests
    CHARGE = 1  # device i32 (-1: host), size
    RELEASE = 2  # token
    MEM_INFO = 3  # device
    EXPORT = 4  # token, size, flags, share type, server id, kind, prop; tail: u32 pids to trust; one fd
    # attached (kind: 0 host memfd, 1 CUDA allocation fd)
    REVOKE = 5  # token
    SET_PIDS = 6  # handle, share type; tail: u32 pids
    IMPORT = 7  # handle, share type, 32-byte secret (zeros for DEFAULT)
    BARE_TGID = 8
    LIST = 9  # offset
    CHARGE_GPU = 10  # device, size: GPU memory, recorded but not capped (the driver has the capacity)
    # replies
    OK = 64
    ERROR = 65  # code; tail: message
    TOKEN = 66  # token
    MEM = 67  # free, total
    EXPORTED = 68  # tail: the shareable handle (8 or 128 bytes)
    IMPORTED = 69  # token, size, kind, prop; one fd attached
    PID = 70  # pid
    LISTING = 71  # tail: JSON text


class Tail(enum.Enum):
    NONE = 0
    BYTES = 1
    U32 = 2
    TEXT = 3


@dataclass(frozen=True)
class Spec:
    fixed: struct.Struct
    tail: Tail = Tail.NONE
    fds: int = 0
    max_tail: int = 0

    @property
    def byte_fields(self) -> dict[int, int]:
        """Index -> size of each fixed-size bytes field (struct would silently cut or pad those)."""
        fields: dict[int, int] = {}
        index = 0
        for count, code in re.findall(r"(\d*)([a-zA-Z?])", self.fixed.format):
            if code == "x":
                continue
            if code == "s":
                fields[index] = int(count or 1)
                index += 1
            else:
                index += int(count or 1)
        return fields


SPECS: dict[Msg, Spec] = {
    Msg.CHARGE: Spec(struct.Struct("<iQ")),
    Msg.RELEASE: Spec(struct.Struct("<Q")),
    Msg.MEM_INFO: Spec(struct.Struct("<I")),
    Msg.EXPORT: Spec(struct.Struct("<QQBBIB" + PROP), Tail.U32, fds=1, max_tail=4096 * 4),
    Msg.REVOKE: Spec(struct.Struct("<Q")),
    Msg.SET_PIDS: Spec(struct.Struct("<QB"), Tail.U32, max_tail=4096 * 4),
    Msg.IMPORT: Spec(struct.Struct("<QB32s")),
    Msg.BARE_TGID: Spec(struct.Struct("<")),
    Msg.LIST: Spec(struct.Struct("<I")),
    Msg.CHARGE_GPU: Spec(struct.Struct("<IQ")),
    Msg.OK: Spec(struct.Struct("<")),
    Msg.ERROR: Spec(struct.Struct("<I"), Tail.TEXT, max_tail=4096),
    Msg.TOKEN: Spec(struct.Struct("<Q")),
    Msg.MEM: Spec(struct.Struct("<QQ")),
    Msg.EXPORTED: Spec(struct.Struct("<"), Tail.BYTES, max_tail=128),
    Msg.IMPORTED: Spec(struct.Struct("<QQB" + PROP), fds=1),
    Msg.PID: Spec(struct.Struct("<I")),
    Msg.LISTING: Spec(struct.Struct("<"), Tail.TEXT, max_tail=MAX_BODY),
}


@dataclass(frozen=True)
class Frame:
    """One decoded message: its type, request id, fixed fields and tail."""

    type: Msg
    req: int
    values: tuple[int | bytes, ...] = ()
    tail: bytes | str | tuple[int, ...] = field(default=b"")

    def ints(self) -> tuple[int, ...]:
        """The fixed fields, all of which are ints for this message type."""
        return tuple(v for v in self.values if isinstance(v, int))


def encode(kind: Msg, req: int, *values: int | bytes, tail: bytes | str | tuple[int, ...] | list[int] = b"") -> bytes:
    """One frame; raises ProtocolError if the values do not fit the message type."""
    spec = SPECS[kind]
    for index, size in _byte_fields(kind).items():
        value = values[index] if index < len(values) else None
        if not isinstance(value, (bytes, bytearray)) or len(value) != size:
            raise ProtocolError(f"{kind.name}: field {index} must be {size} bytes")
    try:
        body = spec.fixed.pack(*values)
    except struct.error as exc:
        raise ProtocolError(f"{kind.name}: {exc}") from None
    if spec.tail is Tail.U32:
        try:
            extra = struct.pack(f"<{len(tail)}I", *tail)
        except struct.error as exc:
            raise ProtocolError(f"{kind.name} tail: {exc}") from None
    elif spec.tail is Tail.TEXT:
        text = tail if isinstance(tail, str) else bytes(tail).decode("utf-8", "replace")
        extra = text.encode("utf-8", "replace")
        if len(extra) > spec.max_tail:  # cut on a character boundary, so the peer can decode it
            extra = extra[: spec.max_tail].decode("utf-8", "ignore").encode("utf-8")
    elif spec.tail is Tail.BYTES:
        extra = bytes(tail)  # type: ignore[arg-type]
    else:
        extra = b""
    if len(extra) > spec.max_tail:
        raise ProtocolError(f"{kind.name} tail of {len(extra)} bytes exceeds {spec.max_tail}")
    body += extra
    return HEADER.pack(MAGIC, VERSION, kind, req & 0xFFFFFFFF, len(body)) + body


_BY_TYPE: dict[int, tuple[Msg, Spec]] = {int(k): (k, v) for k, v in SPECS.items()}


@functools.cache
def _byte_fields(kind: Msg) -> dict[int, int]:
    return SPECS[kind].byte_fields


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
    magic, version, kind_raw, req, length = HEADER.unpack_from(packet)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} is not supported (this side speaks {VERSION})")
    known = _BY_TYPE.get(kind_raw)
    if known is None:
        raise ProtocolError(f"unknown message type {kind_raw}")
    kind, spec = known
    if length != len(packet) - HEADER.size:
        raise ProtocolError(f"body length {length} disagrees with the {len(packet) - HEADER.size} bytes received")
    if nfds != spec.fds:
        raise ProtocolError(f"{kind.name} carries {spec.fds} file descriptor(s), got {nfds}")
    body = packet[HEADER.size :]
    if len(body) < spec.fixed.size:
        raise ProtocolError(f"{kind.name} body of {len(body)} bytes is shorter than {spec.fixed.size}")
    values = spec.fixed.unpack_from(body)
    rest = body[spec.fixed.size :]
    tail: bytes | str | tuple[int, ...]
    if spec.tail is Tail.NONE:
        if rest:
            raise ProtocolError(f"{kind.name} has {len(rest)} trailing bytes")
        tail = b""
    elif len(rest) > spec.max_tail:
        raise ProtocolError(f"{kind.name} tail of {len(rest)} bytes exceeds {spec.max_tail}")
    elif spec.tail is Tail.U32:
        if len(rest) % 4:
            raise ProtocolError(f"{kind.name} tail of {len(rest)} bytes is not a whole number of u32s")
        tail = struct.unpack(f"<{len(rest) // 4}I", rest)
    elif spec.tail is Tail.TEXT:
        try:
            tail = rest.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"{kind.name} text is not UTF-8: {exc}") from None
    else:
        tail = bytes(rest)
    return Frame(kind, req, values, tail)
