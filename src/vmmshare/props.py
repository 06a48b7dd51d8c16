"""Argument checks and the validated C structs (aclrtPhysicalMemProp, aclrtMemLocation) of the runtime."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import constants as C
from . import handles
from .errors import InvalidParamError

U64 = (1 << 64) - 1


def check_int(name: str, value: object, lo: int = 0, hi: int = U64) -> int:
    """`value` as an int in [lo, hi], else InvalidParamError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParamError(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise InvalidParamError(f"{name}={value} is out of range [{lo}, {hi}]")
    return value


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



def check_pids(pids: object, allow_empty: bool = False) -> list[int]:
    """A trustlist argument: a list of positive 32-bit pids, at most MAX_TRUSTLIST of them."""
    if not isinstance(pids, (list, tuple)):
        raise InvalidParamError(f"pid_list must be a list of ints, got {type(pids).__name__}")
    if not pids and not allow_empty:
        raise InvalidParamError("pid_list is empty")
    if len(pids) > handles.MAX_TRUSTLIST:
        raise InvalidParamError(f"pid_list has {len(pids)} pids; at most {handles.MAX_TRUSTLIST} per handle")
    return [check_int(f"pid_list[{i}]", p, 1, (1 << 31) - 1) for i, p in enumerate(pids)]
