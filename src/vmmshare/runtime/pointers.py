"""What a pointer is (aclrtPointerGetAttributes), host memory registered for the device (aclrtHostRegister and its
kin) and batches of copies between host and device memory (aclrtMemcpyBatch).

A pointer's location is read from this process's tables: a mapping says its allocation's location (a device, or
host memory) and page size; a malloc_host block or a registered range is host memory; any other address is
ordinary host memory the runtime does not know, ACL_MEM_LOCATION_TYPE_UNREGISTERED, as the runtime reports memory
from the C library's malloc. Registration keeps the runtime's table of (host base, size) -> device pointer; on the
host backend the device sees host memory at its own address, so the device pointer is the host pointer.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import constants as C
from ..errors import AclError, FeatureNotSupportedError, InvalidParamError
from ..intervals import Intervals
from .copies import process_range_ok

if TYPE_CHECKING:
    from .copies import Copies
    from .shared import Shared
    from .vmm import Vmm

PAGE = mmap.PAGESIZE
MAX_BATCH = 4096  # the driver's DEVMM_MEMCPY_BATCH_MAX_COUNT
SIZE_MAX = (1 << 64) - 1  # failIndex when no copy failed
_REGISTER_FLAGS = C.ACL_HOST_REGISTER_IOMEMORY | C.ACL_HOST_REGISTER_READONLY


@dataclass(frozen=True)
class BatchAttr:
    """One aclrtMemcpyBatchAttr: where the copies it applies to go to and come from."""

    dst_type: int
    dst_id: int
    src_type: int
    src_id: int


class Pointers:
    """Pointer attributes, the host registration table and batched copies; the tables are read under the lock."""

    def __init__(self, s: Shared, memory: Vmm, copies: Copies) -> None:
        self.s, self.memory, self.copies = s, memory, copies
        self.registered: Intervals[int] = Intervals()  # host base -> its size

    # ------------------------------------------------------------ attributes

    def attributes(self, ptr: int) -> dict[str, Any]:
        """{"location": {"id", "type"}, "pageSize"} of `ptr`; a reserved range not mapped there is 107000."""
        ltype, lid, page = self._locate(ptr)
        return {"location": {"id": lid, "type": ltype}, "pageSize": page}

    def _locate(self, ptr: int) -> tuple[int, int, int]:
        with self.s.lock:
            hit = self.memory.mappings.at(ptr)
            if hit is not None:
                prop = hit[2].alloc.prop
                page = prop.huge_page or PAGE
                if prop.location.type == C.ACL_MEM_LOCATION_TYPE_DEVICE:
                    return C.ACL_MEM_LOCATION_TYPE_DEVICE, prop.location.id, page
                return C.ACL_MEM_LOCATION_TYPE_HOST, 0, page
            if self.memory.reservations.at(ptr) is not None:
                raise InvalidParamError(f"{ptr:#x} is reserved but not mapped: it has no memory to describe")
            if self.copies.host_blocks.at(ptr) is not None or self.registered.at(ptr) is not None:
                return C.ACL_MEM_LOCATION_TYPE_HOST, 0, PAGE
        return C.ACL_MEM_LOCATION_TYPE_UNREGISTERED, 0, PAGE

    # ------------------------------------------------------------ host registration

    def register(self, ptr: int, size: int, flags: int) -> int:
        """Register `[ptr, ptr+size)` for the current device; returns the device's pointer to it."""
        if flags & ~_REGISTER_FLAGS:
            raise FeatureNotSupportedError(f"type={flags:#x} is not supported: use ACL_HOST_REGISTER_MAPPED (0), "
                                           "or IOMEMORY (0x4) and READONLY (0x8) combined")
        self.s.devices.current()
        if not self.s.device_backend.cpu_access:
            raise FeatureNotSupportedError("the CUDA backend's GPUs do not map registered host memory: use "
                                           "malloc_host memory and copies")
        write = not flags & C.ACL_HOST_REGISTER_READONLY
        if size > SIZE_MAX - ptr or not process_range_ok(ptr, size, write):
            raise InvalidParamError(f"{ptr:#x}+{size} is not {'writable' if write else 'readable'} memory of this "
                                    "process")
        with self.s.lock:
            if self.registered.overlaps(ptr, size):
                raise AclError(f"{ptr:#x}+{size} overlaps a range registered already: host_unregister it first",
                               C.ACL_ERROR_HOST_MEMORY_ALREADY_REGISTERED)
            self.registered.add(ptr, size, size)
        return ptr

    def unregister(self, ptr: int) -> None:
        """Forget the registration that starts at `ptr` (507911 if none does)."""
        self.s.devices.current()
        with self.s.lock:
            if self.registered.exact(ptr) is None:
                raise AclError(f"{ptr:#x} is not the start of a registered host range",
                               C.ACL_ERROR_HOST_MEMORY_NOT_REGISTERED)
            self.registered.remove(ptr)

    def device_pointer(self, ptr: int) -> int:
        """The device pointer of the registration that starts at `ptr` (107000 if none does)."""
        self.s.devices.current()
        with self.s.lock:
            if self.registered.exact(ptr) is None:
                raise InvalidParamError(f"{ptr:#x} has not been registered for device address mapping (pass the "
                                        "pointer host_register took)")
        return ptr

    # ------------------------------------------------------------ batched copies

    def memcpy_batch(self, dsts: list[int], srcs: list[int], sizes: list[int], attrs: list[BatchAttr],
                     indexes: list[int]) -> None:
        """Check every pair against its attribute (host to device or device to host only), then copy them in
        order. A failure names its pair by raising `BatchError`."""
        count = len(sizes)
        if not attrs:
            raise InvalidParamError("numAttrs is 0")
        if len(attrs) > count:
            raise InvalidParamError(f"numAttrs {len(attrs)} must be less than or equal to count {count}")
        if count > MAX_BATCH:
            raise InvalidParamError(f"count {count} must be less than or equal to {MAX_BATCH}")
        if indexes[0] != 0:
            raise InvalidParamError(f"attrsIndexes[0] is {indexes[0]}: it must be 0")
        for i in range(1, len(attrs)):
            if indexes[i] <= indexes[i - 1]:
                raise InvalidParamError(f"attrsIndexes[{i}] ({indexes[i]}) must be greater than attrsIndexes[{i - 1}]")
            if indexes[i] >= count:
                raise InvalidParamError(f"attrsIndexes[{i}] ({indexes[i]}) must be less than count {count}")
        which = 0
        for i in range(count):
            if which + 1 < len(attrs) and i >= indexes[which + 1]:
                which += 1
            try:
                self._check_pair(dsts[i], srcs[i], attrs[which])
            except AclError as exc:
                raise BatchError(i, exc) from None
        for i in range(count):
            if sizes[i] == 0:
                continue
            try:
                self.copies.memcpy(dsts[i], sizes[i], srcs[i], sizes[i], C.ACL_MEMCPY_DEFAULT)
            except AclError as exc:
                raise BatchError(i, exc) from None

    def _check_pair(self, dst: int, src: int, attr: BatchAttr) -> None:
        dtype, did = self._side(dst, "dst", attr.dst_type, attr.dst_id)
        stype, _ = self._side(src, "src", attr.src_type, attr.src_id)
        if dtype == stype:
            names = {C.ACL_MEM_LOCATION_TYPE_HOST: "host", C.ACL_MEM_LOCATION_TYPE_DEVICE: "device"}
            raise InvalidParamError(f"only host-to-device and device-to-host copies are batched; this one is "
                                    f"{names.get(stype, stype)} to {names.get(dtype, dtype)} (device {did})")

    def _side(self, ptr: int, name: str, want_type: int, want_id: int) -> tuple[int, int]:
        """The side's actual location (unregistered host memory counts as host) checked against its attribute."""
        ltype, lid, _ = self._locate(ptr)
        if ltype == C.ACL_MEM_LOCATION_TYPE_UNREGISTERED:
            ltype = C.ACL_MEM_LOCATION_TYPE_HOST
        want = C.ACL_MEM_LOCATION_TYPE_HOST if want_type == C.ACL_MEM_LOCATION_TYPE_HOST_NUMA else want_type
        if ltype != want or (ltype == C.ACL_MEM_LOCATION_TYPE_DEVICE and lid != want_id):
            raise InvalidParamError(f"{name} {ptr:#x} is {_where(ltype, lid)} memory, but its attribute says "
                                    f"{_where(want, want_id)}")
        return ltype, lid


class BatchError(AclError):
    """A batched copy's failure, with the index of the pair it belongs to (aclrtMemcpyBatch's failIndex)."""

    def __init__(self, index: int, cause: AclError) -> None:
        super().__init__(f"pair {index}: {cause.message}", cause.code)
        self.index = index


def _where(ltype: int, lid: int) -> str:
    if ltype == C.ACL_MEM_LOCATION_TYPE_DEVICE:
        return f"device {lid}"
    return "host" if ltype == C.ACL_MEM_LOCATION_TYPE_HOST else f"location type {ltype}"
