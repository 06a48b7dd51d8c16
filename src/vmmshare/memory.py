"""The Pythonic API: `Device`, `PhysicalMemory`, `ShareableHandle`, `VirtualRange` and `Mapping`.

Objects own what they wrap and give it back on `close()`, at the end of a ``with`` block, or when they
are garbage-collected. Failures raise `AclError` subclasses carrying the ACL code and message.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from . import _inherit
from . import constants as C
from ._process import runtime
from .backends.base import MemoryKind
from .errors import AclInvalidParamError, ContextNullError, InvalidParamError, NoPermissionError
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
        return PhysicalMemory._make(rt.memory.malloc_physical(rounded, prop))


class PhysicalMemory:
    """A physical allocation (made here or imported); `close()` frees this process's handle to it.

    Made by `Device.allocate` and `import_handle` only (not instantiated directly). It travels: pickled (a
    multiprocessing Queue, Pipe or Process argument), it is exported if it was not yet, and the receiver imports it.
    """

    _handle: int
    _size: int
    _device: int
    _on_gpu: bool
    _remote: bool
    numa_node: int | None
    location: dict[str, int]
    imported: bool
    pages: str
    _location: Location
    _prop: PhysicalProp
    _origin: ShareableHandle | None
    _shareable: ShareableHandle | None
    _validate: bool
    _trusted: list[int]
    _remote_trusted: list[tuple[int, list[int]]]
    _finalizer: weakref.finalize[Any, Any]
    _forked = False  # inherited by a forked child: imported again there on first use
    _holders = 0  # arrived here: the mappings (and pools) that hold this import
    _handed_out = False  # arrived here as itself: its receiver closes it, not the mappings that share it

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError("PhysicalMemory cannot be instantiated directly: use Device.allocate() or import_handle()")

    @classmethod
    def _make(cls, handle: int, origin: ShareableHandle | None = None) -> PhysicalMemory:
        """The object owning `handle`, a live allocation of this runtime (`origin`: the handle it was imported from)."""
        self = cls.__new__(cls)
        alloc = runtime().memory.allocation(check_int("handle", handle))
        self._handle = handle
        self._size = alloc.size
        self._device = alloc.device
        location = alloc.prop.location
        self.numa_node = location.id if location.type == C.ACL_MEM_LOCATION_TYPE_HOST_NUMA else None
        self._location = alloc.prop.location  # outlives close()
        self._prop = alloc.prop
        self.location = alloc.prop.location.as_dict()
        self.imported = bool(alloc.imported_from)
        self.pages = alloc.mem.pages
        self._on_gpu = alloc.backend.kind is MemoryKind.GPU
        self._remote = alloc.backend.kind is MemoryKind.REMOTE  # another server's: copies only (SPEC §8)
        self._origin = origin
        self._shareable = None
        self._validate = True  # how it was exported, and whom it trusts: what a grown chunk is exported with
        self._trusted = []
        self._remote_trusted = []
        self._finalizer = weakref.finalize(self, _free_quietly, handle)
        _inherit.track(self)
        return self

    def _after_fork(self) -> None:
        if self._finalizer.alive:
            self._finalizer.detach()
            self._finalizer = _inherit.inherited(self)
            self._forked = True

    def _import_in_child(self) -> None:
        """Inherited through fork: import the memory by its handle here (the parent's handle means nothing)."""
        handle = self.shareable
        if handle is None:
            raise InvalidParamError("this PhysicalMemory was inherited through fork() and was never exported, so this "
                                    "process cannot import it: export() it before starting the process (or start "
                                    "it with the 'spawn' method, and it travels by pickle)")
        try:
            memory = import_handle(handle, self.device)
        except NoPermissionError:
            raise NoPermissionError(_refusal(_Ticket(handle, self.device, os.getppid(), self._validate))) from None
        memory._finalizer.detach()
        self._handle, self._origin, self._shareable, self._forked = memory._handle, handle, None, False
        self.imported = True
        self._finalizer = weakref.finalize(self, _free_quietly, memory._handle)

    @property
    def handle(self) -> int:
        """This process's handle of the allocation (aclrtDrvMemHandle), for the acl layer's calls."""
        return self._handle

    @property
    def size(self) -> int:
        """Its size in bytes (a multiple of the granularity)."""
        return self._size

    @property
    def device(self) -> int:
        """The device it belongs to (0 for host memory)."""
        return self._device

    @property
    def on_gpu(self) -> bool:
        """GPU memory (the CUDA backend's), viewed through DLPack."""
        return self._on_gpu

    @property
    def remote(self) -> bool:
        """Another server's memory (SPEC §8): copies only, no CPU view."""
        return self._remote

    @property
    def shareable(self) -> ShareableHandle | None:
        """The handle other processes import it by: its export, or the handle it was imported from."""
        return self._shareable or self._origin

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("imported" if self.imported else "local")
        return f"<PhysicalMemory {self.size} bytes on device {self.device}, {state}>"

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def _live(self) -> int:
        if self.closed:
            raise InvalidParamError("this PhysicalMemory is closed")
        if self._forked:
            self._import_in_child()
        return self._handle

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
        if self._shareable is not None and not self.closed:
            raise InvalidParamError("this PhysicalMemory is exported already (a handle exports once; sending it "
                                    "exports it): add processes to its trustlist with allow()")
        # the trustlist rides on the export
        self._shareable = runtime().sharing.export(self._live(), st, validate, trust)
        self._validate, self._trusted = validate, list(trust)
        return self._shareable

    def allow(self, pids: Iterable[int], server: int | None = None) -> None:
        """Add processes (host pids, as `device_get_bare_tgid` gives) to the trustlist of the export; with `server`,
        processes of that server only (a FABRIC export imported there through the cross-server transport)."""
        if self._shareable is None:
            raise InvalidParamError("export() this memory before setting its trustlist")
        listed = _pids(pids, allow_empty=False)
        if server is None:
            runtime().sharing.set_pids(self._shareable, listed)
            self._trusted.extend(listed)
        else:
            srv = check_int("server", server, 0, 0xFFFFFFFF)
            runtime().sharing.set_remote_pids(self._shareable, srv, listed)
            self._remote_trusted.append((srv, listed))

    def _export_like(self, other: PhysicalMemory) -> None:
        """Export as `other` was, trusting whom it trusts (a chunk a grown mapping adds to its first)."""
        first = other._shareable
        if first is None:
            return
        self.export(first.share_type.label, other._trusted, other._validate)
        for server, pids in other._remote_trusted:
            self.allow(pids, server)

    def _ticket(self) -> _Ticket:
        """What a receiver imports this memory by; exports it (with pid validation) when it was not yet."""
        if self.closed:
            raise TypeError("this PhysicalMemory is closed: there is nothing to send")
        with _arrived_lock:  # two threads sending it at once export it once
            handle = self.shareable
            if handle is None:
                handle = self.export()
        return _Ticket(handle, self.device, os.getpid(), self._validate if self._origin is None else None)

    def __reduce__(self) -> tuple[object, ...]:
        return (_arrive_memory, (self._ticket(),))

    def map(
        self, access: str = "rw", prepopulate: bool | None = None, max_size: int | None = None
    ) -> Mapping:
        """Reserve a range of this allocation's size and map it there; the Mapping owns both. With `max_size`,
        the range is reserved that large, so that the mapping can `grow()` in place up to it."""
        flags = _access(access)
        populate = _flag("prepopulate", prepopulate, allow_none=True)
        rt = runtime()
        if max_size is not None:
            wanted = _size(max_size)
            room = -(-wanted // self._prop.granularity) * self._prop.granularity
            if wanted < self.size:
                raise InvalidParamError(f"max_size {max_size} is smaller than this {self.size}-byte memory")
            self._live()
            rng = VirtualRange(room, gpu=self.on_gpu)
            try:
                rt.memory.map(rng.ptr, self.size, 0, self._live(), flags, populate)
            except BaseException:
                rng.close()
                raise
            return Mapping._make([(rng.ptr, self)], access, rng=rng, growable=True)
        with rt.lock:
            ptr = rt.memory.map_new(rt.memory.allocation(self._live()), flags, populate)
        return Mapping._make([(ptr, self)], access, own_range=True)

    def close(self) -> None:
        """Free this handle; mappings of it stay valid until they are closed."""
        if self._finalizer.alive:
            self._finalizer.detach()
            if not self._forked:
                runtime().memory.free_physical(self._handle)

    def __enter__(self) -> PhysicalMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class _Ticket:
    """A PhysicalMemory as it travels: its handle, its device and who sent it (for the receiver's errors);
    `validated`: whether its export checks pids (None: not known here, the memory was itself imported)."""

    handle: ShareableHandle
    device: int
    sender: int
    validated: bool | None


# what this process received, by handle value: one import serves every object that arrives with the same handle
_arrived: weakref.WeakValueDictionary[int, PhysicalMemory] = weakref.WeakValueDictionary()
_arrived_lock = threading.RLock()


def _hold(memory: PhysicalMemory) -> None:
    """A mapping (or pool) of this process uses an import that arrived here."""
    with _arrived_lock:
        memory._holders += 1


def _let_go(memory: PhysicalMemory) -> None:
    """It no longer does: the last one closes the import, unless the import was handed to a receiver as itself."""
    with _arrived_lock:
        memory._holders -= 1
        last = memory._holders <= 0 and not memory._handed_out
    if last:
        memory.close()


def _receive(ticket: _Ticket) -> tuple[PhysicalMemory, bool]:
    """The memory a ticket names, imported here (or the live import of it this process has); True if new."""
    with _arrived_lock:
        known = _arrived.get(ticket.handle.value)
        if known is not None and not known.closed:
            return known, False
        rt = runtime()
        device = ticket.device if 0 <= ticket.device < rt.devices.count else 0
        try:
            memory = import_handle(ticket.handle, device)
        except NoPermissionError:
            raise NoPermissionError(_refusal(ticket)) from None
        _arrived[ticket.handle.value] = memory
        return memory, True


def _refusal(ticket: _Ticket) -> str:
    """Why a received object could not be imported here, and what the sender must do about it."""
    me = runtime().sharing.bare_tgid()
    how = "it was exported with pid validation" if ticket.validated is not False else "its exporter checks pids"
    return (f"the memory sent by process {ticket.sender} cannot be imported in process {me}: {how} and {me} is not "
            f"on its trustlist (or the pid was bound to an earlier process). Before sending it, call allow([{me}]) on "
            "it in the exporting process (multiprocessing: after Process.start(), allow([process.pid])), or export "
            "it with validate_pids=False")


def _arrive_memory(ticket: _Ticket) -> PhysicalMemory:
    """Unpickling a PhysicalMemory: the import of it in this process (its receiver closes it)."""
    memory = _receive(ticket)[0]
    memory._handed_out = True
    return memory


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
    dev = rt.device_id(check_device(device))
    return PhysicalMemory._make(rt.sharing.import_handle(h, dev), h)


class VirtualRange:
    """A reserved, inaccessible range of virtual addresses (at `at` exactly, when given)."""

    def __init__(self, size: int, at: int | None = None, gpu: bool | None = None) -> None:
        """`gpu`: GPU address space (default: when the CUDA backend is on), for GPU memory."""
        g = C.MIN_GRANULARITY
        self._size = -(-_size(size) // g) * g
        on_gpu = _flag("gpu", gpu, allow_none=True)
        self._ptr = runtime().memory.reserve(self._size, 0, check_ptr("at", at), on_gpu)
        self._finalizer = weakref.finalize(self, _release_quietly, self._ptr)
        self._forked = False
        _inherit.track(self)

    def _after_fork(self) -> None:
        if self._finalizer.alive:
            self._finalizer.detach()
            self._finalizer = _inherit.inherited(self)
            self._forked = True

    @property
    def ptr(self) -> int:
        """The start of the range."""
        return self._ptr

    @property
    def size(self) -> int:
        """Its size in bytes (whole granules)."""
        return self._size

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
        return Mapping._make([(ptr, memory)], access, rng=self if owns else None)

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("a VirtualRange is address space of this process and cannot be sent: send the "
                        "PhysicalMemory (or the Mapping) mapped in it, and map it in the receiver")

    def close(self) -> None:
        if self._finalizer.alive:
            self._finalizer.detach()
            if not self._forked:
                runtime().memory.release(self.ptr)

    def __enter__(self) -> VirtualRange:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _release_quietly(ptr: int) -> None:
    with contextlib.suppress(Exception):
        rt = runtime()
        rt.when_safe(lambda: _quietly(rt.memory.release, ptr))


def _unmap_quietly(parts: list[tuple[int, PhysicalMemory]], rng: VirtualRange | None, own_range: bool,
                   owned: list[PhysicalMemory], held: list[PhysicalMemory]) -> None:
    def unmap() -> None:
        if own_range:
            _quietly(rt.memory.unmap_release, parts[0][0])
        else:
            for ptr, _ in reversed(parts):
                _quietly(rt.memory.unmap, ptr)
            if rng is not None:
                _quietly(rng.close)
        for memory in owned:
            _quietly(memory.close)
        for memory in held:
            _quietly(_let_go, memory)

    with contextlib.suppress(Exception):
        rt = runtime()
        rt.when_safe(unmap)


class Mapping(MemoryViews):
    """Physical memory mapped at `ptr`: views as memoryview, numpy array or DLPack tensor, zero-copy.

    Made by `PhysicalMemory.map` and `VirtualRange.map` (not instantiated directly). One mapping may hold several
    chunks back to back (`grow()`, or a grown mapping received from another process): one range for views and
    copies. Like `mmap.mmap`, it refuses to close while views of it are alive (BufferError). Pickled, it travels
    as its chunks' handles: the receiver imports them and maps them back to back (at an address of its own).
    """

    _parts: list[tuple[int, PhysicalMemory]]
    _access: str
    _range: VirtualRange | None
    _own_range: bool
    _growable: bool
    _owned: list[PhysicalMemory]
    _held: list[PhysicalMemory]
    _lock: threading.Lock
    _finalizer: weakref.finalize[Any, Any]
    _forked = False  # inherited by a forked child: still mapped there; closing it only lets go

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError("Mapping cannot be instantiated directly: use PhysicalMemory.map() or VirtualRange.map()")

    @classmethod
    def _make(
        cls, parts: list[tuple[int, PhysicalMemory]], access: str, rng: VirtualRange | None = None,
        own_range: bool = False, growable: bool = False, owned: list[PhysicalMemory] | None = None,
        held: list[PhysicalMemory] | None = None,
    ) -> Mapping:
        """The mapping of `parts` (address, memory mapped there, back to back); `rng`: a VirtualRange it closes
        with it; `own_range`: its one part was reserved and mapped in one step (map_new); `growable`: it may map
        more chunks into the rest of `rng`; `owned`: memory it closes with it (the chunks it grew); `held`: imports that
        arrived here, which it lets go of (`_let_go`) when it closes."""
        self = cls.__new__(cls)
        first = parts[0][1]
        self._ptr = parts[0][0]
        self._size = sum(m.size for _, m in parts)
        self._on_gpu, self._remote, self._device = first.on_gpu, first.remote, first.device
        self._parts = list(parts)
        self._access = access
        self._range = rng
        self._own_range = own_range
        self._growable = growable
        self._owned = list(owned or [])
        self._held = list(held or [])
        self._lock = threading.Lock()
        self._init_views()
        self._finalizer = weakref.finalize(self, _unmap_quietly, self._parts, rng, own_range, self._owned,
                                           self._held)
        _inherit.track(self)
        return self

    def _after_fork(self) -> None:
        if self._finalizer.alive:
            self._finalizer.detach()
            self._finalizer = _inherit.inherited(self)
            self._forked = True

    def __repr__(self) -> str:
        chunks = f", {len(self._parts)} chunks" if len(self._parts) > 1 else ""
        return f"<Mapping {self.ptr:#x}+{self.size:#x}{chunks}{' closed' if self.closed else ''}>"

    def _cuts(self) -> list[int]:
        return [ptr for ptr, _ in self._parts[1:]]

    @property
    def memory(self) -> PhysicalMemory:
        """The (first) physical memory mapped here."""
        return self._parts[0][1]

    @property
    def chunks(self) -> tuple[PhysicalMemory, ...]:
        """Every physical memory mapped here, in address order."""
        return tuple(m for _, m in self._parts)

    @property
    def capacity(self) -> int:
        """The most bytes this mapping can `grow()` to (its size, unless it was mapped with `max_size`)."""
        return self._range.size if self._growable and self._range is not None else self.size

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def set_access(self, access: str) -> None:
        flags = _access(access)
        if self.closed:
            raise InvalidParamError("this Mapping is closed")
        for ptr, memory in self._parts:
            runtime().memory.set_access(ptr, memory.size, [(memory._location, flags)])

    def grow(self, size: int) -> None:
        """Grow to at least `size` bytes in place: new chunks of the first one's kind, mapped right after the last
        (exported as the first was, trusting whom it trusts); views made before stay valid."""
        wanted = _size(size)
        with self._lock:
            if self.closed:
                raise InvalidParamError("this Mapping is closed")
            if self._forked:
                raise InvalidParamError("this Mapping was inherited through fork(): only the process that made it "
                                        "grows it")
            if not self._growable or self._range is None:
                raise InvalidParamError("this mapping has no room to grow: map it with "
                                        "PhysicalMemory.map(max_size=...)")
            first = self._parts[0][1]
            g = first._prop.granularity
            extra = -(-(wanted - self._size) // g) * g
            if extra <= 0:
                return
            if self._size + extra > self._range.size:
                raise InvalidParamError(f"{wanted} bytes do not fit the {self._range.size} bytes (max_size) this "
                                        "mapping was made with")
            rt = runtime()
            chunk = PhysicalMemory._make(rt.memory.malloc_physical(extra, first._prop))
            try:
                chunk._export_like(first)
                ptr = self._ptr + self._size
                rt.memory.map(ptr, extra, 0, chunk._live(), _access(self._access), None)
            except BaseException:
                chunk.close()
                raise
            self._parts.append((ptr, chunk))
            self._owned.append(chunk)
            self._size += extra

    def allow(self, pids: Iterable[int], server: int | None = None) -> None:
        """Add processes to the trustlist of every chunk of this mapping (and of the chunks it grows later)."""
        listed = _pids(pids, allow_empty=False)
        for _, memory in self._parts:
            if memory.imported:
                raise InvalidParamError("this mapping is of imported memory: its exporter sets the trustlist")
            if memory._shareable is None:
                memory.export(pids=listed)
            else:
                memory.allow(listed, server)

    def __reduce__(self) -> tuple[object, ...]:
        if self.closed:
            raise TypeError("this Mapping is closed: there is nothing to send")
        first = self._parts[0][1]
        tickets = []
        for _, memory in self._parts:
            with _arrived_lock:
                if memory.shareable is None and memory is not first:
                    memory._export_like(first)
            tickets.append(memory._ticket())
        return (_arrive_mapping, (tickets, self._access))

    def close(self) -> None:
        """Unmap (and release the range it owns); BufferError while views of it are alive."""
        if not self._finalizer.alive:
            return
        self._check_closable()
        self._finalizer.detach()
        if self._forked:
            return  # the parent's: it stays mapped here until this process exits
        rt = runtime()
        if self._own_range:
            rt.memory.unmap_release(self.ptr)
        else:
            for ptr, _ in reversed(self._parts):
                rt.memory.unmap(ptr)
            if self._range is not None:
                self._range.close()
        for memory in self._owned:
            memory.close()
        for memory in self._held:
            _let_go(memory)

    def __enter__(self) -> Mapping:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None and self.live_views():
            return  # do not mask the error in flight; the mapping goes when its last view does
        self.close()


def _map_back_to_back(memories: list[PhysicalMemory], access: str, room: int = 0,
                      held: list[PhysicalMemory] | None = None) -> Mapping:
    """`memories` mapped back to back in one reservation (of `room` bytes at least, to add more later)."""
    if len(memories) == 1 and not room:
        mapping = memories[0].map(access)
        mapping._held.extend(held or [])
        return mapping
    total = sum(m.size for m in memories)
    rng = VirtualRange(max(total, room), gpu=memories[0].on_gpu)
    parts: list[tuple[int, PhysicalMemory]] = []
    rt = runtime()
    try:
        at = rng.ptr
        for memory in memories:
            rt.memory.map(at, memory.size, 0, memory._live(), _access(access), None)
            parts.append((at, memory))
            at += memory.size
    except BaseException:
        for ptr, _ in reversed(parts):
            _quietly(rt.memory.unmap, ptr)
        rng.close()
        raise
    return Mapping._make(parts, access, rng=rng, growable=bool(room), held=held)


def _arrive_mapping(tickets: list[_Ticket], access: str) -> Mapping:
    """Unpickling a Mapping: its chunks imported here (one import per handle in this process), mapped back to
    back; the mapping holds the imports, and the last holder of one closes it."""
    memories: list[PhysicalMemory] = []
    try:
        for ticket in tickets:
            memory = _receive(ticket)[0]
            _hold(memory)
            memories.append(memory)
        return _map_back_to_back(memories, access, held=memories)
    except BaseException:
        for memory in memories:
            _quietly(_let_go, memory)
        raise
