"""Shareable handle formats (SPEC §6): the node-local 64-bit DEFAULT handle and the 128-byte FABRIC handle."""

from __future__ import annotations

import enum
import ipaddress
import re
import struct
from dataclasses import dataclass, field

from .. import constants as C
from ..errors import InvalidHandleError, InvalidParamError

MAX_TRUSTLIST = 4096
FABRIC_MAGIC = b"VMMF"
FABRIC_VERSION = 1
FLAG_NO_PID_VALIDATION = 0x1
SECRET_SIZE = 32

# magic, version, share type, flags, server id, device id, handle, size
_HEAD = struct.Struct("<4sBBHIIQQ")
# endpoint: family (0 none, 4, 6), port, 16 address bytes, 12 reserved
_ENDPOINT = struct.Struct("<BxH16s12x")
assert _HEAD.size == 32 and _ENDPOINT.size == 32


@dataclass(frozen=True)
class Endpoint:
    """Where the exporting server's transfer endpoint listens; family 0 means not reachable remotely."""

    family: int = 0
    address: str = ""
    port: int = 0

    def pack(self) -> bytes:
        if self.family == 0:
            return bytes(_ENDPOINT.size)
        raw = ipaddress.ip_address(self.address).packed.ljust(16, b"\0")
        return _ENDPOINT.pack(self.family, self.port, raw)

    @classmethod
    def unpack(cls, data: bytes) -> Endpoint:
        family, port, raw = _ENDPOINT.unpack(data)
        if family == 0:
            if any(data):
                raise InvalidParamError("FABRIC handle endpoint has family 0 but is not zero")
            return cls()
        if family == 4:
            return cls(4, str(ipaddress.IPv4Address(raw[:4])), port)
        if family == 6:
            return cls(6, str(ipaddress.IPv6Address(raw)), port)
        raise InvalidParamError(f"FABRIC handle endpoint family {family} is not 0, 4 or 6")


@dataclass(frozen=True)
class FabricHandle:
    """The decoded aclrtMemFabricHandle."""

    server_id: int
    device_id: int
    handle: int
    size: int
    secret: bytes
    flags: int = 0
    endpoint: Endpoint = Endpoint()

    def pack(self) -> bytes:
        if len(self.secret) != SECRET_SIZE:
            raise InvalidParamError(f"FABRIC secret must be {SECRET_SIZE} bytes")
        head = _HEAD.pack(
            FABRIC_MAGIC,
            FABRIC_VERSION,
            C.ACL_MEM_SHARE_HANDLE_TYPE_FABRIC,
            self.flags,
            self.server_id,
            self.device_id,
            self.handle,
            self.size,
        )
        return head + self.endpoint.pack() + self.secret + bytes(32)


def decode_fabric(data: object) -> FabricHandle:
    """Decode 128 bytes into a FabricHandle; anything else raises 107000 (shape) or 107017 (content)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidParamError(f"a FABRIC handle is 128 bytes, got {type(data).__name__}")
    raw = bytes(data)
    if len(raw) != C.FABRIC_HANDLE_SIZE:
        raise InvalidParamError(f"a FABRIC handle is {C.FABRIC_HANDLE_SIZE} bytes, got {len(raw)}")
    magic, version, share_type, flags, server, device, handle, size = _HEAD.unpack_from(raw)
    if magic != FABRIC_MAGIC:
        raise InvalidHandleError("not a FABRIC handle (bad magic): pass the 128 bytes the exporter produced")
    if version != FABRIC_VERSION or share_type != C.ACL_MEM_SHARE_HANDLE_TYPE_FABRIC:
        raise InvalidHandleError(f"FABRIC handle version {version} / share type {share_type} is not supported")
    if flags & ~FLAG_NO_PID_VALIDATION or handle == 0 or any(raw[96:]):
        raise InvalidHandleError("FABRIC handle is malformed (flags, handle or reserved bytes)")
    endpoint = Endpoint.unpack(raw[32:64])
    return FabricHandle(server, device, handle, size, raw[64:96], flags, endpoint)


def default_bytes(value: int) -> bytes:
    """A DEFAULT (uint64) shareable handle as the 8 little-endian bytes the runtime keys imports by."""
    return value.to_bytes(8, "little")


class ShareType(enum.IntEnum):
    """aclrtMemSharedHandleType."""

    DEFAULT = C.ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT
    FABRIC = C.ACL_MEM_SHARE_HANDLE_TYPE_FABRIC

    @property
    def label(self) -> str:
        """Its name in the handle text ("default", "fabric"): a table of the two, not Enum.name, read per export."""
        return _LABELS[self]


_LABELS = {ShareType.DEFAULT: "default", ShareType.FABRIC: "fabric"}


class NotAnIntError(InvalidParamError, TypeError):
    """int() of a FABRIC handle: a TypeError, as Python has it for a value with no int, and an AclError (107000)."""


_TEXT = re.compile(r"^vmm:(default|fabric):([0-9a-f]+)$", re.IGNORECASE)
_INT_TEXT = re.compile(r"^(0x[0-9a-f]+|[0-9]+)$", re.IGNORECASE)
_DEFAULT_TEXT = re.compile(r"vmm:default:([0-9a-f]{16})", re.IGNORECASE)  # `_TEXT`'s DEFAULT form, whole


@dataclass(frozen=True)
class ShareableHandle:
    """A shareable handle, copyable by value: ``int(h)`` for DEFAULT, ``bytes(h)`` for FABRIC, ``str(h)``
    as text for environment variables, command lines and JSON, and `ShareableHandle.parse` back.

    `value` is the node-local 64-bit handle both kinds carry; `fabric` the decoded FABRIC handle.
    """

    kind: str
    raw: bytes
    share_type: ShareType = field(init=False, repr=False, compare=False)
    value: int = field(init=False, repr=False, compare=False)
    fabric: FabricHandle | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str):
            raise InvalidParamError(f"kind must be 'default' or 'fabric', got {type(self.kind).__name__}")
        if not isinstance(self.raw, bytes):
            raise InvalidParamError(f"a shareable handle's raw form is bytes, not {type(self.raw).__name__}")
        fabric = None
        if self.kind == "default":
            if len(self.raw) != 8 or not any(self.raw):
                raise InvalidParamError("a DEFAULT shareable handle is 8 bytes, not all zero")
            value, share_type = int.from_bytes(self.raw, "little"), ShareType.DEFAULT
        elif self.kind == "fabric":
            fabric = decode_fabric(self.raw)
            value, share_type = fabric.handle, ShareType.FABRIC
        else:
            raise InvalidParamError(f"kind {self.kind!r}: 'default' or 'fabric'")
        object.__setattr__(self, "share_type", share_type)
        object.__setattr__(self, "value", value)
        object.__setattr__(self, "fabric", fabric)

    @classmethod
    def default(cls, value: int) -> ShareableHandle:
        """The DEFAULT handle of the 64-bit `value`."""
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 1 << 64:
            raise InvalidParamError(f"a DEFAULT shareable handle is a non-zero 64-bit int, got {value!r}")
        if type(value) is int:
            return cls._default_of(value)
        return cls("default", default_bytes(value))

    @classmethod
    def _default_of(cls, value: int) -> ShareableHandle:
        """The DEFAULT handle of a plain int checked to be non-zero and 64-bit: its fields as `__post_init__` would
        work them out of its bytes, set without going through the checks again."""
        self = object.__new__(cls)
        self.__dict__.update(kind="default", raw=value.to_bytes(8, "little"), share_type=ShareType.DEFAULT,
                             value=value, fabric=None)
        return self

    @classmethod
    def of(cls, share_type: ShareType, raw: bytes) -> ShareableHandle:
        """The handle `raw` of `share_type` (8 little-endian bytes for DEFAULT, 128 for FABRIC)."""
        if not isinstance(share_type, ShareType):
            raise InvalidParamError(f"share_type must be a ShareType, got {share_type!r}")
        if share_type is ShareType.DEFAULT and type(raw) is bytes and len(raw) == 8 and any(raw):
            return cls._default_of(int.from_bytes(raw, "little"))  # what `__post_init__` accepts of a DEFAULT handle
        return cls(share_type.label, raw)

    @classmethod
    def from_value(cls, value: int | bytes | bytearray | memoryview | str | ShareableHandle) -> ShareableHandle:
        """From an int (DEFAULT), 8 bytes (DEFAULT) or 128 bytes (FABRIC), any text form, or a ShareableHandle."""
        if isinstance(value, str):  # (first: the text form is what users pass)
            return cls._parse(value)
        if isinstance(value, ShareableHandle):
            return value
        if isinstance(value, (bytes, bytearray, memoryview)):
            raw = bytes(value)
            if len(raw) == 8:
                return cls("default", raw)
            if len(raw) != C.FABRIC_HANDLE_SIZE:
                raise InvalidParamError(f"a shareable handle is 8 bytes (DEFAULT) or {C.FABRIC_HANDLE_SIZE} "
                                        f"(FABRIC), got {len(raw)}")
            return cls("fabric", raw)
        if isinstance(value, int) and not isinstance(value, bool):
            return cls.default(value)
        raise InvalidParamError(f"not a shareable handle: {value!r}")

    @classmethod
    def parse(cls, text: str) -> ShareableHandle:
        """Parse what `str(h)` prints (``vmm:default:<16 hex>``, ``vmm:fabric:<256 hex>``), or a DEFAULT handle's
        value as an int in decimal or ``0x`` hex (what ``vmmshare ls`` and pyACL programs print); any case."""
        if not isinstance(text, str):
            raise InvalidParamError(f"not a shareable handle text: {text!r}")
        return cls._parse(text)

    @classmethod
    def _parse(cls, text: str) -> ShareableHandle:
        """`parse` of a str."""
        stripped = text.strip()
        m = _DEFAULT_TEXT.fullmatch(stripped)  # what str(h) prints for a DEFAULT handle: looked for first
        if m is not None:
            value = int(m[1], 16)
            if value == 0:
                raise InvalidParamError("a DEFAULT shareable handle is 8 bytes, not all zero")
            return cls._default_of(value)
        if _INT_TEXT.match(stripped):
            return cls.default(int(stripped, 0))
        m = _TEXT.match(stripped)
        if not m or m.group(1).lower() != "fabric" or len(m.group(2)) != 256:
            raise InvalidParamError(f"not a shareable handle text: {text!r} (expected vmm:default:<16 hex digits>, "
                                    "vmm:fabric:<256 hex digits>, or the DEFAULT value as an int)")
        return cls("fabric", bytes.fromhex(m.group(2)))

    def __int__(self) -> int:
        if self.share_type is not ShareType.DEFAULT:
            raise NotAnIntError("a FABRIC handle is 128 bytes: use bytes(handle)")
        return self.value

    def __bytes__(self) -> bytes:
        return self.raw

    def __str__(self) -> str:
        if self.share_type is ShareType.DEFAULT:
            return f"vmm:default:{self.value:016x}"
        return f"vmm:fabric:{self.raw.hex()}"

    def __repr__(self) -> str:
        return f"ShareableHandle({str(self)!r})"

    def __reduce__(self) -> tuple[object, ...]:
        return (ShareableHandle, (self.kind, self.raw))
