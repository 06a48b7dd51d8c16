"""Shareable handle formats (SPEC §6): the node-local 64-bit DEFAULT handle and the 128-byte FABRIC handle."""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

from . import constants as C
from .errors import InvalidHandleError, InvalidParamError

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
