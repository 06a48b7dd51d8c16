"""The buffers of a `MemoryPool`: `size` bytes at an offset of the pool, with views, copies and `meta`, that
travel as (pool, offset, size, meta) and arrive in the receiver's one import of the pool."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from ..errors import InvalidHandleError, InvalidParamError
from .memory import _quietly
from .views import MemoryViews

if TYPE_CHECKING:
    from .pools import MemoryPool, _PoolTicket

__all__ = ["PoolBuffer"]


class PoolBuffer(MemoryViews):
    """`size` bytes of a `MemoryPool` at `offset`: views and copies like a Mapping's; `close()` gives the bytes back
    to the pool (in the process that allocated it; elsewhere it only lets go). Made by `MemoryPool.allocate`, or
    unpickled: it travels as (pool, offset, size, meta)."""

    _pool: MemoryPool
    _offset: int
    _length: int
    meta: dict[str, Any]

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError("PoolBuffer cannot be instantiated directly: use MemoryPool.allocate()")

    @classmethod
    def _make(cls, pool: MemoryPool, offset: int, size: int, length: int, meta: dict[str, Any],
              owning: bool = True) -> PoolBuffer:
        """A buffer of `pool`; `owning`: its close gives the bytes back (the one `allocate` made, not a copy)."""
        self = cls.__new__(cls)
        self._pool, self._offset, self._length, self.meta = pool, offset, length, meta
        self._ptr, self._size = pool.ptr + offset, size
        self._on_gpu, self._remote, self._device = pool._on_gpu, pool._remote, pool.device
        self._init_views()
        give_back = pool._release if owning and not pool.imported else None
        self._finalizer = weakref.finalize(self, _give_back, give_back, offset, length)
        return self

    @property
    def pool(self) -> MemoryPool:
        return self._pool

    @property
    def offset(self) -> int:
        """Where the buffer lies in its pool (the same in every process that has the pool)."""
        return self._offset

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive or self._pool.closed

    def _cuts(self) -> list[int]:
        chunk, base = self._pool.chunk_size, self._pool.ptr
        first = self._offset // chunk + 1
        return [base + i * chunk for i in range(first, -(-(self._offset + self._size) // chunk))]

    def _closed_message(self) -> str:
        if self._pool.closed:
            return "the MemoryPool of this PoolBuffer is closed"
        return "this PoolBuffer is closed"

    def _detach(self) -> None:
        """Its pool is closing: nothing to give back."""
        self._finalizer.detach()

    def __repr__(self) -> str:
        state = ", closed" if self.closed else ""
        return f"<PoolBuffer {self.size} bytes at offset {self._offset:#x} of pool {self._pool._id[:8]}{state}>"

    def __reduce__(self) -> tuple[object, ...]:
        if self.closed:
            raise TypeError(f"{self._closed_message()}: there is nothing to send")
        ticket = self._pool._ticket((self._offset, self._offset + self._size))
        return (_arrive_buffer, (ticket, self._offset, self._size, self._length, self.meta))

    def close(self) -> None:
        """Give the bytes back to the pool (BufferError while views of it are alive)."""
        detached = self._start_close()
        if detached is not None:
            _, give_back, args, _ = detached
            give_back(*args)


def _give_back(give_back: Any, offset: int, length: int) -> None:
    if give_back is not None:
        _quietly(give_back, offset, length)


def _arrive_buffer(ticket: _PoolTicket, offset: int, size: int, length: int, meta: dict[str, Any]) -> PoolBuffer:
    """Unpickling a PoolBuffer: the buffer in this process's import of its pool."""
    from .pools import MemoryPool  # (pools imports this module)

    pool = MemoryPool._import(ticket)
    if offset < 0 or size <= 0 or offset + size > pool.capacity:
        raise InvalidParamError(f"a buffer of {size} bytes at offset {offset} does not fit its pool")
    missing = [i for i in range(offset // pool.chunk_size, -(-(offset + size) // pool.chunk_size))
               if i not in pool._chunks]
    if missing:
        raise InvalidHandleError(f"chunks {missing} of the buffer's pool did not come with it")
    buf = PoolBuffer._make(pool, offset, size, length, meta, owning=False)
    pool._buffers.add(buf)
    return buf
