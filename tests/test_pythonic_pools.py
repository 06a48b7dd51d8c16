"""Shareable memory pools: one export per chunk, many buffers carved from them, buffers that
travel as (pool, offset, size) and import through the receiver's one import of the pool; freed buffers go back;
the pool grows by chunks up to its max_size; a buffer used after its pool closed is refused, not a crash."""

from __future__ import annotations

import gc
import multiprocessing as mp
import pickle
from typing import Any

import pytest

import travellers
import vmmshare
from vmmshare import constants as C
from vmmshare._process import runtime

MiB = 1 << 20
CHUNK = 2 * MiB


@pytest.fixture(autouse=True)
def _collected() -> None:
    """Collect first what earlier tests in this process left to the collector: these tests count the runtime's
    objects, and another test's garbage is not theirs (in a parallel run any test may come before)."""
    gc.collect()


@pytest.fixture
def ctx() -> Any:
    return mp.get_context("spawn")


def finish(p: Any) -> None:
    p.join(60)  # a hang guard only
    assert p.exitcode == 0, f"child exited {p.exitcode}"


def test_buffers_are_carved_aligned_and_given_back() -> None:
    before = runtime().counts()
    pool = vmmshare.MemoryPool(max_size=8 * MiB, chunk_size=CHUNK)
    assert (pool.size, pool.capacity, pool.used, len(pool.chunks)) == (CHUNK, 8 * MiB, 0, 1)
    a, b = pool.allocate(100), pool.allocate(1000, meta={"dtype": "float32", "shape": [250]})
    assert a.offset == 0 and b.offset == pool.alignment and b.meta == {"dtype": "float32", "shape": [250]}
    assert b.ptr == pool.ptr + b.offset and b.size == 1000
    c = pool.allocate(10, alignment=4096)
    assert c.offset % 4096 == 0 and c.offset >= b.offset + 1000
    a.numpy()[:] = 1
    assert b.numpy("float32").shape == (250,) and b.read(1) == b"\0"
    used = pool.used
    a.close()
    assert pool.used == used - pool.alignment
    again = pool.allocate(50)
    assert again.offset == 0  # the freed bytes, first fit
    for buf in (again, b, c):
        buf.close()
    assert pool.used == 0
    whole = pool.allocate(CHUNK)  # the runs merged back into one
    assert whole.offset == 0 and len(pool.chunks) == 1
    whole.close()
    pool.close()
    assert runtime().counts() == before


def test_the_pool_grows_by_chunks_up_to_max_size_and_a_buffer_spans_them() -> None:
    before = runtime().counts()
    with vmmshare.MemoryPool(max_size=6 * MiB, chunk_size=CHUNK) as pool:
        small = pool.allocate(MiB)
        big = pool.allocate(4 * MiB)  # grows: from after `small`, across chunk boundaries
        assert len(pool.chunks) == 3 and big.offset == MiB
        big.fill(0x3C)
        assert big.read() == b"\x3c" * (4 * MiB) and int(big.numpy().sum()) == 0x3C * 4 * MiB
        big.write(b"\x01\x02", CHUNK - MiB - 1)  # across the first boundary inside `big`
        assert big.read(2, CHUNK - MiB - 1) == b"\x01\x02"
        with pytest.raises(vmmshare.MemoryAllocationError, match="max_size") as info:
            pool.allocate(2 * MiB)
        assert info.value.code == C.ACL_ERROR_RT_MEMORY_ALLOCATION
        assert len(pool.chunks) == 3 and runtime().counts()["allocations"] == before["allocations"] + 3
        small.close()
        big.close()
    assert runtime().counts() == before


def test_bad_pool_arguments_are_acl_errors_and_leave_nothing() -> None:
    gc.collect()  # what earlier tests in this process left to the collector goes before the count, not during it
    before = runtime().counts()
    for kw in ({"max_size": 0}, {"chunk_size": 0}, {"alignment": 3}, {"alignment": 0}, {"alignment": 4 * MiB},
               {"device": 10_000}, {"access": "x"}, {"pids": [0]}, {"validate_pids": 1}, {"attr": "big"}):
        with pytest.raises(vmmshare.AclError):
            vmmshare.MemoryPool(**kw)
    with vmmshare.MemoryPool(max_size=CHUNK, chunk_size=CHUNK) as pool:
        for args, kw in (((0,), {}), ((-1,), {}), (("1",), {}), ((10,), {"alignment": 6}),
                         ((10,), {"meta": [1]}), ((3 * MiB,), {})):
            with pytest.raises(vmmshare.AclError):
                pool.allocate(*args, **kw)
        assert pool.used == 0
    gc.collect()
    assert runtime().counts() == before


def test_a_crafted_pool_descriptor_is_an_acl_error_and_leaves_nothing() -> None:
    """A pickled buffer whose pool descriptor no MemoryPool sends (chunk size 0, a capacity that is not whole
    chunks, an alignment of 0, a chunk list of the wrong shape, an id that is not text) is refused with 107000;
    a chunk size of 0 used to escape as a ZeroDivisionError, and an unhashable id as a TypeError."""
    from dataclasses import replace

    from vmmshare.api.pool_buffers import _arrive_buffer

    with vmmshare.MemoryPool(max_size=4 * MiB, chunk_size=CHUNK) as pool:
        buf = pool.allocate(4096)
        _, (ticket, offset, size, length, meta) = buf.__reduce__()
        gc.collect()  # earlier tests' garbage goes before the count, not during it
        before = runtime().counts()
        for i, kw in enumerate(({"chunk_size": 0}, {"chunk_size": -CHUNK}, {"capacity": CHUNK + 1},
                                {"capacity": 0}, {"alignment": 0}, {"alignment": 3}, {"chunks": [(0, None)]},
                                {"chunks": ((True, ticket.chunks[0][1]),)}, {"chunks": 5})):
            crafted = replace(ticket, pool_id=f"crafted{i}", **kw)
            with pytest.raises(vmmshare.InvalidParamError):
                _arrive_buffer(crafted, offset, size, length, meta)
        with pytest.raises(vmmshare.InvalidParamError):
            _arrive_buffer(replace(ticket, pool_id=["not", "text"]), offset, size, length, meta)
        gc.collect()
        assert runtime().counts() == before
        buf.close()


def test_a_buffer_used_after_its_pool_closed_is_refused() -> None:
    pool = vmmshare.MemoryPool(max_size=4 * MiB, chunk_size=CHUNK)
    buf = pool.allocate(4096)
    view = buf.numpy()
    with pytest.raises(BufferError):
        pool.close()  # a view of one of its buffers is alive
    del view
    pool.close()
    assert buf.closed and pool.closed
    for use in (buf.numpy, buf.memoryview, buf.read, lambda: buf.write(b"x"), lambda: buf.fill(1),
                buf.__dlpack__, lambda: pool.allocate(10)):
        with pytest.raises(vmmshare.InvalidParamError, match="closed"):
            use()
    with pytest.raises(TypeError, match="MemoryPool of this PoolBuffer is closed"):
        pickle.dumps(buf)
    buf.close()  # nothing to give back: no error
    pool.close()


def test_buffers_travel_as_small_descriptors_through_one_import_per_chunk(ctx: Any) -> None:
    pool = vmmshare.MemoryPool(max_size=16 * MiB, chunk_size=CHUNK)
    q, r = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=travellers.pool_buffers, args=(q, r))
    p.start()
    pool.allow([p.pid])
    sizes = [100, 4096, MiB, 3 * MiB, 10]  # the fourth spans two chunks, added after the pool was shared
    bufs = []
    for i, n in enumerate(sizes):
        b = pool.allocate(n, meta={"i": i})
        a = b.numpy()
        a[0], a[-1] = i + 1, 0x77
        del a
        bufs.append(b)
    assert len(pickle.dumps(bufs[0])) < 600  # the pool's id, a chunk's handle, offset and size: no bulk
    for i, b in enumerate(bufs):
        q.put(b)
        got = r.get(timeout=60)
        assert got["offset"] == b.offset and got["size"] == b.size and got["meta"] == {"i": i}
        assert (got["first"], got["last"], got["imported"]) == (i + 1, 0x77, True)
    q.put(None)
    summary = r.get(timeout=60)
    assert summary == {"allocations": len(pool.chunks), "pools": 1}  # one import per chunk, one pool
    assert r.get(timeout=60) == "done"
    finish(p)
    for b in bufs:  # the child's writes, through our own mapping of the pool
        assert b.read(1) == b"\x5a" and b.read(1, b.size - 1) == b"\xa5"
        b.close()
    assert pool.used == 0
    pool.close()


def test_an_imported_pool_cannot_allocate_and_untrusted_receivers_are_told(ctx: Any) -> None:
    pool = vmmshare.MemoryPool(max_size=8 * MiB, chunk_size=CHUNK, validate_pids=False)
    r = ctx.Queue()
    q = ctx.Queue()
    p = ctx.Process(target=travellers.import_pool, args=(q, r))
    p.start()
    q.put(pool)
    assert r.get(timeout=60) == {"imported": True, "chunks": 1, "capacity": 8 * MiB,
                                 "allocate": C.ACL_ERROR_RT_PARAM_INVALID}
    finish(p)
    pool.close()

    guarded = vmmshare.MemoryPool(max_size=4 * MiB, chunk_size=CHUNK)
    buf = guarded.allocate(64)
    q2, r2 = ctx.Queue(), ctx.Queue()
    p2 = ctx.Process(target=travellers.refused, args=(q2, r2))
    p2.start()
    q2.put(buf)
    kind, code, message, pid, counts = r2.get(timeout=60)
    finish(p2)
    assert (kind, code) == ("error", C.ACL_ERROR_RT_NO_PERMISSION) and f"allow([{pid}])" in message
    assert counts["allocations"] == counts["mappings"] == 0
    buf.close()
    guarded.close()


def test_an_importer_keeps_its_buffers_after_the_pool_closed_but_new_chunks_are_revoked(ctx: Any) -> None:
    """Rule 14 through the pool: the importer's mapped chunks stay; a chunk it never had fails with 107017."""
    pool = vmmshare.MemoryPool(max_size=8 * MiB, chunk_size=CHUNK, validate_pids=False)
    first = pool.allocate(64)
    first.write(b"\x2a")
    later = pool.allocate(3 * MiB)  # in chunks 0..2
    q, r = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=travellers.pool_after_close, args=(q, r))
    p.start()
    q.put(first)
    assert r.get(timeout=60) == "got"
    data = pickle.dumps(later)  # while the pool is open
    first.close()
    later.close()
    pool.close()
    q.put("closed")
    assert r.get(timeout=60) == 0x2A
    q.put(_Raw(data))
    kind, code, message = r.get(timeout=60)
    finish(p)
    assert (kind, code) == ("error", C.ACL_ERROR_RT_INVALID_HANDLE) and "closed the pool" in message


class _Raw:
    """Pickled bytes sent as they are: they unpickle in the receiver into what was pickled."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self) -> tuple[Any, ...]:
        return (pickle.loads, (self.data,))


def test_a_small_pool_is_one_chunk_of_its_size() -> None:
    with vmmshare.MemoryPool(max_size=2 * MiB) as pool:  # cuda.core's POOL_SIZE: one chunk, not 32 MiB
        assert (pool.chunk_size, pool.capacity, pool.size) == (2 * MiB, 2 * MiB, 2 * MiB)
        pool.allocate(64).close()
    with vmmshare.MemoryPool() as pool:
        assert pool.chunk_size == 32 * MiB and pool.capacity == 1 << 30 and pool.size == 32 * MiB


def test_a_worker_pool_maps_over_pool_buffers(ctx: Any) -> None:
    """multiprocessing.Pool.map over buffers: each worker imports the pool once; its writes land in ours."""
    with vmmshare.MemoryPool(max_size=8 * MiB, validate_pids=False) as pool:
        bufs = [pool.allocate(64) for _ in range(20)]
        for i, b in enumerate(bufs):
            b.write(bytes([i]))
        with ctx.Pool(processes=2) as workers:
            assert workers.map(travellers.bump, bufs) == list(range(20))
        assert [b.read(1)[0] for b in bufs] == [i + 1 for i in range(20)]
        for b in bufs:
            b.close()


def test_sending_and_closing_leaves_the_exporters_fds_and_tables_as_they_were() -> None:
    import os

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    vmmshare.Device(0).allocate(CHUNK).close()  # the broker connection, opened once
    gc.collect()
    before, tables = fds(), runtime().counts()
    for _ in range(3):
        mem = vmmshare.Device(0).allocate(CHUNK)
        m = mem.map(max_size=4 * CHUNK)
        m.grow(4 * CHUNK)
        pickle.dumps(m)
        m.close()
        mem.close()
        pool = vmmshare.MemoryPool(max_size=8 * CHUNK, chunk_size=CHUNK)
        for buf in [pool.allocate(3 * MiB) for _ in range(4)]:
            pickle.dumps(buf)
        pool.close()
        dev = vmmshare.DeviceBuffer(4096)
        pickle.dumps(dev)
        dev.close()
    gc.collect()
    assert fds() == before and runtime().counts() == tables


GPU_FLOW = '''
import multiprocessing as mp
import vmmshare
import travellers

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    pool = vmmshare.MemoryPool(max_size=8 << 20, chunk_size=2 << 20, validate_pids=False)
    buf = pool.allocate(3 << 20)  # across two chunks of GPU memory
    buf.fill(7)
    mem = vmmshare.Device(0).allocate(2 << 20)
    mem.export(validate_pids=False)
    m = mem.map(max_size=4 << 20)
    m.grow(4 << 20)
    m.fill(9)
    assert buf.on_gpu and m.on_gpu and buf.__dlpack_device__() == (2, 0)
    q, r = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=travellers.pool_buffers, args=(q, r))
    p.start()
    q.put(buf)
    print("buffer", r.get(timeout=60))
    q.put(None)
    print("summary", r.get(timeout=60), r.get(timeout=60))
    p.join(60)
    q2, r2 = ctx.Queue(), ctx.Queue()
    p2 = ctx.Process(target=travellers.receive_and_write, args=(q2, r2))
    p2.start()
    q2.put(m)
    print("mapping", r2.get(timeout=60), r2.get(timeout=60))
    p2.join(60)
    print("back", buf.read(1), buf.read(1, buf.size - 1), m.read(2), p.exitcode, p2.exitcode)
    buf.close()
    pool.close()
    m.close()
    mem.close()
'''


def test_gpu_pools_and_grown_mappings_travel(tmp_path: Any) -> None:
    """The CUDA backend (a real GPU, or the CPU stand-in libcuda of tests/fakecuda): chunks in GPU address space,
    viewed through DLPack as CUDA memory, copies across chunk boundaries, the same travel as host memory."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from conftest import CUDA_GATE, require

    require(shutil.which(os.environ.get("CC", "cc")), "a C compiler for the CUDA stand-in", CUDA_GATE)
    import fakecuda

    env = {**os.environ, **fakecuda.build(tmp_path), "VMMSHARE_BACKEND": "cuda",
           "VMMSHARE_SOCKET": str(tmp_path / "broker.sock"),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])}
    (tmp_path / "flow.py").write_text(GPU_FLOW)
    out = subprocess.run([sys.executable, "flow.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "'first': 7, 'last': 7, 'imported': True, 'chunks': 2" in out.stdout, out.stdout
    assert "'size': 4194304, 'closed': False, 'first': 9, 'last': 9" in out.stdout, out.stdout
    assert "back b'Z' b'\\xa5' b'\\t\\xab' 0 0" in out.stdout, out.stdout


def test_a_buffer_back_in_the_process_of_its_pool_is_a_view_of_that_pool() -> None:
    with vmmshare.MemoryPool(max_size=4 * MiB, chunk_size=CHUNK) as pool:
        buf = pool.allocate(100, meta={"k": 1})
        buf.write(b"\x11")
        assert pickle.loads(pickle.dumps(pool)) is pool
        back = pickle.loads(pickle.dumps(buf))
        assert back is not buf and back.pool is pool and back.ptr == buf.ptr and back.meta == {"k": 1}
        assert back.read(1) == b"\x11" and runtime().counts()["allocations"] == 1  # no import of our own memory
        used = pool.used
        back.close()  # a copy: it gives nothing back
        assert pool.used == used and not buf.closed
        buf.close()
        assert pool.used == 0


def test_a_forked_child_reads_its_parents_pool_but_does_not_allocate_or_free_in_it() -> None:
    ctx = mp.get_context("fork")
    with vmmshare.MemoryPool(max_size=4 * MiB, chunk_size=CHUNK) as pool:
        buf = pool.allocate(64)
        buf.write(b"\x33")
        r = ctx.Queue()
        p = ctx.Process(target=travellers.inherited_pool, args=(pool, buf, r))
        p.start()
        assert r.get(timeout=60) == {"first": 0x33, "allocate": (C.ACL_ERROR_RT_PARAM_INVALID, True), "counts": 0}
        finish(p)
        assert buf.read(1) == b"\x33" and pool.used == pool.alignment and not buf.closed
        buf.close()
