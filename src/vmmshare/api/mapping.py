"""The Pythonic API's address space: `VirtualRange` (a reserved range) and `Mapping` (physical memory mapped,
one chunk or several back to back), and how a Mapping travels (pickled, its chunks are imported and mapped)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable

from .. import constants as C
from .._process import runtime
from ..errors import InvalidParamError
from ..wire.props import check_int, check_ptr
from ._checks import _access, _flag, _pids, _size
from ._finalize import Finalizer
from ._owned import Owned
from .memory import PhysicalMemory, _arrived_lock, _hold, _let_go, _quietly, _receive, _Ticket
from .views import _VIEWS_LOCK, MemoryViews

__all__ = ["Mapping", "VirtualRange"]


class VirtualRange(Owned):
    """A reserved, inaccessible range of virtual addresses (at `at` exactly, when given)."""

    def __init__(self, size: int, at: int | None = None, gpu: bool | None = None) -> None:
        """`gpu`: GPU address space (default: when the CUDA backend is on), for GPU memory."""
        g = C.MIN_GRANULARITY
        self._size = -(-_size(size) // g) * g
        on_gpu = _flag("gpu", gpu, allow_none=True)
        self._ptr = runtime().memory.reserve(self._size, 0, check_ptr("at", at), on_gpu)
        self._own(_release_quietly, self._ptr)

    @property
    def ptr(self) -> int:
        """The start of the range."""
        return self._ptr

    @property
    def size(self) -> int:
        """Its size in bytes (whole granules)."""
        return self._size

    def __repr__(self) -> str:
        return f"<VirtualRange {self.ptr:#x}+{self.size:#x}>"

    def map(
        self, memory: PhysicalMemory, offset: int = 0, access: str = "rw", prepopulate: bool | None = None,
        owns_range: bool = False,
    ) -> Mapping:
        """Map `memory` at `self.ptr + offset`."""
        flags = _access(access)
        if not isinstance(memory, PhysicalMemory):
            raise InvalidParamError(f"memory must be a PhysicalMemory, not {type(memory).__name__}")
        offset = check_int("offset", offset)
        populate = _flag("prepopulate", prepopulate, allow_none=True)
        owns = _flag("owns_range", owns_range)
        if offset + memory.size > self.size:
            raise InvalidParamError(f"{memory.size} bytes at offset {offset} do not fit this {self.size}-byte range")
        rt = runtime()
        ptr = self.ptr + offset
        rt.memory.map(ptr, memory.size, 0, memory._live(), flags, populate)
        return Mapping._make([(ptr, memory)], access, rng=self if owns else None)

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("a VirtualRange is address space of this process and cannot be sent: send the "
                        "PhysicalMemory (or the Mapping) mapped in it, and map it in the receiver")

    def close(self) -> None:
        if self._finalizer.alive:
            self._finalizer.detach()
            if not self._forked:
                runtime().memory.release(self.ptr)


def _release_quietly(ptr: int) -> None:
    with contextlib.suppress(Exception):
        rt = runtime()
        rt.when_safe(lambda: _quietly(rt.memory.release, ptr))


def _unmap_quietly(parts: list[tuple[int, PhysicalMemory]], rng: VirtualRange | None, own_range: bool,
                   owned: list[PhysicalMemory], held: list[PhysicalMemory]) -> None:
    def unmap() -> None:
        if own_range:
            _quietly(rt.memory.unmap_release, parts[0][0])
        else:
            for ptr, _ in reversed(parts):
                _quietly(rt.memory.unmap, ptr)
            if rng is not None:
                _quietly(rng.close)
        for memory in owned:
            _quietly(memory.close)
        for memory in held:
            _quietly(_let_go, memory)

    with contextlib.suppress(Exception):
        rt = runtime()
        rt.when_safe(unmap)


class Mapping(MemoryViews):
    """Physical memory mapped at `ptr`: views as memoryview, numpy array or DLPack tensor, zero-copy.

    Made by `PhysicalMemory.map` and `VirtualRange.map` (not instantiated directly). One mapping may hold several
    chunks back to back (`grow()`, or a grown mapping received from another process): one range for views and
    copies. Like `mmap.mmap`, it refuses to close while views of it are alive (BufferError). Pickled, it travels
    as its chunks' handles: the receiver imports them and maps them back to back (at an address of its own).
    """

    _finalizer: Finalizer
    _parts: list[tuple[int, PhysicalMemory]]
    _access: str
    _range: VirtualRange | None
    _own_range: bool
    _growable: bool
    _owned: list[PhysicalMemory]
    _held: list[PhysicalMemory]
    _lock: threading.Lock

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError("Mapping cannot be instantiated directly: use PhysicalMemory.map() or VirtualRange.map()")

    @classmethod
    def _make(
        cls, parts: list[tuple[int, PhysicalMemory]], access: str, rng: VirtualRange | None = None,
        own_range: bool = False, growable: bool = False, owned: list[PhysicalMemory] | None = None,
        held: list[PhysicalMemory] | None = None,
    ) -> Mapping:
        """The mapping of `parts` (address, memory mapped there, back to back: a new list, the mapping's from now on);
        `rng`: a VirtualRange it closes with it; `own_range`: its one part was reserved and mapped in one step
        (map_new); `growable`: it may map more chunks into the rest of `rng`; `owned`: memory it closes with it (the
        chunks it grew); `held`: imports that arrived here, which it lets go of (`_let_go`) when it closes."""
        self = cls.__new__(cls)
        ptr, first = parts[0]
        size = 0
        for _, memory in parts:
            size += memory._size
        self._ptr, self._size = ptr, size
        self._on_gpu, self._remote, self._device = first._on_gpu, first._remote, first._device
        self._parts = parts
        self._access = access
        self._range = rng
        self._own_range = own_range
        self._growable = growable
        self._owned = [] if owned is None else list(owned)
        self._held = [] if held is None else list(held)
        self._lock = threading.Lock()
        self._init_views()
        self._finalizer = Finalizer(self, _unmap_quietly, parts, rng, own_range, self._owned, self._held)
        return self

    def __repr__(self) -> str:
        chunks = f", {len(self._parts)} chunks" if len(self._parts) > 1 else ""
        return f"<Mapping {self.ptr:#x}+{self.size:#x}{chunks}{' closed' if self.closed else ''}>"

    def _cuts(self) -> list[int]:
        return [ptr for ptr, _ in self._parts[1:]]

    @property
    def memory(self) -> PhysicalMemory:
        """The (first) physical memory mapped here."""
        return self._parts[0][1]

    @property
    def chunks(self) -> tuple[PhysicalMemory, ...]:
        """Every physical memory mapped here, in address order."""
        return tuple(m for _, m in self._parts)

    @property
    def capacity(self) -> int:
        """The most bytes this mapping can `grow()` to (its size, unless it was mapped with `max_size`)."""
        return self._range.size if self._growable and self._range is not None else self.size

    def set_access(self, access: str) -> None:
        flags = _access(access)
        if self.closed:
            raise InvalidParamError("this Mapping is closed")
        for ptr, memory in self._parts:
            runtime().memory.set_access(ptr, memory.size, [(memory._location, flags)])

    def grow(self, size: int) -> None:
        """Grow to at least `size` bytes in place: new chunks of the first one's kind, mapped right after the last
        (exported as the first was, trusting whom it trusts); views made before stay valid."""
        wanted = _size(size)
        with self._lock:
            if self.closed:
                raise InvalidParamError("this Mapping is closed")
            if self._forked:
                raise InvalidParamError("this Mapping was inherited through fork(): only the process that made it "
                                        "grows it")
            if not self._growable or self._range is None:
                raise InvalidParamError("this mapping has no room to grow: map it with "
                                        "PhysicalMemory.map(max_size=...)")
            first = self._parts[0][1]
            g = first._prop.granularity
            extra = -(-(wanted - self._size) // g) * g
            if extra <= 0:
                return
            if self._size + extra > self._range.size:
                raise InvalidParamError(f"{wanted} bytes do not fit the {self._range.size} bytes (max_size) this "
                                        "mapping was made with")
            rt = runtime()
            chunk = PhysicalMemory._make(rt.memory.malloc_physical(extra, first._prop))
            try:
                chunk._export_like(first)
                ptr = self._ptr + self._size
                rt.memory.map(ptr, extra, 0, chunk._live(), _access(self._access), None)
            except BaseException:
                chunk.close()
                raise
            self._parts.append((ptr, chunk))
            self._owned.append(chunk)
            self._size += extra

    def allow(self, pids: Iterable[int], server: int | None = None) -> None:
        """Add processes to the trustlist of every chunk of this mapping (and of the chunks it grows later)."""
        listed = _pids(pids, allow_empty=False)
        for _, memory in self._parts:
            if memory.imported:
                raise InvalidParamError("this mapping is of imported memory: its exporter sets the trustlist")
            if memory._shareable is None:
                memory.export(pids=listed)
            else:
                memory.allow(listed, server)

    def __reduce__(self) -> tuple[object, ...]:
        if self.closed:
            raise TypeError("this Mapping is closed: there is nothing to send")
        first = self._parts[0][1]
        if any(m.closed for _, m in self._parts):
            raise TypeError("this Mapping's PhysicalMemory was closed, which revoked its export (rule 14): it cannot "
                            "be sent any more; send it before closing the memory")
        tickets = []
        for _, memory in self._parts:
            with _arrived_lock:
                if memory.shareable is None and memory is not first:
                    memory._export_like(first)
            tickets.append(memory._ticket())
        return (_arrive_mapping, (tickets, self._access))

    def close(self) -> None:
        """Unmap (and release the range it owns); BufferError while views of it are alive."""
        finalizer = self._finalizer
        with _VIEWS_LOCK:  # (as `_start_close`: no view is counted after the check)
            if not finalizer.alive:
                return
            if self._views:
                self._check_closable()
            finalizer.cancel()
        if self._forked:
            return  # the parent's: it stays mapped here until this process exits
        rt = runtime()
        if self._own_range:
            rt.memory.unmap_release(self._ptr)
        else:
            for ptr, _ in reversed(self._parts):
                rt.memory.unmap(ptr)
            if self._range is not None:
                self._range.close()
        for memory in self._owned:
            memory.close()
        for memory in self._held:
            _let_go(memory)


def _map_back_to_back(memories: list[PhysicalMemory], access: str, room: int = 0,
                      held: list[PhysicalMemory] | None = None) -> Mapping:
    """`memories` mapped back to back in one reservation (of `room` bytes at least, to add more later)."""
    if len(memories) == 1 and not room:
        mapping = memories[0].map(access)
        mapping._held.extend(held or [])
        return mapping
    total = sum(m.size for m in memories)
    rng = VirtualRange(max(total, room), gpu=memories[0].on_gpu)
    parts: list[tuple[int, PhysicalMemory]] = []
    rt = runtime()
    try:
        at = rng.ptr
        for memory in memories:
            rt.memory.map(at, memory.size, 0, memory._live(), _access(access), None)
            parts.append((at, memory))
            at += memory.size
    except BaseException:
        for ptr, _ in reversed(parts):
            _quietly(rt.memory.unmap, ptr)
        rng.close()
        raise
    return Mapping._make(parts, access, rng=rng, growable=bool(room), held=held)


def _arrive_mapping(tickets: list[_Ticket], access: str) -> Mapping:
    """Unpickling a Mapping: its chunks imported here (one import per handle in this process), mapped back to
    back; the mapping holds the imports, and the last holder of one closes it."""
    if not isinstance(tickets, list) or not tickets:
        raise InvalidParamError("not a Mapping's descriptor (a crafted pickle?): it lists no memory")
    memories: list[PhysicalMemory] = []
    try:
        for ticket in tickets:
            memory = _receive(ticket)[0]
            _hold(memory)
            memories.append(memory)
        return _map_back_to_back(memories, access, held=memories)
    except BaseException:
        for memory in memories:
            _quietly(_let_go, memory)
        raise
