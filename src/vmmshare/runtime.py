"""Per-process runtime state: devices, streams, physical allocations, reservations, mappings, imports.

Every public method validates its arguments and raises an `AclError` subclass on failure; the surfaces
(`vmmshare.acl`, the Pythonic objects) turn those into return codes or exceptions. The node-wide parts
(capacity accounting and sharing) go through a `Node`, which the surfaces provide (the broker client).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from . import constants as C
from . import handles
from .backends import host
from .backends.cuda import CudaBackend, CudaMemory
from .config import Config
from .errors import (
    AclError,
    ContextNullError,
    FeatureNotSupportedError,
    InternalError,
    InvalidDeviceError,
    InvalidHandleError,
    InvalidParamError,
    MemoryAllocationError,
)
from .intervals import Intervals
from .node import Imported, Node
from .props import U64, Location, PhysicalProp, check_int, check_pids, check_ptr, field_of

log = logging.getLogger(__name__)

_ACCESS_PROT = {
    C.ACL_RT_MEM_ACCESS_FLAGS_NONE: host.PROT_NONE,
    C.ACL_RT_MEM_ACCESS_FLAGS_READ: host.PROT_READ,
    C.ACL_RT_MEM_ACCESS_FLAGS_READWRITE: host.PROT_READ | host.PROT_WRITE,
}
_LOCATIONS = {C.ACL_MEM_LOCATION_TYPE_HOST, C.ACL_MEM_LOCATION_TYPE_DEVICE}
_ALL_LOCATIONS = {
    C.ACL_MEM_LOCATION_TYPE_HOST,
    C.ACL_MEM_LOCATION_TYPE_DEVICE,
    C.ACL_MEM_LOCATION_TYPE_UNREGISTERED,
    C.ACL_MEM_LOCATION_TYPE_MANAGED,
    C.ACL_MEM_LOCATION_TYPE_HOST_NUMA,
}


def _over_capacity(device: int, size: int, used: int, config: Config) -> str:
    return (
        f"device {device} has {config.device_memory - used} of {config.device_memory} bytes free; "
        f"{size} bytes do not fit (free memory, or raise VMMSHARE_DEVICE_MEMORY)"
    )


# ---------------------------------------------------------------- per-process tables


@dataclass(eq=False)
class Allocation:
    """A physical allocation as this process sees it (made here, or imported)."""

    handle: int
    mem: host.HostMemory | CudaMemory
    prop: PhysicalProp
    size: int
    token: int  # the node's id for it (capacity, export, import)
    refs: int = 1  # handle references: malloc/import + each retain
    maps: int = 0  # live mappings in this process
    imported_from: int = 0  # the shareable handle it was imported from (0: made here)
    shareable: bytes = b""  # the exported handle (8 bytes DEFAULT, 128 FABRIC); b"" until exported


@dataclass(eq=False)
class Reservation:
    base: int
    size: int
    gpu: bool  # GPU address space (cuMemAddressReserve) rather than a host PROT_NONE range


@dataclass(eq=False)
class MappingEntry:
    ptr: int
    size: int
    alloc: Allocation
    access: dict[Location, int]
    effective: int


@dataclass(eq=False)
class Stream:
    handle: int
    device: int


class Runtime:
    """All VMM state of this process, guarded by one lock so concurrent threads keep it consistent."""

    def __init__(self, config: Config, node: Node) -> None:
        self.config = config
        self.node = node
        self.gpu: CudaBackend | None = _gpu_backend(config.backend)
        self.devices = self.gpu.count if self.gpu is not None else config.devices
        self._told_fabric = False  # the FABRIC-on-GPU log line is written once
        self._ids = itertools.count(1)
        self._reset_tables()

    def _reset_tables(self) -> None:
        """Empty tables (and a fresh lock): at start, and in a forked child, which must not use the parent's."""
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._handles: dict[int, Allocation] = {}
        self._allocs: set[Allocation] = set()
        # keyed by the node's handle value, not the handle's bytes: bytes a FABRIC handle carries besides the value
        # (flags, device, size) must not make the same handle look like another one (rule 13)
        self._imports: dict[int, Allocation] = {}  # handle value imported here -> allocation
        self._exported: set[int] = set()  # handle values this process exported and has not freed
        self._reservations: Intervals[Reservation] = Intervals()
        self._mappings: Intervals[MappingEntry] = Intervals()
        self._host_blocks: Intervals[int] = Intervals()
        self._streams: dict[int, Stream] = {}
        self._device_refs: dict[int, int] = {}
        self._arena = host.Arena()
        self.initialized = False
        self._deferred: list[Callable[[], None]] = []  # finalizers that came while the node was busy

    # ------------------------------------------------------------ devices and streams

    def _device(self, device: object) -> int:
        d = check_int("deviceId", device, -(1 << 31), (1 << 31) - 1)
        if not 0 <= d < self.devices:
            raise InvalidDeviceError(
                f"device {d} does not exist: there are {self.devices} (0..{self.devices - 1})"
                + ("" if self.gpu else "; set VMMSHARE_DEVICES for more")
            )
        return d

    def current_device(self) -> int:
        """This thread's device (set_device), else ContextNullError."""
        device: int | None = getattr(self._tls, "device", None)
        if device is None or self._device_refs.get(device, 0) == 0:
            raise ContextNullError("no current device in this thread: call set_device(id) first")
        return device

    def set_device(self, device: object) -> None:
        d = self._device(device)
        with self._lock:
            self._device_refs[d] = self._device_refs.get(d, 0) + 1
        self._tls.device = d

    def reset_device(self, device: object, force: bool = False) -> None:
        d = self._device(device)
        with self._lock:
            refs = 0 if force else max(0, self._device_refs.get(d, 0) - 1)
            self._device_refs[d] = refs
            if refs == 0:
                for s in [s for s in self._streams.values() if s.device == d]:
                    del self._streams[s.handle]
        if refs == 0 and getattr(self._tls, "device", None) == d:
            self._tls.device = None

    def create_stream(self) -> int:
        device = self.current_device()
        with self._lock:
            handle = 0x5700_0000 + next(self._ids)
            self._streams[handle] = Stream(handle, device)
            return handle

    def _stream(self, stream: object) -> Stream | None:
        s = check_ptr("stream", stream)
        if s == 0:
            return None  # the default stream
        found = self._streams.get(s)
        if found is None:
            raise InvalidParamError(f"stream {s:#x} is not a live stream of this process")
        return found

    def destroy_stream(self, stream: object) -> None:
        with self._lock:
            s = self._stream(stream)
            if s is None:
                raise InvalidParamError("the default stream (0) cannot be destroyed")
            del self._streams[s.handle]

    def synchronize_stream(self, stream: object) -> None:
        self._stream(stream)  # work on a stream runs synchronously: nothing is ever pending

    def can_access_peer(self, device: object, peer: object) -> int:
        d, p = self._device(device), self._device(peer)
        if self.gpu is not None and d != p:
            return int(self.gpu.can_access_peer(d, p))  # the GPUs' topology says
        return int(d != p)

    def enable_peer_access(self, peer: object, flags: object) -> None:
        check_int("flags", flags, 0, 0)
        p = self._device(peer)
        d = self.current_device()
        if p == d:
            raise InvalidParamError(f"device {d} cannot enable peer access to itself")
        if self.gpu is not None and not self.gpu.can_access_peer(d, p):
            raise FeatureNotSupportedError(f"GPU {d} cannot access GPU {p}'s memory (cuDeviceCanAccessPeer says no)")
        # nothing to record: host memory is reachable from every device, and a GPU mapping's access is granted
        # per mapping (mem_set_access), as the runtime's VMM memory is

    # ------------------------------------------------------------ host memory, copies

    def malloc_host(self, size: object) -> int:
        n = check_int("size", size, 1, 1 << 46)
        try:
            ptr = host._mmap_call(0, n, host.PROT_READ | host.PROT_WRITE, host.MAP_PRIVATE | host.MAP_ANONYMOUS)
        except OSError as exc:
            raise MemoryAllocationError(f"cannot allocate {n} bytes of host memory: {exc.strerror}") from None
        with self._lock:
            self._host_blocks.add(ptr, n, n)
        return ptr

    def free_host(self, ptr: object) -> None:
        p = check_ptr("ptr", ptr)
        with self._lock:
            size = self._host_blocks.exact(p)
            if size is None:
                raise InvalidParamError(f"{p:#x} is not memory from malloc_host (or it was freed already)")
            self._host_blocks.remove(p)
            host._libc.munmap(p, size)

    def _classify(self, ptr: int, size: int, write: bool, what: str) -> bool:
        """Check `[ptr, ptr+size)` is accessible memory; True when it is device memory."""
        if ptr == 0:
            raise InvalidParamError(f"{what} is NULL")
        hit = self._mappings.at(ptr)
        if hit is not None:
            start, end, m = hit
            if ptr + size > end:
                raise InvalidParamError(f"{what} range {ptr:#x}+{size} runs past its mapping at {start:#x}")
            need = C.ACL_RT_MEM_ACCESS_FLAGS_READWRITE if write else C.ACL_RT_MEM_ACCESS_FLAGS_READ
            if m.effective & need != need:
                raise InvalidParamError(f"{what} mapping at {start:#x} is not {'writable' if write else 'readable'}")
            return m.alloc.prop.location.type == C.ACL_MEM_LOCATION_TYPE_DEVICE
        if self._reservations.at(ptr) is not None:
            raise InvalidParamError(f"{what} {ptr:#x} is reserved but not mapped: map_mem it first")
        block = self._host_blocks.at(ptr)
        if block is not None:
            if ptr + size > block[1]:
                raise InvalidParamError(f"{what} range {ptr:#x}+{size} runs past its malloc_host block")
            return False
        if not _process_range_ok(ptr, size, write):
            raise InvalidParamError(f"{what} {ptr:#x}+{size} is not {'writable' if write else 'readable'} memory")
        return False

    def memcpy(self, dst: object, dest_max: object, src: object, count: object, kind: object) -> None:
        d, s = check_ptr("dst", dst), check_ptr("src", src)
        dmax, n = check_int("destMax", dest_max), check_int("count", count)
        k = check_int("kind", kind, C.ACL_MEMCPY_HOST_TO_HOST, C.ACL_MEMCPY_DEFAULT)
        if n > dmax:
            raise InvalidParamError(f"count {n} is larger than destMax {dmax}")
        if d == 0 or s == 0:
            raise InvalidParamError(f"{'dst' if d == 0 else 'src'} is NULL")
        if n == 0:
            return
        with self._lock:
            dst_dev = self._classify(d, n, True, "dst")
            src_dev = self._classify(s, n, False, "src")
            want = {
                C.ACL_MEMCPY_HOST_TO_HOST: (False, False),
                C.ACL_MEMCPY_HOST_TO_DEVICE: (True, False),
                C.ACL_MEMCPY_DEVICE_TO_HOST: (False, True),
                C.ACL_MEMCPY_DEVICE_TO_DEVICE: (True, True),
            }.get(k)
            if want is not None and want != (dst_dev, src_dev):
                names = ("host", "device")
                raise InvalidParamError(
                    f"kind {k} copies {names[want[1]]}->{names[want[0]]} but src is {names[src_dev]} memory "
                    f"and dst is {names[dst_dev]} memory (use ACL_MEMCPY_DEFAULT to let the runtime decide)"
                )
            gpu_dev = self._gpu_device(d) if self.gpu is not None else None
            src_gpu = self._gpu_device(s) if self.gpu is not None else None
            if self.gpu is not None and (gpu_dev is not None or src_gpu is not None):
                self.gpu.copy(d, s, n, gpu_dev if gpu_dev is not None else src_gpu or 0)
            else:
                ctypes.memmove(d, s, n)

    def _gpu_device(self, ptr: int) -> int | None:
        """The GPU whose memory is mapped at `ptr`, or None for host memory."""
        hit = self._mappings.at(ptr)
        if hit is not None and isinstance(hit[2].alloc.mem, CudaMemory):
            return hit[2].alloc.mem.device
        return None

    def memset(self, ptr: object, max_count: object, value: object, count: object) -> None:
        p = check_ptr("devPtr", ptr)
        mx, n = check_int("maxCount", max_count), check_int("count", count)
        v = check_int("value", value, -(1 << 31), (1 << 31) - 1)
        if n > mx:
            raise InvalidParamError(f"count {n} is larger than maxCount {mx}")
        if p == 0:
            raise InvalidParamError("devPtr is NULL")
        if n == 0:
            return
        with self._lock:
            self._classify(p, n, True, "devPtr")
            gpu_dev = self._gpu_device(p) if self.gpu is not None else None
            if gpu_dev is not None and self.gpu is not None:
                self.gpu.fill(p, v, n, gpu_dev)
            else:
                ctypes.memset(p, v & 0xFF, n)

    def check_readable(self, ptr: int, size: int) -> None:
        """Raise unless the CPU can read `[ptr, ptr+size)` (GPU memory it cannot)."""
        with self._lock:
            self._classify(ptr, size, False, "ptr")
            if self._gpu_device(ptr) is not None:
                raise InvalidParamError(f"{ptr:#x} is GPU memory, which the CPU cannot read: memcpy it to the host")

    # ------------------------------------------------------------ physical memory

    def parse_prop(self, prop: object) -> PhysicalProp:
        handle_type = check_int("prop.handleType", field_of(prop, "handleType", "prop"), 0, 0xFFFFFFFF)
        if handle_type not in (C.ACL_MEM_HANDLE_TYPE_NONE, C.ACL_MEM_HANDLE_TYPE_POSIX):
            raise InvalidParamError(f"prop.handleType={handle_type}: use ACL_MEM_HANDLE_TYPE_NONE (0) or POSIX (2)")
        alloc_type = check_int("prop.allocationType", field_of(prop, "allocationType", "prop"), 0, 0xFFFFFFFF)
        if alloc_type != C.ACL_MEM_ALLOCATION_TYPE_PINNED:
            raise InvalidParamError(f"prop.allocationType={alloc_type}: only ACL_MEM_ALLOCATION_TYPE_PINNED (0)")
        attr = check_int("prop.memAttr", field_of(prop, "memAttr", "prop"), 0, 17)
        location = self._location(field_of(prop, "location", "prop"), "prop.location", _LOCATIONS)
        reserve = prop.get("reserve", 0) if isinstance(prop, Mapping) else 0
        check_int("prop.reserve", reserve, 0, 0)
        return PhysicalProp(handle_type, alloc_type, attr, location, 0)

    def granularity(self, prop: object, option: object) -> int:
        check_int("option", option, C.ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM, C.ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        p = self.parse_prop(prop)
        if self.gpu is not None and p.location.type == C.ACL_MEM_LOCATION_TYPE_DEVICE:
            return max(p.granularity, self.gpu.granularity(p.location.id))
        return p.granularity

    def malloc_physical(self, size: object, prop: object, flags: object) -> int:
        self._run_deferred()
        n = check_int("size", size, 0, U64)
        p = self.parse_prop(prop)
        check_int("flags", flags, 0, 0)
        g = p.granularity
        if n == 0 or n % g:
            raise InvalidParamError(f"size {n} must be a positive multiple of the granularity {g} ({g >> 20} MiB)")
        device = p.location.id if p.location.type == C.ACL_MEM_LOCATION_TYPE_DEVICE else -1
        on_gpu = device >= 0 and self.gpu is not None  # the GPU's own capacity applies (the driver says)
        if device >= 0 and not on_gpu and n > self.config.device_memory:
            raise MemoryAllocationError(_over_capacity(device, n, 0, self.config))
        made: list[host.HostMemory | CudaMemory] = []
        failed: list[BaseException] = []

        def create() -> None:  # runs while the broker checks the capacity
            try:
                if on_gpu and self.gpu is not None:
                    made.append(self.gpu.allocate(n, device))
                else:
                    name = f"vmmshare:{'dev' if device >= 0 else 'host'}{max(device, 0)}"
                    made.append(host.allocate(n, p.huge_page, name))
            except BaseException as exc:
                failed.append(exc)

        try:
            token = self.node.charge(device, n, create, gpu=on_gpu)
        except BaseException:
            for made_mem in made:
                made_mem.close()
            raise
        if failed:
            self._safe_node_call(self.node.release, token)  # the allocation's own error is the one to report
            exc = failed[0]
            if isinstance(exc, (OSError, OverflowError)):  # e.g. ENOMEM, EFBIG, or beyond off_t
                why = exc.strerror if isinstance(exc, OSError) else "too large for a file"
                raise MemoryAllocationError(f"cannot create {n} bytes of shared memory: {why}") from None
            raise exc
        mem = made[0]
        return self._register(Allocation(0, mem, p, n, token))

    def _register(self, alloc: Allocation) -> int:
        with self._lock:
            alloc.handle = 0x7A00_0000_0000 + (next(self._ids) << 6)
            self._handles[alloc.handle] = alloc
            self._allocs.add(alloc)
            return alloc.handle

    def allocation(self, handle: object) -> Allocation:
        h = check_int("handle", handle)
        alloc = self._handles.get(h)
        if alloc is None:
            raise InvalidHandleError(f"handle {h:#x} is not a live physical allocation of this process")
        return alloc

    def free_physical(self, handle: object) -> None:
        self._run_deferred()
        with self._lock:
            alloc = self.allocation(handle)
            alloc.refs -= 1
            if alloc.refs:
                return
            del self._handles[alloc.handle]
            if alloc.imported_from == 0 and alloc.shareable:
                self._exported.discard(self._shareable_value(alloc.shareable, _share_type_of(alloc.shareable)))
                if alloc.maps:  # still mapped here: revoke now (unmapped, the release below revokes it too)
                    self._safe_node_call(self.node.revoke, alloc.token)
            if alloc.imported_from:
                self._imports.pop(alloc.imported_from, None)
            self._maybe_destroy(alloc)

    def _maybe_destroy(self, alloc: Allocation) -> None:
        if alloc.refs or alloc.maps:
            return
        self._allocs.discard(alloc)
        try:
            alloc.mem.close()
        finally:  # the node's hold goes even if the memory would not close (a driver error): it is not ours any more
            self._safe_node_call(self.node.release, alloc.token)

    def when_safe(self, fn: Callable[[], None]) -> None:
        """Run a finalizer's clean-up now, or, if the garbage collector called it in the middle of a broker
        request in this thread, right after (a nested request would read the outer one's reply)."""
        if self.node.busy_in_this_thread():
            self._deferred.append(fn)
        else:
            fn()

    def _run_deferred(self) -> None:
        while self._deferred and not self.node.busy_in_this_thread():
            fn = self._deferred.pop()
            with contextlib.suppress(Exception):
                fn()

    def _safe_node_call(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except AclError as exc:  # the broker reclaims what a lost connection held
            log.warning("node call %s failed: %s", getattr(fn, "__name__", fn), exc)

    def retain(self, ptr: object) -> int:
        p = check_ptr("ptr", ptr)
        with self._lock:
            m = self._mapping_at(p)
            alloc = m.alloc
            if alloc.refs == 0:
                self._handles[alloc.handle] = alloc
            alloc.refs += 1
            return alloc.handle

    def properties(self, handle: object) -> dict[str, Any]:
        with self._lock:
            return self.allocation(handle).prop.as_dict()

    # ------------------------------------------------------------ reservations and mappings

    def reserve(
        self, size: object, alignment: object, expect_ptr: object, flags: object, gpu: bool | None = None
    ) -> int:
        """A reserved range; in GPU address space when the CUDA backend is on (unless `gpu` says otherwise)."""
        n = check_int("size", size, 0, host.ARENA_END - host.ARENA_START)
        check_int("alignment", alignment, 0, 0)
        want = check_ptr("expectPtr", expect_ptr)
        check_int("flags", flags, 0, 0)
        g = C.MIN_GRANULARITY
        if n == 0 or n % g:
            raise InvalidParamError(f"size {n} must be a positive multiple of {g} ({g >> 20} MiB)")
        if want % g:
            raise InvalidParamError(f"expectPtr {want:#x} must be aligned to {g} ({g >> 20} MiB)")
        align = C.HUGE1G_GRANULARITY if n % C.HUGE1G_GRANULARITY == 0 else g
        on_gpu = self.gpu is not None if gpu is None else gpu and self.gpu is not None
        try:
            base = self.gpu.reserve(n, align, want) if on_gpu and self.gpu else self._arena.reserve(n, align, want)
        except OSError as exc:
            if want:
                raise InvalidParamError(
                    f"cannot reserve at expectPtr {want:#x}: {exc.strerror}; pass 0 to let the runtime choose"
                ) from None
            raise MemoryAllocationError(f"cannot reserve {n} bytes of address space: {exc.strerror}") from None
        with self._lock:
            self._reservations.add(base, n, Reservation(base, n, on_gpu))
        return base

    def release_reservation(self, ptr: object) -> None:
        p = check_ptr("ptr", ptr)
        with self._lock:
            r = self._reservations.exact(p)
            if r is None:
                raise InvalidParamError(f"{p:#x} is not the start of a reservation of this process")
            if self._mappings.overlaps(p, r.size):  # a mapping lies wholly inside one reservation
                raise InvalidParamError(f"the reservation at {p:#x} still holds mappings: unmap_mem them first")
            if r.gpu and self.gpu is not None:  # released first: a range that fails to go stays tracked
                self.gpu.release(p, r.size)
            else:
                self._arena.release(p, r.size)
            self._reservations.remove(p)

    def map(
        self, ptr: object, size: object, offset: object, handle: object, flags: object, access: int,
        prepopulate: bool | None = None,
    ) -> None:
        """Map an allocation over a reserved range; `prepopulate` (default: VMMSHARE_PREPOPULATE) faults it in."""
        p = check_ptr("ptr", ptr)
        n = check_int("size", size)
        check_int("offset", offset, 0, 0)
        check_int("flags", flags, 0, 0)
        with self._lock:
            alloc = self.allocation(handle)
            if n != alloc.size:
                raise InvalidParamError(f"size {n} must equal the physical allocation's size {alloc.size}")
            hit = self._reservations.at(p)
            if hit is None:
                raise InvalidParamError(f"{p:#x} is not inside a reservation: reserve_mem_address first")
            start, end, r = hit
            if p + n > end:
                raise InvalidParamError(f"[{p:#x}, {p + n:#x}) runs past the reservation [{start:#x}, {end:#x})")
            g = alloc.prop.granularity
            if p % g:
                raise InvalidParamError(f"ptr {p:#x} must be aligned to the allocation's granularity {g}")
            if self._mappings.overlaps(p, n):
                raise InvalidParamError(f"[{p:#x}, {p + n:#x}) overlaps an existing mapping: unmap_mem it first")
            mem = alloc.mem
            if isinstance(mem, CudaMemory) != r.gpu:
                raise FeatureNotSupportedError(
                    f"{'GPU' if isinstance(mem, CudaMemory) else 'host'} memory cannot be mapped into a "
                    f"{'GPU' if r.gpu else 'host'} reservation: reserve the range for the memory's location"
                )
            if isinstance(mem, CudaMemory):
                assert self.gpu is not None
                self.gpu.map(p, n, mem, access)
            else:
                try:
                    host.map_shared(p, n, mem.fd, _ACCESS_PROT[access])
                except OSError as exc:
                    raise MemoryAllocationError(f"cannot map {n} bytes at {p:#x}: {exc.strerror}") from None
                if mem.pages == "thp":
                    host.advise_huge(p, n)
                if access and (self.config.prepopulate if prepopulate is None else prepopulate):
                    host.populate(p, n)
            self._mappings.add(p, n, MappingEntry(p, n, alloc, {}, access))
            alloc.maps += 1

    def _mapping_at(self, p: int) -> MappingEntry:
        hit = self._mappings.at(p)
        if hit is None:
            raise InvalidParamError(f"{p:#x} is not inside a mapping of this process")
        return hit[2]

    def unmap(self, ptr: object) -> None:
        p = check_ptr("ptr", ptr)
        with self._lock:
            m = self._mappings.exact(p)
            if m is None:
                raise InvalidParamError(f"{p:#x} is not the start of a mapping (map_mem returns none there)")
            try:
                if isinstance(m.alloc.mem, CudaMemory) and self.gpu is not None:
                    self.gpu.unmap(p, m.size)
                else:
                    host.unmap_to_reserved(p, m.size)
            except OSError as exc:
                raise InternalError(f"cannot unmap {p:#x}: {exc.strerror}") from None
            self._mappings.remove(p)
            m.alloc.maps -= 1
            self._maybe_destroy(m.alloc)

    def _location(self, loc: object, where: str, supported: Collection[int] = _ALL_LOCATIONS) -> Location:
        """An aclrtMemLocation: 107000 for a malformed one, 207000 for a kind outside `supported`."""
        ltype = check_int(f"{where}.type", field_of(loc, "type", where), 0, 0xFFFFFFFF)
        if ltype not in _ALL_LOCATIONS:
            raise InvalidParamError(f"{where}.type={ltype} is not an aclrtMemLocationType")
        if ltype not in supported:
            raise FeatureNotSupportedError(
                f"{where}.type={ltype} is not supported: use ACL_MEM_LOCATION_TYPE_DEVICE (1) or HOST (0)"
            )
        lid = field_of(loc, "id", where)
        if ltype == C.ACL_MEM_LOCATION_TYPE_DEVICE:
            return Location(ltype, self._device(lid))
        lid = check_int(f"{where}.id", lid, 0, (1 << 31) - 1)
        return Location(ltype, lid)

    def set_access(self, ptr: object, size: object, desc_list: object) -> None:
        p, n = check_ptr("ptr", ptr), check_int("size", size)
        if not isinstance(desc_list, (list, tuple)) or not desc_list:
            raise InvalidParamError("desc_list must be a non-empty list of {'flags': ..., 'location': {...}}")
        entries: list[tuple[Location, int]] = []
        for i, desc in enumerate(desc_list):
            flags = check_int(f"desc_list[{i}].flags", field_of(desc, "flags", f"desc_list[{i}]"), 0, 0xFFFFFFFF)
            if flags not in _ACCESS_PROT:
                raise InvalidParamError(f"desc_list[{i}].flags={flags}: use ACL_RT_MEM_ACCESS_FLAGS_* (0, 1, 3)")
            loc = self._location(field_of(desc, "location", f"desc_list[{i}]"), f"desc_list[{i}].location")
            entries.append((loc, flags))
        with self._lock:
            m = self._mappings.exact(p)
            if m is None or m.size != n:
                raise InvalidParamError(f"({p:#x}, {n}) is not exactly a mapping: pass map_mem's ptr and size")
            access = dict(m.access)
            access.update(entries)
            effective = access.get(m.alloc.prop.location, entries[-1][1])
            try:
                mem = m.alloc.mem
                if isinstance(mem, CudaMemory) and self.gpu is not None:
                    self.gpu.protect(p, n, effective, mem.device)
                else:
                    host.protect(p, n, _ACCESS_PROT[effective])
            except OSError as exc:
                raise InternalError(f"mprotect failed: {exc.strerror}") from None
            m.access, m.effective = access, effective

    def get_access(self, ptr: object, location: object) -> int:
        p = check_ptr("ptr", ptr)
        loc = self._location(location, "location")
        with self._lock:
            m = self._mapping_at(p)
            return m.access.get(loc, m.effective)

    def address_range(self, ptr: object) -> tuple[int, int]:
        p = check_ptr("ptr", ptr)
        with self._lock:
            m = self._mapping_at(p)
            return m.ptr, m.size

    # ------------------------------------------------------------ sharing

    def mem_info(self, attr: object) -> tuple[int, int]:
        check_int("attr", attr, 0, 17)
        return self.device_mem_info(self.current_device())

    def device_mem_info(self, device: int) -> tuple[int, int]:
        """(free, total) bytes of `device`: the GPU's, as its driver counts them, or the node's capacity."""
        d = self._device(device)
        if self.gpu is not None:
            return self.gpu.mem_info(d)
        return self.node.mem_info(d)

    def export(self, handle: object, flags: object, share_type: object, pids: object = ()) -> bytes:
        """Export an allocation made here: 8 little-endian bytes (DEFAULT) or the 128-byte FABRIC handle.

        `pids` go on the trustlist in the same round trip (what set_pids would add).
        """
        f = check_int("flags", flags, 0, U64)
        if f not in (C.ACL_RT_VMM_EXPORT_FLAG_DEFAULT, C.ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION):
            raise InvalidParamError(f"flags={f}: use ACL_RT_VMM_EXPORT_FLAG_DEFAULT (0) or DISABLE_PID_VALIDATION (1)")
        st = check_int("shareType", share_type, 0, 0xFFFFFFFF)
        if st not in (C.ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, C.ACL_MEM_SHARE_HANDLE_TYPE_FABRIC):
            raise InvalidParamError(f"shareType={st}: use ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT (1) or FABRIC (2)")
        trust = check_pids(pids, allow_empty=True)
        with self._lock:
            alloc = self.allocation(handle)
            if alloc.imported_from:
                raise InvalidParamError("an imported allocation cannot be exported again; the exporter owns it")
            if alloc.shareable:
                raise InvalidParamError(f"handle {alloc.handle:#x} was exported already; a handle exports once")
            mem = alloc.mem
            on_gpu = isinstance(mem, CudaMemory)
            if on_gpu and st == C.ACL_MEM_SHARE_HANDLE_TYPE_FABRIC and not self._told_fabric:
                self._told_fabric = True
                log.warning("FABRIC export of GPU memory: the handle is vmmshare's FABRIC format and the memory "
                            "travels as a POSIX fd through the node broker, not as a CUDA fabric handle (those "
                            "need an IMEX channel)")
            fd = self.gpu.export_fd(mem) if isinstance(mem, CudaMemory) and self.gpu else mem.fd
            alloc.shareable = self.node.export(alloc.token, fd, alloc.prop, alloc.size, f, st, trust, on_gpu)
            self._exported.add(self._shareable_value(alloc.shareable, st))
            return alloc.shareable

    def set_pids(self, shareable: bytes, share_type: int, pids: object) -> None:
        checked = check_pids(pids)
        value = self._shareable_value(shareable, share_type)
        self.node.set_pids(value, share_type, checked)

    def _shareable_value(self, shareable: bytes, share_type: int) -> int:
        if share_type == C.ACL_MEM_SHARE_HANDLE_TYPE_FABRIC:
            return handles.decode_fabric(shareable).handle
        return int.from_bytes(shareable, "little")

    def import_handle(self, shareable: bytes, share_type: int, device: int, flags: object = 0) -> int:
        check_int("flags", flags, 0, 0)
        secret = b""
        if share_type == C.ACL_MEM_SHARE_HANDLE_TYPE_FABRIC:
            fabric = handles.decode_fabric(shareable)
            if fabric.server_id != self.config.server_id:
                raise FeatureNotSupportedError(
                    f"this FABRIC handle comes from server {fabric.server_id:#x}, not this one "
                    f"({self.config.server_id:#x}); importing across servers needs the cross-server transport, "
                    "which is not configured"
                )
            value, secret = fabric.handle, fabric.secret
        else:
            value = int.from_bytes(shareable, "little")
            if value == 0:
                raise InvalidHandleError("shareable handle 0 is never valid")
        with self._lock:
            if value in self._imports:
                raise InvalidParamError(
                    "this shareable handle is imported in this process already: free_physical that import first"
                )
            if value in self._exported:
                raise InvalidParamError("this process exported the handle; use its own handle instead of importing")
            self._imports[value] = _PENDING
        try:
            got = self.node.import_handle(value, share_type, secret)
        except BaseException:
            with self._lock:
                self._imports.pop(value, None)
            raise
        prop = PhysicalProp(
            got.prop.handle_type,
            got.prop.allocation_type,
            got.prop.mem_attr,
            Location(got.prop.location.type, device) if got.prop.location.type == C.ACL_MEM_LOCATION_TYPE_DEVICE
            else got.prop.location,
        )
        try:
            mem = self._adopt(got, device)
        except BaseException:
            with self._lock:
                self._imports.pop(value, None)
            self._safe_node_call(self.node.release, got.token)
            raise
        alloc = Allocation(0, mem, prop, got.size, got.token, imported_from=value, shareable=shareable)
        with self._lock:
            self._imports[value] = alloc
            return self._register(alloc)

    def _adopt(self, got: Imported, device: int) -> host.HostMemory | CudaMemory:
        if not got.gpu:
            return host.adopt(got.fd, got.size)
        if self.gpu is None:
            os.close(got.fd)
            raise FeatureNotSupportedError(
                "this handle is GPU memory: import it in a process with VMMSHARE_BACKEND=cuda"
            )
        return self.gpu.adopt(got.fd, got.size, device)

    def bare_tgid(self) -> int:
        return self.node.bare_tgid()

    # ------------------------------------------------------------ process life

    def forget_after_fork(self) -> None:
        """In a forked child: drop the parent's tables (their mappings stay, harmlessly) and close inherited fds."""
        for alloc in self._allocs:
            if isinstance(alloc.mem, host.HostMemory):  # CUDA cannot be touched in a forked child
                with contextlib.suppress(OSError):
                    alloc.mem.close()
        self._reset_tables()  # not the GPU backend: CUDA cannot be initialised again in a forked child

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {
                "allocations": len(self._allocs),
                "handles": len(self._handles),
                "reservations": len(self._reservations),
                "mappings": len(self._mappings),
                "host_blocks": len(self._host_blocks),
                "streams": len(self._streams),
            }


_PENDING: Any = object()


def _process_range_ok(ptr: int, size: int, write: bool) -> bool:
    """Whether /proc/self/maps shows `[ptr, ptr+size)` readable (and writable when asked), end to end."""
    need = "w" if write else "r"
    end, cursor = ptr + size, ptr
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                span, perms = line.split(None, 2)[:2]
                lo_s, hi_s = span.split("-")
                lo, hi = int(lo_s, 16), int(hi_s, 16)
                if hi <= cursor:
                    continue
                if lo > cursor or need not in perms or "r" not in perms:
                    return False
                cursor = hi
                if cursor >= end:
                    return True
    except OSError:
        return False
    return False


def _gpu_backend(choice: str) -> CudaBackend | None:
    """The CUDA backend for VMMSHARE_BACKEND=cuda (errors if unusable) or auto (when a GPU is there)."""
    if choice == "host":
        return None
    try:
        return CudaBackend()
    except AclError as exc:
        if choice == "cuda":
            raise
        log.info("VMMSHARE_BACKEND=auto: no usable GPU (%s); device memory is host memory", exc.message)
        return None


def _share_type_of(shareable: bytes) -> int:
    """The share type of a handle this process exported, by its length (8 bytes DEFAULT, 128 FABRIC)."""
    return C.ACL_MEM_SHARE_HANDLE_TYPE_FABRIC if len(shareable) > 8 else C.ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT
