"""Argument checks of the Pythonic API: named choices, flags, sizes and trustlists, refused with ACL codes."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .. import constants as C
from .._process import runtime
from ..errors import AclInvalidParamError, InvalidParamError
from ..wire.handles import ShareType
from ..wire.props import U64, check_device, check_int, pid_list

_ATTRS = {
    "normal": C.ACL_HBM_MEM_NORMAL,
    "huge": C.ACL_HBM_MEM_HUGE,
    "huge1g": C.ACL_HBM_MEM_HUGE1G,
}
_LOCATIONS = {"device": C.ACL_MEM_LOCATION_TYPE_DEVICE, "host": C.ACL_MEM_LOCATION_TYPE_HOST}
_SHARE_TYPES = {"default": ShareType.DEFAULT, "fabric": ShareType.FABRIC}
_ACCESS = {
    "none": C.ACL_RT_MEM_ACCESS_FLAGS_NONE,
    "r": C.ACL_RT_MEM_ACCESS_FLAGS_READ,
    "rw": C.ACL_RT_MEM_ACCESS_FLAGS_READWRITE,
}

def _choice(name: str, value: object, choices: dict[str, Any]) -> Any:
    """One of the named `choices` (any other value, of any type, is refused with 107000)."""
    if not isinstance(value, str) or value not in choices:
        raise InvalidParamError(f"{name} {value!r}: use {' or '.join(repr(c) for c in choices)}")
    return choices[value]


def _attr(attr: str | int) -> int:
    if isinstance(attr, str):
        return int(_choice("attr", attr, _ATTRS))
    return check_int("attr", attr, 0, 0xFFFFFFFF)


def _access(access: object) -> int:
    """An access argument ("none", "r", "rw") as its ACL flags; a plain str is looked up at once."""
    if type(access) is str:
        flags = _ACCESS.get(access)
        if flags is not None:
            return flags
    return int(_choice("access", access, _ACCESS))


def _flag(name: str, value: object, allow_none: bool = False) -> bool | None:
    """A bool argument (None too, where it means "the default")."""
    if value is None and allow_none:
        return None
    if not isinstance(value, bool):
        raise InvalidParamError(f"{name} must be True or False{' (or None)' if allow_none else ''}, got {value!r}")
    return value


def _size(size: object) -> int:
    """A size argument: a positive int that fits a size_t (0 is the acl layer's refusal, 100000)."""
    n = check_int("size", size, 0, U64)
    if n == 0:
        raise AclInvalidParamError("size is 0: ask for a positive number of bytes")
    return n


def _pids(pids: Iterable[int], allow_empty: bool) -> list[int]:
    """A trustlist argument: any iterable of positive 32-bit pids."""
    return pid_list(pids, allow_empty)


def _device(device: object) -> int:
    """A device argument as the runtime numbers it: `device`, or (None) this thread's device, else 0."""
    rt = runtime()
    return rt.device_id(rt.devices.current_or(0) if device is None else check_device(device))
