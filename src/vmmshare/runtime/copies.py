"""Host memory (aclrtMallocHost) and the copies and fills between any memory of this process (now, or queued on
a stream)."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeGuard

from .. import constants as C
from ..backends import mman
from ..backends.remote import BOUNCE, NO_CPU_ACCESS
from ..errors import FeatureNotSupportedError, InvalidParamError, MemoryAllocationError
from ..intervals import Intervals
from .tables import MappingEntry

if TYPE_CHECKING:
    from .shared import Shared
    from .vmm import Vmm

_KIND_SIDES = {  # memcpy kind -> (dst is device memory, src is device memory)
    C.ACL_MEMCPY_HOST_TO_HOST: (False, False),
    C.ACL_MEMCPY_HOST_TO_DEVICE: (True, False),
    C.ACL_MEMCPY_DEVICE_TO_HOST: (False, True),
    C.ACL_MEMCPY_DEVICE_TO_DEVICE: (True, True),
    C.ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE: (True, False),
}
MAX_HOST_ALLOC = 1 << 46
Piece = tuple[int, int, "MappingEntry | None"]  # (address, length, the mapping holding it; None: other memory)
Chunk = tuple[int, int, int, "MappingEntry | None", "MappingEntry | None"]  # (dst, src, count, dst's, src's mapping)


class Copies:
    """malloc_host blocks, memcpy and memset; classifies every pointer against this process's tables."""

    def __init__(self, s: Shared, memory: Vmm) -> None:
        self.s, self.memory = s, memory
        self.host_blocks: Intervals[int] = Intervals()

    def malloc_host(self, size: int) -> int:
        if not 1 <= size <= MAX_HOST_ALLOC:
            raise InvalidParamError(f"size={size} is out of range [1, {MAX_HOST_ALLOC}]")
        try:
            ptr = mman.map_anonymous(size)
        except OSError as exc:
            raise MemoryAllocationError(f"cannot allocate {size} bytes of host memory: {exc.strerror}") from None
        with self.s.lock:
            self.host_blocks.add(ptr, size, size)
        return ptr

    def free_host(self, ptr: int) -> None:
        with self.s.lock:
            size = self.host_blocks.exact(ptr)
            if size is None:
                raise InvalidParamError(f"{ptr:#x} is not memory from malloc_host (or it was freed already)")
            self.host_blocks.remove(ptr)
            mman.unmap(ptr, size)

    def _pieces(self, ptr: int, size: int, write: bool, what: str) -> list[Piece]:
        """Check `[ptr, ptr+size)` is accessible memory: the mappings it runs through, end to end, each with the
        part of the range it holds (rule 7), or one piece without a mapping for other memory of this process."""
        if ptr == 0:
            raise InvalidParamError(f"{what} is NULL")
        vmm = self.memory
        hit = vmm.mappings.at(ptr)
        if hit is None:
            self._check_other(ptr, size, write, what)
            return [(ptr, size, None)]
        need = C.ACL_RT_MEM_ACCESS_FLAGS_READWRITE if write else C.ACL_RT_MEM_ACCESS_FLAGS_READ
        pieces: list[Piece] = []
        cursor, end = ptr, ptr + size
        while True:
            start, stop, m = hit
            if m.effective & need != need:
                raise InvalidParamError(f"{what} mapping at {start:#x} is not {'writable' if write else 'readable'}")
            stop = min(stop, end)
            pieces.append((cursor, stop - cursor, m))
            if stop == end:
                return pieces
            cursor = stop
            hit = vmm.mappings.at(cursor)
            if hit is None:
                why = "reserved but not mapped" if vmm.reservations.at(cursor) is not None else "not mapped"
                raise InvalidParamError(f"{what} range {ptr:#x}+{size} runs into {cursor:#x}, which is {why}: "
                                        "a copy may span mappings only where they lie end to end")

    def _check_other(self, ptr: int, size: int, write: bool, what: str) -> None:
        """Memory outside the mappings: a malloc_host block, or memory the process has mapped itself."""
        vmm = self.memory
        if vmm.reservations.at(ptr) is not None:
            raise InvalidParamError(f"{what} {ptr:#x} is reserved but not mapped: map_mem it first")
        block = self.host_blocks.at(ptr)
        if block is not None:
            if ptr + size > block[1]:
                raise InvalidParamError(f"{what} range {ptr:#x}+{size} runs past its malloc_host block")
            return
        if not process_range_ok(ptr, size, write):
            raise InvalidParamError(f"{what} {ptr:#x}+{size} is not {'writable' if write else 'readable'} memory")

    def memcpy(self, dst: int, dest_max: int, src: int, count: int, kind: int) -> None:
        if count > dest_max:
            raise InvalidParamError(f"count {count} is larger than destMax {dest_max}")
        if dst == 0 or src == 0:
            raise InvalidParamError(f"{'dst' if dst == 0 else 'src'} is NULL")
        if count == 0:
            return
        with self.s.lock:
            plan = self._plan(dst, src, count, kind)
            if len(plan) == 1 and _local(plan[0]):  # one mapping (or none) on each side: the common case
                _, _, _, to, of = plan[0]
                self._local_copy(to, of, dst, src, count)
                return
        self._run(plan)

    def _plan(self, dst: int, src: int, count: int, kind: int) -> list[Chunk]:
        """Check a copy's ranges and kind; the copy cut where either side passes from one mapping to the next."""
        to = self._pieces(dst, count, True, "dst")
        of = self._pieces(src, count, False, "src")
        want = _KIND_SIDES.get(kind)
        if want is not None:
            dst_dev = {_on_device(m) for _, _, m in to}
            src_dev = {_on_device(m) for _, _, m in of}
            if dst_dev != {want[0]} or src_dev != {want[1]}:
                names = ("host", "device")

                def sides(found: set[bool]) -> str:
                    return " and ".join(names[d] for d in sorted(found))

                raise InvalidParamError(
                    f"kind {kind} copies {names[want[1]]}->{names[want[0]]} but src is {sides(src_dev)} memory "
                    f"and dst is {sides(dst_dev)} memory (use ACL_MEMCPY_DEFAULT to let the runtime decide)"
                )
        if len(to) == 1 and len(of) == 1:
            return [(dst, src, count, to[0][2], of[0][2])]
        cuts = sorted({a - dst for a, _, _ in to} | {a - src for a, _, _ in of} | {count})
        plan: list[Chunk] = []
        i = j = 0
        for k in range(len(cuts) - 1):
            off, n = cuts[k], cuts[k + 1] - cuts[k]
            while to[i][0] + to[i][1] <= dst + off:
                i += 1
            while of[j][0] + of[j][1] <= src + off:
                j += 1
            plan.append((dst + off, src + off, n, to[i][2], of[j][2]))
        if src < dst < src + count:  # overlapping, the destination above: the last chunk first, as memmove does
            plan.reverse()
        return plan

    def _run(self, plan: list[Chunk]) -> None:
        """Copy chunk by chunk, in order: local memory under the lock (checking its mapping is still there), memory
        of another server outside it, which a stalled peer would hold for up to VMMSHARE_FABRIC_TIMEOUT (the
        memory stays served until this process's import of it is released, so nothing moves under the copy)."""
        for chunk in plan:
            d, s, n, to, of = chunk
            if not _local(chunk):
                self._remote_copy(to, of, d, s, n)
                continue
            with self.s.lock:
                self._still_mapped(d, n, to)
                self._still_mapped(s, n, of)
                self._local_copy(to, of, d, s, n)

    def _still_mapped(self, ptr: int, size: int, m: MappingEntry | None) -> None:
        if m is not None and (self.memory.mappings.at(ptr) or (0, 0, None))[2] is not m:
            raise InvalidParamError(f"{ptr:#x}+{size} was unmapped while the copy ran")

    def _local_copy(self, to: MappingEntry | None, of: MappingEntry | None, dst: int, src: int, count: int) -> None:
        """A copy between memory of this server (under the lock): the GPU's backend copies if a side is GPU memory."""
        mover = _mover(to, of)
        if mover is None:
            self.s.host.copy(dst, src, count, 0)
        else:
            mover.alloc.backend.copy(dst, src, count, self.s.devices.logical(mover.alloc.device))

    def _remote_copy(self, to: MappingEntry | None, of: MappingEntry | None, dst: int, src: int, count: int) -> None:
        """A copy with memory of another server on one side or both: the engine moves the bytes to and from memory
        the CPU can address; memory it cannot (a GPU's) on the other side goes through a host bounce buffer."""
        remote = self.s.remote
        if _remote(to):
            if _remote(of):
                remote.between(to.alloc.mem, dst - to.ptr, of.alloc.mem, src - of.ptr, count)
                return
            far, near, to_far = to, of, True
        else:
            assert _remote(of), "a copy with no side of another server is a local copy"
            far, near, to_far = of, to, False
        if near is None or near.alloc.backend.cpu_access:
            if to_far:
                remote.write(far.alloc.mem, dst - far.ptr, src, count)
            else:
                remote.read(far.alloc.mem, src - far.ptr, dst, count)
            return
        with self.s.lock:  # memory the CPU cannot address is copied under the lock, as any GPU copy is
            self._bounce(near, far, not to_far, dst, src, count)

    def _bounce(self, near: MappingEntry, far: MappingEntry, to_near: bool, dst: int, src: int, count: int) -> None:
        """Copy between memory of another server (`far`) and local memory the CPU cannot address (`near`), through
        host memory: its backend copies one way, the engine the other."""
        remote, backend, device = self.s.remote, near.alloc.backend, self.s.devices.logical(near.alloc.device)
        bounce = mman.map_anonymous(min(count, BOUNCE))
        try:
            for done in range(0, count, BOUNCE):
                n = min(BOUNCE, count - done)
                if to_near:
                    remote.read(far.alloc.mem, src - far.ptr + done, bounce, n)
                    backend.copy(dst + done, bounce, n, device)
                else:
                    backend.copy(bounce, src + done, n, device)
                    remote.write(far.alloc.mem, dst - far.ptr + done, bounce, n)
        finally:
            mman.unmap(bounce, min(count, BOUNCE))

    def memset(self, ptr: int, max_count: int, value: int, count: int) -> None:
        if count > max_count:
            raise InvalidParamError(f"count {count} is larger than maxCount {max_count}")
        if ptr == 0:
            raise InvalidParamError("devPtr is NULL")
        if count == 0:
            return
        with self.s.lock:
            pieces = self._pieces(ptr, count, True, "devPtr")
            if len(pieces) == 1 and not _remote(pieces[0][2]):
                self._local_fill(pieces[0][2], ptr, value, count)
                return
        for p, n, m in pieces:
            if _remote(m):
                self.s.remote.set(m.alloc.mem, p - m.ptr, value, n)
                continue
            with self.s.lock:
                self._still_mapped(p, n, m)
                self._local_fill(m, p, value, n)

    def _local_fill(self, m: MappingEntry | None, ptr: int, value: int, count: int) -> None:
        if m is None:
            self.s.host.fill(ptr, value, count, 0)
        else:
            m.alloc.backend.fill(ptr, value, count, self.s.devices.logical(m.alloc.device))

    def memcpy_async(self, dst: int, dest_max: int, src: int, count: int, kind: int, stream: int) -> None:
        """Queue a copy on `stream`: checked now (a bad range fails here), checked again and done when its turn
        comes (memory unmapped meanwhile fails then, reported by synchronize_stream)."""
        if count > dest_max:
            raise InvalidParamError(f"count {count} is larger than destMax {dest_max}")
        s = self.s.devices.stream_here(stream)
        with self.s.lock:
            self._plan(dst, src, count, kind)
        s.submit("memcpy_async", lambda: self.memcpy(dst, dest_max, src, count, kind))

    def memset_async(self, ptr: int, max_count: int, value: int, count: int, stream: int) -> None:
        """Queue a fill on `stream` (checked now and when it runs, as `memcpy_async`)."""
        if count > max_count:
            raise InvalidParamError(f"count {count} is larger than maxCount {max_count}")
        s = self.s.devices.stream_here(stream)
        with self.s.lock:
            self._pieces(ptr, count, True, "devPtr")
        s.submit("memset_async", lambda: self.memset(ptr, max_count, value, count))

    def check_readable(self, ptr: int, size: int) -> None:
        """Raise unless the CPU can read `[ptr, ptr+size)` (GPU memory it cannot, nor another server's)."""
        with self.s.lock:
            for p, _, m in self._pieces(ptr, size, False, "ptr"):
                if _remote(m):
                    raise FeatureNotSupportedError(f"{p:#x} cannot be viewed by the CPU: {NO_CPU_ACCESS}")
                if m is not None and not m.alloc.backend.cpu_access:
                    raise InvalidParamError(f"{p:#x} is GPU memory, which the CPU cannot read: memcpy it to the host")


def _mover(to: MappingEntry | None, of: MappingEntry | None) -> MappingEntry | None:
    """In a copy within this server, whichever side the CPU cannot address decides who copies: its backend (a
    GPU's; the destination's first), or (None) the CPU."""
    for m in (to, of):
        if m is not None and not m.alloc.backend.cpu_access:
            return m
    return None


def _remote(m: MappingEntry | None) -> TypeGuard[MappingEntry]:
    """Whether `m` maps memory of another server (a side no local backend can copy)."""
    return m is not None and m.alloc.backend.remote


def _local(chunk: Chunk) -> bool:
    """Whether a copy chunk stays on this server (neither side is memory of another one)."""
    return not (_remote(chunk[3]) or _remote(chunk[4]))


def _on_device(m: MappingEntry | None) -> bool:
    """Device memory for the memcpy kinds: memory placed on a device, and any memory of another server, whatever its
    location there (docs/fabric.md; the C library's ranges.c says the same)."""
    return m is not None and (m.alloc.prop.location.type == C.ACL_MEM_LOCATION_TYPE_DEVICE or m.alloc.backend.remote)


def process_range_ok(ptr: int, size: int, write: bool) -> bool:
    """Whether /proc/self/maps shows `[ptr, ptr+size)` readable (and writable when asked), end to end."""
    need = "w" if write else "r"
    end, cursor = ptr + size, ptr
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                span, perms = line.split(None, 2)[:2]
                lo_s, hi_s = span.split("-")
                lo, hi = int(lo_s, 16), int(hi_s, 16)
                if hi <= cursor:
                    continue
                if lo > cursor or need not in perms or "r" not in perms:
                    return False
                cursor = hi
                if cursor >= end:
                    return True
    except OSError:
        return False
    return False
