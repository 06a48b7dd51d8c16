"""Host backend: one sealed memfd per physical allocation, mapped with mmap into PROT_NONE reservations.

Reservations are placed in a fixed arena (16 TiB to 24 TiB, as on the real runtime) so that the same
virtual address is usually free in every process and `expect_ptr` can be honoured.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import fcntl
import logging
import mmap as _mmap
import os
import platform
import threading
from dataclasses import dataclass
from pathlib import Path

from .. import constants as C
from ..errors import FeatureNotSupportedError, InvalidParamError
from .base import Memory, MemoryKind

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.restype = ctypes.c_int
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.syscall.restype = ctypes.c_long

PROT_NONE = _mmap.PROT_NONE if hasattr(_mmap, "PROT_NONE") else 0
PROT_READ = _mmap.PROT_READ
PROT_WRITE = _mmap.PROT_WRITE
MAP_SHARED = _mmap.MAP_SHARED
MAP_PRIVATE = _mmap.MAP_PRIVATE
MAP_ANONYMOUS = _mmap.MAP_ANONYMOUS
MAP_FIXED = 0x10
MAP_NORESERVE = 0x4000
MAP_FIXED_NOREPLACE = 0x100000
MADV_HUGEPAGE = 14
MADV_POPULATE_READ = 22
MFD_HUGE_SHIFT = 26
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL  # what the broker wants of an export
MAP_FAILED = ctypes.c_void_p(-1).value

ARENA_START = 16 << 40
ARENA_END = 24 << 40

_RESERVE_FLAGS = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE


def _oserror(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def _mmap_call(addr: int, size: int, prot: int, flags: int, fd: int = -1) -> int:
    ptr = _libc.mmap(addr, size, prot, flags, fd, 0)
    if ptr is None or ptr == MAP_FAILED:
        raise _oserror("mmap")
    return int(ptr)


def map_anonymous(size: int) -> int:
    """Private read-write memory of `size` bytes (aclrtMallocHost's)."""
    return _mmap_call(0, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS)


def unmap(addr: int, size: int) -> None:
    if _libc.munmap(addr, size) != 0:
        raise _oserror("munmap")


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
    addr = _mmap_call(0, size, PROT_NONE, MAP_SHARED, fd)
    try:
        rc = _libc.syscall(ctypes.c_long(nr), ctypes.c_void_p(addr), ctypes.c_ulong(size), ctypes.c_int(MPOL_BIND),
                           mask, ctypes.c_ulong(_MASK_WORDS * 64 + 1), ctypes.c_uint(0))
        if rc != 0:
            raise _oserror(f"mbind(node {node})")
    finally:
        _libc.munmap(addr, size)


def adopt(fd: int, size: int, pages: str = "normal") -> HostMemory:
    """Wrap an imported memfd of `size` bytes (the broker checked the file's size when it was exported)."""
    return HostMemory(fd, size, pages)


class Arena:
    """Placement of reservations inside [ARENA_START, ARENA_END), first fit, thread-safe."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._lock = threading.Lock()

    def reserve(self, size: int, alignment: int, expect_ptr: int = 0) -> int:
        """Reserve `size` bytes (inaccessible, nothing committed); at `expect_ptr` exactly when non-zero."""
        with self._lock:
            if expect_ptr:
                ptr = self._try(expect_ptr, size)
                if ptr is None:
                    raise OSError(errno.EEXIST, f"the range at {expect_ptr:#x} of {size:#x} bytes is in use")
                return ptr
            addr = ARENA_START
            tries = 0
            while addr + size <= ARENA_END and tries < 4096:
                i = bisect.bisect_right(self._starts, addr)
                if i > 0 and self._ends[i - 1] > addr:  # inside one of ours: skip past it
                    addr = _align_up(self._ends[i - 1], alignment)
                    continue
                if i < len(self._starts) and self._starts[i] < addr + size:
                    addr = _align_up(self._ends[i], alignment)
                    continue
                tries += 1
                ptr = self._try(addr, size)
                if ptr is not None:
                    return ptr
                addr += _align_up(size, alignment)  # something foreign is there: move on
            # the arena is full or foreign: let the kernel choose, aligned by over-reserving
            return self._anywhere(size, alignment)

    def _try(self, addr: int, size: int) -> int | None:
        ptr = _libc.mmap(addr, size, PROT_NONE, _RESERVE_FLAGS | MAP_FIXED_NOREPLACE, -1, 0)
        if ptr is None or ptr == MAP_FAILED:
            if ctypes.get_errno() == errno.EEXIST:
                return None
            raise _oserror("mmap(reserve)")
        if ptr != addr:  # very old kernels ignore MAP_FIXED_NOREPLACE and treat it as a hint
            _libc.munmap(ptr, size)
            return None
        self._add(addr, size)
        return addr

    def _anywhere(self, size: int, alignment: int) -> int:
        raw = _mmap_call(0, size + alignment, PROT_NONE, _RESERVE_FLAGS)
        ptr = _align_up(raw, alignment)
        if ptr > raw:
            _libc.munmap(raw, ptr - raw)
        tail = raw + size + alignment - (ptr + size)
        if tail:
            _libc.munmap(ptr + size, tail)
        self._add(ptr, size)
        return ptr

    def _add(self, addr: int, size: int) -> None:
        i = bisect.bisect_left(self._starts, addr)
        self._starts.insert(i, addr)
        self._ends.insert(i, addr + size)

    def release(self, addr: int, size: int) -> None:
        """Give a reservation back to the system."""
        with self._lock:
            unmap(addr, size)
            i = bisect.bisect_left(self._starts, addr)
            if i < len(self._starts) and self._starts[i] == addr:
                del self._starts[i]
                del self._ends[i]


def _align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def map_shared(addr: int, size: int, fd: int, prot: int) -> None:
    """Map `fd` over the reserved `[addr, addr+size)` (MAP_SHARED | MAP_FIXED)."""
    _mmap_call(addr, size, prot, MAP_SHARED | MAP_FIXED, fd)


def map_file(fd: int, size: int) -> int:
    """A shared read-write mapping of the first `size` bytes of `fd`, placed by the kernel (a broker serving an
    export to other servers holds one)."""
    return _mmap_call(0, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd)


def unmap_to_reserved(addr: int, size: int) -> None:
    """Replace a mapping by a fresh reservation, atomically, so the hole stays ours."""
    _mmap_call(addr, size, PROT_NONE, _RESERVE_FLAGS | MAP_FIXED)


def protect(addr: int, size: int, prot: int) -> None:
    if _libc.mprotect(addr, size, prot) != 0:
        raise _oserror("mprotect")


def advise_huge(addr: int, size: int) -> bool:
    """Ask for transparent huge pages on a mapping; False where the kernel says no."""
    return bool(_libc.madvise(addr, size, MADV_HUGEPAGE) == 0)


def populate(addr: int, size: int) -> bool:
    """Map every page of a mapping now (MADV_POPULATE_READ), False where unsupported (Linux < 5.14).

    Read-populating a shared mapping also leaves its pages writable without another fault, and costs
    less than MADV_POPULATE_WRITE, which dirties every page (measured: 22 ms against 53 ms for 256 MiB).
    """
    return bool(_libc.madvise(addr, size, MADV_POPULATE_READ) == 0)


ACCESS_PROT = {
    C.ACL_RT_MEM_ACCESS_FLAGS_NONE: PROT_NONE,
    C.ACL_RT_MEM_ACCESS_FLAGS_READ: PROT_READ,
    C.ACL_RT_MEM_ACCESS_FLAGS_READWRITE: PROT_READ | PROT_WRITE,
}


class HostBackend:
    """Host memory: memfds mapped into reservations of the arena; the CPU copies."""

    kind = MemoryKind.HOST

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
        return adopt(fd, size)

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
