"""Argument checks and the validated C structs (aclrtPhysicalMemProp, aclrtMemLocation) of the runtime."""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .. import constants as C
from ..errors import AclInvalidParamError, FeatureNotSupportedError, InvalidParamError
from . import handles

U64 = (1 << 64) - 1


def check_int(name: str, value: object, lo: int = 0, hi: int = U64) -> int:
    """`value` as an int in [lo, hi], else InvalidParamError naming the argument."""
    if type(value) is int and lo <= value <= hi:  # the common case, a plain int in range: checked in one line
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParamError(f"{name} must be an int, got {type(value).__name__}")
    # an int subclass's own value: its comparisons, __int__ and __str__ may say otherwise, and what is kept and
    # handed back is the value
    plain = int.__index__(value)
    if not lo <= plain <= hi:
        raise InvalidParamError(f"{name}={plain} is out of range [{lo}, {hi}]")
    return plain


def check_device(value: object) -> int:
    """A device id argument (whether the device exists is the runtime's check, 107001)."""
    return check_int("deviceId", value, -(1 << 31), (1 << 31) - 1)


def check_ptr(name: str, value: object) -> int:
    """A pointer (or handle) argument: a non-negative int; None is NULL, as 0 is."""
    if type(value) is int and 0 <= value <= U64:  # the common case, as check_int has it (without the call)
        return value
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
    """An aclrtPhysicalMemProp, typed (`read_prop`); its values are checked by `check_prop` and the runtime."""

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

    @property
    def on_host(self) -> bool:
        """Host memory (a HOST or HOST_NUMA location), as opposed to a device's."""
        return self.location.type in HOST_LOCATIONS

    def as_dict(self) -> dict[str, Any]:
        return {
            "handleType": self.handle_type,
            "allocationType": self.allocation_type,
            "memAttr": self.mem_attr,
            "location": self.location.as_dict(),
            "reserve": self.reserve,
        }

    def reported(self) -> dict[str, Any]:
        """The property as the runtime reports it for memory made with it (`reported_attr`; types 0, reserve 0)."""
        return {
            "handleType": C.ACL_MEM_HANDLE_TYPE_NONE,
            "allocationType": C.ACL_MEM_ALLOCATION_TYPE_PINNED,
            "memAttr": reported_attr(self),
            "location": self.location.as_dict(),
            "reserve": 0,
        }


@functools.lru_cache(maxsize=512)
def prop_of(
    handle_type: int, allocation_type: int, mem_attr: int, location_type: int, location_id: int
) -> PhysicalProp:
    """The PhysicalProp of these values, made once: props are immutable, and every import needs one."""
    return PhysicalProp(handle_type, allocation_type, mem_attr, Location(location_type, location_id))


LOCATION_TYPES = frozenset({
    C.ACL_MEM_LOCATION_TYPE_HOST,
    C.ACL_MEM_LOCATION_TYPE_DEVICE,
    C.ACL_MEM_LOCATION_TYPE_UNREGISTERED,
    C.ACL_MEM_LOCATION_TYPE_MANAGED,
    C.ACL_MEM_LOCATION_TYPE_HOST_NUMA,
})
# Where physical memory can live: the host (any NUMA node, or one named) and the devices.
MEMORY_LOCATIONS = frozenset({C.ACL_MEM_LOCATION_TYPE_HOST, C.ACL_MEM_LOCATION_TYPE_DEVICE,
                              C.ACL_MEM_LOCATION_TYPE_HOST_NUMA})
HOST_LOCATIONS = frozenset({C.ACL_MEM_LOCATION_TYPE_HOST, C.ACL_MEM_LOCATION_TYPE_HOST_NUMA})
ACCESS_FLAGS = frozenset({
    C.ACL_RT_MEM_ACCESS_FLAGS_NONE, C.ACL_RT_MEM_ACCESS_FLAGS_READ, C.ACL_RT_MEM_ACCESS_FLAGS_READWRITE,
})
U32 = 0xFFFFFFFF


def acl_require(ok: bool, message: str) -> None:
    """A check the acl layer makes itself: ACL_ERROR_INVALID_PARAM (100000) when it fails (SPEC §4a)."""
    if not ok:
        raise AclInvalidParamError(message)


def parse_location(loc: object, where: str, supported: Collection[int] = LOCATION_TYPES) -> Location:
    """An aclrtMemLocation dict: 107000 when malformed, 207000 for a kind outside `supported`.

    A DEVICE location's id is only read here: whether that device exists is the runtime's check (107001).
    """
    return check_location(read_location(loc, where), where, supported)


def check_location(location: Location, where: str, supported: Collection[int] = LOCATION_TYPES) -> Location:
    """The values of a location `read_location` read: a known type (107000), one of `supported` (207000)."""
    if location.type not in LOCATION_TYPES:
        raise InvalidParamError(f"{where}.type={location.type} is not an aclrtMemLocationType")
    if location.type not in supported:
        raise FeatureNotSupportedError(
            f"{where}.type={location.type} is not supported: use ACL_MEM_LOCATION_TYPE_DEVICE (1) or HOST (0)"
        )
    if location.type != C.ACL_MEM_LOCATION_TYPE_DEVICE:
        check_int(f"{where}.id", location.id, 0, (1 << 31) - 1)
    return location


def read_location(loc: object, where: str) -> Location:
    """An aclrtMemLocation dict as the C struct holds it (shape and types only: 107000 when they do not fit)."""
    ltype = check_int(f"{where}.type", field_of(loc, "type", where), 0, U32)
    name = "deviceId" if ltype == C.ACL_MEM_LOCATION_TYPE_DEVICE else f"{where}.id"
    return Location(ltype, check_int(name, field_of(loc, "id", where), -(1 << 31), U32))


def read_prop(prop: object) -> PhysicalProp | None:
    """An aclrtPhysicalMemProp dict as the C struct holds it, None for NULL: the shape and the field types only
    (107000, as pyACL refuses a struct it cannot convert); the values are checked by `check_prop` and the runtime."""
    if prop is None:
        return None
    handle_type = check_int("prop.handleType", field_of(prop, "handleType", "prop"), 0, U32)
    alloc_type = check_int("prop.allocationType", field_of(prop, "allocationType", "prop"), 0, U32)
    attr = check_int("prop.memAttr", field_of(prop, "memAttr", "prop"), 0, U32)
    location = read_location(field_of(prop, "location", "prop"), "prop.location")
    reserve = check_int("prop.reserve", prop.get("reserve", 0) if isinstance(prop, Mapping) else 0)
    return PhysicalProp(handle_type, alloc_type, attr, location, reserve)


def check_prop(prop: PhysicalProp, for_malloc: bool) -> PhysicalProp:
    """The acl layer's checks of a physical memory property (100000), in its order: for `malloc_physical` the handle
    and allocation types and the location type come first; both calls then refuse a DDR attribute on a device and
    an attribute outside the table (0, 1, 8, 9, 11 and anything above 17)."""
    if for_malloc:  # (each message is made only when its check fails)
        if prop.handle_type != C.ACL_MEM_HANDLE_TYPE_NONE:
            raise AclInvalidParamError(f"prop.handleType={prop.handle_type}: physical memory takes "
                                       "ACL_MEM_HANDLE_TYPE_NONE (0)")
        if prop.allocation_type != C.ACL_MEM_ALLOCATION_TYPE_PINNED:
            raise AclInvalidParamError(f"prop.allocationType={prop.allocation_type}: only "
                                       "ACL_MEM_ALLOCATION_TYPE_PINNED (0)")
        if prop.location.type in (C.ACL_MEM_LOCATION_TYPE_UNREGISTERED, C.ACL_MEM_LOCATION_TYPE_MANAGED):
            raise AclInvalidParamError(f"prop.location.type={prop.location.type}: physical memory lives on the HOST "
                                       "(0), a DEVICE (1) or a HOST_NUMA node (4), not UNREGISTERED (2) or MANAGED "
                                       "(3) memory")
    if prop.location.type == C.ACL_MEM_LOCATION_TYPE_DEVICE and prop.mem_attr in C.DDR_MEM_ATTRS:
        raise AclInvalidParamError(f"prop.memAttr={prop.mem_attr} ({C.MEM_ATTR_NAMES[prop.mem_attr]}) is host (DDR) "
                                   "memory: a DEVICE location takes an HBM or ACL_MEM_* attribute")
    if prop.mem_attr not in C.PHYSICAL_MEM_ATTRS:  # (the message is made only when it is needed)
        raise AclInvalidParamError(f"prop.memAttr={prop.mem_attr} is not a physical memory attribute: use one of "
                                   f"{', '.join(C.MEM_ATTR_NAMES[a] for a in sorted(C.PHYSICAL_MEM_ATTRS))}")
    return prop


def reported_attr(prop: PhysicalProp) -> int:
    """The memAttr the runtime reports for memory made with `prop`: it keeps the page and memory type, not the
    attribute, and maps them back through its table (a device's ACL_MEM_HUGE comes back as ACL_HBM_MEM_HUGE)."""
    host = prop.location.type in HOST_LOCATIONS
    return (_HOST_REPORTED if host else _DEVICE_REPORTED).get(prop.mem_attr, prop.mem_attr)


# attribute asked -> attribute reported (aclrtMemGetAllocationPropertiesFromHandle); missing ones come back as given
_DEVICE_REPORTED = {C.ACL_MEM_NORMAL: C.ACL_HBM_MEM_NORMAL, C.ACL_MEM_HUGE: C.ACL_HBM_MEM_HUGE,
                    C.ACL_MEM_HUGE1G: C.ACL_HBM_MEM_HUGE1G}
_HOST_REPORTED = {C.ACL_DDR_MEM_HUGE: C.ACL_MEM_HUGE, C.ACL_DDR_MEM_NORMAL: C.ACL_MEM_NORMAL,
                  C.ACL_DDR_MEM_P2P_HUGE: C.ACL_MEM_P2P_HUGE, C.ACL_MEM_P2P_NORMAL: C.ACL_DDR_MEM_P2P_NORMAL}


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


def pid_list(pids: Iterable[object], allow_empty: bool = False) -> list[int]:
    """A trustlist from any iterable of pids (what the Pythonic surfaces take), checked as `check_pids` checks a
    list: the one check of type, range and count each surface runs before a trustlist reaches the broker."""
    if isinstance(pids, (list, tuple)):
        return check_pids(pids, allow_empty)
    try:
        listed = list(pids)
    except Exception:  # not iterable, or an iterable that fails: either way not a list of pids
        raise InvalidParamError(f"pids must be an iterable of ints, got {type(pids).__name__}") from None
    return check_pids(listed, allow_empty)
