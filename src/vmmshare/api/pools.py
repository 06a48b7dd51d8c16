"""Shareable memory pools: many buffers carved from chunks of physical memory in one reservation, shared once.

A `MemoryPool` exports each chunk it maps (with the pool's trust), so a buffer travels to another process as a
small descriptor (pool, offset, size) and imports through that process's one import of the pool: the chunks it
needs are imported and mapped where the exporter has them, at the same offsets of one reservation, so a buffer
spanning chunks is one range there too. Freeing a buffer returns its bytes to the pool; the pool grows a chunk at a
time up to `max_size`. What a layer above (bucketed tensors by handle) needs is here: aligned carve-outs (`offset`,
`alignment`), per-buffer metadata (`meta`, which travels with the buffer) and views (numpy, DLPack, copies).
"""

from __future__ import annotations

import bisect
import secrets
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .._process import runtime
from ..errors import InvalidHandleError, InvalidParamError, MemoryAllocationError
from ..wire.props import check_int
from ._checks import _access, _pids, _size
from ._owned import Owned
from .mapping import VirtualRange
from .memory import Device, PhysicalMemory, _hold, _let_go, _quietly, _receive, _Ticket
from .pool_buffers import PoolBuffer
from .views import _VIEWS_LOCK

__all__ = ["MemoryPool"]

DEFAULT_ALIGNMENT = 512  # bytes: what torch's caching allocator rounds to, and a multiple of any dtype's size
DEFAULT_CHUNK = 32 << 20
DEFAULT_MAX = 1 << 30
_MAX_ALIGNMENT = 2 << 20  # a chunk boundary: coarser alignment would need the reservation aligned to it


@dataclass(frozen=True)
class _PoolTicket:
    """A pool as it travels: its id, its layout and the chunks (by index) a receiver needs."""

    pool_id: str
    capacity: int
    chunk_size: int
    alignment: int
    access: str
    on_gpu: bool
    chunks: tuple[tuple[int, _Ticket], ...]


# the pools of this process (made here or imported), by id: one import (of each chunk) serves every buffer that
# arrives, and a buffer that comes back to the process that made its pool is a view of that pool
_imported: weakref.WeakValueDictionary[str, MemoryPool] = weakref.WeakValueDictionary()
_imported_lock = threading.Lock()


class MemoryPool(Owned):
    """Buffers carved from shared chunks of `chunk_size` bytes (default: 32 MiB, or `max_size` when smaller;
    rounded up to the granularity) on `device`, growing up to `max_size` bytes.

    Every chunk is exported when it is added (``validate_pids`` and ``pids`` as for `PhysicalMemory.export`;
    `allow()` trusts more processes, for every chunk now and later). Send the pool or its buffers through
    multiprocessing (pickle): the receiver imports the pool once and maps each buffer where it lies.
    """

    def __init__(
        self, max_size: int = DEFAULT_MAX, device: int = 0, chunk_size: int | None = None, *, attr: str = "normal",
        location: str = "device", pids: Iterable[int] = (), validate_pids: bool = True, share_type: str = "default",
        alignment: int = DEFAULT_ALIGNMENT, access: str = "rw",
    ) -> None:
        dev = Device(device)
        self._alignment = _check_alignment(alignment)
        self._access = access
        _access(access)
        g = dev.granularity(attr, location)
        chunk = min(DEFAULT_CHUNK, _size(max_size)) if chunk_size is None else _size(chunk_size)
        self._chunk_size = -(-chunk // g) * g
        self._capacity = -(-_size(max_size) // self._chunk_size) * self._chunk_size
        trust = _pids(pids, allow_empty=True)
        self._id = secrets.token_hex(16)
        self._device = dev.id
        self._imported_pool = False
        self._lock = threading.RLock()
        self._chunks: dict[int, PhysicalMemory] = {}
        self._buffers: weakref.WeakSet[PoolBuffer] = weakref.WeakSet()
        self._free: list[tuple[int, int]] = []  # (offset, length), by offset, coalesced
        self._used = 0
        first = dev.allocate(self._chunk_size, attr, location)
        try:
            first.export(share_type, trust, validate_pids)
            self._range = VirtualRange(self._capacity, gpu=first.on_gpu)
        except BaseException:
            first.close()
            raise
        self._on_gpu, self._remote = first.on_gpu, first.remote
        self._own(_unmap_pool, self._range, self._chunks, False)
        self._add_chunk(0, first)
        with _imported_lock:
            _imported[self._id] = self

    @classmethod
    def _import(cls, ticket: _PoolTicket) -> MemoryPool:
        """The pool a ticket names, as this process imported it (once: later tickets add the chunks they bring)."""
        _check_ticket(ticket)
        with _imported_lock:
            pool = _imported.get(ticket.pool_id)
            if pool is None or pool.closed:
                pool = cls.__new__(cls)
                pool._id, pool._imported_pool = ticket.pool_id, True
                pool._alignment, pool._access = ticket.alignment, ticket.access
                pool._chunk_size, pool._capacity = ticket.chunk_size, ticket.capacity
                pool._lock = threading.RLock()
                pool._chunks, pool._buffers, pool._free, pool._used = {}, weakref.WeakSet(), [], 0
                first = ticket.chunks[0][1] if ticket.chunks else None
                pool._device = first.device if first is not None else 0
                pool._range = VirtualRange(ticket.capacity, gpu=bool(ticket.on_gpu))
                pool._on_gpu, pool._remote = bool(ticket.on_gpu), False
                pool._own(_unmap_pool, pool._range, pool._chunks, True)
                _imported[ticket.pool_id] = pool
        if pool._imported_pool:
            pool._take(ticket)
        return pool

    def _take(self, ticket: _PoolTicket) -> None:
        """Import and map the chunks of `ticket` this process does not have yet."""
        with self._lock:
            for index, chunk in ticket.chunks:
                if index in self._chunks:
                    continue
                if not 0 <= index < self._capacity // self._chunk_size:
                    raise InvalidParamError(f"chunk {index} lies outside this pool of {self._capacity} bytes")
                try:
                    memory, _ = _receive(chunk)
                except InvalidHandleError as exc:
                    raise InvalidHandleError(f"chunk {index} of this MemoryPool cannot be imported: its exporter "
                                             f"closed the pool, or died ({exc.message})") from None
                if memory.size != self._chunk_size:
                    raise InvalidHandleError(f"chunk {index} has {memory.size} bytes, not the pool's "
                                             f"{self._chunk_size}")
                if memory.on_gpu != self._on_gpu:
                    raise InvalidHandleError(f"chunk {index} is not the pool's kind of memory")
                self._remote = self._remote or memory.remote  # another server's: copies only
                _hold(memory)
                try:
                    self._map(index, memory)
                except BaseException:
                    _let_go(memory)
                    raise

    # ------------------------------------------------------------ what a user (or a torch layer) reads

    @property
    def imported(self) -> bool:
        """A pool another process exported (its buffers came from there: this process cannot allocate in it)."""
        return self._imported_pool

    @property
    def ptr(self) -> int:
        """The address of the pool's reservation in this process (a buffer lies at ``ptr + buffer.offset``)."""
        return self._range.ptr

    @property
    def capacity(self) -> int:
        """The most bytes the pool can grow to (`max_size` rounded up to whole chunks)."""
        return self._capacity

    @property
    def size(self) -> int:
        """The bytes of physical memory the pool holds (its chunks)."""
        return len(self._chunks) * self._chunk_size

    @property
    def used(self) -> int:
        """The bytes its live buffers take (with their alignment padding)."""
        return self._used

    @property
    def chunk_size(self) -> int:
        return self._chunk_size

    @property
    def alignment(self) -> int:
        """Every buffer's offset is a multiple of this (unless `allocate` asked for more)."""
        return self._alignment

    @property
    def device(self) -> int:
        return self._device

    @property
    def chunks(self) -> tuple[PhysicalMemory, ...]:
        """The physical memory of the pool, in address order."""
        return tuple(self._chunks[i] for i in sorted(self._chunks))

    def __repr__(self) -> str:
        where = "imported" if self._imported_pool else f"{self._used} of {self.size} bytes used"
        return (f"<MemoryPool {self._id[:8]} on device {self._device}, {len(self._chunks)} chunk(s) of "
                f"{self._chunk_size}, {where}{', closed' if self.closed else ''}>")

    # ------------------------------------------------------------ buffers

    def allocate(self, size: int, alignment: int | None = None, meta: dict[str, Any] | None = None) -> PoolBuffer:
        """A buffer of `size` bytes whose offset is a multiple of `alignment` (default: the pool's), with `meta`
        (plain data: dtype, shape, a tag...) that travels with it; the pool grows when no free bytes fit."""
        n = _size(size)
        align = self._alignment if alignment is None else _check_alignment(alignment)
        if meta is not None and not isinstance(meta, dict):
            raise InvalidParamError(f"meta must be a dict, got {type(meta).__name__}")
        need = -(-n // self._alignment) * self._alignment  # the next buffer starts aligned too
        with self._lock:
            self._check_open()
            if self._imported_pool or self._forked:
                raise InvalidParamError(f"this MemoryPool was {'imported' if self._imported_pool else 'inherited'}: "
                                        "buffers are allocated by the process that made it")
            offset = self._fit(need, align)
            while offset is None:
                end = self.size
                tail = self._free[-1] if self._free and sum(self._free[-1]) == end else (end, 0)
                start = -(-tail[0] // align) * align
                if start + need > self._capacity:
                    raise MemoryAllocationError(
                        f"{n} bytes do not fit this MemoryPool: {self._used} of its {self._capacity} bytes (max_size) "
                        "are in use; free buffers or make the pool with a larger max_size")
                self._grow()
                offset = self._fit(need, align)
            self._used += need
            buf = PoolBuffer._make(self, offset, n, need, dict(meta or {}))
            self._buffers.add(buf)
            return buf

    def _fit(self, need: int, align: int) -> int | None:
        """Carve `need` bytes at an `align`ed offset out of the first free run that holds them (first fit)."""
        for i, (off, length) in enumerate(self._free):
            start = -(-off // align) * align
            if start + need > off + length:
                continue
            rest = [(off, start - off)] if start > off else []
            if start + need < off + length:
                rest.append((start + need, off + length - start - need))
            self._free[i:i + 1] = rest
            return start
        return None

    def _release(self, offset: int, length: int) -> None:
        """Give a buffer's bytes back (merged with the free runs next to them)."""
        with self._lock:
            self._used -= length
            self._insert(offset, length)

    def _insert(self, offset: int, length: int) -> None:
        i = bisect.bisect(self._free, (offset, length))
        if i and sum(self._free[i - 1]) == offset:
            i -= 1
            offset, length = self._free[i][0], self._free[i][1] + length
            del self._free[i]
        if i < len(self._free) and self._free[i][0] == offset + length:
            length += self._free[i][1]
            del self._free[i]
        self._free.insert(i, (offset, length))

    def _grow(self) -> None:
        """One more chunk, of the first one's kind, exported as it was, mapped after the last."""
        index = len(self._chunks)
        first = self._chunks[0]
        chunk = PhysicalMemory._make(runtime().memory.malloc_physical(self._chunk_size, first._prop))
        try:
            chunk._export_like(first)
            self._add_chunk(index, chunk)
        except BaseException:
            chunk.close()
            raise

    def _add_chunk(self, index: int, chunk: PhysicalMemory) -> None:
        self._map(index, chunk)
        self._insert(index * self._chunk_size, self._chunk_size)

    def _map(self, index: int, memory: PhysicalMemory) -> None:
        runtime().memory.map(self._range.ptr + index * self._chunk_size, memory.size, 0, memory._live(),
                             _access(self._access), None)
        self._chunks[index] = memory

    def allow(self, pids: Iterable[int], server: int | None = None) -> None:
        """Add processes to the trustlist of every chunk, now and as the pool grows."""
        listed = _pids(pids, allow_empty=False)
        with self._lock:
            self._check_open()
            if self._imported_pool:
                raise InvalidParamError("this MemoryPool was imported: its exporter sets the trustlist")
            for i in sorted(self._chunks):
                self._chunks[i].allow(listed, server)

    def _check_open(self) -> None:
        if self.closed:
            raise InvalidParamError("this MemoryPool is closed")

    def _ticket(self, upto: tuple[int, int] | None = None) -> _PoolTicket:
        """The pool as it travels: every chunk, or those [offset, end) of `upto` lies in."""
        with self._lock:
            if self.closed:
                raise TypeError("this MemoryPool is closed: there is nothing to send")
            indexes = sorted(self._chunks)
            if upto is not None:
                lo, hi = upto[0] // self._chunk_size, -(-upto[1] // self._chunk_size)
                indexes = [i for i in indexes if lo <= i < hi]
            chunks = tuple((i, self._chunks[i]._ticket()) for i in indexes)
            return _PoolTicket(self._id, self._capacity, self._chunk_size, self._alignment, self._access, self._on_gpu,
                               chunks)

    def __reduce__(self) -> tuple[object, ...]:
        return (MemoryPool._import, (self._ticket(),))

    def close(self) -> None:
        """Unmap and free the pool (its exports are revoked: importers keep what they mapped); its buffers are
        closed with it. BufferError while views of any of its buffers are alive."""
        with self._lock:
            if self.closed:
                return
            with _VIEWS_LOCK:  # no view of a buffer is counted between this check and the close
                busy = sum(b.live_views() for b in self._buffers)
                if busy:
                    raise BufferError(f"{busy} view(s) of this MemoryPool's buffers are alive: delete them first")
                for buf in list(self._buffers):
                    buf._detach()
                self._finalizer.detach()
            if self._forked:
                return  # the parent's: it stays mapped here until this process exits
            rt = runtime()
            for i in sorted(self._chunks, reverse=True):
                rt.memory.unmap(self._range.ptr + i * self._chunk_size)
                if self._imported_pool:
                    _let_go(self._chunks[i])
                else:
                    self._chunks[i].close()
            self._chunks.clear()
            self._range.close()

    def _busy(self) -> bool:
        return any(b.live_views() for b in self._buffers)


def _check_alignment(alignment: object) -> int:
    a = check_int("alignment", alignment, 1, _MAX_ALIGNMENT)
    if a & (a - 1):
        raise InvalidParamError(f"alignment {a} is not a power of two")
    return a


def _check_ticket(ticket: object) -> None:
    """Refuse (107000) a pool descriptor that no MemoryPool sends (a crafted pickle): a layout that is not whole
    chunks, an alignment no pool has, a chunk list that is not (index, chunk ticket) pairs."""
    if not isinstance(ticket, _PoolTicket) or not isinstance(ticket.pool_id, str):
        raise InvalidParamError(f"not a MemoryPool's descriptor: {type(ticket).__name__}")
    chunk = ticket.chunk_size
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise InvalidParamError(f"the pool's descriptor has chunk size {chunk!r}: not a positive int")
    capacity = ticket.capacity
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0 or capacity % chunk:
        raise InvalidParamError(f"the pool's descriptor has capacity {capacity!r}: not whole chunks of {chunk}")
    a = ticket.alignment
    if isinstance(a, bool) or not isinstance(a, int) or not 1 <= a <= _MAX_ALIGNMENT or a & (a - 1):
        raise InvalidParamError(f"the pool's descriptor has alignment {a!r}: not a power of two up to "
                                f"{_MAX_ALIGNMENT}")
    chunks = ticket.chunks
    if not isinstance(chunks, tuple) or not all(
            isinstance(c, tuple) and len(c) == 2 and isinstance(c[0], int) and not isinstance(c[0], bool)
            and isinstance(c[1], _Ticket) for c in chunks):
        raise InvalidParamError("the pool's descriptor does not list its chunks as (index, chunk) pairs")


def _unmap_pool(rng: VirtualRange, chunks: dict[int, PhysicalMemory], imported: bool) -> None:
    """A pool gone with the garbage: its chunks unmapped and freed (let go of, when imported), its reservation
    released."""
    def run() -> None:
        rt = runtime()
        for i in sorted(chunks, reverse=True):
            memory = chunks[i]
            _quietly(rt.memory.unmap, rng.ptr + i * (memory.size))
            _quietly(_let_go if imported else PhysicalMemory.close, memory)
        chunks.clear()
        _quietly(rng.close)

    _quietly(lambda: runtime().when_safe(run))
