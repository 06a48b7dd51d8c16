"""The Pythonic API: `Device`, `PhysicalMemory`, `ShareableHandle`, `VirtualRange` and `Mapping`.

Objects own what they wrap and give it back on `close()`, at the end of a ``with`` block, or when they
are garbage-collected. Failures raise `AclError` subclasses carrying the ACL code and message.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from . import constants as C
from ._process import runtime
from .backends.host import HostMemory
from .errors import InvalidParamError
from .handles import decode_fabric, default_bytes
from .props import check_int

_ATTRS = {
    "normal": C.ACL_HBM_MEM_NORMAL,
    "huge": C.ACL_HBM_MEM_HUGE,
    "huge1g": C.ACL_HBM_MEM_HUGE1G,
}
_LOCATIONS = {"device": C.ACL_MEM_LOCATION_TYPE_DEVICE, "host": C.ACL_MEM_LOCATION_TYPE_HOST}
_SHARE_TYPES = {"default": C.ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, "fabric": C.ACL_MEM_SHARE_HANDLE_TYPE_FABRIC}
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
    return attr


class Device:
    """One (virtual or real) device: where physical memory is allocated."""

    def __init__(self, device_id: int = 0) -> None:
        self.id = runtime()._device(device_id)

    def __repr__(self) -> str:
        return f"Device({self.id})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return hash(("Device", self.id))

    def _prop(self, attr: str | int, location: str) -> dict[str, Any]:
        if location not in _LOCATIONS:
            raise InvalidParamError(f"location {location!r}: use 'device' or 'host'")
        loc = {"id": self.id if location == "device" else 0, "type": _LOCATIONS[location]}
        return {"handleType": 0, "allocationType": 0, "memAttr": _attr(attr), "location": loc, "reserve": 0}

    def granularity(self, attr: str | int = "normal") -> int:
        return runtime().granularity(self._prop(attr, "device"), C.ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED)

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of this device across the node (the GPU's own figures under the CUDA backend)."""
        return runtime().device_mem_info(self.id)

    def allocate(self, size: int, attr: str | int = "normal", location: str = "device") -> PhysicalMemory:
        """Physical memory of at least `size` bytes (rounded up to the granularity)."""
        prop = self._prop(attr, location)
        rt = runtime()
        g = rt.granularity(prop, C.ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM)
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise InvalidParamError(f"size must be a positive int, got {size!r}")
        return PhysicalMemory(rt.malloc_physical(-(-size // g) * g, prop, 0))


class PhysicalMemory:
    """A physical allocation (made here or imported); `close()` frees this process's handle to it."""

    def __init__(self, handle: int) -> None:
        rt = runtime()
        alloc = rt.allocation(handle)
        self.handle = handle
        self.size = alloc.size
        self.device = alloc.prop.location.id
        self.location = {"type": alloc.prop.location.type, "id": alloc.prop.location.id}  # outlives close()
        self.imported = bool(alloc.imported_from)
        self.pages = alloc.mem.pages
        self.on_gpu = not isinstance(alloc.mem, HostMemory)
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
        return runtime().properties(self._live())

    def export(
        self, share_type: str = "default", pids: Iterable[int] = (), validate_pids: bool = True
    ) -> ShareableHandle:
        """Export once, as a handle other processes can import; `pids` go on the trustlist at once."""
        if share_type not in _SHARE_TYPES:
            raise InvalidParamError(f"share_type {share_type!r}: use 'default' or 'fabric'")
        st = _SHARE_TYPES[share_type]
        flags = 0 if validate_pids else C.ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION
        raw = runtime().export(self._live(), flags, st, list(pids))  # the trustlist rides on the export
        self._shareable = ShareableHandle(share_type, raw)
        return self._shareable

    def allow(self, pids: Iterable[int]) -> None:
        """Add processes (host pids, as `device_get_bare_tgid` gives) to the trustlist of the export."""
        if self._shareable is None:
            raise InvalidParamError("export() this memory before setting its trustlist")
        runtime().set_pids(self._shareable.raw, _SHARE_TYPES[self._shareable.kind], list(pids))

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
            runtime().free_physical(self.handle)

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
        rt.when_safe(lambda: _quietly(rt.free_physical, handle))


_TEXT = re.compile(r"^vmm:(default|fabric):([0-9a-f]+)$")


@dataclass(frozen=True)
class ShareableHandle:
    """A shareable handle, copyable by value: ``int(h)`` for DEFAULT, ``bytes(h)`` for FABRIC, ``str(h)``
    as text for environment variables, command lines and JSON, and `ShareableHandle.parse` back."""

    kind: str
    raw: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.raw, bytes):
            raise InvalidParamError(f"a shareable handle's raw form is bytes, not {type(self.raw).__name__}")
        if self.kind == "default":
            if len(self.raw) != 8 or not any(self.raw):
                raise InvalidParamError("a DEFAULT shareable handle is 8 bytes, not all zero")
        elif self.kind == "fabric":
            decode_fabric(self.raw)
        else:
            raise InvalidParamError(f"kind {self.kind!r}: 'default' or 'fabric'")

    @classmethod
    def from_value(cls, value: int | bytes | str | ShareableHandle) -> ShareableHandle:
        """From an int (DEFAULT), 128 bytes (FABRIC), the text form, or a ShareableHandle."""
        if isinstance(value, ShareableHandle):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        if isinstance(value, (bytes, bytearray, memoryview)):
            return cls("fabric", bytes(value))
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 64:
            return cls("default", default_bytes(value))
        raise InvalidParamError(f"not a shareable handle: {value!r}")

    @classmethod
    def parse(cls, text: str) -> ShareableHandle:
        if not isinstance(text, str):
            raise InvalidParamError(f"not a shareable handle text: {text!r}")
        m = _TEXT.match(text.strip())
        expected = {"default": 16, "fabric": 256}
        if not m or len(m.group(2)) != expected[m.group(1)]:
            raise InvalidParamError(f"not a shareable handle text: {text!r} (expected vmm:default:<16 hex digits> "
                                    "or vmm:fabric:<256 hex digits>)")
        raw = bytes.fromhex(m.group(2))
        return cls(m.group(1), raw[::-1] if m.group(1) == "default" else raw)

    def __int__(self) -> int:
        if self.kind != "default":
            raise TypeError("a FABRIC handle is 128 bytes: use bytes(handle)")
        return int.from_bytes(self.raw, "little")

    def __bytes__(self) -> bytes:
        return self.raw

    def __str__(self) -> str:
        if self.kind == "default":
            return f"vmm:default:{int(self):016x}"
        return f"vmm:fabric:{self.raw.hex()}"

    def __repr__(self) -> str:
        return f"ShareableHandle({str(self)!r})"


def import_handle(handle: int | bytes | str | ShareableHandle, device: int | None = None) -> PhysicalMemory:
    """Import a handle another process exported; on `device` (default: this thread's device, else 0)."""
    h = ShareableHandle.from_value(handle)
    rt = runtime()
    if device is None:
        try:
            device = rt.current_device()
        except Exception:
            device = 0
    dev = rt._device(device)
    return PhysicalMemory(rt.import_handle(h.raw, _SHARE_TYPES[h.kind], dev))


class VirtualRange:
    """A reserved, inaccessible range of virtual addresses (at `at` exactly, when given)."""

    def __init__(self, size: int, at: int | None = None, gpu: bool | None = None) -> None:
        """`gpu`: GPU address space (default: when the CUDA backend is on), for GPU memory."""
        g = C.MIN_GRANULARITY
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise InvalidParamError(f"size must be a positive int, got {size!r}")
        self.size = -(-size // g) * g
        self.ptr = runtime().reserve(self.size, 0, at or 0, 0, gpu)
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
        rt.map(ptr, memory.size, 0, memory._live(), 0, flags, prepopulate)
        return Mapping(ptr, memory, self if owns_range else None)

    def close(self) -> None:
        if self._finalizer.alive:
            self._finalizer.detach()
            runtime().release_reservation(self.ptr)

    def __enter__(self) -> VirtualRange:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _release_quietly(ptr: int) -> None:
    with contextlib.suppress(Exception):
        rt = runtime()
        rt.when_safe(lambda: _quietly(rt.release_reservation, ptr))


def _unmap_quietly(ptr: int, rng: VirtualRange | None) -> None:
    def unmap() -> None:
        _quietly(rt.unmap, ptr)
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
        runtime().set_access(self.ptr, self.size, [{"flags": _ACCESS[access], "location": self.memory.location}])

    def close(self) -> None:
        """Unmap (and release the range it owns); BufferError while views of it are alive."""
        if not self._finalizer.alive:
            return
        if len(self._views):
            raise BufferError(f"{len(self._views)} view(s) of this mapping are alive: delete them first")
        self._finalizer.detach()
        runtime().unmap(self.ptr)
        if self._range is not None:
            self._range.close()

    def __enter__(self) -> Mapping:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None and len(self._views):
            return  # do not mask the error in flight; the mapping goes when its last view does
        self.close()
