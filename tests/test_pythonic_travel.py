"""Live objects travel: a PhysicalMemory, Mapping or DeviceBuffer sent through a
multiprocessing Queue, Pipe or Process argument arrives working in the other process; one that cannot travel says
what to send instead; a grown mapping arrives as one range, before and after it grew.

The children are real spawned (and forkserver) processes on this test session's broker (rules 11 and 14 apply).
"""

from __future__ import annotations

import dis
import gc
import multiprocessing as mp
import os
import pickle
import sys
import threading
from typing import Any

import pytest

import travellers
import vmmshare
from vmmshare import constants as C
from vmmshare._process import runtime

MiB = 1 << 20
NO_PERMISSION = C.ACL_ERROR_RT_NO_PERMISSION


@pytest.fixture(autouse=True)
def _collected() -> None:
    """Collect first what earlier tests in this process left to the collector: these tests count the runtime's
    objects, and another test's garbage is not theirs (in a parallel run any test may come before)."""
    gc.collect()


@pytest.fixture(params=["spawn", "forkserver", "fork"])
def ctx(request: pytest.FixtureRequest) -> Any:
    return mp.get_context(request.param)


def run(ctx: Any, target: Any, *args: Any) -> Any:
    p = ctx.Process(target=target, args=args)
    p.start()
    return p


def finish(p: Any) -> None:
    p.join(60)  # a hang guard only
    assert p.exitcode == 0, f"child exited {p.exitcode}"


def filled(size: int = 4 * MiB, **map_kw: Any) -> tuple[vmmshare.PhysicalMemory, vmmshare.Mapping]:
    mem = vmmshare.Device(0).allocate(size)
    m = mem.map(**map_kw)
    a = m.numpy()
    a[0], a[-1] = 7, 8
    del a
    return mem, m


def test_a_mapping_sent_through_a_queue_arrives_mapped_and_shares_the_bytes(ctx: Any) -> None:
    """Rule 11: the receiver is trusted by pid (known once it started), then the object is sent."""
    mem, m = filled()
    mem.export()
    q, r = ctx.Queue(), ctx.Queue()
    p = run(ctx, travellers.receive_and_write, q, r)
    mem.allow([p.pid])
    q.put(m)
    got = r.get(timeout=60)
    assert got == {"type": "Mapping", "size": 4 * MiB, "closed": False, "first": 7, "last": 8}
    assert r.get(timeout=60) == "done"
    finish(p)
    assert m.read(2) == b"\x07\xab"  # the child's write, in our mapping
    m.close()
    mem.close()


def test_a_physical_memory_through_a_pipe_arrives_imported(ctx: Any) -> None:
    mem, m = filled()
    mem.export(pids=[os.getpid()])
    a, b = ctx.Pipe()
    q, r = ctx.Queue(), ctx.Queue()
    p = run(ctx, travellers.receive_and_write, b, r)
    mem.allow([p.pid])
    a.send(mem)
    assert r.get(timeout=60) == {"type": "PhysicalMemory", "size": 4 * MiB, "closed": False, "first": 7, "last": 8}
    assert r.get(timeout=60) == "done"
    finish(p)
    assert m.read(2) == b"\x07\xab"
    m.close()
    mem.close()
    del q


def test_process_arguments_travel_when_exported_without_pid_validation(ctx: Any) -> None:
    """A Process's arguments are pickled before it has a pid: only an export without pid validation admits it."""
    mem, m = filled()
    mem.export(validate_pids=False)
    r = ctx.Queue()
    for obj in (mem, m):
        p = run(ctx, travellers.argument, obj, r)
        assert r.get(timeout=60)["first"] == 7
        finish(p)
    assert m.read(2) == b"\x07\xab"
    m.close()
    mem.close()


def test_a_receiver_not_on_the_trustlist_is_told_the_fix_and_keeps_nothing(ctx: Any) -> None:
    """Rule 11: pickling an unexported memory exports it with pid validation; the untrusted receiver gets 207006
    with a message naming its pid and what the sender must call, and holds nothing afterwards."""
    mem, m = filled()
    q, r = ctx.Queue(), ctx.Queue()
    p = run(ctx, travellers.refused, q, r)
    q.put(m)
    kind, code, message, pid, counts = r.get(timeout=60)
    finish(p)
    assert (kind, code) == ("error", NO_PERMISSION)
    assert f"allow([{pid}])" in message and "validate_pids=False" in message and str(os.getpid()) in message
    assert "pid validation" in message
    assert counts["allocations"] == 0 and counts["mappings"] == 0
    assert mem.shareable is not None  # sending it exported it
    with pytest.raises(vmmshare.InvalidParamError, match="allow"):
        mem.export()  # a handle exports once (rule 9): the error says what to do instead
    m.close()
    mem.close()


def test_pickling_exports_once_and_then_sends_the_same_handle() -> None:
    mem = vmmshare.Device(0).allocate(2 * MiB)
    assert mem.shareable is None
    first = pickle.dumps(mem)
    h = mem.shareable
    assert h is not None and pickle.dumps(mem) == first
    assert len(first) < 400  # a handle and a few numbers, not the memory
    mem.close()
    with pytest.raises(TypeError, match="closed"):
        pickle.dumps(mem)


def test_objects_that_cannot_travel_say_what_to_send_instead() -> None:
    rng = vmmshare.VirtualRange(2 * MiB)
    with pytest.raises(TypeError, match="send the PhysicalMemory"):
        pickle.dumps(rng)
    mem, m = filled(2 * MiB)
    m.close()
    with pytest.raises(TypeError, match="closed"):
        pickle.dumps(m)
    m = mem.map()
    mem.close()  # the mapping stays (rule 6), the export goes (rule 14)
    with pytest.raises(TypeError, match="revoked its export"):
        pickle.dumps(m)
    m.close()
    rng.close()


def test_a_crafted_mapping_or_memory_descriptor_is_an_acl_error_and_leaves_nothing() -> None:
    """A pickle that names no memory (an empty chunk list), or a chunk descriptor that is not one (None, a bare
    int for its handle, a device that is not an int), is refused with 107000; these used to escape as IndexError,
    AttributeError or TypeError."""
    from dataclasses import replace

    from vmmshare.api.mapping import _arrive_mapping
    from vmmshare.api.memory import _arrive_memory

    with vmmshare.Device(0).allocate(2 * MiB) as mem, mem.map() as m:
        _, (tickets, access) = m.__reduce__()
        gc.collect()  # earlier tests' garbage goes before the count, not during it
        before = runtime().counts()
        for crafted in ([], 5, [None], [replace(tickets[0], handle=5)], [replace(tickets[0], device="0")]):
            with pytest.raises(vmmshare.InvalidParamError):
                _arrive_mapping(crafted, access)
        for ticket in (None, replace(tickets[0], handle=5), replace(tickets[0], device=True)):
            with pytest.raises(vmmshare.InvalidParamError):
                _arrive_memory(ticket)
        gc.collect()
        assert runtime().counts() == before


def test_rule_13_a_same_process_round_trip_is_a_second_object_over_the_same_memory() -> None:
    """Unpickling in the exporting process is an import there (rule 13): a second object over the same bytes, closed
    on its own, and nothing is left behind once both are closed."""
    before = runtime().counts()
    mem, m = filled(2 * MiB)
    data = pickle.dumps(m)
    back = pickle.loads(data)
    assert back.ptr != m.ptr
    assert back.read(1) == b"\x07"
    back.write(b"\x09")
    assert m.read(1) == b"\x09"
    back.close()
    assert m.read(1) == b"\x09"  # the first object's memory is still there
    m.close()
    mem.close()
    assert runtime().counts() == before


def test_a_device_buffer_arrives_as_the_ipc_import_of_its_key(ctx: Any) -> None:
    buf = vmmshare.DeviceBuffer(4096)
    buf.write(b"\x07")
    buf.ipc_export()
    q, r = ctx.Queue(), ctx.Queue()
    p = run(ctx, travellers.receive_and_write, q, r)
    buf.ipc_allow([p.pid])
    q.put(buf)
    got = r.get(timeout=60)
    assert got["type"] == "IpcMemory" and got["first"] == 7 and got["size"] == 4096
    assert r.get(timeout=60) == "done"
    finish(p)
    assert buf.read(2) == b"\x07\xab"
    buf.close()


def test_an_untrusted_device_buffer_receiver_is_told_the_fix(ctx: Any) -> None:
    buf = vmmshare.DeviceBuffer(4096)
    q, r = ctx.Queue(), ctx.Queue()
    p = run(ctx, travellers.refused, q, r)
    q.put(buf)  # exported now, with pid validation
    kind, code, message, pid, _ = r.get(timeout=60)
    finish(p)
    assert (kind, code) == ("error", NO_PERMISSION) and f"ipc_allow([{pid}])" in message
    buf.close()


def test_fds_in_the_receiver_come_back_to_where_they_were(ctx: Any) -> None:
    mem, m = filled()
    mem.export(validate_pids=False)
    q, r = ctx.Queue(), ctx.Queue()
    p = run(ctx, travellers.fd_round_trip, q, r)
    q.put(m)
    q.put(m)
    before, during, after, counts = r.get(timeout=60)
    finish(p)
    assert during > before and after == before
    assert counts["allocations"] == counts["mappings"] == counts["reservations"] == 0
    m.close()
    mem.close()


# ---------------------------------------------------------------- grown mappings (item 5)


def test_a_grown_mapping_imports_as_one_range_before_and_after_growth(ctx: Any) -> None:
    """A mapping grown after export arrives as its chunks mapped back to back (one range for views and copies);
    one received before it grew keeps working, and the chunk both have is imported once in the receiver."""
    mem, m = filled(2 * MiB, max_size=8 * MiB)
    mem.export()
    q, r = ctx.Queue(), ctx.Queue()
    p = run(ctx, travellers.keep_both, q, r)
    m.allow([p.pid])
    q.put(m)
    assert r.get(timeout=60)["size"] == 2 * MiB
    m.grow(5 * MiB)
    assert m.size == 6 * MiB and len(m.chunks) == 2 and m.capacity == 8 * MiB
    m.write(b"\x09", 2 * MiB)  # the first byte of the new chunk
    a = m.numpy()
    a[-1] = 3
    del a
    q.put(m)
    grown = r.get(timeout=60)
    assert grown == {"type": "Mapping", "size": 6 * MiB, "closed": False, "first": 7, "last": 3}
    assert r.get(timeout=60) == {"middle": 9, "first_still": 7, "allocations": 2, "chunks": 2}
    assert r.get(timeout=60) == "done"
    finish(p)
    m.close()
    mem.close()


def test_a_grown_mapping_is_one_range_here_and_its_chunks_go_with_it() -> None:
    gc.collect()  # earlier tests' garbage goes before the count, not during it
    before = runtime().counts()
    mem = vmmshare.Device(0).allocate(2 * MiB)
    m = mem.map(max_size=6 * MiB)
    m.grow(3 * MiB)  # a chunk of one granule, then one of two
    m.grow(6 * MiB)
    assert [c.size for c in m.chunks] == [2 * MiB] * 3
    m.fill(0x11)  # rule 7: three mappings end to end are one range for the copies
    assert m.read() == b"\x11" * (6 * MiB) and m.numpy().sum() == 0x11 * 6 * MiB
    gc.collect()
    assert runtime().counts()["allocations"] == before["allocations"] + 3
    m.grow(4 * MiB)  # already that large: nothing to do
    assert m.size == 6 * MiB
    with pytest.raises(vmmshare.InvalidParamError, match="max_size"):
        m.grow(8 * MiB)
    m.close()
    mem.close()
    assert runtime().counts() == before


def test_growth_refusals_leave_nothing_behind() -> None:
    before = runtime().counts()
    mem = vmmshare.Device(0).allocate(2 * MiB)
    plain = mem.map()
    with pytest.raises(vmmshare.InvalidParamError, match="no room to grow"):
        plain.grow(4 * MiB)
    plain.close()
    with pytest.raises(vmmshare.InvalidParamError, match="smaller"):
        mem.map(max_size=MiB)
    m = mem.map(max_size=4 * MiB)
    with pytest.raises(vmmshare.InvalidParamError):
        m.grow(0)
    with pytest.raises(vmmshare.MemoryAllocationError):
        small = vmmshare.Device(0).allocate(2 * MiB)
        big = small.map(max_size=1 << 40)
        try:
            big.grow(1 << 40)  # more than the device holds
        finally:
            big.close()
            small.close()
    m.close()
    with pytest.raises(vmmshare.InvalidParamError, match="closed"):
        m.grow(4 * MiB)
    mem.close()
    assert runtime().counts() == before


def test_a_grown_chunk_is_exported_as_the_first_was() -> None:
    mem = vmmshare.Device(0).allocate(2 * MiB)
    mem.export(validate_pids=False)
    m = mem.map(max_size=4 * MiB)
    m.grow(4 * MiB)
    second = m.chunks[1]
    assert second.shareable is not None and second._validate is False
    m.close()
    mem.close()


def _pause_before_storing_trusted(reached: threading.Event, go_on: threading.Event) -> Any:
    """A trace function for the calling thread: inside PhysicalMemory.allow, just before each instruction that stores
    `self._trusted` (where an update made of a read, an add and a store would end), it says so (`reached`) and
    waits for `go_on` (at most 10 s); an allow() that makes no such store is never paused (`reached` at once)."""
    code = vmmshare.PhysicalMemory.allow.__code__
    stores = {i.offset for i in dis.get_instructions(code) if i.opname == "STORE_ATTR" and i.argval == "_trusted"}
    if not stores:
        reached.set()

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode" and frame.f_lasti in stores and not reached.is_set():
            reached.set()
            go_on.wait(10)
        return local

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is code:
            frame.f_trace_opcodes = True
            return local
        return None

    return tracer


def test_pids_allowed_by_two_threads_at_once_are_both_trusted_by_the_chunks_a_mapping_grows() -> None:
    """Two threads allow a pid each on one memory, the second while the first is inside its update of the memory's
    record of whom it trusts (the switch is forced there by a trace function, not waited for): a chunk the mapping
    grows afterwards is exported trusting both, as `Mapping.allow` promises for the chunks it grows later."""
    first_pid, second_pid = os.getppid(), 1  # live processes
    mem = vmmshare.Device(0).allocate(2 * MiB)
    m = mem.map(max_size=4 * MiB)
    try:
        mem.export()
        reached, go_on = threading.Event(), threading.Event()
        errors: list[BaseException] = []

        def first() -> None:
            sys.settrace(_pause_before_storing_trusted(reached, go_on))
            try:
                mem.allow([first_pid])
            except BaseException as exc:  # reported below
                errors.append(exc)
            finally:
                sys.settrace(None)

        one = threading.Thread(target=first)
        one.start()
        try:
            assert reached.wait(30)
            mem.allow([second_pid])
        finally:
            go_on.set()
            one.join(30)
        assert not errors, errors
        m.grow(4 * MiB)
        value = f"{m.chunks[1].shareable.value:#018x}"
        rows = [row for row in runtime().node.listing()["exports"] if row["handle"] == value]
        assert len(rows) == 1, rows
        assert {first_pid, second_pid} <= set(rows[0]["trustlist"]), rows[0]["trustlist"]
    finally:
        m.close()
        mem.close()


def test_an_object_passed_on_through_a_third_process_imports_from_the_exporter(ctx: Any) -> None:
    mem, m = filled()
    mem.export(validate_pids=False)
    q, onward, r = ctx.Queue(), ctx.Queue(), ctx.Queue()
    a = run(ctx, travellers.relay, q, onward)
    b = run(ctx, travellers.receive_and_write, onward, r)
    q.put(m)
    got = r.get(timeout=60)
    assert got["first"] == 7 and got["size"] == 4 * MiB and r.get(timeout=60) == "done"
    q.put("finish")
    finish(b)
    finish(a)
    assert m.read(3) == b"\x07\xab\x01"
    m.close()
    mem.close()


# ---------------------------------------------------------------- objects inherited through fork()


def test_an_inherited_object_never_frees_what_the_forked_child_makes() -> None:
    """The child's runtime numbers handles afresh: closing an inherited PhysicalMemory or Mapping there lets go
    of the parent's, and must not free the child's own allocation that got the same number."""
    ctx = mp.get_context("fork")
    mem, m = filled()
    r = ctx.Queue()
    for obj in (mem, m):
        p = run(ctx, travellers.inherited_then_new, obj, r)
        assert r.get(timeout=60) == (b"\x42", 1)
        finish(p)
    assert m.read(1) == b"\x07" and not m.closed and not mem.closed  # the parent's are untouched
    m.close()
    mem.close()


def test_an_inherited_unexported_memory_says_to_export_it_first() -> None:
    ctx = mp.get_context("fork")
    mem = vmmshare.Device(0).allocate(2 * MiB)
    r = ctx.Queue()
    p = run(ctx, travellers.inherited_unexported, mem, r)
    kind, code, message = r.get(timeout=60)
    finish(p)
    assert (kind, code) == ("error", C.ACL_ERROR_RT_PARAM_INVALID) and "export() it before starting" in message
    mem.close()


def test_the_flow_in_the_docs_runs_as_written(tmp_path: Any) -> None:
    """docs/index.md's cuda.core-style flow: allocate, send the object, use it in the child."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "index.md").read_text()
    code = re.search(r"```python\n# travel.py\n(.*?)```", text, re.S)
    assert code is not None, "docs/index.md lost its travel.py snippet"
    (tmp_path / "travel.py").write_text(code.group(1))
    out = subprocess.run([sys.executable, "travel.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "42.0", out.stdout + out.stderr


def test_objects_arriving_with_one_handle_share_one_import_and_each_closes_its_own(ctx: Any) -> None:
    mem, m = filled()
    mem.export(validate_pids=False)
    q, r = ctx.Queue(), ctx.Queue()
    p = run(ctx, travellers.shared_import, q, r)
    for obj in (m, mem, m):
        q.put(obj)
    got = r.get(timeout=60)
    finish(p)
    assert got["one_import"] == 1 and got["same"] and got["after"] == 7
    assert got["left"]["allocations"] == got["left"]["mappings"] == got["left"]["reservations"] == 0
    m.close()
    mem.close()


def test_threads_sending_one_unexported_memory_at_once_export_it_once() -> None:
    import threading

    mem = vmmshare.Device(0).allocate(2 * MiB)
    barrier = threading.Barrier(8)
    got: list[bytes | BaseException] = []

    def send() -> None:
        barrier.wait()
        try:
            got.append(pickle.dumps(mem))
        except BaseException as exc:  # collected: the assertion below names it
            got.append(exc)

    threads = [threading.Thread(target=send) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len(set(got)) == 1, got  # one export, the same handle eight times
    mem.close()
