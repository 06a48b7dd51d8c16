"""What the multiprocessing children of the Pythonic travel and pool tests run.

A module of its own: a spawned child imports the functions it runs by module, and this one imports nothing of
the test suite (conftest would point the child at a broker of its own, not its parent's).
"""

from __future__ import annotations

import os
from typing import Any

import vmmshare
from vmmshare._process import runtime


def fds() -> int:
    """This process's open file descriptors."""
    return len(os.listdir("/proc/self/fd"))


def take(source: Any) -> Any:
    """The next object from a Queue or a Pipe's end."""
    return source.recv() if hasattr(source, "recv") else source.get()


def describe(obj: Any) -> dict[str, Any]:
    """What arrived: its kind, size, state and first and last bytes (through a numpy view of it)."""
    out: dict[str, Any] = {"type": type(obj).__name__, "size": obj.size, "closed": obj.closed}
    view = obj.map() if isinstance(obj, vmmshare.PhysicalMemory) else obj
    out["first"], out["last"] = view.read(1)[0], view.read(1, view.size - 1)[0]  # copies: GPU memory too
    if not view.on_gpu:  # and a CPU view where there is one
        a = view.numpy()
        assert (int(a[0]), int(a[-1])) == (out["first"], out["last"])
        del a
    if view is not obj:
        view.close()
    return out


def receive_and_write(q: Any, r: Any, rounds: int = 1) -> None:
    """Take `rounds` objects from `q`; for each, report it and write 0xAB at byte 1 (the sender checks)."""
    try:
        for _ in range(rounds):
            obj = take(q)
            r.put(describe(obj))
            view = obj.map() if isinstance(obj, vmmshare.PhysicalMemory) else obj
            view.write(b"\xab", 1)
            if view is not obj:
                view.close()
            obj.close()
        r.put("done")
    except vmmshare.AclError as exc:
        r.put(("error", exc.code, exc.message))


def argument(obj: Any, r: Any) -> None:
    """A Process argument: report it, write at byte 1, close it."""
    r.put(describe(obj))
    view = obj.map() if isinstance(obj, vmmshare.PhysicalMemory) else obj
    view.write(b"\xab", 1)
    if view is not obj:
        view.close()
    obj.close()


def refused(q: Any, r: Any) -> None:
    """Report the error that receiving an object from `q` raises here (with this process's pid)."""
    try:
        obj = q.get()
    except vmmshare.AclError as exc:
        r.put(("error", exc.code, exc.message, runtime().sharing.bare_tgid(), runtime().counts()))
        return
    r.put(("arrived", repr(obj)))


def keep_both(q: Any, r: Any) -> None:
    """Receive a mapping, keep it, receive it again (grown): report both, and that one import serves each chunk."""
    first = q.get()
    r.put(describe(first))
    second = q.get()
    r.put(describe(second))
    a = second.numpy()
    r.put({"middle": int(a[first.size]), "first_still": int(first.numpy()[0]),
           "allocations": runtime().counts()["allocations"], "chunks": len(second.chunks)})
    del a
    first.close()
    second.close()
    r.put("done")


def fd_round_trip(q: Any, r: Any) -> None:
    """Receive one object to warm up (the broker connection), then count fds before and after a second."""
    warm = q.get()
    warm.close()
    del warm
    before = fds()
    obj = q.get()
    during = fds()
    obj.close()
    del obj
    r.put((before, during, fds(), runtime().counts()))


def pool_buffers(q: Any, r: Any) -> None:
    """Receive pool buffers until None: report each (offset, size, meta, bytes) and write 0x5A over its first byte
    and 0xA5 over its last; at the end, how many imports this process holds (one per chunk, not per buffer)."""
    kept = []
    try:
        while True:
            buf = q.get()
            if buf is None:
                break
            r.put({"offset": buf.offset, "size": buf.size, "meta": buf.meta, "first": buf.read(1)[0],
                   "last": buf.read(1, buf.size - 1)[0], "imported": buf.pool.imported,
                   "chunks": len(buf.pool.chunks)})
            buf.write(b"\x5a")
            buf.write(b"\xa5", buf.size - 1)
            kept.append(buf)
        r.put({"allocations": runtime().counts()["allocations"], "pools": len({id(b.pool) for b in kept})})
        for buf in kept:
            buf.close()
        r.put("done")
    except vmmshare.AclError as exc:
        r.put(("error", exc.code, exc.message))


def pool_after_close(q: Any, r: Any) -> None:
    """Keep a buffer; after its pool was closed in the exporter, read it again and take one more buffer."""
    buf = q.get()
    r.put("got")
    q.get()  # the exporter closed the pool
    r.put(int(buf.numpy()[0]))
    try:
        q.get()
        r.put("imported")
    except vmmshare.AclError as exc:
        r.put(("error", exc.code, exc.message))
    buf.close()


def import_pool(q: Any, r: Any) -> None:
    """Receive a MemoryPool itself and report what it allows."""
    pool = q.get()
    out: dict[str, Any] = {"imported": pool.imported, "chunks": len(pool.chunks), "capacity": pool.capacity}
    try:
        pool.allocate(10)
    except vmmshare.AclError as exc:
        out["allocate"] = exc.code
    pool.close()
    r.put(out)


def bump(buf: Any) -> int:
    """A worker pool's task: add one to the buffer's first byte, return what it was."""
    a = buf.numpy()
    was = int(a[0])
    a[0] = was + 1
    del a
    buf.close()
    return was


def relay(q: Any, onward: Any) -> None:
    """Receive an object and send it on to another process (which imports it from the exporter)."""
    obj = q.get()
    obj.write(b"\x01", 2)
    onward.put(obj)
    q.get()  # hold on until the parent is done (the receiver imports from the exporter, not from here)
    obj.close()


def inherited_then_new(obj: Any, r: Any) -> None:
    """A forked child: allocate after the fork, then close the inherited object; the new memory must stay ours
    (the child's runtime numbers handles afresh: the parent's handle must not free it)."""
    try:
        mem = vmmshare.Device(0).allocate(2 << 20)
        obj.close()
        m = mem.map()
        m.write(b"\x42")
        r.put((m.read(1), runtime().counts()["allocations"]))
        m.close()
        mem.close()
    except vmmshare.AclError as exc:
        r.put(("error", exc.code, exc.message))


def inherited_unexported(obj: Any, r: Any) -> None:
    try:
        obj.map()
        r.put("mapped")
    except vmmshare.AclError as exc:
        r.put(("error", exc.code, exc.message))
    obj.close()


def shared_import(q: Any, r: Any) -> None:
    """Receive a Mapping, then its PhysicalMemory, then the Mapping again: one import serves all three; closing
    the mappings leaves the PhysicalMemory (the receiver's to close) working, and closing it leaves nothing."""
    first = q.get()
    memory = q.get()
    second = q.get()
    out: dict[str, Any] = {"one_import": runtime().counts()["allocations"], "same": second.memory is memory}
    first.close()
    second.close()
    again = memory.map()
    out["after"] = int(again.numpy()[0])
    again.close()
    memory.close()
    out["left"] = runtime().counts()
    r.put(out)


def inherited_pool(pool: Any, buf: Any, r: Any) -> None:
    """A forked child with its parent's pool and buffer: the buffer reads, the pool refuses to allocate, and
    closing both frees nothing of the parent's."""
    out: dict[str, Any] = {"first": buf.read(1)[0]}
    try:
        pool.allocate(10)
    except vmmshare.AclError as exc:
        out["allocate"] = (exc.code, "inherited" in exc.message)
    buf.close()
    pool.close()
    out["counts"] = runtime().counts()["allocations"]
    r.put(out)
