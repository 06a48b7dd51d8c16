"""The broker wire format, encode/decode only (no I/O), so it can be tested and fuzzed on its own.

One frame is one SOCK_SEQPACKET packet on the shared framing (framing.py): a 12-byte header (magic ``b"VB"``,
version 2, message type, request id, body length) and a body made of a fixed struct and, for some types, a tail
(bytes, a u32 array or UTF-8 text). Each message type is a dataclass (messages.py) whose fields are the fixed
fields in wire order, then the tail; this module is their table. Decoding is strict (framing.py says what it
refuses) and raises ProtocolError.

Every import crosses this codec four times, so each type's header and fixed fields are packed and unpacked by
one struct, worked out once.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from .framing import HEADER, PROP, Framing, Layout, Tail
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
    "HOT_IMPORT",
    "HOT_IMPORTED",
    "HOT_OK",
    "HOT_RELEASE",
    "LAYOUTS",
    "MAGIC",
    "MAX_BODY",
    "MAX_FDS",
    "MAX_FRAME",
    "MAX_PIDS",
    "PROP",
    "VERSION",
    "BareTgid",
    "Charge",
    "ChargeGpu",
    "Error",
    "Export",
    "Exported",
    "Frame",
    "HotFrame",
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
VERSION = 2  # 2: REMOTE_IMPORTED carries the engine's data port
MAX_FRAME = 64 * 1024
MAX_BODY = MAX_FRAME - HEADER.size
MAX_FDS = 1
MAX_PIDS = 4096  # u32s in a pid tail


class ProtocolError(ValueError):
    """A frame that does not follow the protocol; the peer gets an error reply, never a crash."""


class Frame(NamedTuple):
    """One decoded packet: the request id it answers or asks under, and the message."""

    req: int
    message: Message


def _layout(message: type[Message], fmt: str, tail: Tail = Tail.NONE, max_tail: int = 0, fds: int = 0) -> Layout:
    """A message type's layout, numbered by its class (every text tail of this protocol is cut to fit)."""
    return Layout(message, message.TYPE, fmt, tail, max_tail, fds)


LAYOUTS: dict[Msg, Layout] = {
    Msg(layout.kind): layout
    for layout in (
        _layout(Charge, "<iQ"),
        _layout(Release, "<Q"),
        _layout(MemInfo, "<I"),
        _layout(Export, "<QQBBIB" + PROP.format, Tail.U32, max_tail=MAX_PIDS * 4, fds=1),
        _layout(Revoke, "<Q"),
        _layout(SetPids, "<QB", Tail.U32, max_tail=MAX_PIDS * 4),
        _layout(Import, "<QB32s"),
        _layout(BareTgid, "<"),
        _layout(List, "<I"),
        _layout(ChargeGpu, "<IQ"),
        _layout(RemoteImport, "<128s"),
        _layout(SetRemotePids, "<QBI", Tail.U32, max_tail=MAX_PIDS * 4),
        _layout(Ok, "<"),
        _layout(Error, "<I", Tail.TEXT, max_tail=4096),  # text over its limit is cut, here and below
        _layout(Token, "<Q"),
        _layout(Mem, "<QQ"),
        _layout(Exported, "<", Tail.BYTES, max_tail=128),
        _layout(Imported, "<QQB" + PROP.format, fds=1),
        _layout(Pid, "<I"),
        _layout(Listing, "<", Tail.TEXT, max_tail=MAX_BODY),
        _layout(RemoteImported, "<QQB" + PROP.format + "QH16sH", Tail.TEXT, max_tail=255),
    )
}
LOCAL: Framing[Message, Frame] = Framing("broker protocol", MAGIC, VERSION, MAX_BODY, ProtocolError, Frame,
                                         LAYOUTS.values())

# the module's codec: bound once, so a call costs what a plain function's does
encode = LOCAL.encode  # (message, request_id) -> one frame; ProtocolError if its values do not fit its type
decode = LOCAL.decode  # (packet, nfds=0) -> Frame of a whole packet that arrived with nfds descriptors
peek_request_id = LOCAL.peek_request_id  # (packet) -> its request id (0 if not even its header parses)


class HotFrame:
    """One message type's whole frame as one struct whose first field is the header's constant start (magic,
    version, type: 4 bytes) and whose third is the body length (4 bytes), so a frame of the type is recognised by two
    comparisons and packed or unpacked in one call. For the frames every import and free exchanges: the broker and
    the client read and write their fields directly, without building message objects, with the same bytes as
    `encode` gives and `decode` takes (tests pin both)."""

    def __init__(self, kind: Msg) -> None:
        layout = LAYOUTS[kind]
        if layout.tail is not Tail.NONE:
            raise AssertionError(f"{kind.name} has a tail: its frames are not of one size")
        self.kind = kind
        self.start = HEADER.pack(MAGIC, VERSION, kind, 0, 0)[:4]
        self.length = layout.fixed.size.to_bytes(4, "little")
        self.struct = struct.Struct("<4sI4s" + layout.fixed.format.lstrip("<"))
        self.size = self.struct.size
        self.fds = layout.fds


HOT_IMPORT = HotFrame(Msg.IMPORT)  # (start, req, length, shareable, share_type, secret)
HOT_IMPORTED = HotFrame(Msg.IMPORTED)  # (start, req, length, hold, size, memory_kind, *prop)
HOT_RELEASE = HotFrame(Msg.RELEASE)  # (start, req, length, hold)
HOT_OK = HotFrame(Msg.OK)  # (start, req, length)
