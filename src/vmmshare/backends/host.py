"""Host backend: one sealed memfd per physical allocation, mapped with mmap into PROT_NONE reservations.

Reservations and mappings are made through mman.py, in the arena it places them in.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from .. import constants as C
from ..errors import FeatureNotSupportedError, InvalidParamError
from .base import Memory, MemoryKind
from .mman import (
    MAP_SHARED,
    PROT_NONE,
    PROT_READ,
    PROT_WRITE,
    Arena,
    advise_huge,
    libc,
    map_shared,
    mmap_call,
    oserror,
    populate,
    protect,
    unmap_to_reserved,
)

log = logging.getLogger(__name__)

MFD_HUGE_SHIFT = 26
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL  # what the broker wants of an export


def _read_first_line(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def hugetlb_free_bytes(page_size: int) -> int:
    """Bytes of free, unreserved huge pages of `page_size` in the kernel's pool."""
    base = f"/sys/kernel/mm/hugepages/hugepages-{page_size // 1024}kB"
    free = _read_first_line(f"{base}/free_hugepages")
    resv = _read_first_line(f"{base}/resv_hugepages")
    if not free:
        return 0
    return max(0, int(free) - int(resv or 0)) * page_size


def shmem_thp_mode() -> str:
    """The bracketed value of /sys/kernel/mm/transparent_hugepage/shmem_enabled ("never" when absent)."""
    text = _read_first_line("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "never"


@dataclass
class HostMemory:
    """A physical allocation: the memfd that holds it and how its pages are backed."""

    fd: int
    size: int
    pages: str  # "hugetlb-2M", "hugetlb-1G", "thp" or "normal"

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def allocate(size: int, huge_page: int = 0, name: str = "vmmshare", hugetlb: bool = True) -> HostMemory:
    """A memfd of `size` bytes, sealed so that nobody (an importer included) can shrink or grow it; `huge_page`
    (2 MiB or 1 GiB) asks for huge pages when the pool allows (hugetlb pages only with `hugetlb`).

    Never fails for lack of huge pages: it falls back to transparent huge pages, then to normal pages.
    """
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    pages = "normal"
    if hugetlb and huge_page and size % huge_page == 0 and hugetlb_free_bytes(huge_page) >= size:
        flags |= os.MFD_HUGETLB | ((huge_page.bit_length() - 1) << MFD_HUGE_SHIFT)
        pages = f"hugetlb-{'1G' if huge_page >= 1 << 30 else '2M'}"
    elif huge_page and shmem_thp_mode() in ("always", "within_size", "advise", "force"):
        pages = "thp"
    fd = os.memfd_create(name, flags)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS)
    except OSError as exc:
        os.close(fd)
        if flags & os.MFD_HUGETLB and exc.errno in (errno.EINVAL, errno.EPERM):
            # a kernel whose hugetlbfs memfds take no size seals (before 4.16): an importer could then truncate
            # the file under every other mapping of it, so such memory is made of ordinary pages instead
            log.debug("hugetlb memfd refused its size seals (%s): using ordinary pages", exc)
            return allocate(size, huge_page, name, hugetlb=False)
        raise
    except BaseException:
        os.close(fd)
        raise
    return HostMemory(fd, size, pages)


# ---------------------------------------------------------------- NUMA nodes

NUMA_SYSFS = "/sys/devices/system/node"  # where the kernel lists the NUMA nodes (a test may point it elsewhere)
MPOL_BIND = 2
_MBIND_SYSCALL = {"x86_64": 237, "aarch64": 235, "riscv64": 235, "ppc64le": 259, "ppc64": 259, "s390x": 268}
_MASK_WORDS = 64  # node mask of 4096 bits, the kernel's largest MAX_NUMNODES


def parse_node_list(text: str) -> list[int]:
    """The kernel's node list format ("0", "0-3,6") as sorted ids; ValueError when it is not one."""
    nodes: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi or lo)
        if first < 0 or last < first or last >= _MASK_WORDS * 64:
            raise ValueError(f"bad node range {part!r}")
        nodes.update(range(first, last + 1))
    return sorted(nodes)


def numa_nodes(root: str | None = None) -> list[int]:
    """The NUMA nodes of this machine with memory online (`<root>/online`); [0] on a kernel without NUMA."""
    base = Path(root or NUMA_SYSFS)
    try:
        return parse_node_list((base / "online").read_text()) or [0]
    except (OSError, ValueError):
        return [0]


def bind_numa(fd: int, size: int, node: int) -> None:
    """Bind every page of the shared memory object `fd` to NUMA `node` (OSError when the kernel refuses).

    mbind on a shared mapping of a memfd sets the object's own shared policy: it stays with the object after this
    temporary mapping goes, and every later fault in any process that maps it allocates on `node`.
    """
    nr = _MBIND_SYSCALL.get(platform.machine())
    if nr is None:
        raise OSError(errno.ENOSYS, f"mbind: no system call number known for {platform.machine()}")
    if not 0 <= node < _MASK_WORDS * 64:
        raise OSError(errno.EINVAL, f"mbind: node {node} is beyond the kernel's node mask")
    mask = (ctypes.c_ulong * _MASK_WORDS)()
    mask[node // 64] = 1 << (node % 64)
    addr = mmap_call(0, size, PROT_NONE, MAP_SHARED, fd)
    try:
        rc = libc.syscall(ctypes.c_long(nr), ctypes.c_void_p(addr), ctypes.c_ulong(size), ctypes.c_int(MPOL_BIND),
                           mask, ctypes.c_ulong(_MASK_WORDS * 64 + 1), ctypes.c_uint(0))
        if rc != 0:
            raise oserror(f"mbind(node {node})")
    finally:
        libc.munmap(addr, size)


def adopt(fd: int, size: int, pages: str = "normal") -> HostMemory:
    """Wrap an imported memfd of `size` bytes (the broker checked the file's size when it was exported)."""
    return HostMemory(fd, size, pages)


ACCESS_PROT = {
    C.ACL_RT_MEM_ACCESS_FLAGS_NONE: PROT_NONE,
    C.ACL_RT_MEM_ACCESS_FLAGS_READ: PROT_READ,
    C.ACL_RT_MEM_ACCESS_FLAGS_READWRITE: PROT_READ | PROT_WRITE,
}


class HostBackend:
    """Host memory: memfds mapped into reservations of the arena; the CPU copies."""

    kind = MemoryKind.HOST
    name, on_gpu, remote, cpu_access = "host", False, False, True

    def __init__(self) -> None:
        self.arena = Arena()

    def granularity(self, device: int) -> int:
        return C.MIN_GRANULARITY

    def mem_info(self, device: int) -> tuple[int, int] | None:
        return None  # the node's capacity, as the broker accounts it

    def allocate(self, size: int, device: int, huge_page: int, numa_node: int | None = None) -> HostMemory:
        """A memfd; on `numa_node` when given (then without hugetlb pages, whose policy would not outlive the
        binding's own mapping: transparent huge pages or normal pages keep it)."""
        if numa_node is None:
            return allocate(size, huge_page, f"vmmshare:{'dev' if device >= 0 else 'host'}{max(device, 0)}")
        mem = allocate(size, huge_page, f"vmmshare:numa{numa_node}", hugetlb=False)
        try:
            bind_numa(mem.fd, size, numa_node)
        except OSError as exc:
            if exc.errno == errno.ENOSYS and numa_nodes() == [0]:  # no NUMA here: node 0 is all the memory there is
                return mem
            mem.close()
            if exc.errno == errno.ENOSYS:
                raise FeatureNotSupportedError(f"cannot bind memory to NUMA node {numa_node}: {exc.strerror}") from None
            raise InvalidParamError(
                f"cannot bind memory to NUMA node {numa_node}: {exc.strerror} (the kernel lists nodes "
                f"{numa_nodes()}; this process's cpuset may not allow that one)"
            ) from None
        return mem

    def adopt(self, fd: int, size: int, device: int) -> HostMemory:
        return HostMemory(fd, size, "normal")  # (`adopt`'s)

    def export_fd(self, mem: Memory) -> int:
        assert isinstance(mem, HostMemory)
        return mem.fd

    def forget(self, mem: Memory) -> None:
        mem.close()

    def reserve(self, size: int, alignment: int, expect_ptr: int) -> int:
        return self.arena.reserve(size, alignment, expect_ptr)

    def release(self, ptr: int, size: int) -> None:
        self.arena.release(ptr, size)

    def map(self, ptr: int, size: int, mem: Memory, access: int, prepopulate: bool) -> None:
        assert isinstance(mem, HostMemory)
        map_shared(ptr, size, mem.fd, ACCESS_PROT[access])
        self._advise(ptr, size, mem, access, prepopulate)

    def reserve_mapped(self, size: int, alignment: int, mem: Memory, access: int, prepopulate: bool) -> int:
        """A new range with `mem` mapped over it: reserve and map in one system call."""
        assert isinstance(mem, HostMemory)
        ptr = self.arena.reserve(size, alignment, 0, mem.fd, ACCESS_PROT[access])
        if mem.pages == "thp" or (access and prepopulate):
            self._advise(ptr, size, mem, access, prepopulate)
        return ptr

    def release_mapped(self, ptr: int, size: int) -> None:
        """Give back a range made by `reserve_mapped`: one munmap drops the mapping with the reservation."""
        self.arena.release(ptr, size)

    @staticmethod
    def _advise(ptr: int, size: int, mem: HostMemory, access: int, prepopulate: bool) -> None:
        if mem.pages == "thp":
            advise_huge(ptr, size)
        if access and prepopulate:
            populate(ptr, size)

    def unmap(self, ptr: int, size: int) -> None:
        unmap_to_reserved(ptr, size)

    def protect(self, ptr: int, size: int, access: int, device: int) -> None:
        protect(ptr, size, ACCESS_PROT[access])

    def copy(self, dst: int, src: int, count: int, device: int) -> None:
        ctypes.memmove(dst, src, count)

    def fill(self, ptr: int, value: int, count: int, device: int) -> None:
        ctypes.memset(ptr, value & 0xFF, count)
