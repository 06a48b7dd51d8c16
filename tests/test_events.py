"""Rule 19: events and IPC events. A record completes when its stream gets there; a wait waits for the last record
made before it; the handle travels by value and another process waits on it; a waiter whose producer dies gets
507057; bad input gets the runtime's codes and leaks nothing."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from conftest import ACL_PARAM, NO_CONTEXT, NOT_SUPPORTED, PARAM, expect_fail, fd_count, map_count, ok, read, write
from procs import Actor, clean_env
from procs import ok as aok
from vmmshare._process import runtime

BAD_HANDLE = 107017
SYNC_TIMEOUT = 507047
PRODUCER_DIED = 507057
IPC = 0x40
MEMORY_ALLOCATION = 207001
COMPLETE, NOT_READY = 1, 0


def fds() -> int:
    """This process's open fds, but for the pidfds its watcher keeps of producers it has waited on (they stay
    open for the next wait, up to a bound: see syncpage.Watcher)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}") != "anon_inode:[pidfd]"
    return count


@contextlib.contextmanager
def held(stream: int) -> Iterator[threading.Event]:
    """`stream` (of this process) busy with a task that runs until the block ends: work queued behind it waits."""
    gate = threading.Event()
    runtime().devices.stream(stream).submit("a task the test holds", gate.wait)
    try:
        yield gate
    finally:
        gate.set()


@pytest.fixture
def peer() -> Iterator[Any]:
    """Another process on this test process's broker, with device 0 set (an `Actor`)."""
    made: list[Actor] = []

    def make() -> Actor:
        a = Actor(clean_env(VMMSHARE_SOCKET=os.environ["VMMSHARE_SOCKET"], VMMSHARE_BROKER_IDLE="1"))
        made.append(a)
        return a

    yield make
    for a in made:
        a.kill()


def ipc_event(acl: Any) -> tuple[int, bytes]:
    e = ok(acl.rt.create_event_ex_with_flag(IPC))
    return e, ok(acl.rt.ipc_get_event_handle(e))


# ---------------------------------------------------------------- in one process


@pytest.mark.parametrize("ipc", [True, False])
def test_rule_19_a_record_completes_when_its_stream_gets_there(acl, vmm, ipc):
    e = ipc_event(acl)[0] if ipc else ok(acl.rt.create_event())
    s = vmm.stream()
    try:
        with held(s):
            ok(acl.rt.record_event(e, s))
            assert ok(acl.rt.query_event_status(e)) == NOT_READY
            expect_fail(SYNC_TIMEOUT, acl.rt.synchronize_event_with_timeout, e, 20)
        ok(acl.rt.synchronize_stream(s))
        assert ok(acl.rt.query_event_status(e)) == COMPLETE
        ok(acl.rt.synchronize_event(e))
        ok(acl.rt.record_event(e, s))  # an idle stream reaches it at once
        assert ok(acl.rt.query_event_status(e)) == COMPLETE
    finally:
        ok(acl.rt.destroy_event(e))


def test_rule_19_an_event_never_recorded_is_complete(acl, vmm):
    """IpcEventSync / IpcEventWait / IpcEventQuery: no record in flight, nothing to wait for."""
    e, _ = ipc_event(acl)
    plain = ok(acl.rt.create_event_with_flag(1))
    s = vmm.stream()
    try:
        for ev in (e, plain):
            assert ok(acl.rt.query_event_status(ev)) == COMPLETE
            ok(acl.rt.synchronize_event(ev))
            ok(acl.rt.synchronize_event_with_timeout(ev, 1))
            ok(acl.rt.stream_wait_event(s, ev))
        ok(acl.rt.synchronize_stream(s))
    finally:
        ok(acl.rt.destroy_event(e))
        ok(acl.rt.destroy_event(plain))


def test_rule_19_a_stream_waits_for_an_event_of_another_stream(acl, vmm):
    """Stream B waits on an event recorded behind held work on stream A; B's copy runs only after A gets there."""
    a, b = vmm.stream(), vmm.stream()
    src, dst = vmm.host(64), vmm.host(64)
    e, _ = ipc_event(acl)
    try:
        with held(a) as gate:
            ok(acl.rt.record_event(e, a))
            ok(acl.rt.stream_wait_event(b, e))
            ok(acl.rt.memcpy_async(dst, 64, src, 6, 0, b))
            expect_fail(507046, acl.rt.synchronize_stream_with_timeout, b, 20)  # B waits behind A's hold
            write(src, b"after!")
            gate.set()
            ok(acl.rt.synchronize_stream(b))
        assert read(dst, 6) == b"after!"
    finally:
        ok(acl.rt.destroy_event(e))


# ---------------------------------------------------------------- across processes


def test_rule_19_a_consumer_waits_for_the_producers_record(acl, vmm, peer):
    """The producer (this process) writes behind a held stream and records; the consumer opens the handle, finds
    the event not ready, waits, and reads what was written before the record. Then the same with the consumer's
    stream waiting on the event and copying after it."""
    b = peer()
    buf = ok(acl.rt.malloc(4096, 0))
    e, handle = ipc_event(acl)
    s = vmm.stream()
    pool = ThreadPoolExecutor(1)
    try:
        key = ok(acl.rt.ipc_mem_get_export_key(buf, 4096, 65, 1))
        q = aok(b, "rt.ipc_mem_import_by_key", key, 0)
        be = aok(b, "rt.ipc_open_event_handle", handle)
        with held(s) as gate:
            ok(acl.rt.record_event(e, s))
            assert aok(b, "rt.query_event_status", be) == NOT_READY
            assert b.call("rt.synchronize_event_with_timeout", be, 20) == SYNC_TIMEOUT
            waiting = pool.submit(b.call, "rt.synchronize_event", be)
            write(buf, b"written before the record")
            gate.set()
            assert waiting.result(timeout=60) == 0
        assert b.call("!read", q, 25) == b"written before the record"
        # the consumer's stream waits on the event, then copies
        sb = aok(b, "rt.create_stream")
        local = aok(b, "rt.malloc_host", 64)
        with held(s) as gate:
            ok(acl.rt.record_event(e, s))
            aok(b, "rt.stream_wait_event", sb, be)
            aok(b, "rt.memcpy_async", local, 64, q, 14, 2, sb)
            copied = pool.submit(b.call, "rt.synchronize_stream", sb)
            write(buf, b"second record!")
            gate.set()
            assert copied.result(timeout=60) == 0
        assert b.call("!read", local, 14) == b"second record!"
        for call, arg in (("rt.destroy_event", be), ("rt.destroy_stream", sb), ("rt.free_host", local),
                          ("rt.ipc_mem_close", key)):
            aok(b, call, arg)
    finally:
        pool.shutdown()
        ok(acl.rt.destroy_event(e))
        acl.rt.ipc_mem_close(key)
        ok(acl.rt.free(buf))


def test_rule_19_the_consumer_records_and_the_producer_waits(acl, vmm, peer):
    """Both sides of an IPC event record and wait (as the runtime's opener does)."""
    b = peer()
    e, handle = ipc_event(acl)
    try:
        be = aok(b, "rt.ipc_open_event_handle", handle)
        aok(b, "rt.record_event", be, 0)
        ok(acl.rt.synchronize_event(e))
        assert ok(acl.rt.query_event_status(e)) == COMPLETE
        aok(b, "rt.destroy_event", be)
    finally:
        ok(acl.rt.destroy_event(e))


def test_rule_19_a_waiter_whose_producer_dies_gets_an_error(acl, vmm, peer):
    """B records E1 on a stream that waits for E0, which this process holds; B is killed before it gets there:
    this process's synchronize of E1, and its stream waiting on E1, fail with 507057 instead of waiting forever."""
    b = peer()
    e0, h0 = ipc_event(acl)
    e1, h1 = ipc_event(acl)
    s, other = vmm.stream(), vmm.stream()
    pool = ThreadPoolExecutor(1)
    try:
        with held(s):
            ok(acl.rt.record_event(e0, s))
            b0 = aok(b, "rt.ipc_open_event_handle", h0)
            b1 = aok(b, "rt.ipc_open_event_handle", h1)
            sb = aok(b, "rt.create_stream")
            aok(b, "rt.stream_wait_event", sb, b0)
            aok(b, "rt.record_event", b1, sb)  # B's record of E1 waits behind E0
            assert ok(acl.rt.query_event_status(e1)) == NOT_READY
            waiting = pool.submit(acl.rt.synchronize_event, e1)
            ok(acl.rt.stream_wait_event(other, e1))
            b.kill()
            assert waiting.result(timeout=60) == PRODUCER_DIED
            assert acl.rt.synchronize_stream(other) == PRODUCER_DIED
            assert "exited before its stream reached the record" in acl.get_recent_err_msg()
        # a new record by a living process supersedes the dead one
        ok(acl.rt.record_event(e1, 0))
        ok(acl.rt.synchronize_event(e1))
    finally:
        pool.shutdown()
        ok(acl.rt.synchronize_stream(s))
        ok(acl.rt.destroy_event(e0))
        ok(acl.rt.destroy_event(e1))


def test_rule_19_a_forced_stream_destroy_ends_a_wait(acl, vmm):
    """A stream blocked waiting on an event that will not complete is destroyed by force: the call returns."""
    e, _ = ipc_event(acl)
    s = ok(acl.rt.create_stream())
    hold = vmm.stream()
    try:
        with held(hold):
            ok(acl.rt.record_event(e, hold))
            ok(acl.rt.stream_wait_event(s, e))
            ok(acl.rt.destroy_stream_force(s))  # the waiting task gives up, the stream's thread ends
            expect_fail(BAD_HANDLE, acl.rt.synchronize_stream, s)
    finally:
        ok(acl.rt.destroy_event(e))


# ---------------------------------------------------------------- bad input


def test_rule_19_creation_flags(acl):
    expect_fail(PARAM, acl.rt.create_event_with_flag, IPC)  # aclrtCreateEventWithFlag refuses ACL_EVENT_IPC
    expect_fail(PARAM, acl.rt.create_event_with_flag, 0)
    expect_fail(PARAM, acl.rt.create_event_ex_with_flag, IPC | 1)  # IPC alone
    expect_fail(PARAM, acl.rt.create_event_ex_with_flag, 0x80)
    expect_fail(PARAM, acl.rt.create_event_ex_with_flag, 0x10)  # device-only: not an Ex flag
    expect_fail(NOT_SUPPORTED, acl.rt.create_event_with_flag, 0x10)
    expect_fail(PARAM, acl.rt.create_event_with_flag, "1")
    for flag in (1, 2, 8, 0xB):
        ok(acl.rt.destroy_event(ok(acl.rt.create_event_with_flag(flag))))
        ok(acl.rt.destroy_event(ok(acl.rt.create_event_ex_with_flag(flag))))

    def no_context() -> tuple[int, int]:
        return acl.rt.create_event_ex_with_flag(IPC)

    box: list[Any] = []
    t = threading.Thread(target=lambda: box.append(no_context()))
    t.start()
    t.join()
    assert box[0] == (0, NO_CONTEXT)


def test_rule_19_bad_handles_and_arguments(acl, vmm):
    e, handle = ipc_event(acl)
    plain = ok(acl.rt.create_event())
    s = vmm.stream()
    try:
        for call in (acl.rt.destroy_event, acl.rt.query_event_status, acl.rt.synchronize_event,
                     acl.rt.ipc_get_event_handle):
            expect_fail(ACL_PARAM, call, 0)
            expect_fail(BAD_HANDLE, call, s)  # a stream's handle is not an event's
            expect_fail(BAD_HANDLE, call, 0xE7FF_FFFF)
        expect_fail(ACL_PARAM, acl.rt.record_event, 0, s)
        expect_fail(BAD_HANDLE, acl.rt.record_event, s, s)
        expect_fail(BAD_HANDLE, acl.rt.stream_wait_event, s, s)
        expect_fail(PARAM, acl.rt.stream_wait_event, s, 0)
        expect_fail(BAD_HANDLE, acl.rt.record_event, e, 0x5700_FFFF)  # not a stream
        expect_fail(PARAM, acl.rt.synchronize_event_with_timeout, e, 0)
        expect_fail(PARAM, acl.rt.synchronize_event_with_timeout, e, -2)
        expect_fail(PARAM, acl.rt.ipc_get_event_handle, plain)  # only IPC events have one
        expect_fail(PARAM, acl.rt.ipc_open_event_handle, handle[:63])
        expect_fail(PARAM, acl.rt.ipc_open_event_handle, "not bytes")
        expect_fail(BAD_HANDLE, acl.rt.ipc_open_event_handle, bytes(64))
        expect_fail(BAD_HANDLE, acl.rt.ipc_open_event_handle, handle[:20] + b"\1" + handle[21:])
        wrong = bytearray(handle)
        wrong[0] ^= 0xFF  # a value the broker never gave out
        expect_fail(BAD_HANDLE, acl.rt.ipc_open_event_handle, bytes(wrong))
        assert acl.rt.reset_event(e, s) == NOT_SUPPORTED  # the runtime's calls IPC events do not take
        for name in ("query_event", "query_event_wait_status", "get_event_id"):
            assert getattr(acl.rt, name)(e)[-1] == NOT_SUPPORTED
    finally:
        ok(acl.rt.destroy_event(plain))
    ok(acl.rt.destroy_event(e))
    # destroyed: every call fails, and the creator's destroy revoked the handle
    expect_fail(BAD_HANDLE, acl.rt.synchronize_event, e)
    expect_fail(BAD_HANDLE, acl.rt.record_event, e, s)
    expect_fail(BAD_HANDLE, acl.rt.stream_wait_event, s, e)
    expect_fail(BAD_HANDLE, acl.rt.destroy_event, e)
    expect_fail(BAD_HANDLE, acl.rt.ipc_open_event_handle, handle)


def test_rule_19_a_key_of_another_kind_is_not_an_event(acl):
    """The 64 bytes name a broker export: a physical allocation's export under an event's header is refused with
    107017, its fd closed."""
    from vmmshare.runtime.events import _HANDLE
    from vmmshare.runtime.syncshare import MAGIC_EVENT

    h = ok(acl.rt.malloc_physical(2 << 20, {"handleType": 0, "allocationType": 0, "memAttr": 5,
                                            "location": {"id": 0, "type": 1}}, 0))
    try:
        shareable = ok(acl.rt.mem_export_to_shareable_handle(h, 0, 1))
        forged = _HANDLE.pack(shareable, runtime().config.server_id, MAGIC_EVENT)
        before = fd_count()
        assert "not an IPC event" in expect_fail(BAD_HANDLE, acl.rt.ipc_open_event_handle,
                                                 forged + bytes(64 - len(forged)))
        assert fd_count() == before
    finally:
        ok(acl.rt.free_physical(h))


def test_rule_19_nothing_leaks(acl, vmm, peer):
    from vmmshare.runtime.syncpage import watcher

    b = peer()
    s = vmm.stream()
    watcher().watch(None, [])  # type: ignore[arg-type]  # what lives on (its eventfd, its thread) made now, not by
    # whichever round's wait first has to sleep (whether one does is a race with the held stream's record)
    for _ in range(2):  # the first round may open what lives on (the broker's connection)
        fds_before, maps = fds(), map_count()
        e, handle = ipc_event(acl)
        e2 = ok(acl.rt.ipc_open_event_handle(handle))
        be = aok(b, "rt.ipc_open_event_handle", handle)
        with held(s):
            ok(acl.rt.record_event(e, s))
            ok(acl.rt.stream_wait_event(0, e2))
        ok(acl.rt.synchronize_stream(0))
        ok(acl.rt.destroy_event(e2))
        ok(acl.rt.destroy_event(e))
        aok(b, "rt.destroy_event", be)
    assert (fds(), map_count()) == (fds_before, maps)


def test_rule_2_an_event_page_that_cannot_be_made_loses_nothing(acl, vmm, monkeypatch):
    """The page's memfd cannot be made (out of fds) while the broker checks its charge: the creation fails with
    207001, the charge goes back and the connection stays in step (the next event is made)."""
    host = runtime().shared.host

    def out_of_fds(*args: Any) -> Any:
        raise OSError(24, "Too many open files")

    e, _ = ipc_event(acl)  # (the first opens what lives on: the broker's connection)
    ok(acl.rt.destroy_event(e))
    node = runtime().node
    holds_before = len(node._holds)  # the broker's holds of this process: the charge would stay among them
    fds_before = fds()
    with monkeypatch.context() as m:
        m.setattr(host, "allocate", out_of_fds)
        msg = expect_fail(MEMORY_ALLOCATION, acl.rt.create_event_ex_with_flag, IPC)
    assert "Too many open files" in msg
    assert (len(node._holds), fds()) == (holds_before, fds_before)
    e, _ = ipc_event(acl)
    ok(acl.rt.destroy_event(e))


def test_rule_19_a_record_runs_behind_a_failed_task(acl, vmm):
    """The copy before the record fails when its turn comes (its memory was freed meanwhile): the record still
    completes, and the stream's synchronize reports the copy's failure."""
    e, _ = ipc_event(acl)
    s = vmm.stream()
    src = vmm.host(64)
    gone = ok(acl.rt.malloc_host(64))
    try:
        with held(s):
            ok(acl.rt.memcpy_async(gone, 64, src, 8, 0, s))
            ok(acl.rt.record_event(e, s))
            ok(acl.rt.free_host(gone))  # the copy's destination goes before the copy runs
        ok(acl.rt.synchronize_event_with_timeout(e, 60_000))  # (a bound: a skipped record would never come)
        assert ok(acl.rt.query_event_status(e)) == COMPLETE
        assert acl.rt.synchronize_stream(s) == PARAM
    finally:
        ok(acl.rt.destroy_event(e))
