"""The C arguments of the C library's calls (cacl.py): the runtime's structures as ctypes, and the conversions of
Python values to C ones that refuse, as pyACL does, a value its C type cannot hold (BadArgument, 107000 to the
caller). The conversions keep a leading underscore: the calls' parameters use their plain names."""

from __future__ import annotations

import ctypes as C
from collections.abc import Mapping
from typing import Any

PARAM = 107000
NOT_SUPPORTED = 207000
DEFAULT, FABRIC = 1, 2
U64 = (1 << 64) - 1


class Location(C.Structure):
    _fields_ = [("id", C.c_uint32), ("type", C.c_int)]


class Prop(C.Structure):
    _fields_ = [("handleType", C.c_int), ("allocationType", C.c_int), ("memAttr", C.c_int), ("location", Location),
                ("reserve", C.c_uint64)]


class AccessDesc(C.Structure):
    _fields_ = [("flags", C.c_int), ("location", Location), ("rsv", C.c_uint8 * 12)]


class ServerPid(C.Structure):
    _fields_ = [("sdid", C.c_uint32), ("pid", C.POINTER(C.c_int32)), ("num", C.c_size_t)]


class IpcEventHandle(C.Structure):
    _fields_ = [("reserved", C.c_char * 64)]


class BadArgument(Exception):
    """A Python value that does not fit the C argument (the binding's own refusal)."""


def _int(name: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadArgument(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise BadArgument(f"{name}={value} is out of range [{lo}, {hi}]")
    return value


def _u64(name: str, v: object) -> int:
    return _int(name, v, 0, U64)


def _i32(name: str, v: object) -> int:
    return _int(name, v, -(1 << 31), (1 << 31) - 1)


def _u32(name: str, v: object) -> int:
    return _int(name, v, 0, (1 << 32) - 1)


def _ptr(name: str, v: object) -> int | None:
    return None if v is None or v == 0 else _u64(name, v)


def _field(struct: object, key: str, where: str) -> object:
    if not isinstance(struct, Mapping):
        raise BadArgument(f"{where} must be a dict with the C field names, got {type(struct).__name__}")
    if key not in struct:
        raise BadArgument(f"{where} lacks the field {key!r}")
    return struct[key]


def _location(loc: object, where: str) -> Location:
    ltype = _u32(f"{where}.type", _field(loc, "type", where))
    lid = _int(f"{where}.id", _field(loc, "id", where), -(1 << 31), (1 << 32) - 1)
    return Location(lid & 0xFFFFFFFF, ltype)


def _prop(prop: object) -> Any:
    if prop is None:
        return None
    p = Prop()
    p.handleType = _u32("prop.handleType", _field(prop, "handleType", "prop"))
    p.allocationType = _u32("prop.allocationType", _field(prop, "allocationType", "prop"))
    p.memAttr = _u32("prop.memAttr", _field(prop, "memAttr", "prop"))
    p.location = _location(_field(prop, "location", "prop"), "prop.location")
    p.reserve = _u64("prop.reserve", prop.get("reserve", 0) if isinstance(prop, Mapping) else 0)
    return C.byref(p)


def _pids(name: str, pids: object) -> tuple[Any, int]:
    if pids is None:
        return None, 0
    if not isinstance(pids, (list, tuple)):
        raise BadArgument(f"{name} must be a list, got {type(pids).__name__}")
    array = (C.c_int32 * max(len(pids), 1))(*[_i32(f"{name}[{i}]", p) for i, p in enumerate(pids)])
    return array, len(pids)


def _text(name: str, value: object) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, str) or "\0" in value:
        raise BadArgument(f"{name} must be a str without NUL characters")
    return value.encode()


def _shareable(value: object, share_type: object) -> Any:
    """A V2 shareable handle argument: an int (DEFAULT, a uint64_t), bytes (FABRIC, 128 of them) or None; a value of
    the other kind's Python type is refused, as pyACL refuses it (in C both are a pointer)."""
    if value is None:
        return None
    if share_type == DEFAULT and isinstance(value, (bytes, bytearray, memoryview)):
        raise BadArgument(f"a DEFAULT shareable handle is an int, got {type(value).__name__}")
    if share_type == FABRIC and not isinstance(value, (bytes, bytearray, memoryview)):
        raise BadArgument(f"a FABRIC shareable handle is 128 bytes, got {type(value).__name__}")
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if share_type == FABRIC and len(raw) != 128:  # the C struct aclrtMemFabricHandle is 128 bytes
            raise BadArgument(f"a FABRIC handle is 128 bytes, got {len(raw)}")
        return C.create_string_buffer(raw, max(len(raw), 128))
    return C.byref(C.c_uint64(_u64("shareableHandle", value)))
