"""Argument checks and the validated C structs (aclrtPhysicalMemProp, aclrtMemLocation) of the runtime."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from . import constants as C
from . import handles
from .errors import FeatureNotSupportedError, InvalidParamError

U64 = (1 << 64) - 1


def check_int(name: str, value: object, lo: int = 0, hi: int = U64) -> int:
    """`value` as an int in [lo, hi], else InvalidParamError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParamError(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise InvalidParamError(f"{name}={value} is out of range [{lo}, {hi}]")
    return value


def check_device(value: object) -> int:
    """A device id argument (whether the device exists is the runtime's check, 107001)."""
    return check_int("deviceId", value, -(1 << 31), (1 << 31) - 1)


def check_ptr(name: str, value: object) -> int:
    """A pointer argument: a non-negative int (None counts as NULL)."""
    return 0 if value is None else check_int(name, value, 0, U64)


def field_of(struct: object, key: str, where: str) -> object:
    if not isinstance(struct, Mapping):
        raise InvalidParamError(f"{where} must be a dict with the C field names, got {type(struct).__name__}")
    if key not in struct:
        raise InvalidParamError(f"{where} lacks the field {key!r}")
    return struct[key]


@dataclass(frozen=True)
class Location:
    type: int
    id: int

    def as_dict(self) -> dict[str, int]:
        return {"id": self.id, "type": self.type}


@dataclass(frozen=True)
class PhysicalProp:
    """A validated aclrtPhysicalMemProp."""

    handle_type: int
    allocation_type: int
    mem_attr: int
    location: Location
    reserve: int = 0

    @property
    def granularity(self) -> int:
        return C.HUGE1G_GRANULARITY if self.mem_attr in C.HUGE1G_ATTRS else C.MIN_GRANULARITY

    @property
    def huge_page(self) -> int:
        """The huge page size this attribute asks for (0: normal pages)."""
        if self.mem_attr in C.HUGE1G_ATTRS:
            return C.HUGE1G_GRANULARITY
        return C.MIN_GRANULARITY if self.mem_attr in C.HUGE_ATTRS else 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "handleType": self.handle_type,
            "allocationType": self.allocation_type,
            "memAttr": self.mem_attr,
            "location": self.location.as_dict(),
            "reserve": self.reserve,
        }


LOCATION_TYPES = frozenset({
    C.ACL_MEM_LOCATION_TYPE_HOST,
    C.ACL_MEM_LOCATION_TYPE_DEVICE,
    C.ACL_MEM_LOCATION_TYPE_UNREGISTERED,
    C.ACL_MEM_LOCATION_TYPE_MANAGED,
    C.ACL_MEM_LOCATION_TYPE_HOST_NUMA,
})
MEMORY_LOCATIONS = frozenset({C.ACL_MEM_LOCATION_TYPE_HOST, C.ACL_MEM_LOCATION_TYPE_DEVICE})
ACCESS_FLAGS = frozenset({
    C.ACL_RT_MEM_ACCESS_FLAGS_NONE, C.ACL_RT_MEM_ACCESS_FLAGS_READ, C.ACL_RT_MEM_ACCESS_FLAGS_READWRITE,
})


def parse_location(loc: object, where: str, supported: Collection[int] = LOCATION_TYPES) -> Location:
    """An aclrtMemLocation dict: 107000 when malformed, 207000 for a kind outside `supported`.

    A DEVICE location's id is only read here: whether that device exists is the runtime's check (107001).
    """
    ltype = check_int(f"{where}.type", field_of(loc, "type", where), 0, 0xFFFFFFFF)
    if ltype not in LOCATION_TYPES:
        raise InvalidParamError(f"{where}.type={ltype} is not an aclrtMemLocationType")
    if ltype not in supported:
        raise FeatureNotSupportedError(
            f"{where}.type={ltype} is not supported: use ACL_MEM_LOCATION_TYPE_DEVICE (1) or HOST (0)"
        )
    lo = -(1 << 31) if ltype == C.ACL_MEM_LOCATION_TYPE_DEVICE else 0
    name = "deviceId" if ltype == C.ACL_MEM_LOCATION_TYPE_DEVICE else f"{where}.id"
    return Location(ltype, check_int(name, field_of(loc, "id", where), lo, (1 << 31) - 1))


def parse_prop(prop: object) -> PhysicalProp:
    """An aclrtPhysicalMemProp dict."""
    handle_type = check_int("prop.handleType", field_of(prop, "handleType", "prop"), 0, 0xFFFFFFFF)
    if handle_type not in (C.ACL_MEM_HANDLE_TYPE_NONE, C.ACL_MEM_HANDLE_TYPE_POSIX):
        raise InvalidParamError(f"prop.handleType={handle_type}: use ACL_MEM_HANDLE_TYPE_NONE (0) or POSIX (2)")
    alloc_type = check_int("prop.allocationType", field_of(prop, "allocationType", "prop"), 0, 0xFFFFFFFF)
    if alloc_type != C.ACL_MEM_ALLOCATION_TYPE_PINNED:
        raise InvalidParamError(f"prop.allocationType={alloc_type}: only ACL_MEM_ALLOCATION_TYPE_PINNED (0)")
    attr = check_int("prop.memAttr", field_of(prop, "memAttr", "prop"), 0, 17)
    location = parse_location(field_of(prop, "location", "prop"), "prop.location", MEMORY_LOCATIONS)
    reserve = prop.get("reserve", 0) if isinstance(prop, Mapping) else 0
    check_int("prop.reserve", reserve, 0, 0)
    return PhysicalProp(handle_type, alloc_type, attr, location, 0)


def parse_access_descs(desc_list: object) -> list[tuple[Location, int]]:
    """An aclrtMemAccessDesc list: (location, ACL access flags) pairs, in order."""
    if not isinstance(desc_list, (list, tuple)) or not desc_list:
        raise InvalidParamError("desc_list must be a non-empty list of {'flags': ..., 'location': {...}}")
    entries: list[tuple[Location, int]] = []
    for i, desc in enumerate(desc_list):
        flags = check_int(f"desc_list[{i}].flags", field_of(desc, "flags", f"desc_list[{i}]"), 0, 0xFFFFFFFF)
        if flags not in ACCESS_FLAGS:
            raise InvalidParamError(f"desc_list[{i}].flags={flags}: use ACL_RT_MEM_ACCESS_FLAGS_* (0, 1, 3)")
        entries.append((parse_location(field_of(desc, "location", f"desc_list[{i}]"), f"desc_list[{i}].location"),
                        flags))
    return entries


def check_pids(pids: object, allow_empty: bool = False) -> list[int]:
    """A trustlist argument: a list of positive 32-bit pids, at most MAX_TRUSTLIST of them."""
    if not isinstance(pids, (list, tuple)):
        raise InvalidParamError(f"pid_list must be a list of ints, got {type(pids).__name__}")
    if not pids and not allow_empty:
        raise InvalidParamError("pid_list is empty")
    if len(pids) > handles.MAX_TRUSTLIST:
        raise InvalidParamError(f"pid_list has {len(pids)} pids; at most {handles.MAX_TRUSTLIST} per handle")
    return [check_int(f"pid_list[{i}]", p, 1, (1 << 31) - 1) for i, p in enumerate(pids)]
