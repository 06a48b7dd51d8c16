"""How pyACL converts arguments before the C call: a value of the wrong type (or outside the C type) is refused
with 107000 before anything is checked, as pyACL raises for it; None is NULL where C takes a pointer."""

from __future__ import annotations

from ..errors import InvalidParamError
from ..wire.props import check_int

I32 = (-(1 << 31), (1 << 31) - 1)


def read_list(name: str, value: object) -> list[object] | None:
    """A list (or tuple) argument; None is NULL."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise InvalidParamError(f"{name} must be a list, got {type(value).__name__}")
    return list(value)


def read_pids(name: str, value: object) -> list[int] | None:
    """A pid list (None: NULL) of int32 values; whether they are usable pids is the runtime's check."""
    items = read_list(name, value)
    if items is None:
        return None
    return [check_int(f"{name}[{i}]", p, *I32) for i, p in enumerate(items)]


def read_text(name: str, value: object) -> str | None:
    """A C string argument (None: NULL)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidParamError(f"{name} must be a str, got {type(value).__name__}")
    if "\0" in value:
        raise InvalidParamError(f"{name} holds a NUL character")
    return value
