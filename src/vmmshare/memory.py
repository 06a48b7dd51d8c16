"""The Pythonic API: `Device`, `PhysicalMemory`, `ShareableHandle`, `VirtualRange` and `Mapping`.

Objects own what they wrap and give it back on `close()`, at the end of a ``with`` block, or when they
are garbage-collected. Failures raise `AclError` subclasses carrying the ACL code and message.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable
from typing import Any

from . import constants as C
from ._process import runtime
from .backends.base import MemoryKind
from .errors import AclInvalidParamError, ContextNullError, InvalidHandleError, InvalidParamError
from .handles import ShareableHandle, ShareType
from .props import U64, Location, PhysicalProp, check_device, check_int, check_pids, check_prop, check_ptr
from .views import MemoryViews

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
    try:
        listed = list(pids)
    except Exception:  # not iterable, or an iterable that fails: either way not a list of pids
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

    def _prop(self, attr: str | int, location: str, numa_node: int | None = None) -> PhysicalProp:
        """The property of memory here; the acl layer's checks of it apply (100000), as for pyACL's."""
        kind = _choice("location", location, _LOCATIONS)
        if numa_node is not None:
            if kind != C.ACL_MEM_LOCATION_TYPE_HOST:
                raise InvalidParamError("numa_node places host memory: pass location='host' with it")
            loc = Location(C.ACL_MEM_LOCATION_TYPE_HOST_NUMA, check_int("numa_node", numa_node, 0, (1 << 31) - 1))
        else:
            loc = Location(kind, self.id if kind == C.ACL_MEM_LOCATION_TYPE_DEVICE else 0)
        prop = PhysicalProp(C.ACL_MEM_HANDLE_TYPE_NONE, C.ACL_MEM_ALLOCATION_TYPE_PINNED, _attr(attr), loc)
        return check_prop(prop, for_malloc=True)

    def granularity(self, attr: str | int = "normal", location: str = "device") -> int:
        return runtime().memory.granularity(self._prop(attr, location))

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of this device across the node (the GPU's own figures under the CUDA backend)."""
        return runtime().mem_info(self.id)

    def allocate(
        self, size: int, attr: str | int = "normal", location: str = "device", numa_node: int | None = None
    ) -> PhysicalMemory:
        """Physical memory of at least `size` bytes (rounded up to the granularity); `location` "device" (this
        device's) or "host", on NUMA node `numa_node` when given (ACL_MEM_LOCATION_TYPE_HOST_NUMA)."""
        n = _size(size)
        prop = self._prop(attr, location, numa_node)
        rt = runtime()
        g = rt.memory.granularity(prop)
        rounded = -(-n // g) * g
        if rounded > U64:
            raise InvalidParamError(f"size {n} rounded up to the granularity {g} does not fit a size_t")
        return PhysicalMemory(rt.memory.malloc_physical(rounded, prop))


class PhysicalMemory:
    """A physical allocation (made here or imported); `close()` frees this process's handle to it."""

    def __init__(self, handle: int) -> None:
        rt = runtime()
        alloc = rt.memory.allocation(check_int("handle", handle))
        self.handle = handle
        self.size = alloc.size
        self.device = alloc.device
        location = alloc.prop.location
        self.numa_node = location.id if location.type == C.ACL_MEM_LOCATION_TYPE_HOST_NUMA else None
        self._location = alloc.prop.location  # outlives close()
        self.location = alloc.prop.location.as_dict()
        self.imported = bool(alloc.imported_from)
        self.pages = alloc.mem.pages
        self.on_gpu = alloc.backend.kind is MemoryKind.GPU
        self.remote = alloc.backend.kind is MemoryKind.REMOTE  # another server's: copies only (SPEC §8)
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
        st = _choice("share_type", share_type, _SHARE_TYPES)
        trust = _pids(pids, allow_empty=True)
        validate = bool(_flag("validate_pids", validate_pids))
        # the trustlist rides on the export
        self._shareable = runtime().sharing.export(self._live(), st, validate, trust)
        return self._shareable

    def allow(self, pids: Iterable[int], server: int | None = None) -> None:
        """Add processes (host pids, as `device_get_bare_tgid` gives) to the trustlist of the export; with `server`,
        processes of that server only (a FABRIC export imported there through the cross-server transport)."""
        if self._shareable is None:
            raise InvalidParamError("export() this memory before setting its trustlist")
        listed = _pids(pids, allow_empty=False)
        if server is None:
            runtime().sharing.set_pids(self._shareable, listed)
        else:
            runtime().sharing.set_remote_pids(self._shareable, check_int("server", server, 0, 0xFFFFFFFF), listed)

    def map(self, access: str = "rw", prepopulate: bool | None = None) -> Mapping:
        """Reserve a range of this allocation's size and map it there; the Mapping owns both."""
        flags = _access(access)
        populate = _flag("prepopulate", prepopulate, allow_none=True)
        rt = runtime()
        with rt.lock:
            ptr = rt.memory.map_new(rt.memory.allocation(self._live()), flags, populate)
        return Mapping(ptr, self, None, own_range=True)

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
    """Import an exported handle on `device` (default: this thread's device, else 0). The exporting process may
    import its own handle, and importing a handle again gives another object over the same memory (rule 13):
    each object is closed on its own, and the memory stays until the last is."""
    h = ShareableHandle.from_value(handle)
    rt = runtime()
    if device is None:
        try:
            device = rt.devices.current()
        except ContextNullError:
            device = 0
    dev = rt.device_id(check_device(device))
    try:
        imported = rt.sharing.import_handle(h, dev)
    except InvalidHandleError as exc:
        if "revoked" not in exc.message:
            raise
        raise InvalidHandleError(  # in this API's terms: objects are closed, not freed
            f"handle {h.value:#x} cannot be imported: it is unknown on this node, or revoked (its exporter closed "
            "the memory, or exited)") from None
    try:
        return PhysicalMemory(imported)
    except BaseException:
        rt.memory.free_physical(imported)
        raise


class VirtualRange:
    """A reserved, inaccessible range of virtual addresses (at `at` exactly, when given)."""

    def __init__(self, size: int, at: int | None = None, gpu: bool | None = None) -> None:
        """`gpu`: GPU address space (default: when the CUDA backend is on), for GPU memory."""
        g = C.MIN_GRANULARITY
        self.size = -(-_size(size) // g) * g
        on_gpu = _flag("gpu", gpu, allow_none=True)
        self.ptr = runtime().memory.reserve(self.size, 0, check_ptr("at", at), on_gpu)
        self._finalizer = weakref.finalize(self, _release_quietly, self.ptr)

    def __repr__(self) -> str:
        return f"<VirtualRange {self.ptr:#x}+{self.size:#x}>"

    def map(
        self, memory: PhysicalMemory, offset: int = 0, access: str = "rw", prepopulate: bool | None = None,
        owns_range: bool = False,
    ) -> Mapping:
        """Map `memory` at `self.ptr + offset`."""
        flags = _access(access)
        if not isinstance(memory, PhysicalMemory):
            raise InvalidParamError(f"memory must be a PhysicalMemory, not {type(memory).__name__}")
        offset = check_int("offset", offset)
        populate = _flag("prepopulate", prepopulate, allow_none=True)
        owns = _flag("owns_range", owns_range)
        if offset + memory.size > self.size:
            raise InvalidParamError(f"{memory.size} bytes at offset {offset} do not fit this {self.size}-byte range")
        rt = runtime()
        ptr = self.ptr + offset
        rt.memory.map(ptr, memory.size, 0, memory._live(), flags, populate)
        return Mapping(ptr, memory, self if owns else None)

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


def _unmap_quietly(ptr: int, rng: VirtualRange | None, own_range: bool) -> None:
    def unmap() -> None:
        if own_range:
            _quietly(rt.memory.unmap_release, ptr)
            return
        _quietly(rt.memory.unmap, ptr)
        if rng is not None:
            _quietly(rng.close)

    with contextlib.suppress(Exception):
        rt = runtime()
        rt.when_safe(unmap)


class Mapping(MemoryViews):
    """Physical memory mapped at `ptr`: views as memoryview, numpy array or DLPack tensor, zero-copy.

    Like `mmap.mmap`, it refuses to close while views of it are alive (BufferError).
    """

    def __init__(self, ptr: int, memory: PhysicalMemory, rng: VirtualRange | None, own_range: bool = False) -> None:
        """`rng`: a VirtualRange this mapping closes with it; `own_range`: the range was reserved with the mapping
        (PhysicalMemory.map), and goes with it in one step."""
        self.ptr = ptr
        self.size = memory.size
        self.memory = memory
        self.on_gpu = memory.on_gpu
        self.remote = memory.remote
        self.device = memory.device
        self._range = rng
        self._own_range = own_range
        self._init_views()
        self._finalizer = weakref.finalize(self, _unmap_quietly, ptr, rng, own_range)

    def __repr__(self) -> str:
        return f"<Mapping {self.ptr:#x}+{self.size:#x}{' closed' if self.closed else ''}>"

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def set_access(self, access: str) -> None:
        runtime().memory.set_access(self.ptr, self.size, [(self.memory._location, _access(access))])

    def close(self) -> None:
        """Unmap (and release the range it owns); BufferError while views of it are alive."""
        if not self._finalizer.alive:
            return
        self._check_closable()
        self._finalizer.detach()
        if self._own_range:
            runtime().memory.unmap_release(self.ptr)
            return
        runtime().memory.unmap(self.ptr)
        if self._range is not None:
            self._range.close()

    def __enter__(self) -> Mapping:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None and self.live_views():
            return  # do not mask the error in flight; the mapping goes when its last view does
        self.close()
