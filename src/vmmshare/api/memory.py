"""The Pythonic API: `Device`, `PhysicalMemory` and `import_handle` (`VirtualRange` and `Mapping` are in
`mapping`), and how a PhysicalMemory travels to another process (pickled, it is imported there).

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
from typing import TYPE_CHECKING, Any

from .. import constants as C
from .._process import runtime
from ..errors import InvalidHandleError, InvalidParamError, NoPermissionError
from ..wire.handles import ShareableHandle
from ..wire.props import Location, PhysicalProp, check_device, check_int, check_prop, prop_of
from ._checks import _LOCATIONS, _SHARE_TYPES, _access, _attr, _choice, _flag, _pids, _size
from ._finalize import Finalizer
from ._owned import Owned

if TYPE_CHECKING:
    from ..runtime.tables import Allocation
    from .mapping import Mapping

__all__ = ["Device", "PhysicalMemory", "ShareableHandle", "import_handle"]

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
        """The property of memory here; the acl layer's checks of it apply (100000), as for pyACL's.

        Made once per value (props are immutable). Its handle and allocation types and its location kind are this
        method's own, so of the acl layer's checks only those of the attribute apply (`for_malloc=False`)."""
        kind = _choice("location", location, _LOCATIONS)
        if numa_node is not None:
            if kind != C.ACL_MEM_LOCATION_TYPE_HOST:
                raise InvalidParamError("numa_node places host memory: pass location='host' with it")
            kind, where = C.ACL_MEM_LOCATION_TYPE_HOST_NUMA, check_int("numa_node", numa_node, 0, (1 << 31) - 1)
        else:
            where = self.id if kind == C.ACL_MEM_LOCATION_TYPE_DEVICE else 0
        prop = prop_of(C.ACL_MEM_HANDLE_TYPE_NONE, C.ACL_MEM_ALLOCATION_TYPE_PINNED, _attr(attr), kind, where)
        return check_prop(prop, for_malloc=False)

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
        return PhysicalMemory._of(runtime().memory.allocate_rounded(n, self._prop(attr, location, numa_node)))


class PhysicalMemory(Owned):
    """A physical allocation (made here or imported); `close()` frees this process's handle to it.

    Made by `Device.allocate` and `import_handle` only (not instantiated directly). It travels: pickled (a
    multiprocessing Queue, Pipe or Process argument), it is exported if it was not yet, and the receiver imports it.
    """

    _finalizer: Finalizer
    _handle: int
    _size: int
    _device: int
    _on_gpu: bool
    _remote: bool
    numa_node: int | None = None  # the NUMA node of HOST_NUMA memory
    imported = False  # imported here (not allocated by this process)
    pages: str
    _location: Location
    _prop: PhysicalProp
    _origin: ShareableHandle | None
    # how it was exported, and whom it trusts (set by export: what a grown chunk is exported with); allow() adds to
    # the lists in one step each (extend, append), so that two threads allowing pids at once both stay
    _shareable: ShareableHandle | None = None
    _validate = True
    _trusted: list[int]
    _remote_trusted: list[tuple[int, list[int]]]
    _holders = 0  # arrived here: the mappings (and pools) that hold this import
    _handed_out = False  # arrived here as itself: its receiver closes it, not the mappings that share it

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError("PhysicalMemory cannot be instantiated directly: use Device.allocate() or import_handle()")

    @classmethod
    def _make(cls, handle: int) -> PhysicalMemory:
        """The object owning `handle`, a live allocation of this runtime."""
        return cls._of(runtime().memory.allocation(handle))

    @classmethod
    def _of(cls, alloc: Allocation, origin: ShareableHandle | None = None) -> PhysicalMemory:
        """The object owning a live, registered allocation of this runtime (`origin`: the handle it was imported
        from)."""
        self = cls.__new__(cls)
        handle = alloc.handle
        prop, backend = alloc.prop, alloc.backend
        location = prop.location
        self._handle = handle
        self._size = alloc.size
        self._device = location.id if location.type == C.ACL_MEM_LOCATION_TYPE_DEVICE else 0  # (Allocation.device)
        if location.type == C.ACL_MEM_LOCATION_TYPE_HOST_NUMA:
            self.numa_node = location.id
        self._location = location  # outlives close()
        self._prop = prop
        if alloc.imported_from:
            self.imported = True
        self.pages = alloc.mem.pages
        self._on_gpu = backend.on_gpu
        self._remote = backend.remote  # another server's: copies only (SPEC §8)
        self._origin = origin
        # inherited by a forked child: imported again there on first use
        self._finalizer = Finalizer(self, _free_quietly, handle)
        return self

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
        self._finalizer = Finalizer(self, _free_quietly, memory._handle)

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
    def location(self) -> dict[str, int]:
        """Where it lives, as an aclrtMemLocation dict ({"id": ..., "type": ...})."""
        return self._location.as_dict()

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

    def _live(self) -> int:
        if not self._finalizer.alive:  # (closed)
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
        self._validate, self._trusted, self._remote_trusted = validate, trust, []
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
        Mapping = _mapping.Mapping
        if max_size is not None:
            wanted = _size(max_size)
            room = -(-wanted // self._prop.granularity) * self._prop.granularity
            if wanted < self.size:
                raise InvalidParamError(f"max_size {max_size} is smaller than this {self.size}-byte memory")
            self._live()
            rng = _mapping.VirtualRange(room, gpu=self.on_gpu)
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
        if self._finalizer.cancel() and not self._forked:
            runtime().memory.free_physical(self._handle)


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
    if not isinstance(ticket, _Ticket) or not isinstance(ticket.handle, ShareableHandle) or isinstance(
            ticket.device, bool) or not isinstance(ticket.device, int):
        raise InvalidParamError(f"not a PhysicalMemory's descriptor (a crafted pickle?): {ticket!r:.200}")
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
    """Import an exported handle on `device` (default: this thread's device, else 0). The exporting process may
    import its own handle, and importing a handle again gives another object over the same memory (rule 13):
    each object is closed on its own, and the memory stays until the last is."""
    h = ShareableHandle.from_value(handle)
    rt = runtime()
    devices = rt.devices  # this thread's device, else 0
    dev = devices.device_id(devices.current_or(0) if device is None else check_device(device))
    try:
        imported = rt.sharing.import_handle(h, dev)
    except InvalidHandleError as exc:
        if "revoked" not in exc.message:
            raise
        raise InvalidHandleError(  # in this API's terms: objects are closed, not freed
            f"handle {h.value:#x} cannot be imported: it is unknown on this node, or revoked (its exporter closed "
            "the memory, or exited)") from None
    try:
        return PhysicalMemory._of(imported, h)
    except BaseException:
        rt.memory.free_physical(imported.handle)
        raise


from . import mapping as _mapping  # noqa: E402  (mapping imports this module: bound once both are, not on each map)
