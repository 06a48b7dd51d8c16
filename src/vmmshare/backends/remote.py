"""Remote backend: memory of another server, imported through the cross-server transport (SPEC §8). Copy-only.

The memory stays on its server, served by that node's transfer engine. A mapping of it only records which range of
this process stands for it: the range stays reserved and inaccessible, because the CPU cannot load or store across
servers. Copies and fills whose source or destination lies in it become one-sided engine reads and writes (local
memory to and from remote memory), bounds-checked here first: the engine answers an address outside the served
memory by dropping the connection. A remote-to-remote copy goes through a bounce buffer.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .. import constants as C
from ..errors import FeatureNotSupportedError, InvalidParamError
from ..intervals import Intervals
from . import mman
from .base import Memory, MemoryKind

BOUNCE = 16 << 20  # bytes of the bounce buffer (remote to remote, and fills)
NO_CPU_ACCESS = ("it is memory of another server, reached through the cross-server transport: the CPU cannot load "
                 "or store it; copy it to local memory with memcpy (or the read and write calls) instead")


class Transfers(Protocol):
    """One-sided transfers to and from memory another server serves (the transfer engine of this process)."""

    def read(self, segment: str, local: int, remote: int, size: int) -> None: ...
    def write(self, segment: str, local: int, remote: int, size: int) -> None: ...


@dataclass
class RemoteMemory:
    """An import of another server's memory: where its engine serves it."""

    segment: str  # the serving engine, "<address>:<port>"
    address: int  # the memory's address there
    size: int
    pages: str = "remote"

    def close(self) -> None:
        """Nothing here to free: the node's release of the import ends it on its server."""


class RemoteBackend:
    """Copies to and from memory of other servers; reservations are the host's (and stay inaccessible)."""

    kind = MemoryKind.REMOTE
    name, on_gpu, remote, cpu_access = "remote", False, True, False

    def __init__(self, transfers: Callable[[], Transfers]) -> None:
        self._transfers = transfers  # this process's engine, made on first use
        self._mapped: Intervals[RemoteMemory] = Intervals()  # the runtime's lock is held around every use
        self._bounce = 0
        self._bounce_lock = threading.Lock()

    def engine(self) -> Transfers:
        """This process's engine, asked for at each copy: a forked child gets its own, and a process whose broker
        restarted one made with the new broker's metadata URL (the node's answer is kept, so this costs a lock)."""
        return self._transfers()

    def granularity(self, device: int) -> int:
        return C.MIN_GRANULARITY

    def mem_info(self, device: int) -> tuple[int, int] | None:
        return None

    def allocate(self, size: int, device: int, huge_page: int, numa_node: int | None = None) -> Memory:
        raise FeatureNotSupportedError("memory of another server is imported, never allocated here")

    def adopt(self, fd: int, size: int, device: int) -> Memory:
        raise FeatureNotSupportedError("memory of another server comes without a file descriptor")

    def adopt_remote(self, segment: str, address: int, size: int) -> RemoteMemory:
        return RemoteMemory(segment, address, size)

    def export_fd(self, mem: Memory) -> int:
        raise InvalidParamError("memory of another server cannot be exported again; its exporter owns it")

    def forget(self, mem: Memory) -> None:
        pass

    def reserve(self, size: int, alignment: int, expect_ptr: int) -> int:
        raise FeatureNotSupportedError("reserve ranges for memory of another server with reserve_mem_address")

    def release(self, ptr: int, size: int) -> None:
        raise FeatureNotSupportedError("memory of another server holds no reservation of its own")

    def reserve_mapped(self, size: int, alignment: int, mem: Memory, access: int, prepopulate: bool) -> int:
        raise FeatureNotSupportedError("memory of another server is mapped into a host reservation")

    def release_mapped(self, ptr: int, size: int) -> None:
        raise FeatureNotSupportedError("memory of another server holds no reservation of its own")

    def map(self, ptr: int, size: int, mem: Memory, access: int, prepopulate: bool) -> None:
        """Let `[ptr, ptr+size)` stand for `mem` (the range itself stays reserved and inaccessible)."""
        assert isinstance(mem, RemoteMemory)
        self._mapped.add(ptr, size, mem)

    def unmap(self, ptr: int, size: int) -> None:
        self._mapped.remove(ptr)

    def protect(self, ptr: int, size: int, access: int, device: int) -> None:
        """Access flags are the runtime's to check before each copy: nothing to change in the address space."""

    def read(self, memory: Memory, offset: int, local: int, count: int) -> None:
        """`count` bytes of `memory` from `offset` into local memory at `local` (the CPU can address it)."""
        mem = _check(memory, offset, count)
        self.engine().read(mem.segment, local, mem.address + offset, count)

    def write(self, memory: Memory, offset: int, local: int, count: int) -> None:
        """`count` bytes of local memory at `local` into `memory` from `offset`."""
        mem = _check(memory, offset, count)
        self.engine().write(mem.segment, local, mem.address + offset, count)

    def between(self, to_memory: Memory, to_offset: int, of_memory: Memory, of_offset: int, count: int) -> None:
        """Remote to remote (the same server's or two servers'), through the bounce buffer."""
        of = _check(of_memory, of_offset, count)
        to = _check(to_memory, to_offset, count)
        engine = self.engine()
        starts = range(0, count, BOUNCE)
        into, start = to.address + to_offset, of.address + of_offset
        if to.segment == of.segment and start < into < start + count:  # dst above an overlapping src: last first
            starts = starts[::-1]
        with self._bounce_lock:
            bounce = self._bounce_buffer()
            for done in starts:
                n = min(BOUNCE, count - done)
                engine.read(of.segment, bounce, of.address + of_offset + done, n)
                engine.write(to.segment, bounce, to.address + to_offset + done, n)

    def set(self, memory: Memory, offset: int, value: int, count: int) -> None:
        """`count` bytes of `memory` from `offset` set to `value` (written from the bounce buffer)."""
        mem = _check(memory, offset, count)
        engine = self.engine()
        with self._bounce_lock:
            bounce = self._bounce_buffer()
            ctypes.memset(bounce, value & 0xFF, min(BOUNCE, count))
            for done in range(0, count, BOUNCE):
                engine.write(mem.segment, bounce, mem.address + offset + done, min(BOUNCE, count - done))

    def copy(self, dst: int, src: int, count: int, device: int) -> None:
        """Copy between remote memory mapped here and local memory the CPU can address (or remote to remote)."""
        to, of = self._at(dst, count), self._at(src, count)
        if to is None and of is None:
            ctypes.memmove(dst, src, count)
        elif to is None:
            assert of is not None
            self.read(of[0], of[1], dst, count)
        elif of is None:
            self.write(to[0], to[1], src, count)
        else:
            self.between(to[0], to[1], of[0], of[1], count)

    def fill(self, ptr: int, value: int, count: int, device: int) -> None:
        to = self._at(ptr, count)
        if to is None:
            ctypes.memset(ptr, value & 0xFF, count)
        else:
            self.set(to[0], to[1], value, count)

    def _at(self, ptr: int, count: int) -> tuple[RemoteMemory, int] | None:
        hit = self._mapped.at(ptr)
        if hit is None:
            return None
        return hit[2], ptr - hit[0]

    def _bounce_buffer(self) -> int:
        if not self._bounce:
            self._bounce = mman.map_anonymous(BOUNCE)
        return self._bounce


def _check(mem: Memory, offset: int, count: int) -> RemoteMemory:
    """`mem` as the import it is, once `[offset, offset+count)` is checked to lie inside it: the engine answers an
    address outside the memory it serves by dropping the connection, so never send one."""
    if not isinstance(mem, RemoteMemory):
        raise InvalidParamError(f"{mem.pages} memory is not memory of another server")
    if offset < 0 or count < 0 or offset + count > mem.size:
        raise InvalidParamError(f"{count} bytes at offset {offset} run past the remote memory ({mem.size} bytes)")
    return mem
