"""``acl.util``: pointer helpers of pyACL (numpy arrays and bytes to and from raw pointers)."""

from __future__ import annotations

import ctypes
import math
from typing import Any

from .._process import runtime
from ..errors import AclError, set_recent_error
from ..runtime import check_int


def _numpy() -> Any:
    import numpy

    return numpy


def ptr_to_numpy(ptr: int, shape: tuple[int, ...] | list[int], npy_type: Any) -> Any:
    """A numpy array viewing `ptr` (no copy); None, with a recent error message, if the memory is not readable.

    `npy_type` is a numpy type number (as pyACL takes) or anything `numpy.dtype` accepts.
    """
    np = _numpy()
    try:
        dims = tuple(check_int("shape", d, 0, 1 << 48) for d in shape)
        dtype = np.dtype(np.sctypeDict[npy_type] if isinstance(npy_type, int) else npy_type)
        nbytes = math.prod(dims) * dtype.itemsize
        p = check_int("ptr", ptr, 1, (1 << 64) - 1)
        if nbytes:
            runtime().check_readable(p, nbytes)
    except (AclError, KeyError, TypeError) as exc:
        set_recent_error(f"ptr_to_numpy: {getattr(exc, 'message', exc)}")
        return None
    buf = (ctypes.c_char * nbytes).from_address(p)
    return np.frombuffer(buf, dtype=dtype).reshape(dims)


def numpy_to_ptr(array: Any) -> int:
    """The address of a numpy array's data (the array must stay alive while the pointer is used)."""
    return int(array.ctypes.data)


def bytes_to_ptr(data: bytes | bytearray) -> int:
    """The address of a bytes object's buffer (keep the object alive while the pointer is used)."""
    if isinstance(data, bytearray):
        return ctypes.addressof((ctypes.c_char * len(data)).from_buffer(data))
    return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0


def ptr_to_bytes(ptr: int, size: int) -> bytes | None:
    """A copy of `size` bytes at `ptr`; None, with a recent error message, if the memory is not readable."""
    try:
        p = check_int("ptr", ptr, 1, (1 << 64) - 1)
        n = check_int("size", size, 0, 1 << 48)
        if n:
            runtime().check_readable(p, n)
    except AclError as exc:
        set_recent_error(f"ptr_to_bytes: {exc.message}")
        return None
    return ctypes.string_at(p, n)
