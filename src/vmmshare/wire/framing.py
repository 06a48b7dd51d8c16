"""The one framing both wire protocols are written on (local.py: a process and its broker; peer.py: broker and broker).

A frame is a 12-byte header (magic, version, message type, request id, body length; little-endian) and a body: a
fixed struct and, for some types, a tail (bytes, a u32 array or UTF-8 text). A `Layout` says how one message type
lies in a body; a `Framing` is one protocol (its magic, version, body limit, error class and layouts) and encodes and
decodes its frames. Decoding is strict: a bad magic or version, an unknown type, a length outside what the type takes
or that disagrees with the frame, trailing bytes, a ragged u32 tail, text that is not UTF-8 or the wrong number of
attached file descriptors raise the protocol's error.

The five fields of an allocation property (handleType, allocationType, memAttr, location.type, location.id) travel
together in several messages of both protocols: `PROP` is their one codec.
"""

from __future__ import annotations

import enum
import functools
import operator
import struct
from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import Any, Generic, TypeVar

HEADER = struct.Struct("<2sBBII")  # magic, version, message type, request id, body length
KIND_AT = 3  # the header's message type byte, after the 2-byte magic and the version
M = TypeVar("M")  # a protocol's message base class
F = TypeVar("F", bound=tuple)  # type: ignore[type-arg]  # its (request id, message) named tuple


class Tail(enum.Enum):
    """What follows a message's fixed fields: nothing, bytes, a u32 array or UTF-8 text."""

    NONE = 0
    BYTES = 1
    U32 = 2
    TEXT = 3


class PropCodec:
    """The allocation property's five fields as they lie in a message: their struct codes and names, in wire order.

    A message that carries a property has these five fields one after another; `values` reads them off a message
    (of either protocol), so code that copies a property from one message into another copies one tuple.
    """

    format = "BBBBi"
    fields = ("handle_type", "allocation_type", "mem_attr", "location_type", "location_id")

    def __init__(self) -> None:
        self.values: Callable[[Any], tuple[int, int, int, int, int]] = operator.attrgetter(*self.fields)


PROP = PropCodec()


def cut_text(raw: bytes, limit: int) -> bytes:
    """`raw` (UTF-8) shortened to at most `limit` bytes on a character boundary, so the other end can decode it."""
    if len(raw) <= limit:
        return raw
    return raw[:limit].decode("utf-8", "ignore").encode("utf-8")


@functools.cache
def _u32s(n: int) -> struct.Struct:
    """The struct of an n-element u32 tail (n is bounded: both sides check the length first)."""
    return struct.Struct(f"<{n}I")


class Layout:
    """How one message type lies in a body: its fixed struct, its tail (the message's last field), the most bytes
    that tail takes, and the file descriptors that travel with it. A text tail over its limit is cut (`cut`) or
    refused; everything encode and decode need per type is worked out here once, not per call.
    """

    def __init__(self, message: type, kind: int, fmt: str, tail: Tail = Tail.NONE, max_tail: int = 0,
                 fds: int = 0, cut: bool = True) -> None:
        self.message = message
        self.kind = kind
        self.name = getattr(kind, "name", str(kind))
        self.new: Callable[..., Any] = message  # the dataclass's own __init__ (fields in wire order)
        self.fixed = struct.Struct(fmt)
        self.whole = struct.Struct(HEADER.format + fmt.lstrip("<"))  # the header and the fixed fields as one
        self.tail, self.max_tail, self.fds, self.cut = tail, max_tail, fds, cut
        self.most = self.whole.size + max_tail  # the longest frame of the type
        names = tuple(f.name for f in fields(message))
        self.fields = names[:-1] if tail is not Tail.NONE else names
        self.tail_field = names[-1] if tail is not Tail.NONE else ""
        zeros = self.fixed.unpack(bytes(self.fixed.size))
        if len(zeros) != len(self.fields):
            raise AssertionError(f"{message.__name__}: {fmt} packs {len(zeros)} fields, the class has {self.fields}")
        # fixed-size bytes fields: struct would silently cut or pad those
        self.sized = tuple((i, len(z)) for i, z in enumerate(zeros) if isinstance(z, bytes))
        self.values: Callable[[Any], tuple[Any, ...]]  # the fixed fields of a message, in wire order
        if not self.fields:
            self.values = lambda m: ()
        elif len(self.fields) == 1:
            one = operator.attrgetter(self.fields[0])
            self.values = lambda m: (one(m),)
        else:
            self.values = operator.attrgetter(*self.fields)
        self.tail_of: Callable[[Any], Any] = (operator.attrgetter(self.tail_field) if self.tail_field
                                              else lambda m: None)  # a message's tail (None: the type has none)

    def build(self, values: tuple[Any, ...], tail: Any = None) -> Any:
        """The message of these fixed values (and tail, for a type that has one)."""
        return self.new(*values) if self.tail is Tail.NONE else self.new(*values, tail)


class Framing(Generic[M, F]):
    """One protocol on the shared framing: its magic, version, body limit, the error it raises, and its layouts.

    `frame` is the protocol's (request id, message) named tuple, built without its Python-level constructor.
    """

    def __init__(self, name: str, magic: bytes, version: int, max_body: int, error: type[ValueError],
                 frame: type[F], layouts: Iterable[Layout]) -> None:
        self.name, self.magic, self.version, self.max_body, self.error = name, magic, version, max_body, error
        self.max_frame = HEADER.size + max_body
        self._frame = frame
        self.layouts = tuple(layouts)
        self.by_kind: dict[int, Layout] = {int(layout.kind): layout for layout in self.layouts}
        self.by_class: dict[type, Layout] = {layout.message: layout for layout in self.layouts}
        for layout in self.layouts:
            if layout.fixed.size + layout.max_tail > max_body:
                raise AssertionError(f"{layout.name} takes up to {layout.fixed.size + layout.max_tail} bytes, more "
                                     f"than the {name}'s {max_body}-byte body")

    # ------------------------------------------------------------ encode

    def encode(self, message: M, request_id: int) -> bytes:
        """One frame; the protocol's error if the message is not one of its own or its values do not fit."""
        layout = self.by_class.get(type(message))
        if layout is None:
            raise self.error(f"{type(message).__name__} is not a message of the {self.name}")
        return self.encode_fields(layout, request_id, layout.values(message), layout.tail_of(message))

    def encode_fields(self, layout: Layout, request_id: int, values: tuple[Any, ...], tail: Any = None) -> bytes:
        """`encode` of a message given as its layout, fixed values (in wire order) and tail, for a caller that has
        the values at hand: the same frame and the same errors, without a message object made to be read back."""
        for index, size in layout.sized:
            value = values[index]
            if not isinstance(value, (bytes, bytearray)) or len(value) != size:
                raise self.error(f"{layout.name}: field {layout.fields[index]} must be {size} bytes")
        req = request_id & 0xFFFFFFFF
        try:
            if layout.tail is Tail.NONE:
                return layout.whole.pack(self.magic, self.version, layout.kind, req, layout.fixed.size, *values)
            body = layout.fixed.pack(*values)
        except struct.error as exc:
            raise self.error(f"{layout.name}: {exc}") from None
        body += self._encode_tail(layout, tail)
        return HEADER.pack(self.magic, self.version, layout.kind, req, len(body)) + body

    def _encode_tail(self, layout: Layout, tail: Any) -> bytes:
        if layout.tail is Tail.U32:
            try:
                count = len(tail)
                if count * 4 > layout.max_tail:
                    raise self.error(f"{layout.name} tail of {count * 4} bytes exceeds {layout.max_tail}")
                return _u32s(count).pack(*tail)
            except (struct.error, TypeError) as exc:
                raise self.error(f"{layout.name} tail: {exc}") from None
        if layout.tail is Tail.TEXT:
            if isinstance(tail, str):
                text = tail
            elif isinstance(tail, (bytes, bytearray, memoryview)):
                text = bytes(tail).decode("utf-8", "replace")
            else:
                raise self.error(f"{layout.name} text must be str or bytes, not {type(tail).__name__}")
            extra = text.encode("utf-8", "replace")
            if layout.cut:
                extra = cut_text(extra, layout.max_tail)
        elif isinstance(tail, (bytes, bytearray, memoryview)):
            extra = bytes(tail)
        else:
            raise self.error(f"{layout.name} tail must be bytes, not {type(tail).__name__}")
        if len(extra) > layout.max_tail:
            raise self.error(f"{layout.name} tail of {len(extra)} bytes exceeds {layout.max_tail}")
        return extra

    # ------------------------------------------------------------ decode

    def header(self, data: bytes | bytearray) -> tuple[Layout, int, int]:
        """The layout, request id and body length of a frame's header (at least HEADER.size bytes), checked before
        any of its body is looked at (or, on a stream, read)."""
        magic, version, kind, req, length = HEADER.unpack_from(data)
        if magic != self.magic:
            raise self.error(f"bad magic {bytes(magic)!r}: not the {self.name}")
        if version != self.version:
            raise self.error(f"{self.name} version {version} is not supported (this side speaks {self.version})")
        layout = self.by_kind.get(kind)
        if layout is None:
            raise self.error(f"unknown message type {kind}")
        size = layout.fixed.size
        if not size <= length <= size + layout.max_tail:
            raise self.error(f"{layout.name} body of {length} bytes: it takes {size}"
                             + (f" to {size + layout.max_tail}" if layout.max_tail else ""))
        return layout, req, length

    def decode(self, packet: bytes, nfds: int = 0) -> F:
        """Decode one whole frame that arrived with `nfds` file descriptors."""
        if len(packet) >= HEADER.size:
            layout = self.by_kind.get(packet[KIND_AT])
            if layout is not None and nfds == layout.fds:
                # the common cases, a frame whose length its type takes: header and fields in one unpack
                if layout.tail is Tail.NONE:
                    if len(packet) == layout.whole.size:
                        got = layout.whole.unpack(packet)
                        if got[0] == self.magic and got[1] == self.version and got[4] == layout.fixed.size:
                            return tuple.__new__(self._frame, (got[3], layout.new(*got[5:])))
                elif layout.whole.size <= len(packet) <= layout.most:
                    got = layout.whole.unpack_from(packet)
                    if got[0] == self.magic and got[1] == self.version and got[4] == len(packet) - HEADER.size:
                        # (every check `_decode_checked` makes before the tail holds: its tail's are the same)
                        tail = self._read_tail(layout, packet[layout.whole.size :])
                        return tuple.__new__(self._frame, (got[3], layout.new(*got[5:], tail)))
        return self._decode_checked(packet, nfds)

    def _decode_checked(self, packet: bytes, nfds: int) -> F:
        """Decode any frame, saying exactly what is wrong with one that does not follow the protocol."""
        if len(packet) < HEADER.size:
            raise self.error(f"frame of {len(packet)} bytes is shorter than the {HEADER.size}-byte header")
        if len(packet) > self.max_frame:
            raise self.error(f"frame of {len(packet)} bytes exceeds the {self.max_frame}-byte limit")
        layout, req, length = self.header(packet)
        if length != len(packet) - HEADER.size:
            raise self.error(f"frame of {len(packet)} bytes, its header says {HEADER.size + length}")
        if nfds != layout.fds:
            raise self.error(f"{layout.name} carries {layout.fds} file descriptor(s), got {nfds}")
        values = layout.fixed.unpack_from(packet, HEADER.size)
        if layout.tail is Tail.NONE:
            return tuple.__new__(self._frame, (req, layout.new(*values)))
        tail = self._read_tail(layout, packet[HEADER.size + layout.fixed.size :])
        return tuple.__new__(self._frame, (req, layout.new(*values, tail)))

    def _read_tail(self, layout: Layout, raw: bytes) -> bytes | str | tuple[int, ...]:
        """The tail of a frame whose header and length are checked: its bytes, u32s or UTF-8 text."""
        if layout.tail is Tail.U32:
            if len(raw) % 4:
                raise self.error(f"{layout.name} tail of {len(raw)} bytes is not a whole number of u32s")
            return _u32s(len(raw) // 4).unpack(raw)
        if layout.tail is Tail.TEXT:
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise self.error(f"{layout.name} text is not UTF-8: {exc}") from None
        return bytes(raw)

    def peek_request_id(self, packet: bytes) -> int:
        """The request id of a frame whose header at least parses (0 otherwise), for addressing error replies."""
        return int(HEADER.unpack_from(packet)[3]) if len(packet) >= HEADER.size else 0
