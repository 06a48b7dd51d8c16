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
from . import host
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

    def __init__(self, transfers: Callable[[], Transfers]) -> None:
        self._transfers = transfers  # this process's engine, made on first use
        self._mapped: Intervals[RemoteMemory] = Intervals()
        self._lock = threading.Lock()
        self._bounce = 0
        self._bounce_lock = threading.Lock()

    def engine(self) -> Transfers:
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

    def map(self, ptr: int, size: int, mem: Memory, access: int, prepopulate: bool) -> None:
        """Let `[ptr, ptr+size)` stand for `mem` (the range itself stays reserved and inaccessible)."""
        assert isinstance(mem, RemoteMemory)
        with self._lock:
            self._mapped.add(ptr, size, mem)

    def unmap(self, ptr: int, size: int) -> None:
        with self._lock:
            self._mapped.remove(ptr)

    def protect(self, ptr: int, size: int, access: int, device: int) -> None:
        """Access flags are the runtime's to check before each copy: nothing to change in the address space."""

    def remote_at(self, ptr: int, count: int) -> tuple[str, int] | None:
        """(segment, remote address) of `[ptr, ptr+count)` when it lies in remote memory mapped here; None when
        `ptr` is not in any; InvalidParamError when the range runs past its mapping."""
        with self._lock:
            hit = self._mapped.at(ptr)
        if hit is None:
            return None
        start, end, mem = hit
        offset = ptr - start
        if count < 0 or ptr + count > end or offset + count > mem.size:
            raise InvalidParamError(f"{ptr:#x}+{count} runs past the remote mapping at {start:#x} ({mem.size} bytes)")
        return mem.segment, mem.address + offset

    def copy(self, dst: int, src: int, count: int, device: int) -> None:
        """Copy between remote memory mapped here and local memory the CPU can address (or remote to remote)."""
        to, of = self.remote_at(dst, count), self.remote_at(src, count)
        engine = self.engine()
        if to is None and of is None:
            ctypes.memmove(dst, src, count)
        elif to is None:
            assert of is not None
            engine.read(of[0], dst, of[1], count)
        elif of is None:
            engine.write(to[0], src, to[1], count)
        else:
            with self._bounce_lock:
                bounce = self._bounce_buffer()
                for done in range(0, count, BOUNCE):
                    n = min(BOUNCE, count - done)
                    engine.read(of[0], bounce, of[1] + done, n)
                    engine.write(to[0], bounce, to[1] + done, n)

    def fill(self, ptr: int, value: int, count: int, device: int) -> None:
        to = self.remote_at(ptr, count)
        if to is None:
            ctypes.memset(ptr, value & 0xFF, count)
            return
        engine = self.engine()
        with self._bounce_lock:
            bounce = self._bounce_buffer()
            ctypes.memset(bounce, value & 0xFF, min(BOUNCE, count))
            for done in range(0, count, BOUNCE):
                engine.write(to[0], bounce, to[1] + done, min(BOUNCE, count - done))

    def _bounce_buffer(self) -> int:
        if not self._bounce:
            self._bounce = host.map_anonymous(BOUNCE)
        return self._bounce
