"""Physical allocations, reserved ranges and the mappings between them (SPEC §4 rules 1-8)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import constants as C
from ..backends import host, mman
from ..backends.base import Backend, Memory
from ..errors import (
    AclError,
    FeatureNotSupportedError,
    InternalError,
    InvalidHandleError,
    InvalidParamError,
    MemoryAllocationError,
)
from ..intervals import Intervals
from ..wire.props import HOST_LOCATIONS, LOCATION_TYPES, MEMORY_LOCATIONS, U64, Location, PhysicalProp
from .tables import Allocation, MappingEntry, Reservation

if TYPE_CHECKING:
    from .shared import Shared

ARENA_SIZE = mman.ARENA_END - mman.ARENA_START


class Vmm:
    """This process's allocations, reservations and mappings; callers hold the runtime's lock for the tables."""

    def __init__(self, s: Shared, forget_exports: Callable[[Allocation], None]) -> None:
        self.s = s
        self._forget_exports = forget_exports  # what sharing knows of an allocation, once it is freed
        self.handles: dict[int, Allocation] = {}
        self.allocs: set[Allocation] = set()  # live, with or without a handle (a freed one stays while mapped)
        self.reservations: Intervals[Reservation] = Intervals()
        self.mappings: Intervals[MappingEntry] = Intervals()
        self._handles = itertools.count(0x7A00_0000_0040, 0x40)  # the aclrtDrvMemHandles given out, in order

    # ------------------------------------------------------------ physical memory

    def backend_for(self, location: Location) -> Backend:
        """Device memory lives on the device backend (the GPUs under CUDA); host memory on the host."""
        return self.s.device_backend if location.type == C.ACL_MEM_LOCATION_TYPE_DEVICE else self.s.host

    def check_location(self, location: Location) -> None:
        if location.type == C.ACL_MEM_LOCATION_TYPE_DEVICE:
            self.s.devices.device_id(location.id)

    def check_prop(self, prop: PhysicalProp) -> None:
        """What the runtime and the driver check of a property, after the acl layer's own checks (`props.check_prop`):
        the location (107000 / 107001 / 207000), the types, `reserve`, and 1 GiB pages on host memory (207000)."""
        loc = prop.location
        if loc.type not in LOCATION_TYPES:
            raise InvalidParamError(f"prop.location.type={loc.type} is not an aclrtMemLocationType")
        if loc.type not in MEMORY_LOCATIONS:
            raise FeatureNotSupportedError(f"prop.location.type={loc.type} is not supported: use "
                                           "ACL_MEM_LOCATION_TYPE_DEVICE (1), HOST (0) or HOST_NUMA (4)")
        if prop.handle_type not in (C.ACL_MEM_HANDLE_TYPE_NONE, C.ACL_MEM_HANDLE_TYPE_POSIX):
            raise InvalidParamError(f"prop.handleType={prop.handle_type}: use ACL_MEM_HANDLE_TYPE_NONE (0)")
        if prop.allocation_type != C.ACL_MEM_ALLOCATION_TYPE_PINNED:
            raise InvalidParamError(f"prop.allocationType={prop.allocation_type}: only ACL_MEM_ALLOCATION_TYPE_PINNED")
        if not 0 <= prop.mem_attr < len(C.MEM_ATTR_NAMES):
            raise InvalidParamError(f"prop.memAttr={prop.mem_attr} is not an aclrtMemAttr")
        if prop.reserve:
            raise InvalidParamError(f"prop.reserve={prop.reserve}: it is reserved and must be 0")
        self.check_placement(prop)

    def check_placement(self, prop: PhysicalProp) -> None:
        """`check_prop`'s checks of where the memory lives: the device (107001), the HOST id or NUMA node, and 1 GiB
        pages on host memory; alone for a prop whose types and attribute are known good (`Device.allocate`'s)."""
        loc = prop.location
        if loc.type == C.ACL_MEM_LOCATION_TYPE_DEVICE:
            self.s.devices.device_id(loc.id)
        elif loc.type == C.ACL_MEM_LOCATION_TYPE_HOST and loc.id != 0:
            raise FeatureNotSupportedError(f"a HOST location's id is 0, not {loc.id}: to place host memory on a NUMA "
                                           "node, use ACL_MEM_LOCATION_TYPE_HOST_NUMA (4) with the node's id")
        elif loc.type == C.ACL_MEM_LOCATION_TYPE_HOST_NUMA:
            nodes = host.numa_nodes()
            if loc.id not in nodes:
                raise InvalidParamError(f"NUMA node {loc.id} does not exist on this machine: its nodes are "
                                        f"{', '.join(map(str, nodes))}")
        if prop.mem_attr in C.HUGE1G_ATTRS and loc.type in HOST_LOCATIONS:
            raise FeatureNotSupportedError(
                f"{C.MEM_ATTR_NAMES[prop.mem_attr]}: 1 GiB pages are device memory only; host memory takes the "
                "normal or 2 MiB huge attributes"
            )

    def granularity(self, prop: PhysicalProp) -> int:
        self.check_prop(prop)
        return max(prop.granularity, self.backend_for(prop.location).granularity(self._node_device(prop.location)))

    def _node_device(self, location: Location) -> int:
        """The node's number for a DEVICE location (its id is a user id, ASCEND_RT_VISIBLE_DEVICES applied)."""
        if location.type == C.ACL_MEM_LOCATION_TYPE_DEVICE:
            return self.s.devices.logical(location.id)
        return location.id

    def malloc_physical(self, size: int, prop: PhysicalProp) -> int:
        return self.register(self.create(size, prop))

    def allocate_rounded(self, size: int, prop: PhysicalProp) -> Allocation:
        """A registered physical allocation of at least `size` bytes (a positive size_t), rounded up to the
        granularity: `granularity` and `malloc_physical` in one, its device resolved once. For a prop of the Pythonic
        API (`Device._prop`): its types, location kind and attribute are checked there, so only its placement is."""
        self.check_placement(prop)
        location = prop.location
        backend = self.backend_for(location)
        node_device = self._node_device(location)
        g = max(prop.granularity, backend.granularity(node_device))
        rounded = -(-size // g) * g
        if rounded > U64:
            raise InvalidParamError(f"size {size} rounded up to the granularity {g} does not fit a size_t")
        self.s.run_deferred()
        alloc = self._make(rounded, prop, backend, node_device)
        self.register(alloc)
        return alloc

    def create(self, size: int, prop: PhysicalProp, owner: str = "") -> Allocation:
        """A physical allocation of `size` bytes, charged to its device on the node (not yet registered)."""
        self.s.run_deferred()
        self.check_prop(prop)
        backend = self.backend_for(prop.location)
        node_device = self._node_device(prop.location)
        g = max(prop.granularity, backend.granularity(node_device))
        if size == 0 or size % g:
            raise InvalidParamError(f"size {size} must be a positive multiple of the granularity {g} ({g >> 20} MiB)")
        return self._make(size, prop, backend, node_device, owner)

    def _make(self, size: int, prop: PhysicalProp, backend: Backend, node_device: int, owner: str = "") -> Allocation:
        """`create`'s allocation, of a checked property and size (`node_device`: its location's node number)."""
        location = prop.location
        device = node_device if location.type == C.ACL_MEM_LOCATION_TYPE_DEVICE else -1
        numa = location.id if location.type == C.ACL_MEM_LOCATION_TYPE_HOST_NUMA else None
        config = self.s.config
        if device >= 0 and not backend.on_gpu and size > config.device_memory:  # device memory the node counts
            raise MemoryAllocationError(
                f"device {device} has {config.device_memory} of {config.device_memory} bytes free; "
                f"{size} bytes do not fit (free memory, or raise VMMSHARE_DEVICE_MEMORY)"
            )
        made: list[Memory] = []
        failed: list[BaseException] = []

        def make() -> None:  # runs while the broker checks the capacity
            try:
                made.append(backend.allocate(size, device, prop.huge_page, numa))
            except BaseException as exc:
                failed.append(exc)

        try:
            node_ref = self.s.node.charge(device, size, make, gpu=backend.on_gpu)
        except BaseException:
            for mem in made:
                mem.close()
            raise
        if failed:
            self.s.safe_node_call(self.s.node.release, node_ref)  # the allocation's own error is the one to report
            exc = failed[0]
            if isinstance(exc, (OSError, OverflowError)):  # e.g. ENOMEM, EFBIG, or beyond off_t
                why = exc.strerror if isinstance(exc, OSError) else "too large for a file"
                raise MemoryAllocationError(f"cannot create {size} bytes of shared memory: {why}") from None
            raise exc
        return Allocation(0, made[0], backend, prop, size, node_ref, owner=owner)

    def register(self, alloc: Allocation) -> int:
        """Record an allocation; one without an owner gets a handle the caller can name (aclrtDrvMemHandle)."""
        with self.s.lock:
            return self.register_locked(alloc)

    def register_locked(self, alloc: Allocation) -> int:
        """`register`, for a caller that holds the lock already (an import records it with its own tables)."""
        alloc.handle = handle = next(self._handles)
        if not alloc.owner:
            self.handles[handle] = alloc
        self.allocs.add(alloc)
        return handle

    def allocation(self, handle: int) -> Allocation:
        alloc = self.handles.get(handle)
        if alloc is None:
            raise InvalidHandleError(f"handle {handle:#x} is not a live physical allocation of this process")
        return alloc

    def free_physical(self, handle: int) -> None:
        self.s.run_deferred()
        with self.s.lock:
            self._drop(self.allocation(handle))

    def drop(self, alloc: Allocation) -> None:
        """One handle reference fewer; at the last, its export is revoked and, once unmapped, the memory goes."""
        with self.s.lock:
            self._drop(alloc)

    def _drop(self, alloc: Allocation) -> None:
        """`drop`, under the lock."""
        alloc.refs -= 1
        if alloc.refs:
            return
        self.handles.pop(alloc.handle, None)
        self._forget_exports(alloc)
        if not alloc.maps:
            self._destroy(alloc)

    def maybe_destroy(self, alloc: Allocation) -> None:
        """Destroy an allocation no handle and no mapping holds any more."""
        if not (alloc.refs or alloc.maps):
            self._destroy(alloc)

    def _destroy(self, alloc: Allocation) -> None:
        self.allocs.discard(alloc)
        s = self.s
        try:
            alloc.mem.close()
        finally:  # the node's hold goes even if the memory would not close (a driver error): it is not ours any more
            s.safe_node_call(s.node.release, alloc.node_ref)

    def retain(self, ptr: int) -> int:
        with self.s.lock:
            alloc = self.vmm_mapping_at(ptr).alloc
            if alloc.refs == 0:
                self.handles[alloc.handle] = alloc
            alloc.refs += 1
            return alloc.handle

    def properties(self, handle: int) -> dict[str, Any]:
        with self.s.lock:
            return self.allocation(handle).prop.reported()

    # ------------------------------------------------------------ reservations and mappings

    def reserve(
        self, size: int, alignment: int, expect_ptr: int, on_device: bool | None = None, owner: str = ""
    ) -> int:
        """A reserved range, in the device backend's address space unless `on_device` is False."""
        if alignment != 0:
            raise InvalidParamError(f"alignment={alignment} is out of range [0, 0]")
        g = C.MIN_GRANULARITY
        _check_range_size(size)
        if expect_ptr % g:
            raise InvalidParamError(f"expectPtr {expect_ptr:#x} must be aligned to {g} ({g >> 20} MiB)")
        align = C.HUGE1G_GRANULARITY if size % C.HUGE1G_GRANULARITY == 0 else g
        backend = self.s.device_backend if on_device is None or on_device else self.s.host
        try:
            base = backend.reserve(size, align, expect_ptr)
        except OSError as exc:
            if expect_ptr:
                raise InvalidParamError(
                    f"cannot reserve at expectPtr {expect_ptr:#x}: {exc.strerror}; pass 0 to let the runtime choose"
                ) from None
            raise MemoryAllocationError(f"cannot reserve {size} bytes of address space: {exc.strerror}") from None
        with self.s.lock:
            self.reservations.add(base, size, Reservation(base, size, backend, owner))
        return base

    def release(self, ptr: int, owner: str = "") -> None:
        with self.s.lock:
            r = self.reservations.exact(ptr)
            if r is None or r.owner != owner:
                raise InvalidParamError(f"{ptr:#x} is not the start of a reservation of this process"
                                        + _owned_by(r.owner if r is not None else ""))
            if self.mappings.overlaps(ptr, r.size):  # a mapping lies wholly inside one reservation
                raise InvalidParamError(f"the reservation at {ptr:#x} still holds mappings: unmap_mem them first")
            r.backend.release(ptr, r.size)  # released first: a range that fails to go stays tracked
            self.reservations.remove(ptr)

    def map(self, ptr: int, size: int, offset: int, handle: int, access: int, prepopulate: bool | None = None) -> None:
        """Map an allocation over a reserved range; `prepopulate` (default: VMMSHARE_PREPOPULATE) faults it in."""
        if offset != 0:
            raise InvalidParamError(f"offset={offset} is out of range [0, 0]")
        with self.s.lock:
            self.map_alloc(ptr, size, self.allocation(handle), access, prepopulate)

    def map_alloc(self, ptr: int, size: int, alloc: Allocation, access: int, prepopulate: bool | None = None) -> None:
        with self.s.lock:
            if size != alloc.size:
                raise InvalidParamError(f"size {size} must equal the physical allocation's size {alloc.size}")
            hit = self.reservations.at(ptr)
            if hit is None:
                raise InvalidParamError(f"{ptr:#x} is not inside a reservation: reserve_mem_address first")
            start, end, r = hit
            if r.owner != alloc.owner:
                raise InvalidParamError(f"{ptr:#x} is not inside a reservation of reserve_mem_address"
                                        + _owned_by(r.owner))
            if ptr + size > end:
                raise InvalidParamError(f"[{ptr:#x}, {ptr + size:#x}) runs past the reservation [{start:#x}, {end:#x})")
            g = alloc.prop.granularity
            if ptr % g:
                raise InvalidParamError(f"ptr {ptr:#x} must be aligned to the allocation's granularity {g}")
            if self.mappings.overlaps(ptr, size):
                raise InvalidParamError(f"[{ptr:#x}, {ptr + size:#x}) overlaps an existing mapping: unmap_mem it first")
            if alloc.backend is not r.backend and not alloc.backend.remote:
                what, where = alloc.backend.name, r.backend.name
                raise FeatureNotSupportedError(
                    f"{what} memory cannot be mapped into a {where} reservation: reserve the range for the "
                    "memory's location"
                )
            try:
                alloc.backend.map(ptr, size, alloc.mem, access,
                                  self.s.config.prepopulate if prepopulate is None else prepopulate)
            except OSError as exc:
                raise MemoryAllocationError(f"cannot map {size} bytes at {ptr:#x}: {exc.strerror}") from None
            self.mappings.add(ptr, size, MappingEntry(ptr, size, alloc, {}, access))
            alloc.maps += 1

    def map_new(self, alloc: Allocation, access: int, prepopulate: bool | None = None, owner: str = "") -> int:
        """Reserve a range of the allocation's size and map it there (in one system call for host memory): what
        the Pythonic `map()`, aclrtMalloc blocks and IPC imports do, without a range of their own to reuse."""
        size, backend = alloc.size, alloc.backend
        if backend.remote:  # its range is a host reservation the CPU cannot touch
            ptr = self.reserve(size, 0, 0, on_device=False, owner=owner)
            try:
                self.map_alloc(ptr, size, alloc, access, prepopulate)
            except BaseException:
                self.release(ptr, owner)
                raise
            return ptr
        _check_range_size(size)
        align = C.HUGE1G_GRANULARITY if size % C.HUGE1G_GRANULARITY == 0 else C.MIN_GRANULARITY
        s = self.s
        populate = s.config.prepopulate if prepopulate is None else prepopulate
        with s.lock:
            if alloc.refs == 0 and alloc.maps == 0:
                raise InvalidParamError("this allocation was freed")
            try:
                ptr = backend.reserve_mapped(size, align, alloc.mem, access, populate)
            except OSError as exc:
                raise MemoryAllocationError(f"cannot reserve and map {size} bytes: {exc.strerror}") from None
            self.reservations.add(ptr, size, Reservation(ptr, size, backend, owner))
            self.mappings.add(ptr, size, MappingEntry(ptr, size, alloc, {}, access))
            alloc.maps += 1
        return ptr

    def unmap_release(self, ptr: int, owner: str = "") -> None:
        """Unmap a mapping that fills its own reservation and release the range (`map_new`'s undoing)."""
        with self.s.lock:
            m, r = self.mappings.exact(ptr), self.reservations.exact(ptr)
            if m is None or r is None or m.size != r.size or m.alloc.backend is not r.backend or r.owner != owner:
                if m is not None:  # not one of map_new's: the two steps say what is wrong
                    self.unmap(ptr, owner)
                self.release(ptr, owner)  # (unmapped already, e.g. by acl.rt.unmap_mem: the range still goes)
                return
            alloc = m.alloc
            if alloc.owner != owner:
                raise InvalidParamError(f"{ptr:#x} is not the start of a mapping (map_mem returns none there)"
                                        + _owned_by(alloc.owner))
            try:
                r.backend.release_mapped(ptr, r.size)
            except OSError as exc:
                raise InternalError(f"cannot unmap {ptr:#x}: {exc.strerror}") from None
            self.mappings.remove(ptr)
            self.reservations.remove(ptr)
            alloc.maps -= 1
            if not (alloc.maps or alloc.refs):
                self._destroy(alloc)

    def mapping_at(self, ptr: int) -> MappingEntry:
        hit = self.mappings.at(ptr)
        if hit is None:
            raise InvalidParamError(f"{ptr:#x} is not inside a mapping of this process")
        return hit[2]

    def vmm_mapping_at(self, ptr: int) -> MappingEntry:
        """The map_mem mapping holding `ptr` (not the memory behind an aclrtMalloc or IPC pointer)."""
        m = self.mapping_at(ptr)
        if m.alloc.owner:
            raise InvalidParamError(f"{ptr:#x} is not inside a map_mem mapping" + _owned_by(m.alloc.owner))
        return m

    def unmap(self, ptr: int, owner: str = "") -> None:
        with self.s.lock:
            m = self.mappings.exact(ptr)
            if m is None or m.alloc.owner != owner:
                raise InvalidParamError(f"{ptr:#x} is not the start of a mapping (map_mem returns none there)"
                                        + _owned_by(m.alloc.owner if m is not None else ""))
            try:
                m.alloc.backend.unmap(ptr, m.size)
            except OSError as exc:
                raise InternalError(f"cannot unmap {ptr:#x}: {exc.strerror}") from None
            self.mappings.remove(ptr)
            m.alloc.maps -= 1
            self.maybe_destroy(m.alloc)

    def set_access(self, ptr: int, size: int, entries: list[tuple[Location, int]]) -> None:
        for loc, _ in entries:
            self.check_location(loc)
        with self.s.lock:
            m = self.mappings.exact(ptr)
            if m is None or m.size != size or m.alloc.owner:
                raise InvalidParamError(f"({ptr:#x}, {size}) is not exactly a mapping: pass map_mem's ptr and size"
                                        + _owned_by(m.alloc.owner if m is not None else ""))
            access = dict(m.access)
            access.update(entries)
            effective = access.get(m.alloc.prop.location, entries[-1][1])
            try:
                m.alloc.backend.protect(ptr, size, effective, self.s.devices.logical(m.alloc.device))
            except OSError as exc:
                raise InternalError(f"mprotect failed: {exc.strerror}") from None
            m.access, m.effective = access, effective

    def get_access(self, ptr: int, location: Location) -> int:
        self.check_location(location)
        with self.s.lock:
            m = self.vmm_mapping_at(ptr)
            return m.access.get(location, m.effective)

    def address_range(self, ptr: int) -> tuple[int, int]:
        with self.s.lock:
            m = self.mapping_at(ptr)
            return m.ptr, m.size

    def close_all_in_child(self) -> None:
        """In a forked child: let go of the parent's memory where the backend can (its mappings stay)."""
        for alloc in self.allocs:
            with contextlib.suppress(OSError, AclError):
                alloc.backend.forget(alloc.mem)


def _owned_by(owner: str) -> str:
    """The hint for a pointer that belongs to an aclrtMalloc block or an IPC import, not to the VMM calls."""
    if owner == "malloc":
        return " (it is memory from acl.rt.malloc: release it with acl.rt.free)"
    if owner == "ipc":
        return " (it is imported IPC memory: release it with acl.rt.ipc_mem_close)"
    return ""


def _check_range_size(size: int) -> None:
    """A reservation's size: whole granules, within the arena (reserve_mem_address and map_new alike)."""
    g = C.MIN_GRANULARITY
    if size > ARENA_SIZE:
        raise InvalidParamError(
            f"size {size} is more than one reservation holds, {ARENA_SIZE} ({ARENA_SIZE >> 40} TiB, where the "
            "runtime's drivers other than A3's stop): reserve the size you will map, or several ranges"
        )
    if size == 0 or size % g:
        raise InvalidParamError(f"size {size} must be a positive multiple of {g} ({g >> 20} MiB)")
