"""The process's address space through libc: mmap, munmap, mprotect, madvise, and the arena reservations live in.

Reservations are placed in a fixed arena (16 TiB to 24 TiB, as on the real runtime) so that the same virtual address
is usually free in every process and `expect_ptr` can be honoured.
"""

from __future__ import annotations

import ctypes
import errno
import mmap as _mmap
import os
import threading
from bisect import bisect_left, bisect_right

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.restype = ctypes.c_int
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.mprotect.restype = ctypes.c_int
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.madvise.restype = ctypes.c_int
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.syscall.restype = ctypes.c_long

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
MAP_FAILED = ctypes.c_void_p(-1).value

ARENA_START = 16 << 40
ARENA_END = 24 << 40

_RESERVE_FLAGS = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE


def oserror(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def mmap_call(addr: int, size: int, prot: int, flags: int, fd: int = -1) -> int:
    ptr = libc.mmap(addr, size, prot, flags, fd, 0)
    if ptr is None or ptr == MAP_FAILED:
        raise oserror("mmap")
    return int(ptr)


def map_anonymous(size: int) -> int:
    """Private read-write memory of `size` bytes (aclrtMallocHost's)."""
    return mmap_call(0, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS)


def unmap(addr: int, size: int) -> None:
    if libc.munmap(addr, size) != 0:
        raise oserror("munmap")


class Arena:
    """Placement of reservations inside [ARENA_START, ARENA_END), first fit, thread-safe."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._lock = threading.Lock()

    def reserve(self, size: int, alignment: int, expect_ptr: int = 0, fd: int = -1, prot: int = PROT_NONE) -> int:
        """Reserve `size` bytes (inaccessible, nothing committed); at `expect_ptr` exactly when non-zero.

        With `fd`, the range is that file mapped shared with `prot` instead, reserved and mapped in one call.
        """
        with self._lock:
            starts, ends = self._starts, self._ends
            if expect_ptr:
                if not self._try(expect_ptr, size, fd, prot):
                    raise OSError(errno.EEXIST, f"the range at {expect_ptr:#x} of {size:#x} bytes is in use")
                self._add(expect_ptr, size)
                return expect_ptr
            addr = ARENA_START
            tries = 0
            while addr + size <= ARENA_END and tries < 4096:
                i = bisect_right(starts, addr)
                if i > 0 and ends[i - 1] > addr:  # inside one of ours: skip past it
                    addr = _align_up(ends[i - 1], alignment)
                    continue
                if i < len(starts) and starts[i] < addr + size:
                    addr = _align_up(ends[i], alignment)
                    continue
                tries += 1
                if self._try(addr, size, fd, prot):
                    starts.insert(i, addr)  # (where `_add` would put it: no start of ours is `addr`)
                    ends.insert(i, addr + size)
                    return addr
                addr += _align_up(size, alignment)  # something foreign is there: move on
            # the arena is full or foreign: let the kernel choose, aligned by over-reserving
            return self._anywhere(size, alignment, fd, prot)

    @staticmethod
    def _try(addr: int, size: int, fd: int, prot: int) -> bool:
        """Map `size` bytes at `addr` exactly (not yet recorded: the caller adds it); False where something is."""
        flags = (MAP_SHARED if fd >= 0 else _RESERVE_FLAGS) | MAP_FIXED_NOREPLACE
        ptr = libc.mmap(addr, size, prot, flags, fd, 0)
        if ptr is None or ptr == MAP_FAILED:
            if ctypes.get_errno() == errno.EEXIST:
                return False
            raise oserror("mmap(reserve)")
        if ptr != addr:  # very old kernels ignore MAP_FIXED_NOREPLACE and treat it as a hint
            libc.munmap(ptr, size)
            return False
        return True

    def _anywhere(self, size: int, alignment: int, fd: int, prot: int) -> int:
        raw = mmap_call(0, size + alignment, PROT_NONE, _RESERVE_FLAGS)
        ptr = _align_up(raw, alignment)
        if ptr > raw:
            libc.munmap(raw, ptr - raw)
        tail = raw + size + alignment - (ptr + size)
        if tail:
            libc.munmap(ptr + size, tail)
        if fd >= 0:
            try:
                map_shared(ptr, size, fd, prot)
            except OSError:
                libc.munmap(ptr, size)
                raise
        self._add(ptr, size)
        return ptr

    def _add(self, addr: int, size: int) -> None:
        i = bisect_left(self._starts, addr)
        self._starts.insert(i, addr)
        self._ends.insert(i, addr + size)

    def release(self, addr: int, size: int) -> None:
        """Give a reservation back to the system."""
        with self._lock:
            if libc.munmap(addr, size) != 0:  # (`unmap`)
                raise oserror("munmap")
            starts = self._starts
            i = bisect_left(starts, addr)
            if i < len(starts) and starts[i] == addr:
                del starts[i], self._ends[i]


def _align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def map_shared(addr: int, size: int, fd: int, prot: int) -> None:
    """Map `fd` over the reserved `[addr, addr+size)` (MAP_SHARED | MAP_FIXED)."""
    mmap_call(addr, size, prot, MAP_SHARED | MAP_FIXED, fd)


def map_file(fd: int, size: int) -> int:
    """A shared read-write mapping of the first `size` bytes of `fd`, placed by the kernel (a broker serving an
    export to other servers holds one)."""
    return mmap_call(0, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd)


def unmap_to_reserved(addr: int, size: int) -> None:
    """Replace a mapping by a fresh reservation, atomically, so the hole stays ours."""
    mmap_call(addr, size, PROT_NONE, _RESERVE_FLAGS | MAP_FIXED)


def protect(addr: int, size: int, prot: int) -> None:
    if libc.mprotect(addr, size, prot) != 0:
        raise oserror("mprotect")


def advise_huge(addr: int, size: int) -> bool:
    """Ask for transparent huge pages on a mapping; False where the kernel says no."""
    return bool(libc.madvise(addr, size, MADV_HUGEPAGE) == 0)


def populate(addr: int, size: int) -> bool:
    """Map every page of a mapping now (MADV_POPULATE_READ), False where unsupported (Linux < 5.14).

    Read-populating a shared mapping also leaves its pages writable without another fault, and costs
    less than MADV_POPULATE_WRITE, which dirties every page (measured: 22 ms against 53 ms for 256 MiB).
    """
    return bool(libc.madvise(addr, size, MADV_POPULATE_READ) == 0)
