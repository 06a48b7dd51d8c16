"""CUDA backend: device-location allocations are real GPU memory, through cuda-python's driver bindings.

Physical memory comes from cuMemCreate (POSIX file-descriptor handles requested, so it can be shared),
reservations from cuMemAddressReserve, mappings from cuMemMap + cuMemSetAccess; a shareable export is
the fd from cuMemExportToShareableHandle, which the broker holds like a host memfd.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .. import constants as C
from ..errors import (
    AclError,
    FeatureNotSupportedError,
    InternalError,
    InvalidParamError,
    MemoryAllocationError,
)
from . import mman
from .base import Memory, MemoryKind

log = logging.getLogger(__name__)
_BOUNCE = 16 << 20  # bytes of the host buffer an overlapping copy goes through


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise FeatureNotSupportedError(
            f"VMMSHARE_BACKEND=cuda needs cuda-bindings: pip install 'vmmshare[cuda]' ({exc})"
        ) from None
    return driver


@dataclass
class CudaMemory:
    """A GPU physical allocation (CUmemGenericAllocationHandle) on `device`."""

    handle: Any
    size: int
    device: int
    backend: CudaBackend
    pages: str = "gpu"
    fd: int = -1  # exported POSIX fd, once exported

    def close(self) -> None:
        handle, fd = self.handle, self.fd
        self.handle, self.fd = None, -1
        try:
            if handle is not None:
                self.backend.check(self.backend.cu.cuMemRelease(handle)[0], "cuMemRelease")
        finally:
            if fd >= 0:
                os.close(fd)


class CudaBackend:
    """The process's view of the GPUs: contexts are the devices' primary contexts."""

    kind = MemoryKind.GPU
    name, on_gpu, remote, cpu_access = "GPU", True, False, False

    def __init__(self) -> None:
        self.cu = _driver()
        try:
            err, = self.cu.cuInit(0)
        except Exception as exc:  # no driver library at all
            raise FeatureNotSupportedError(f"no CUDA driver on this machine: {exc}") from None
        self.check(err, "cuInit")
        err, self.count = self.cu.cuDeviceGetCount()
        self.check(err, "cuDeviceGetCount")
        if self.count == 0:
            raise FeatureNotSupportedError("VMMSHARE_BACKEND=cuda but no GPU is visible")
        self._contexts: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._granularity: dict[int, int] = {}
        self.fd_type = self.cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR

    # ------------------------------------------------------------ plumbing

    def check(self, err: Any, what: str) -> None:
        """Raise the AclError that matches a CUresult."""
        if int(err) == 0:
            return
        cu = self.cu
        name = getattr(err, "name", str(err))
        message = f"{what} failed: {name}"
        if err in (cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY,):
            raise MemoryAllocationError(message)
        if err in (cu.CUresult.CUDA_ERROR_INVALID_VALUE, cu.CUresult.CUDA_ERROR_INVALID_HANDLE):
            raise InvalidParamError(message)
        if err in (cu.CUresult.CUDA_ERROR_NOT_SUPPORTED, cu.CUresult.CUDA_ERROR_NOT_PERMITTED):
            raise FeatureNotSupportedError(message)
        raise InternalError(message)

    @contextlib.contextmanager
    def on(self, device: int) -> Iterator[None]:
        """Run with `device`'s primary context current in this thread, then give back the one that was current.

        The driver is asked each time (nothing cached per thread), and another context is restored afterwards:
        other code in the thread (torch.cuda.set_device, cupy) keeps the device it chose. When none was current,
        ours stays, so the next call need not switch again.
        """
        ctx = self._context(device)
        err, previous = self.cu.cuCtxGetCurrent()
        self.check(err, "cuCtxGetCurrent")
        switch = int(previous) != int(ctx)
        if switch:
            self.check(self.cu.cuCtxSetCurrent(ctx)[0], "cuCtxSetCurrent")
        try:
            yield
        finally:
            if switch and int(previous):
                self.cu.cuCtxSetCurrent(previous)

    def _context(self, device: int) -> Any:
        """The primary context of `device` (retained once, kept for the process's life)."""
        ctx = self._contexts.get(device)
        if ctx is None:
            with self._lock:
                ctx = self._contexts.get(device)
                if ctx is None:
                    err, dev = self.cu.cuDeviceGet(device)
                    self.check(err, "cuDeviceGet")
                    err, ctx = self.cu.cuDevicePrimaryCtxRetain(dev)
                    self.check(err, "cuDevicePrimaryCtxRetain")
                    self._contexts[device] = ctx
        return ctx

    def _prop(self, device: int) -> Any:
        cu = self.cu
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        prop.requestedHandleTypes = self.fd_type
        return prop

    def granularity(self, device: int) -> int:
        """The driver's minimum granularity for `device` (asked once: every allocation checks it)."""
        g = self._granularity.get(device)
        if g is None:
            err, got = self.cu.cuMemGetAllocationGranularity(
                self._prop(device), self.cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
            )
            self.check(err, "cuMemGetAllocationGranularity")
            g = self._granularity[device] = int(got)
        return g

    def total_memory(self, device: int) -> int:
        err, dev = self.cu.cuDeviceGet(device)
        self.check(err, "cuDeviceGet")
        err, total = self.cu.cuDeviceTotalMem(dev)
        self.check(err, "cuDeviceTotalMem")
        return int(total)

    def can_access_peer(self, device: int, peer: int) -> bool:
        """Whether `device` can map and access memory that lives on `peer` (NVLink or PCIe peer-to-peer)."""
        err, can = self.cu.cuDeviceCanAccessPeer(device, peer)
        self.check(err, "cuDeviceCanAccessPeer")
        return bool(can)

    def mem_info(self, device: int) -> tuple[int, int]:
        """(free, total) bytes of the GPU, as its driver counts them (every process's allocations)."""
        with self.on(device):
            err, free, total = self.cu.cuMemGetInfo()
        self.check(err, "cuMemGetInfo")
        return int(free), int(total)

    # ------------------------------------------------------------ memory

    def allocate(self, size: int, device: int, huge_page: int = 0, numa_node: int | None = None) -> CudaMemory:
        """GPU memory of `size` bytes on `device` (the driver picks its pages; `huge_page` and `numa_node`, which
        only host memory has, do not apply)."""
        g = self.granularity(device)
        if size % g:
            raise InvalidParamError(f"size {size} is not a multiple of the GPU's granularity {g}")
        with self.on(device):
            err, handle = self.cu.cuMemCreate(size, self._prop(device), 0)
        self.check(err, "cuMemCreate")
        return CudaMemory(handle, size, device, self)

    def export_fd(self, mem: Memory) -> int:
        """The POSIX fd of an allocation (made once, on first export; the runtime exports once)."""
        assert isinstance(mem, CudaMemory)
        if mem.fd < 0:
            with self.on(mem.device):
                err, fd = self.cu.cuMemExportToShareableHandle(mem.handle, self.fd_type, 0)
            self.check(err, "cuMemExportToShareableHandle")
            mem.fd = int(fd)
        return mem.fd

    def adopt(self, fd: int, size: int, device: int) -> CudaMemory:
        """Import an exported fd (closed here either way). A fd the driver does not take is a bad handle (107000):
        the broker cannot look inside a GPU export, so this is where a forged one is caught."""
        try:
            with self.on(device):
                err, handle = self.cu.cuMemImportFromShareableHandle(fd, self.fd_type)
            if int(err) and err != self.cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                raise InvalidParamError(
                    f"cuMemImportFromShareableHandle failed: {getattr(err, 'name', err)} "
                    "(the exporter's fd is not a CUDA allocation this GPU can import)"
                )
            self.check(err, "cuMemImportFromShareableHandle")
        finally:
            os.close(fd)
        return CudaMemory(handle, size, device, self)

    def reserve(self, size: int, alignment: int, expect_ptr: int) -> int:
        err, ptr = self.cu.cuMemAddressReserve(size, alignment, expect_ptr, 0)
        self.check(err, "cuMemAddressReserve")
        if expect_ptr and int(ptr) != expect_ptr:
            self.cu.cuMemAddressFree(ptr, size)
            raise OSError(17, f"the GPU address range at {expect_ptr:#x} is not free")
        return int(ptr)

    def release(self, ptr: int, size: int) -> None:
        self.check(self.cu.cuMemAddressFree(ptr, size)[0], "cuMemAddressFree")

    def forget(self, mem: Memory) -> None:
        """Nothing: CUDA cannot be touched in a forked child."""

    def map(self, ptr: int, size: int, mem: Memory, access: int, prepopulate: bool = False) -> None:
        assert isinstance(mem, CudaMemory)
        with self.on(mem.device):
            self.check(self.cu.cuMemMap(ptr, size, 0, mem.handle, 0)[0], "cuMemMap")
            if access:
                try:
                    self.protect(ptr, size, access, mem.device)
                except AclError:
                    self.cu.cuMemUnmap(ptr, size)
                    raise

    def unmap(self, ptr: int, size: int) -> None:
        self.check(self.cu.cuMemUnmap(ptr, size)[0], "cuMemUnmap")

    def reserve_mapped(self, size: int, alignment: int, mem: Memory, access: int, prepopulate: bool) -> int:
        """A new GPU range with `mem` mapped over it (the driver reserves and maps in two calls)."""
        ptr = self.reserve(size, alignment, 0)
        try:
            self.map(ptr, size, mem, access, prepopulate)
        except BaseException:
            self.release(ptr, size)
            raise
        return ptr

    def release_mapped(self, ptr: int, size: int) -> None:
        """Unmap a range made by `reserve_mapped` and give it back."""
        self.unmap(ptr, size)
        self.release(ptr, size)

    def protect(self, ptr: int, size: int, access: int, device: int) -> None:
        cu = self.cu
        flags = {
            C.ACL_RT_MEM_ACCESS_FLAGS_NONE: cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_NONE,
            C.ACL_RT_MEM_ACCESS_FLAGS_READ: cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ,
            C.ACL_RT_MEM_ACCESS_FLAGS_READWRITE: cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        }[access]
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = device
        desc.flags = flags
        with self.on(device):
            self.check(cu.cuMemSetAccess(ptr, size, [desc], 1)[0], "cuMemSetAccess")

    def copy(self, dst: int, src: int, count: int, device: int) -> None:
        """A synchronous copy, as aclrtMemcpy is (cuMemcpy may return before a device-side copy is done); ranges
        that overlap (the driver's copies "may not") go through a host buffer, with memmove's bytes."""
        if dst == src:
            return
        with self.on(device):
            if dst < src + count and src < dst + count:
                self._overlapping_copy(dst, src, count)
            else:
                self.check(self.cu.cuMemcpy(dst, src, count)[0], "cuMemcpy")
            self.check(self.cu.cuCtxSynchronize()[0], "cuCtxSynchronize")

    def _overlapping_copy(self, dst: int, src: int, count: int) -> None:
        """Part by part through host memory, the last part first where dst lies above src (the context current)."""
        chunk = min(count, _BOUNCE)
        bounce = mman.map_anonymous(chunk)
        try:
            moved = 0
            while moved < count:
                k = min(chunk, count - moved)
                at = count - moved - k if src < dst else moved
                self.check(self.cu.cuMemcpy(bounce, src + at, k)[0], "cuMemcpy")
                self.check(self.cu.cuMemcpy(dst + at, bounce, k)[0], "cuMemcpy")
                moved += k
        finally:
            mman.unmap(bounce, chunk)

    def fill(self, ptr: int, value: int, count: int, device: int) -> None:
        """A synchronous memset, as aclrtMemset is (cuMemsetD8 is asynchronous for device memory)."""
        with self.on(device):
            self.check(self.cu.cuMemsetD8(ptr, value & 0xFF, count)[0], "cuMemsetD8")
            self.check(self.cu.cuCtxSynchronize()[0], "cuCtxSynchronize")


def available() -> bool:
    """Whether a CUDA driver and at least one GPU are usable here."""
    try:
        CudaBackend()
    except AclError:
        return False
    return True
