"""The Pythonic API: `Device`, `PhysicalMemory`, `ShareableHandle`, `VirtualRange` and `Mapping`.

Objects own what they wrap and give it back on `close()`, at the end of a ``with`` block, or when they
are garbage-collected. Failures raise `AclError` subclasses carrying the ACL code and message.
"""

from __future__ import annotations

import contextlib
import ctypes
import weakref
from collections.abc import Iterable
from typing import Any

from . import constants as C
from ._process import runtime
from .backends.base import MemoryKind
from .errors import ContextNullError, InvalidParamError
from .handles import ShareableHandle, ShareType
from .props import Location, PhysicalProp, check_device, check_int, check_pids, check_ptr

__all__ = ["Device", "Mapping", "PhysicalMemory", "ShareableHandle", "VirtualRange", "import_handle"]

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


def _attr(attr: str | int) -> int:
    if isinstance(attr, str):
        if attr not in _ATTRS:
            raise InvalidParamError(f"attr {attr!r}: use one of {sorted(_ATTRS)} or an aclrtMemAttr value")
        return _ATTRS[attr]
    return check_int("attr", attr, 0, 17)


def _pids(pids: Iterable[int], allow_empty: bool) -> list[int]:
    """A trustlist argument: any iterable of positive 32-bit pids."""
    try:
        listed = list(pids)
    except TypeError:
        raise InvalidParamError(f"pids must be an iterable of ints, got {type(pids).__name__}") from None
    return check_pids(listed, allow_empty)


class Device:
    """One (virtual or real) device: where physical memory is allocated."""

    def __init__(self, device_id: int = 0) -> None:
        self.id = runtime().device_id(check_device(device_id))

    def __repr__(self) -> str:
        return f"Device({self.id})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return hash(("Device", self.id))

    def _prop(self, attr: str | int, location: str) -> PhysicalProp:
        if location not in _LOCATIONS:
            raise InvalidParamError(f"location {location!r}: use 'device' or 'host'")
        loc = Location(_LOCATIONS[location], self.id if location == "device" else 0)
        return PhysicalProp(C.ACL_MEM_HANDLE_TYPE_NONE, C.ACL_MEM_ALLOCATION_TYPE_PINNED, _attr(attr), loc)

    def granularity(self, attr: str | int = "normal") -> int:
        return runtime().memory.granularity(self._prop(attr, "device"))

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of this device across the node (the GPU's own figures under the CUDA backend)."""
        return runtime().mem_info(self.id)

    def allocate(self, size: int, attr: str | int = "normal", location: str = "device") -> PhysicalMemory:
        """Physical memory of at least `size` bytes (rounded up to the granularity)."""
        prop = self._prop(attr, location)
        rt = runtime()
        g = rt.memory.granularity(prop)
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise InvalidParamError(f"size must be a positive int, got {size!r}")
        return PhysicalMemory(rt.memory.malloc_physical(-(-size // g) * g, prop))


class PhysicalMemory:
    """A physical allocation (made here or imported); `close()` frees this process's handle to it."""

    def __init__(self, handle: int) -> None:
        rt = runtime()
        alloc = rt.memory.allocation(handle)
        self.handle = handle
        self.size = alloc.size
        self.device = alloc.prop.location.id
        self._location = alloc.prop.location  # outlives close()
        self.location = alloc.prop.location.as_dict()
        self.imported = bool(alloc.imported_from)
        self.pages = alloc.mem.pages
        self.on_gpu = alloc.backend.kind is MemoryKind.GPU
        self._shareable: ShareableHandle | None = None
        self._finalizer = weakref.finalize(self, _free_quietly, handle)

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("imported" if self.imported else "local")
        return f"<PhysicalMemory {self.size} bytes on device {self.device}, {state}>"

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def _live(self) -> int:
        if self.closed:
            raise InvalidParamError("this PhysicalMemory is closed")
        return self.handle

    @property
    def properties(self) -> dict[str, Any]:
        return runtime().memory.properties(self._live())

    def export(
        self, share_type: str = "default", pids: Iterable[int] = (), validate_pids: bool = True
    ) -> ShareableHandle:
        """Export once, as a handle other processes can import; `pids` go on the trustlist at once."""
        if share_type not in _SHARE_TYPES:
            raise InvalidParamError(f"share_type {share_type!r}: use 'default' or 'fabric'")
        trust = _pids(pids, allow_empty=True)
        # the trustlist rides on the export
        self._shareable = runtime().sharing.export(self._live(), _SHARE_TYPES[share_type], bool(validate_pids), trust)
        return self._shareable

    def allow(self, pids: Iterable[int]) -> None:
        """Add processes (host pids, as `device_get_bare_tgid` gives) to the trustlist of the export."""
        if self._shareable is None:
            raise InvalidParamError("export() this memory before setting its trustlist")
        runtime().sharing.set_pids(self._shareable, _pids(pids, allow_empty=False))

    def map(self, access: str = "rw", prepopulate: bool | None = None) -> Mapping:
        """Reserve a range of this allocation's size and map it there; the Mapping owns both."""
        rng = VirtualRange(self.size, gpu=self.on_gpu)
        try:
            return rng.map(self, access=access, prepopulate=prepopulate, owns_range=True)
        except BaseException:
            rng.close()
            raise

    def close(self) -> None:
        """Free this handle; mappings of it stay valid until they are closed."""
        if self._finalizer.alive:
            self._finalizer.detach()
            runtime().memory.free_physical(self.handle)

    def __enter__(self) -> PhysicalMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _quietly(fn: Any, *args: Any) -> None:
    with contextlib.suppress(Exception):  # e.g. at interpreter exit: nothing left to free
        fn(*args)


def _free_quietly(handle: int) -> None:
    with contextlib.suppress(Exception):
        rt = runtime()
        rt.when_safe(lambda: _quietly(rt.memory.free_physical, handle))


def import_handle(handle: int | bytes | str | ShareableHandle, device: int | None = None) -> PhysicalMemory:
    """Import a handle another process exported; on `device` (default: this thread's device, else 0)."""
    h = ShareableHandle.from_value(handle)
    rt = runtime()
    if device is None:
        try:
            device = rt.devices.current()
        except ContextNullError:
            device = 0
    return PhysicalMemory(rt.sharing.import_handle(h, rt.device_id(check_device(device))))


class VirtualRange:
    """A reserved, inaccessible range of virtual addresses (at `at` exactly, when given)."""

    def __init__(self, size: int, at: int | None = None, gpu: bool | None = None) -> None:
        """`gpu`: GPU address space (default: when the CUDA backend is on), for GPU memory."""
        g = C.MIN_GRANULARITY
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise InvalidParamError(f"size must be a positive int, got {size!r}")
        self.size = -(-size // g) * g
        self.ptr = runtime().memory.reserve(self.size, 0, check_ptr("at", at), gpu)
        self._finalizer = weakref.finalize(self, _release_quietly, self.ptr)

    def __repr__(self) -> str:
        return f"<VirtualRange {self.ptr:#x}+{self.size:#x}>"

    def map(
        self, memory: PhysicalMemory, offset: int = 0, access: str = "rw", prepopulate: bool | None = None,
        owns_range: bool = False,
    ) -> Mapping:
        """Map `memory` at `self.ptr + offset`."""
        if access not in _ACCESS:
            raise InvalidParamError(f"access {access!r}: use 'rw', 'r' or 'none'")
        if not isinstance(memory, PhysicalMemory):
            raise InvalidParamError(f"memory must be a PhysicalMemory, not {type(memory).__name__}")
        offset = check_int("offset", offset)
        if offset + memory.size > self.size:
            raise InvalidParamError(f"{memory.size} bytes at offset {offset} do not fit this {self.size}-byte range")
        rt = runtime()
        ptr = self.ptr + offset
        flags = _ACCESS[access]
        rt.memory.map(ptr, memory.size, 0, memory._live(), flags, prepopulate)
        return Mapping(ptr, memory, self if owns_range else None)

    def close(self) -> None:
        if self._finalizer.alive:
            self._finalizer.detach()
            runtime().memory.release(self.ptr)

    def __enter__(self) -> VirtualRange:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _release_quietly(ptr: int) -> None:
    with contextlib.suppress(Exception):
        rt = runtime()
        rt.when_safe(lambda: _quietly(rt.memory.release, ptr))


def _unmap_quietly(ptr: int, rng: VirtualRange | None) -> None:
    def unmap() -> None:
        _quietly(rt.memory.unmap, ptr)
        if rng is not None:
            _quietly(rng.close)

    with contextlib.suppress(Exception):
        rt = runtime()
        rt.when_safe(unmap)


class _Keepalive:
    """What a GPU DLPack capsule holds on to (there is no host buffer to hold)."""

    _vmmshare_owner: Mapping


class Mapping:
    """Physical memory mapped at `ptr`: views as memoryview, numpy array or DLPack tensor, zero-copy.

    Like `mmap.mmap`, it refuses to close while views of it are alive (BufferError).
    """

    def __init__(self, ptr: int, memory: PhysicalMemory, rng: VirtualRange | None) -> None:
        self.ptr = ptr
        self.size = memory.size
        self.memory = memory
        self._range = rng
        self._views: dict[int, weakref.ref[Any]] = {}  # live buffers handed out, by id
        self._finalizer = weakref.finalize(self, _unmap_quietly, ptr, rng)

    def __repr__(self) -> str:
        return f"<Mapping {self.ptr:#x}+{self.size:#x}{' closed' if self.closed else ''}>"

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def _buffer(self) -> Any:
        if self.memory.on_gpu:
            raise InvalidParamError("this mapping is GPU memory: view it with DLPack (torch/cupy.from_dlpack)")
        return self._register((ctypes.c_char * self.size).from_address(self.ptr))

    def _register(self, buf: Any) -> Any:
        """Count `buf` as a live view: it keeps the mapping alive, and the mapping will not close under it."""
        if self.closed:
            raise InvalidParamError("this Mapping is closed")
        buf._vmmshare_owner = self  # the view keeps the mapping alive
        key, views = id(buf), self._views

        def forget(_: object) -> None:
            views.pop(key, None)

        views[key] = weakref.ref(buf, forget)
        return buf

    def memoryview(self) -> memoryview:
        return memoryview(self._buffer()).cast("B")

    def numpy(self, dtype: Any = "uint8", shape: tuple[int, ...] | int | None = None) -> Any:
        """A numpy array over the mapping (no copy)."""
        import numpy as np

        arr = np.frombuffer(self._buffer(), dtype=np.dtype(dtype))
        return arr if shape is None else arr.reshape(shape)

    def __dlpack__(
        self, *, stream: Any = None, max_version: tuple[int, int] | None = None, dl_device: Any = None,
        copy: bool | None = None,
    ) -> Any:
        """A DLPack capsule of the whole mapping as uint8, zero-copy (DLPack 1.0 when the consumer takes it).

        Work on the mapping is synchronous, so no `stream` needs waiting on.
        """
        from . import dlpack

        if copy:
            raise BufferError("a mapping is shared memory: it is exported without a copy")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"the mapping lives on {self.__dlpack_device__()}, not {tuple(dl_device)}")
        owner = self._register(_Keepalive()) if self.memory.on_gpu else self._buffer()
        versioned = max_version is not None and tuple(max_version) >= dlpack.DLPACK_VERSION
        return dlpack.capsule(self.ptr, self.size, *self.__dlpack_device__(), owner, versioned)

    def __dlpack_device__(self) -> tuple[int, int]:
        from . import dlpack

        if self.memory.on_gpu:
            return (dlpack.KDL_CUDA, self.memory.device)
        return (dlpack.KDL_CPU, 0)

    def set_access(self, access: str) -> None:
        if access not in _ACCESS:
            raise InvalidParamError(f"access {access!r}: use 'rw', 'r' or 'none'")
        runtime().memory.set_access(self.ptr, self.size, [(self.memory._location, _ACCESS[access])])

    def close(self) -> None:
        """Unmap (and release the range it owns); BufferError while views of it are alive."""
        if not self._finalizer.alive:
            return
        if len(self._views):
            raise BufferError(f"{len(self._views)} view(s) of this mapping are alive: delete them first")
        self._finalizer.detach()
        runtime().memory.unmap(self.ptr)
        if self._range is not None:
            self._range.close()

    def __enter__(self) -> Mapping:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None and len(self._views):
            return  # do not mask the error in flight; the mapping goes when its last view does
        self.close()
