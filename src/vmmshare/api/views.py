"""Zero-copy views (memoryview, numpy, DLPack) of memory an object has mapped at `ptr`.

Like `mmap.mmap`, the object refuses to close while views of it are alive (BufferError); each view keeps it alive.
"""

from __future__ import annotations

import ctypes
import math
import threading
import weakref
from typing import Any

from .. import constants as C
from ..backends.remote import NO_CPU_ACCESS
from ..errors import FeatureNotSupportedError, InvalidParamError
from ..wire.props import check_int
from ._owned import Owned


class DLPackRequestError(InvalidParamError, BufferError):
    """A DLPack request this memory cannot meet: a BufferError, as the protocol has it, and an AclError."""


class _Keepalive:
    """What a GPU DLPack capsule holds on to (there is no host buffer to hold)."""

    _vmmshare_owner: Any


# a view is counted and a close looks for views one at a time: without it a view counted just after a close found
# none would reach unmapped pages (SIGSEGV)
_VIEWS_LOCK = threading.RLock()


class MemoryViews(Owned):
    """Views of `size` bytes at `ptr` (GPU memory when `on_gpu`, on `device`) of an object that owns them; subclasses
    set those and their finalizer."""

    _ptr: int
    _size: int
    _on_gpu: bool
    _device: int
    _remote: bool = False  # memory of another server (SPEC §8): copies only, no CPU view

    # read-only: a view made after `ptr` or `remote` were changed would reach memory that is not there
    @property
    def ptr(self) -> int:
        """The address of the memory in this process."""
        return self._ptr

    @property
    def size(self) -> int:
        """Its size in bytes."""
        return self._size

    @property
    def on_gpu(self) -> bool:
        """GPU memory (viewed through DLPack), not host memory."""
        return self._on_gpu

    @property
    def device(self) -> int:
        """The device the memory belongs to."""
        return self._device

    @property
    def remote(self) -> bool:
        """Memory of another server: copies only, no CPU view."""
        return self._remote

    def _init_views(self) -> None:
        self._views: dict[int, weakref.ref[Any]] = {}  # live buffers handed out, by id

    def _closed_message(self) -> str:
        return f"this {type(self).__name__} is closed"

    def _cuts(self) -> list[int]:
        """The addresses inside the memory where one mapping ends and the next begins (a copy is made per piece)."""
        return []

    def live_views(self) -> int:
        return len(self._views)

    def _busy(self) -> bool:
        return bool(self._views)

    def _check_closable(self) -> None:
        if len(self._views):
            raise BufferError(f"{len(self._views)} view(s) of this {type(self).__name__} are alive: delete them first")

    def _start_close(self) -> Any:
        """For close(): None when closed already, else (BufferError while views are alive) the finalizer detached
        as one step with the view check, its (obj, func, args, kwargs); no view can be counted after it."""
        finalizer = self._finalizer
        with _VIEWS_LOCK:
            if not finalizer.alive:
                return None
            self._check_closable()
            return finalizer.detach()

    def _buffer(self, offset: int = 0, nbytes: int | None = None) -> Any:
        if self.remote:
            raise FeatureNotSupportedError(f"this {type(self).__name__} has no CPU view: {NO_CPU_ACCESS}")
        if self.on_gpu:
            raise InvalidParamError(f"this {type(self).__name__} is GPU memory: view it with DLPack "
                                    "(torch/cupy.from_dlpack), or copy it to the host")
        n = self.size - offset if nbytes is None else nbytes
        return self._register((ctypes.c_char * n).from_address(self.ptr + offset))

    def _register(self, buf: Any) -> Any:
        """Count `buf` as a live view: it keeps this object alive, and this object will not close under it."""
        with _VIEWS_LOCK:
            if self.closed:
                raise InvalidParamError(self._closed_message())
            buf._vmmshare_owner = self
            key, views = id(buf), self._views

            def forget(_: object) -> None:
                views.pop(key, None)

            views[key] = weakref.ref(buf, forget)
        return buf

    # ------------------------------------------------------------ copies (any memory: host, GPU, another server's)

    def _span(self, offset: object, size: object) -> tuple[int, int]:
        if self.closed:
            raise InvalidParamError(self._closed_message())
        start = check_int("offset", offset, 0, self.size)
        n = self.size - start if size is None else check_int("size", size, 0, self.size - start)
        return start, n

    def read(self, size: int | None = None, offset: int = 0) -> bytes:
        """A copy of `size` bytes from byte `offset` (default: to the end), as memcpy makes it."""
        start, n = self._span(offset, size)
        buf = ctypes.create_string_buffer(n)
        if n:
            _copy(ctypes.addressof(buf), [], self.ptr + start, self._cuts(), n)
        return buf.raw[:n]

    def write(self, data: Any, offset: int = 0) -> None:
        """Copy the bytes of `data` (any buffer: bytes, bytearray, a numpy array) in from byte `offset`."""
        try:
            raw = memoryview(data).cast("B")
        except (TypeError, ValueError) as exc:
            raise InvalidParamError(f"data must be a contiguous buffer of bytes: {exc}") from None
        start, n = self._span(offset, raw.nbytes)
        if not n:
            return
        try:
            src: Any = (ctypes.c_char * n).from_buffer(raw)
        except TypeError:  # read-only (bytes): copied once into a buffer that has an address
            src = (ctypes.c_char * n).from_buffer_copy(raw)
        _copy(self.ptr + start, self._cuts(), ctypes.addressof(src), [], n)

    def copy_from(self, source: MemoryViews, size: int | None = None, offset: int = 0, source_offset: int = 0) -> None:
        """Copy `size` bytes of `source` (from its byte `source_offset`) in at byte `offset`, as memcpy does."""
        if not isinstance(source, MemoryViews):
            raise InvalidParamError(f"source must be a Mapping or buffer of vmmshare, not {type(source).__name__}")
        src_start, n = source._span(source_offset, size)
        start, n = self._span(offset, n)
        if n:
            _copy(self.ptr + start, self._cuts(), source.ptr + src_start, source._cuts(), n)

    def fill(self, value: int, size: int | None = None, offset: int = 0) -> None:
        """Set `size` bytes from byte `offset` (default: to the end) to `value`, as memset does."""
        from .._process import runtime

        byte = check_int("value", value, 0, 255)
        start, n = self._span(offset, size)
        for at, length in _pieces(self.ptr + start, n, self._cuts()):
            runtime().copies.memset(at, length, byte, length)

    def memoryview(self) -> memoryview:
        """The whole memory as bytes (no copy)."""
        return memoryview(self._buffer()).cast("B")

    def numpy(self, dtype: Any = "uint8", shape: tuple[int, ...] | int | None = None, offset: int = 0) -> Any:
        """A numpy array over the memory (no copy): `shape` elements of `dtype` from byte `offset` (default: as
        many whole elements as fit), which must lie inside the memory."""
        import numpy as np

        if isinstance(dtype, (int, np.integer)):
            raise InvalidParamError(f"dtype {dtype!r} is a number: pass a numpy dtype, such as 'float32'")
        try:
            dt = np.dtype(dtype)
        except Exception as exc:  # numpy refuses it in many ways (TypeError, ValueError, ...)
            raise InvalidParamError(f"dtype {dtype!r} is not a numpy dtype: {exc}") from None
        if dt.hasobject or dt.itemsize == 0:
            raise InvalidParamError(f"dtype {dt} does not describe plain bytes of memory")
        start = check_int("offset", offset, 0, self.size)
        if shape is None:
            dims: tuple[int, ...] = ((self.size - start) // dt.itemsize,)
        else:
            raw = (shape,) if isinstance(shape, int) and not isinstance(shape, bool) else shape
            if not isinstance(raw, (tuple, list)):
                raise InvalidParamError(f"shape must be an int or a tuple of ints, got {type(shape).__name__}")
            dims = tuple(check_int(f"shape[{i}]", d, 0, self.size) for i, d in enumerate(raw))
        nbytes = math.prod(dims) * dt.itemsize
        if start + nbytes > self.size:
            raise InvalidParamError(f"shape {dims} of {dt} needs {nbytes} bytes from offset {start}; this "
                                    f"{type(self).__name__} has {self.size} bytes (pass a smaller shape or offset)")
        return np.frombuffer(self._buffer(start, nbytes), dtype=dt).reshape(dims)

    def __dlpack__(
        self, *, stream: Any = None, max_version: tuple[int, int] | None = None, dl_device: Any = None,
        copy: bool | None = None,
    ) -> Any:
        """A DLPack capsule of the whole memory as uint8, zero-copy (DLPack 1.0 when the consumer takes it).

        Work on the memory is synchronous, so no `stream` needs waiting on.
        """
        from . import dlpack

        if copy:
            raise DLPackRequestError("this memory is shared: it is exported without a copy")
        if dl_device is not None and _pair(dl_device) != self.__dlpack_device__():
            raise DLPackRequestError(f"the memory lives on {self.__dlpack_device__()}, not {dl_device!r}")
        owner = self._register(_Keepalive()) if self.on_gpu and not self.remote else self._buffer()
        versioned = max_version is not None and _pair(max_version) >= dlpack.DLPACK_VERSION
        return dlpack._capsule(self.ptr, self.size, *self.__dlpack_device__(), owner, versioned)

    def __dlpack_device__(self) -> tuple[int, int]:
        from . import dlpack

        return (dlpack.KDL_CUDA, self.device) if self.on_gpu else (dlpack.KDL_CPU, 0)


def _pair(value: Any) -> tuple[int, int]:
    """A (major, minor) or (device type, id) pair; BufferError for anything else, as DLPack consumers expect."""
    try:
        a, b = value
        return (int(a), int(b))
    except Exception as exc:  # not a pair, or a value that fails when unpacked or converted
        raise DLPackRequestError(f"{value!r} is not a pair of ints: {exc}") from None


def _pieces(start: int, n: int, cuts: list[int]) -> list[tuple[int, int]]:
    """[start, start+n) split at `cuts`: (address, length) pieces."""
    out, at = [], start
    for cut in sorted(c for c in cuts if start < c < start + n):
        out.append((at, cut - at))
        at = cut
    if start + n > at:
        out.append((at, start + n - at))
    return out


def _copy(dst: int, dst_cuts: list[int], src: int, src_cuts: list[int], n: int) -> None:
    """memcpy of `n` bytes, one call per piece that lies in one mapping on both sides."""
    from .._process import runtime

    cuts = dst_cuts + [dst + (c - src) for c in src_cuts]  # the source's cuts, as destination addresses
    for at, length in _pieces(dst, n, cuts):
        runtime().copies.memcpy(at, length, src + (at - dst), length, C.ACL_MEMCPY_DEFAULT)
