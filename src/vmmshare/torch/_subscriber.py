"""The reading side of a bucket (`_buckets.py` has its layout, records and ordering): a `Subscriber` pins the
current version in its own reader record and sees it as a `Snapshot` of tensor views, or copies it out. It goes by
its record alone, which only it and the publisher can write: nothing in the bucket's header, which every subscriber
can write, is trusted."""

from __future__ import annotations

import math
import pickle
import threading
import weakref
from collections.abc import Iterator

import torch

from .._process import runtime
from ..api.pool_buffers import PoolBuffer
from ..constants import ACL_MEMCPY_DEFAULT
from ..errors import FeatureNotSupportedError, InvalidParamError, MemoryAllocationError, NoPermissionError
from ._buckets import (
    _CMD_REGISTER_GLOBAL_EXPEDITED,
    EXPEDITED,
    MAX_SLOTS,
    PINNED,
    READER,
    RECORD_BYTES,
    RECORD_MAGIC,
    SLOT_SEQ,
    BucketEntry,
    BucketTicket,
    _Header,
    _membarrier,
    _views,
)
from ._tensors import bare_pid

__all__ = ["Snapshot", "Subscriber"]


class Snapshot:
    """One whole version of a bucket, as tensor views (zero-copy), pinned until `release()` (or the end of a with
    block): the publisher writes no version into it meanwhile. After release the views may change under you."""

    def __init__(self, subscriber: Subscriber, version: int, tensors: dict[str, torch.Tensor]) -> None:
        self.version = version
        self.tensors = tensors
        self._sub: weakref.ref[Subscriber] = weakref.ref(subscriber)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def release(self) -> None:
        sub = self._sub()
        if sub is not None:
            sub._unpin(self)

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Subscriber:
    """The reading side of a bucket, made from the publisher's `ticket()` in another process."""

    def __init__(self, ticket: BucketTicket) -> None:
        if not isinstance(ticket, BucketTicket):
            raise InvalidParamError(f"Subscriber takes a Publisher's ticket(), not {type(ticket).__name__}")
        self._h = _Header(ticket.header)  # the bucket's header: only to refuse a closed bucket, never read for trust
        pid, server = bare_pid(), runtime().config.server_id
        records = ticket.records if isinstance(ticket.records, tuple) else ()
        mine = [blob for entry in records if isinstance(entry, tuple) and len(entry) == 3
                and entry[:2] == (server, pid) for blob in entry[2:]]
        if not mine or not isinstance(mine[0], bytes):
            raise NoPermissionError(f"this process (host pid {pid}) is not a subscriber of the bucket: the publisher "
                                    f"must pass it in pids= or call allow([{pid}]), then make the ticket")
        record = pickle.loads(mine[0])  # imports the record: the broker lets this process alone (and the publisher)
        if not isinstance(record, PoolBuffer) or record.size < RECORD_BYTES:
            raise InvalidParamError("the ticket's reader record is not a bucket record")
        self._r = _Header(record)
        if self._r.load(0) != RECORD_MAGIC or self._r.load(READER) & 0xFFFFFFFF != pid:
            raise InvalidParamError("this memory is not a vmmshare bucket's reader record for this process")
        nslots = self._r.load(16)
        if nslots != len(ticket.slots) or not 2 <= nslots <= MAX_SLOTS:
            raise InvalidParamError(f"the bucket's record has {nslots} slots, the ticket {len(ticket.slots)}")
        self._slots = ticket.slots
        self.entries = _checked(ticket.entries, min(s.size for s in ticket.slots))
        self.remote = ticket.header.remote
        self._record_buf = record
        flags = EXPEDITED if not self.remote and _membarrier(_CMD_REGISTER_GLOBAL_EXPEDITED) else 0
        self._r.store(READER, pid | flags << 32)
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        self._pinned: Snapshot | None = None
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        """The latest version published (0: none yet)."""
        if not self.remote:
            self._h.load(0)  # 107000 once the bucket is closed here
        return self._r.load(8) >> 8

    def _pin(self) -> tuple[int, int]:
        """Pin the current version in this reader's record: (version, slot)."""
        if not self.remote:
            self._h.load(0)  # 107000 once the bucket is closed here (its pages are unmapped): never a crash
        for _ in range(1000):
            cur = self._r.load(8)
            if cur == 0:
                raise InvalidParamError("nothing is published in this bucket yet")
            version, slot = cur >> 8, cur & 0xFF
            if slot >= len(self._slots):
                raise InvalidParamError(f"the bucket's header names slot {slot} of {len(self._slots)}")
            self._r.store(PINNED, version)
            if self._r.load(SLOT_SEQ + 8 * slot) == version:
                return version, slot
        raise MemoryAllocationError("the bucket's publisher overwrote every version this reader tried to take")

    def latest(self) -> Snapshot:
        """The latest whole version as a dict of tensor views, pinned until released (one snapshot at a time per
        subscriber: taking a new one releases the one before)."""
        if self.remote:
            raise FeatureNotSupportedError("this bucket is another server's memory, which the CPU cannot view: use "
                                           "copy_latest() to copy it into local tensors through the transfer engine")
        with self._lock:
            version, slot = self._pin()
            views = self._views.get(slot)
            if views is None:
                views = self._views[slot] = _views(self._slots[slot], self.entries)
            self._pinned = Snapshot(self, version, dict(views))  # the caller's own dict over the cached views
            return self._pinned

    def copy_latest(self, into: dict[str, torch.Tensor] | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """Copy the latest whole version into local tensors (`into`, or new ones): (version, tensors). Works on
        memory of another server too, through the transfer engine (FABRIC buckets)."""
        out = dict(into or {})
        for e in self.entries:
            t = out.get(e.name)
            if t is None:
                out[e.name] = torch.empty(e.shape, dtype=getattr(torch, e.dtype))
            elif (not isinstance(t, torch.Tensor) or tuple(t.shape) != e.shape or not t.is_contiguous()
                  or str(t.dtype).removeprefix("torch.") != e.dtype or t.device.type != "cpu"):
                raise InvalidParamError(f"{e.name}: into[] must be a contiguous CPU {e.dtype} tensor of shape "
                                        f"{list(e.shape)}")
        with self._lock:
            version, slot = self._pin()
            try:
                base = self._slots[slot].ptr
                copies = runtime().copies
                for e in self.entries:
                    if e.nbytes:
                        dst = out[e.name].data_ptr()
                        copies.memcpy(dst, e.nbytes, base + e.offset, e.nbytes, ACL_MEMCPY_DEFAULT)
            finally:
                self._r.store(PINNED, 0)
                self._pinned = None
        return version, out

    def _unpin(self, snap: Snapshot) -> None:
        with self._lock:
            if self._pinned is snap:
                self._r.store(PINNED, 0)
                self._pinned = None

    def close(self) -> None:
        """Release any snapshot and let go of the bucket (its memory goes when no tensor views it)."""
        with self._lock:
            if self._pinned is not None:
                self._r.store(PINNED, 0)
                self._pinned = None
            self._views.clear()


def _checked(entries: object, slot_size: int) -> tuple[BucketEntry, ...]:
    """A ticket's layout, refused (107000) unless every entry is a tensor that lies inside a slot."""
    if not isinstance(entries, tuple) or not all(isinstance(e, BucketEntry) for e in entries):
        raise InvalidParamError("the ticket's layout is not a tuple of BucketEntry")
    for e in entries:
        dt = getattr(torch, e.dtype, None) if isinstance(e.dtype, str) else None
        ok = (isinstance(e.name, str) and isinstance(dt, torch.dtype) and isinstance(e.shape, tuple)
              and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 62 for d in e.shape)
              and isinstance(e.offset, int) and isinstance(e.nbytes, int) and e.offset >= 0)
        if not ok or dt is None or e.nbytes != math.prod(e.shape) * dt.itemsize or e.offset % dt.itemsize or (
                e.offset + e.nbytes > slot_size):
            raise InvalidParamError(f"the ticket's entry {e.name!r} does not describe a tensor inside the bucket's "
                                    f"{slot_size}-byte slots")
    return entries
