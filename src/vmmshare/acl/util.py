"""``acl.util``: pointer helpers of pyACL (numpy arrays and bytes to and from raw pointers).

They return their result directly (no ret code, as in pyACL); on bad input they return None and leave
a message for `acl.get_recent_err_msg()`, never raising and never touching unreadable memory.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable
from typing import Any, ParamSpec

from .._process import runtime
from ..errors import AclError, set_recent_error
from ..props import check_int

P = ParamSpec("P")


def _util_call(fn: Callable[P, Any]) -> Callable[P, Any]:
    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> Any:
        try:
            return fn(*args, **kwargs)
        except AclError as exc:
            set_recent_error(f"{fn.__name__}: {exc.message}")
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as exc:
            set_recent_error(f"{fn.__name__}: {exc}")
        return None

    return call


def _numpy() -> Any:
    import numpy

    return numpy


@functools.cache
def _dtypes_by_number() -> dict[int, Any]:
    np = _numpy()
    return {np.dtype(t).num: np.dtype(t) for t in set(np.sctypeDict.values())}


def _dtype(npy_type: Any) -> Any:
    np = _numpy()
    if isinstance(npy_type, int) and not isinstance(npy_type, bool):
        dtype = _dtypes_by_number().get(npy_type)
        if dtype is None:
            raise ValueError(f"{npy_type} is not a numpy type number")
    else:
        dtype = np.dtype(npy_type)
    if dtype.hasobject:
        raise ValueError(f"dtype {dtype} holds Python objects; raw memory can only be viewed as plain data")
    return dtype


@_util_call
def ptr_to_numpy(ptr: int, shape: tuple[int, ...] | list[int], npy_type: Any) -> Any:
    """A numpy array viewing `ptr` (no copy); `npy_type` is a numpy type number (as pyACL takes) or a dtype."""
    np = _numpy()
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"shape must be a tuple of ints, got {type(shape).__name__}")
    dims = tuple(check_int("shape", d, 0, 1 << 48) for d in shape)
    dtype = _dtype(npy_type)
    nbytes = math.prod(dims) * dtype.itemsize
    p = check_int("ptr", ptr, 1, (1 << 64) - 1)
    if nbytes:
        runtime().copies.check_readable(p, nbytes)
    buf = (ctypes.c_char * nbytes).from_address(p)
    return np.frombuffer(buf, dtype=dtype).reshape(dims)


@_util_call
def numpy_to_ptr(array: Any) -> int:
    """The address of a numpy array's data (the array must stay alive while the pointer is used)."""
    np = _numpy()
    if not isinstance(array, np.ndarray):
        raise TypeError(f"expected a numpy.ndarray, got {type(array).__name__}")
    return int(array.ctypes.data)


@_util_call
def bytes_to_ptr(data: bytes | bytearray) -> int:
    """The address of a bytes or bytearray buffer (keep the object alive while the pointer is used)."""
    if isinstance(data, bytearray):
        return ctypes.addressof((ctypes.c_char * len(data)).from_buffer(data)) if data else 0
    if not isinstance(data, bytes):
        raise TypeError(f"expected bytes or bytearray, got {type(data).__name__}")
    return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0


@_util_call
def ptr_to_bytes(ptr: int, size: int) -> bytes:
    """A copy of `size` bytes at `ptr`."""
    p = check_int("ptr", ptr, 1, (1 << 64) - 1)
    n = check_int("size", size, 0, 1 << 48)
    if n:
        runtime().copies.check_readable(p, n)
    return ctypes.string_at(p, n)
