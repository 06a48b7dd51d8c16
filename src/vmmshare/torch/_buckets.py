"""Buckets for weight updates: many tensors in one shared allocation, published version after version.

A bucket is a `vmmshare.api.pools.MemoryPool` of one chunk (so one export, one handle) seen from torch: a header
buffer and `versions` slot buffers carved from it, each slot holding every tensor at an aligned offset. The
`Publisher` writes the next version into a slot no reader holds, then flips `current` to it; a `Subscriber` pins
the current slot in its own reader record and maps it as a dict of tensor views, so it always sees one whole
version, never a torn one.

Every subscriber maps the bucket writable, so nothing in it is trusted by anyone: each reader has a record of its own
instead, a small pool the publisher makes and exports to that reader alone (the broker refuses any other importer),
which only the publisher and that reader can write. The publisher writes there what a reader goes by (`current` and
every slot's version word) and reads the reader's pin from there; a subscriber that scribbles on the bucket's
header, or on its own record, can fool only itself, and can neither move another reader's pin nor make the
publisher write into a slot another reader holds.

A reader record (the first 4 KiB of its pool) and the bucket's header (its first 4 KiB, informative only), both
little-endian 64-bit words:

    0   magic            8   current (version << 8 | slot; 0 before the first publish)
    16  slot count      24   slot_seq[8]: the version a slot holds, WRITING while it is being written
    128 (record only) pid (u32) and flags (u32), the reader's      136 (record only) the pinned version, the reader's

Ordering: a reader stores its pin, then checks that the slot still holds the version it pinned; the publisher marks
a slot WRITING in every record, then reads every pin. Both are store-then-load (Dekker), so they need a full fence
between: the reader gets it for free and the publisher pays for both with membarrier(2) (the asymmetric-fence
idiom), which makes every thread of every (registered) process pass a full barrier. Aligned 64-bit loads and stores
are single-copy atomic on x86-64 and aarch64, the platforms vmmshare runs on.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import pickle
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._process import runtime
from ..api.pool_buffers import PoolBuffer
from ..api.pools import MemoryPool
from ..books.listing import LIST_REMOTE
from ..constants import ACL_MEMCPY_DEFAULT
from ..errors import FeatureNotSupportedError, InvalidParamError, MemoryAllocationError
from ._tensors import _pid_list

log = logging.getLogger(__name__)

__all__ = ["BucketEntry", "BucketTicket", "Publisher"]

HEADER = 4096
MAGIC = int.from_bytes(b"vmmsbkt1", "little")
MAX_SLOTS = 8
SLOT_SEQ = 24
RECORD_BYTES = 4096  # a reader record (its pool rounds it up to the allocation granularity)
RECORD_MAGIC = int.from_bytes(b"vmmsrec1", "little")
READER = 128  # a record's pid (u32) and flags (u32), written by its reader
PINNED = 136  # a record's pinned version, written by its reader
MAX_READERS = 165
WRITING = (1 << 64) - 1
EXPEDITED = 1  # reader record flag: registered for MEMBARRIER_CMD_GLOBAL_EXPEDITED
SLOT_ALIGNMENT = 4096
DEFAULT_ALIGNMENT = 512  # what torch's caching allocator rounds to; a multiple of every dtype's size

_MEMBARRIER = {"x86_64": 324, "aarch64": 283}.get(os.uname().machine)
_CMD_QUERY, _CMD_GLOBAL, _CMD_GLOBAL_EXPEDITED, _CMD_REGISTER_GLOBAL_EXPEDITED = 0, 1, 2, 4
_libc = ctypes.CDLL(None, use_errno=True)


def _membarrier(cmd: int) -> bool:
    if _MEMBARRIER is None:
        return False
    return int(_libc.syscall(_MEMBARRIER, cmd, 0, 0)) == 0


def _supported() -> int:
    """membarrier's command mask (0 where the kernel or a seccomp filter refuses it)."""
    if _MEMBARRIER is None:
        return 0
    got = int(_libc.syscall(_MEMBARRIER, _CMD_QUERY, 0, 0))
    return max(got, 0)


@dataclass(frozen=True)
class BucketEntry:
    """One tensor of a bucket: where it lies in every slot, and what it is."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # bytes from the start of a slot
    nbytes: int


@dataclass(frozen=True)
class BucketTicket:
    """What a subscriber needs, picklable: the pool's header and slot buffers (they travel as the pool does: one
    import of its one chunk) and the tensors' layout."""

    header: PoolBuffer
    slots: tuple[PoolBuffer, ...]
    entries: tuple[BucketEntry, ...]
    records: tuple[tuple[int, int, bytes], ...] = ()  # (server id, pid, its record pickled): each imports its own


def _layout(tensors: Mapping[str, torch.Tensor], alignment: int) -> tuple[tuple[BucketEntry, ...], int]:
    if not isinstance(tensors, Mapping) or not tensors:
        raise InvalidParamError("a bucket holds a non-empty dict of name -> tensor (a state_dict)")
    entries, offset = [], 0
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise InvalidParamError(f"bucket entries are str -> torch.Tensor, got {name!r} -> {type(t).__name__}")
        if t.device.type != "cpu":
            raise InvalidParamError(f"{name}: buckets hold CPU tensors here, not {t.device}")
        nbytes = t.numel() * t.element_size()
        entries.append(BucketEntry(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes))
        offset += -(-max(nbytes, 1) // alignment) * alignment
    return tuple(entries), -(-offset // SLOT_ALIGNMENT) * SLOT_ALIGNMENT


def _views(buf: PoolBuffer, entries: Iterable[BucketEntry]) -> dict[str, torch.Tensor]:
    """Every entry as a tensor over `buf` (one DLPack wrap of the slot, zero-copy)."""
    storage = torch.utils.dlpack.from_dlpack(buf).untyped_storage()
    out = {}
    for e in entries:
        dt = getattr(torch, e.dtype)
        t = torch.empty(0, dtype=dt)
        stride, acc = [], 1
        for d in reversed(e.shape):
            stride.append(acc)
            acc *= max(d, 1)
        t.set_(storage, e.offset // dt.itemsize, e.shape, tuple(reversed(stride)))
        out[e.name] = t
    return out


class _Header:
    """The header words of a bucket, read and written in place (local memory) or through copies (another
    server's memory, reached through the transfer engine)."""

    def __init__(self, buf: PoolBuffer) -> None:
        self.buf = buf
        self.remote = buf.remote
        self.ptr = buf.ptr
        self._word = ctypes.c_uint64()

    def _check_open(self) -> None:
        """Refuse (107000) once the header's buffer or its pool is closed: its pages are unmapped then, and a load or
        store there would kill the process (SIGSEGV). Called under the pool's lock, which its close() takes."""
        if self.buf.closed:
            raise InvalidParamError(f"this bucket's memory is closed here ({self.buf._closed_message()})")

    def load(self, offset: int) -> int:
        if not self.remote:
            with self.buf.pool._lock:
                self._check_open()
                return int(ctypes.c_uint64.from_address(self.ptr + offset).value)
        runtime().copies.memcpy(ctypes.addressof(self._word), 8, self.ptr + offset, 8, ACL_MEMCPY_DEFAULT)
        return int(self._word.value)

    def store(self, offset: int, value: int) -> None:
        if not self.remote:
            with self.buf.pool._lock:
                self._check_open()
                ctypes.c_uint64.from_address(self.ptr + offset).value = value
            return
        self._word.value = value
        runtime().copies.memcpy(self.ptr + offset, 8, ctypes.addressof(self._word), 8, ACL_MEMCPY_DEFAULT)


@dataclass
class _Record:
    """A reader's record, as the publisher holds it: its own pool (exported to that reader alone) and its words."""

    pool: MemoryPool
    buf: PoolBuffer
    words: _Header


class Publisher:
    """Publishes versions of a state dict (name -> CPU tensor) into one shared bucket.

    The bucket is laid out from `tensors` (names, dtypes, shapes: every version has the same), each tensor at an
    `alignment`-byte offset, with `versions` slots (2: double buffering). `pids` (host pids, `bare_pid()` in the
    subscriber) may subscribe; `allow()` adds more (at most 165 readers). `publish()` writes a version."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], pids: Iterable[int] = (), versions: int = 2,
                 alignment: int = DEFAULT_ALIGNMENT, device: int = 0, share_type: str = "default") -> None:
        if isinstance(versions, bool) or not isinstance(versions, int) or not 2 <= versions <= MAX_SLOTS:
            raise InvalidParamError(f"versions must be an int from 2 to {MAX_SLOTS}, got {versions!r}")
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1 or alignment & (
                alignment - 1) or alignment > SLOT_ALIGNMENT:
            raise InvalidParamError(f"alignment must be a power of two up to {SLOT_ALIGNMENT}, got {alignment!r}")
        listed = _pid_list(pids)
        mask = _supported()
        if not mask & _CMD_GLOBAL:
            raise FeatureNotSupportedError("a bucket publisher needs membarrier(2), which this kernel or a seccomp "
                                           "filter refuses: allow the membarrier system call")
        self.entries, self.slot_size = _layout(tensors, alignment)
        self._index = {e.name: e for e in self.entries}
        total = HEADER + versions * self.slot_size
        self.pool = MemoryPool(max_size=total, chunk_size=total, device=device, pids=listed,
                               share_type=share_type, alignment=SLOT_ALIGNMENT)
        try:
            self._header_buf = self.pool.allocate(HEADER)
            self._slots = tuple(self.pool.allocate(self.slot_size) for _ in range(versions))
        except BaseException:
            self.pool.close()
            raise
        self._views = [_views(s, self.entries) for s in self._slots]
        self._h = _Header(self._header_buf)
        self._h.store(0, MAGIC)
        self._h.store(16, versions)
        for s in range(versions):
            self._h.store(SLOT_SEQ + 8 * s, 0)
        self._h.store(8, 0)
        self._device, self._share_type = device, share_type
        self._readers: dict[tuple[int, int], _Record] = {}  # (server id, pid) -> its record
        self._server = runtime().config.server_id
        self._lock = threading.Lock()
        self.version = 0
        self._slot_versions: dict[int, int] = {}  # slot -> the version it holds
        self._current_slot = 0
        self._changed_at: dict[str, int] = {}  # name -> the version that last wrote it
        self._expedited = bool(mask & _CMD_GLOBAL_EXPEDITED)
        try:
            self._add_readers(listed)
        except BaseException:
            self._close_records()
            self.pool.close()
            raise

    def __repr__(self) -> str:
        return (f"<Publisher of {len(self.entries)} tensors, {len(self._slots)} slots of {self.slot_size} bytes, "
                f"version {self.version}>")

    @property
    def nbytes(self) -> int:
        """The bytes of one version (every tensor, with its alignment padding)."""
        return self.slot_size

    def _add_readers(self, pids: list[int], server: int | None = None) -> None:
        where = self._server if server is None else server
        for pid in dict.fromkeys(pids):
            if (where, pid) in self._readers:
                continue
            if len(self._readers) >= MAX_READERS:
                raise InvalidParamError(f"a bucket has at most {MAX_READERS} subscribers")
            self._readers[(where, pid)] = self._new_record(pid, server)

    def _new_record(self, pid: int, server: int | None) -> _Record:
        """A reader's record: a pool of its own that only this publisher and that reader may import (and so
        write), holding the words the reader goes by, as they are now."""
        pool = MemoryPool(max_size=RECORD_BYTES, chunk_size=RECORD_BYTES, device=self._device,
                          pids=[pid] if server is None else [], share_type=self._share_type, alignment=SLOT_ALIGNMENT)
        try:
            if server is not None:
                pool.allow([pid], server)
            buf = pool.allocate(RECORD_BYTES)
            words = _Header(buf)
            words.store(READER, pid)
            words.store(PINNED, 0)
            words.store(16, len(self._slots))
            for s in range(len(self._slots)):
                words.store(SLOT_SEQ + 8 * s, self._slot_versions.get(s, 0))
            words.store(8, self.version << 8 | self._current_slot if self.version else 0)
            words.store(0, RECORD_MAGIC)
        except BaseException:
            pool.close()
            raise
        return _Record(pool, buf, words)

    def _tell(self, offset: int, value: int) -> None:
        """Write a word every reader goes by into each reader's record (and the bucket's header, for show)."""
        self._h.store(offset, value)
        for record in self._readers.values():
            record.words.store(offset, value)

    def _close_records(self) -> None:
        for record in self._readers.values():
            with contextlib.suppress(Exception):
                record.pool.close()

    def allow(self, pids: Iterable[int], server: int | None = None) -> None:
        """Let more processes (host pids) subscribe; with `server`, processes of that server (a FABRIC bucket read
        across servers: they copy versions out through the transfer engine)."""
        listed = _pid_list(pids)
        if not listed:
            raise InvalidParamError("allow() takes at least one pid")
        with self._lock:
            self.pool.allow(listed, server)
            self._add_readers(listed, server)

    def ticket(self) -> BucketTicket:
        """What to send a subscriber (through pickle, a multiprocessing queue, ...): it names the readers allowed
        when it is made, each of which imports its own record (take a new ticket after `allow()`)."""
        records = tuple((server, pid, pickle.dumps(record.buf)) for (server, pid), record in self._readers.items())
        return BucketTicket(self._header_buf, self._slots, self.entries, records)

    def _fence(self) -> None:
        """A full barrier in this thread and in every thread of the subscribers (membarrier(2))."""
        expedited = self._expedited and all(
            r.words.load(READER) >> 32 & EXPEDITED for r in self._readers.values())
        if not _membarrier(_CMD_GLOBAL_EXPEDITED if expedited else _CMD_GLOBAL):
            err = ctypes.get_errno()
            raise FeatureNotSupportedError(f"membarrier(2) failed: {errno.errorcode.get(err, err)}")

    def _pins(self) -> dict[tuple[int, int], int]:
        """(server, pid) -> the version each reader has pinned (0: none)."""
        return {key: r.words.load(PINNED) for key, r in self._readers.items()}

    def _importers(self) -> set[tuple[int, int]] | None:
        """The (server, pid)s that hold an import of the bucket now (the broker's word: a dead reader is not there);
        None when the broker's list is cut short, so nobody can be taken for gone. A pid of another server also
        counts here as this server's: that errs towards waiting, never towards dropping a live reader's pin."""
        handle = self.pool.chunks[0].shareable
        if handle is None:
            return None
        node: Any = runtime().node  # the broker client: it lists the node's exports, as `vmmshare ls` does
        for e in node.listing()["exports"]:
            if e["handle"] != "(hidden)" and int(e["handle"], 16) == handle.value:
                remote = e.get("remote_importers", [])
                if e["importer_count"] != len(e["importers"]) or len(remote) >= LIST_REMOTE:
                    return None
                live = {(self._server, p) for p in e["importers"]}
                for item in remote:
                    server, _, pid = item.partition(":")
                    live.add((int(server, 16), int(pid)))
                return live
        return None

    def _claim(self, timeout: float) -> int:
        """A slot to write the next version into: not the current one, and pinned by no reader. Waits up to `timeout`
        seconds for readers to let go (a reader that died lets go: the broker no longer lists it as importing).

        The publisher goes by its own books (which slot is current, which version each holds), never by the header's
        words, which every subscriber can write, and reads each reader's pin from that reader's own record: a reader
        that scribbles on the header, or on its own record, can only delay a publish."""
        current = self._current_slot if self.version else -1
        deadline = time.monotonic() + timeout
        pause = 0.0005
        while True:
            for s in range(len(self._slots)):
                if s == current:
                    continue
                seq_at = SLOT_SEQ + 8 * s
                held = self._slot_versions.get(s, 0)
                self._tell(seq_at, WRITING)
                self._fence()
                if held == 0 or held not in self._pins().values():
                    return s
                self._tell(seq_at, held)  # a reader holds it: leave it as it was
            pins = self._pins()
            live = self._importers()
            for key, v in pins.items():
                if v and live is not None and key not in live:  # died (or let go of the bucket) holding a pin
                    log.info("bucket reader %d of server %#x is gone: its pin of version %d is dropped", key[1],
                             key[0], v)
                    self._readers[key].words.store(PINNED, 0)
            if time.monotonic() >= deadline:
                holders = sorted(pid if server == self._server else f"{server:#x}:{pid}"
                                 for (server, pid), v in self._pins().items() if v)
                raise MemoryAllocationError(f"every slot of this bucket is in use: readers {holders} hold older "
                                            "versions; they must release their snapshots (or make the bucket with "
                                            "more versions)")
            time.sleep(pause)  # a reader holds a snapshot: give it time to release it
            pause = min(pause * 2, 0.05)

    def publish(self, tensors: Mapping[str, torch.Tensor] | None = None, changed: Iterable[str] | None = None,
                timeout: float = 30.0) -> int:
        """Write the next version and flip subscribers to it; return its number (1, 2, ...).

        `tensors` gives the new values (names of the bucket; a missing name keeps its value); with `changed`, only
        those names are read from `tensors`. The slot written last held an older version, so besides the tensors
        given, the tensors that changed since that version are brought up to date from the current slot: an update
        costs a memcpy of the bytes that changed."""
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout < 0:
            raise InvalidParamError(f"timeout must be a number of seconds, got {timeout!r}")
        given = dict(tensors or {})
        names = list(given) if changed is None else list(changed)
        for name in names:
            if name not in self._index:
                raise InvalidParamError(f"{name!r} is not in this bucket")
            if name not in given:
                raise InvalidParamError(f"{name!r} is named as changed but no tensor is given for it")
            e, t = self._index[name], given[name]
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != e.shape or str(t.dtype).removeprefix(
                    "torch.") != e.dtype:
                raise InvalidParamError(f"{name}: expected {e.dtype} {list(e.shape)}, got "
                                        f"{getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', []))}")
        with self._lock:
            if self.pool.closed:
                raise InvalidParamError("this Publisher is closed")
            s = self._claim(float(timeout))
            version = self.version + 1
            try:
                held = self._slot_versions.get(s, 0)
                target, current = self._views[s], self._views[self._current_slot] if self.version else None
                fresh = set(names)
                with torch.no_grad():
                    for name in fresh:
                        target[name].copy_(given[name])
                    if current is not None:  # what changed after this slot's version and is not written now
                        for name, at in self._changed_at.items():
                            if at > held and name not in fresh:
                                target[name].copy_(current[name])
            except BaseException:
                self._tell(SLOT_SEQ + 8 * s, 0)  # half written: no reader may take it
                self._slot_versions[s] = 0
                for name in self._index:
                    self._changed_at[name] = version  # every tensor is rewritten next time
                raise
            for name in fresh:
                self._changed_at[name] = version
            self._fence()  # the data before the words that publish it
            self._h.store(0, MAGIC)  # rewritten each time: a subscriber may have scribbled on them
            self._h.store(16, len(self._slots))
            self._tell(SLOT_SEQ + 8 * s, version)
            self._tell(8, version << 8 | s)
            self._slot_versions[s] = version
            self._current_slot = s
            self.version = version
            return version

    def close(self) -> None:
        """Free the bucket here: its export is revoked (subscribers keep what they mapped, the last version).
        BufferError while tensors of this process still view it (a Subscriber's snapshots here)."""
        with self._lock:
            self._views = []
            try:
                self.pool.close()
            except BaseException:
                self._views = [_views(s, self.entries) for s in self._slots]  # still usable, as it was
                raise
            self._close_records()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
