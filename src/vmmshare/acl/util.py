"""``acl.util``: pointer helpers of pyACL (numpy arrays and bytes to and from raw pointers).

They return their result directly (no ret code, as in pyACL); on bad input they return None and leave
a message for `acl.get_recent_err_msg()`, never raising and never touching unreadable memory.
"""

from __future__ import annotations

import ctypes as _ctypes
import errno as _errno
import functools as _functools
import inspect as _inspect
import logging as _logging
import math as _math
import threading as _threading
from collections.abc import Callable as _Callable
from typing import Any as _Any
from typing import ParamSpec as _ParamSpec

from .._process import runtime as _runtime
from ..errors import AclError as _AclError
from ..errors import set_recent_error as _set_recent_error
from ..wire.props import check_int as _check_int

__all__ = ["bytes_to_ptr", "numpy_contiguous_to_ptr", "numpy_to_ptr", "ptr_to_bytes", "ptr_to_numpy", "start_thread",
           "stop_thread"]
P = _ParamSpec("P")
_log = _logging.getLogger("vmmshare.acl")
_threads: dict[int, _threading.Thread] = {}
_threads_lock = _threading.Lock()


def __dir__() -> list[str]:
    return list(__all__)


def _util_call(fn: _Callable[P, _Any]) -> _Callable[P, _Any]:
    @_functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> _Any:
        try:
            return fn(*args, **kwargs)
        except _AclError as exc:
            _set_recent_error(f"{fn.__name__}: {exc.message}")
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as exc:
            _set_recent_error(f"{fn.__name__}: {exc}")
        return None

    return call


def _numpy() -> _Any:
    import numpy

    return numpy


@_functools.cache
def _dtypes_by_number() -> dict[int, _Any]:
    np = _numpy()
    return {np.dtype(t).num: np.dtype(t) for t in set(np.sctypeDict.values())}


def _dtype(npy_type: _Any) -> _Any:
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
def ptr_to_numpy(ptr: int, shape: tuple[int, ...] | list[int], npy_type: _Any) -> _Any:
    """A numpy array viewing `ptr` (no copy); `npy_type` is a numpy type number (as pyACL takes) or a dtype."""
    np = _numpy()
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"shape must be a tuple of ints, got {type(shape).__name__}")
    dims = tuple(_check_int("shape", d, 0, 1 << 48) for d in shape)
    dtype = _dtype(npy_type)
    nbytes = _math.prod(dims) * dtype.itemsize
    p = _check_int("ptr", ptr, 1, (1 << 64) - 1)
    if nbytes:
        _runtime().copies.check_readable(p, nbytes)
    buf = (_ctypes.c_char * nbytes).from_address(p)
    return np.frombuffer(buf, dtype=dtype).reshape(dims)


@_util_call
def numpy_to_ptr(array: _Any) -> int:
    """The address of a numpy array's data (the array must stay alive while the pointer is used)."""
    np = _numpy()
    if not isinstance(array, np.ndarray):
        raise TypeError(f"expected a numpy.ndarray, got {type(array).__name__}")
    return int(array.ctypes.data)


@_util_call
def bytes_to_ptr(data: bytes | bytearray) -> int:
    """The address of a bytes or bytearray buffer (keep the object alive while the pointer is used)."""
    if isinstance(data, bytearray):
        return _ctypes.addressof((_ctypes.c_char * len(data)).from_buffer(data)) if data else 0
    if not isinstance(data, bytes):
        raise TypeError(f"expected bytes or bytearray, got {type(data).__name__}")
    return _ctypes.cast(_ctypes.c_char_p(data), _ctypes.c_void_p).value or 0


@_util_call
def ptr_to_bytes(ptr: int, size: int) -> bytes:
    """A copy of `size` bytes at `ptr`."""
    p = _check_int("ptr", ptr, 1, (1 << 64) - 1)
    n = _check_int("size", size, 0, 1 << 48)
    if n:
        _runtime().copies.check_readable(p, n)
    return _ctypes.string_at(p, n)


@_util_call
def numpy_contiguous_to_ptr(array: _Any) -> int:
    """The address of a C-contiguous numpy array's data (a strided view has no single buffer to point at)."""
    np = _numpy()
    if not isinstance(array, np.ndarray):
        raise TypeError(f"expected a numpy.ndarray, got {type(array).__name__}")
    if not array.flags["C_CONTIGUOUS"]:
        raise ValueError("the array is not C-contiguous: numpy.ascontiguousarray(array) makes a copy that is")
    return int(array.ctypes.data)


def _thread_call(failed: _Any) -> _Callable[[_Callable[P, _Any]], _Callable[P, _Any]]:
    """Arguments that do not fit the signature return `failed` (EINVAL, as pthread reports it) with a message."""

    def wrap(fn: _Callable[P, _Any]) -> _Callable[P, _Any]:
        @_functools.wraps(fn)
        def call(*args: P.args, **kwargs: P.kwargs) -> _Any:
            try:
                _inspect.signature(fn).bind(*args, **kwargs)
            except TypeError as exc:
                _set_recent_error(f"{fn.__name__}: {exc}")
                return failed
            return fn(*args, **kwargs)

        return call

    return wrap


@_thread_call((0, _errno.EINVAL))
def start_thread(fn: _Any, args: _Any = None) -> tuple[int, int]:
    """Run `fn(args)` (or `fn()` when `args` is None) on a new thread: (thread id, 0); (0, EINVAL) when `fn` cannot
    be called. An exception in `fn` is logged; `stop_thread` joins the thread."""
    if not callable(fn):
        _set_recent_error(f"start_thread: fn must be callable, got {type(fn).__name__}")
        return 0, _errno.EINVAL

    def run() -> None:
        try:
            fn() if args is None else fn(args)
        except Exception as exc:  # the thread's own failure: said once in the log, the traceback at debug level
            _log.error("a thread of acl.util.start_thread raised %s: %s", type(exc).__name__, exc)
            _log.debug("the thread's traceback", exc_info=True)

    thread = _threading.Thread(target=run, name="acl.util.start_thread", daemon=True)
    thread.start()
    ident = thread.ident or 0
    with _threads_lock:
        _threads[ident] = thread
    return ident, 0


@_thread_call(_errno.EINVAL)
def stop_thread(thread_id: _Any) -> int:
    """Wait for a thread of `start_thread` to end: 0, or ESRCH for an id it did not give (pthread_join's codes)."""
    with _threads_lock:
        thread = _threads.pop(thread_id, None) if isinstance(thread_id, int) else None
    if thread is None:
        _set_recent_error(f"stop_thread: {thread_id!r} is not a thread of acl.util.start_thread (or it was joined)")
        return _errno.ESRCH
    if thread is not _threading.current_thread():
        thread.join()
    return 0
