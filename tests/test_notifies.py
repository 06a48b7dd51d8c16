"""Rule 20: notifies and IPC notifies. The exporter waits (its stream is held until the notify is recorded, then it
is reset), the importers record; the broker's trustlist decides who imports (its flag to disable pid validation is
0x2); a wait whose importers all died fails with 507057, one that runs out with 107019; bad input gets the
runtime's codes and leaks nothing."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from conftest import ACL_PARAM, NO_CONTEXT, NOT_SUPPORTED, PARAM, expect_fail, fd_count, map_count, ok, read
from procs import Actor, clean_env
from procs import fails as afails
from procs import ok as aok
from vmmshare._process import runtime

BAD_HANDLE = 107017
NO_PERMISSION = 207006
WAIT_TIMEOUT = 107019
STREAM_SYNC_TIMEOUT = 507046
EVENT_SYNC_TIMEOUT = 507047
PRODUCER_DIED = 507057
NO_PID_CHECK = 0x2


def fds() -> int:
    """This process's open fds, but for the pidfds its watcher keeps of producers it has waited on (they stay
    open for the next wait, up to a bound: see syncpage.Watcher)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}") != "anon_inode:[pidfd]"
    return count


@pytest.fixture
def peer() -> Iterator[Any]:
    """Another process on this test process's broker, with device 0 set (an `Actor`)."""
    made: list[Actor] = []

    def make(device: int = 0) -> Actor:
        a = Actor(clean_env(VMMSHARE_SOCKET=os.environ["VMMSHARE_SOCKET"], VMMSHARE_BROKER_IDLE="1"), device=device)
        made.append(a)
        return a

    yield make
    for a in made:
        a.kill()


def exported(acl: Any, flags: int = 0) -> tuple[int, str]:
    n = ok(acl.rt.create_notify(0))
    return n, ok(acl.rt.notify_get_export_key(n, 65, flags))


def test_rule_20_the_exporter_waits_and_the_importer_records(acl, vmm, peer):
    """The runtime's sample flow: A creates, exports with B's pid trusted and queues a wait; B imports and
    records; A's stream, held until then, copies what B wrote before its record."""
    b = peer()
    buf = ok(acl.rt.malloc(4096, 0))
    dst = vmm.host(64)
    n, key = exported(acl)
    s = vmm.stream()
    try:
        ok(acl.rt.notify_set_import_pid(n, [aok(b, "rt.device_get_bare_tgid")]))
        mem_key = ok(acl.rt.ipc_mem_get_export_key(buf, 4096, 65, 1))
        q = aok(b, "rt.ipc_mem_import_by_key", mem_key, 0)
        ok(acl.rt.wait_and_reset_notify(n, s, 0))
        ok(acl.rt.memcpy_async(dst, 64, buf, 12, 2, s))
        expect_fail(STREAM_SYNC_TIMEOUT, acl.rt.synchronize_stream_with_timeout, s, 20)  # held by the wait
        m = aok(b, "rt.notify_import_by_key", key, 2)  # ACL_RT_NOTIFY_IMPORT_FLAG_ENABLE_PEER_ACCESS
        b.call("!write_bytes", q, b"from the importer")
        aok(b, "rt.record_notify", m, 0)
        ok(acl.rt.synchronize_stream(s))
        assert read(dst, 12) == b"from the imp"
        # reset: the next wait waits for the next record
        ok(acl.rt.wait_and_reset_notify(n, s, 0))
        expect_fail(STREAM_SYNC_TIMEOUT, acl.rt.synchronize_stream_with_timeout, s, 20)
        aok(b, "rt.record_notify", m, 0)
        ok(acl.rt.synchronize_stream(s))
        aok(b, "rt.destroy_notify", m)
        aok(b, "rt.ipc_mem_close", mem_key)
        ok(acl.rt.ipc_mem_close(mem_key))
    finally:
        ok(acl.rt.destroy_notify(n))
        ok(acl.rt.free(buf))


def test_rule_20_an_event_recorded_behind_a_notify_wait_completes_when_the_stream_gets_there(acl, vmm, peer):
    """A's stream waits on a notify, then records an IPC event; B waits on the event, which completes only once C
    records the notify and A's stream gets past the wait."""
    b, c = peer(), peer()
    n, key = exported(acl, NO_PID_CHECK)
    e = ok(acl.rt.create_event_ex_with_flag(0x40))
    s = vmm.stream()
    pool = ThreadPoolExecutor(1)
    try:
        be = aok(b, "rt.ipc_open_event_handle", ok(acl.rt.ipc_get_event_handle(e)))
        ok(acl.rt.wait_and_reset_notify(n, s, 0))
        ok(acl.rt.record_event(e, s))
        assert aok(b, "rt.query_event_status", be) == 0
        assert b.call("rt.synchronize_event_with_timeout", be, 20) == EVENT_SYNC_TIMEOUT
        waiting = pool.submit(b.call, "rt.synchronize_event", be)
        m = aok(c, "rt.notify_import_by_key", key, 0)
        aok(c, "rt.record_notify", m, 0)
        assert waiting.result(timeout=60) == 0
        assert aok(b, "rt.query_event_status", be) == 1
        aok(b, "rt.destroy_event", be)
        aok(c, "rt.destroy_notify", m)
    finally:
        pool.shutdown()
        ok(acl.rt.synchronize_stream(s))
        ok(acl.rt.destroy_event(e))
        ok(acl.rt.destroy_notify(n))


def test_rule_20_the_trustlist_decides_who_imports(acl, peer):
    b, c = peer(), peer()
    n, key = exported(acl)
    try:
        msg = afails(c, NO_PERMISSION, "rt.notify_import_by_key", key, 0)
        assert "trustlist" in msg
        ok(acl.rt.notify_set_import_pid(n, [b.pid]))
        m = aok(b, "rt.notify_import_by_key", key, 0)
        afails(c, NO_PERMISSION, "rt.notify_import_by_key", key, 0)  # still not c
        afails(b, NO_PERMISSION, "rt.notify_set_import_pid", m, [c.pid])  # only the exporter sets it
        ok(acl.rt.notify_set_import_pid_inter_server(n, [{"sdid": runtime().config.server_id, "pid": [c.pid]}]))
        aok(b, "rt.destroy_notify", m)
        aok(c, "rt.destroy_notify", aok(c, "rt.notify_import_by_key", key, 0))
    finally:
        ok(acl.rt.destroy_notify(n))
    # without pid validation, whoever holds the key imports it, and there is no trustlist to set
    n, key = exported(acl, NO_PID_CHECK)
    try:
        aok(c, "rt.destroy_notify", aok(c, "rt.notify_import_by_key", key, 0))
        assert "DISABLE_PID_VALIDATION" in expect_fail(NO_PERMISSION, acl.rt.notify_set_import_pid, n, [c.pid])
        assert ok(acl.rt.notify_get_export_key(n, 100, NO_PID_CHECK)) == key  # the same key again
        expect_fail(PARAM, acl.rt.notify_get_export_key, n, 65, 0)  # not with the other flag
    finally:
        ok(acl.rt.destroy_notify(n))
    afails(c, BAD_HANDLE, "rt.notify_import_by_key", key, 0)  # destroyed by its exporter: revoked


def test_rule_20_a_wait_whose_importers_died_fails(acl, vmm, peer):
    """B imports (a producer); A waits; B is killed before it records: A's stream reports 507057."""
    b = peer()
    n, key = exported(acl, NO_PID_CHECK)
    s = vmm.stream()
    try:
        aok(b, "rt.notify_import_by_key", key, 0)
        ok(acl.rt.wait_and_reset_notify(n, s, 0))
        expect_fail(STREAM_SYNC_TIMEOUT, acl.rt.synchronize_stream_with_timeout, s, 20)
        b.kill()
        assert acl.rt.synchronize_stream(s) == PRODUCER_DIED
        assert "exited before recording it" in acl.get_recent_err_msg()
        # a producer that comes later is waited for again
        c = peer()
        m = aok(c, "rt.notify_import_by_key", key, 0)
        ok(acl.rt.wait_and_reset_notify(n, s, 0))
        aok(c, "rt.record_notify", m, 0)
        ok(acl.rt.synchronize_stream(s))
        aok(c, "rt.destroy_notify", m)
    finally:
        ok(acl.rt.destroy_notify(n))


def test_rule_20_a_wait_takes_the_runtimes_timeout(acl, vmm):
    n, _ = exported(acl)
    s = vmm.stream()
    try:
        ok(acl.rt.wait_and_reset_notify(n, s, 1))  # seconds
        assert acl.rt.synchronize_stream(s) == WAIT_TIMEOUT
        assert "not recorded within 1 s" in acl.get_recent_err_msg()
        ok(acl.rt.record_notify(n, 0))  # the creator may record too; the flag stays set for the next wait
        ok(acl.rt.wait_and_reset_notify(n, s, 1))
        ok(acl.rt.synchronize_stream(s))
    finally:
        ok(acl.rt.destroy_notify(n))


def test_rule_20_an_importer_waits_on_the_device_the_notify_was_made_on(acl, peer):
    b = peer(device=1)
    n, key = exported(acl, NO_PID_CHECK)
    try:
        m = aok(b, "rt.notify_import_by_key", key, 0)
        assert "device 0" in afails(b, PARAM, "rt.wait_and_reset_notify", m, 0, 0)
        aok(b, "rt.record_notify", m, 0)  # recording is what an importer does
        aok(b, "rt.destroy_notify", m)
    finally:
        ok(acl.rt.destroy_notify(n))


def test_rule_20_bad_input(acl, vmm):
    n, key = exported(acl)
    plain = ok(acl.rt.create_notify(1))  # ACL_NOTIFY_DEVICE_USE_ONLY
    s = vmm.stream()
    e = ok(acl.rt.create_event())
    buf = ok(acl.rt.malloc(4096, 0))
    try:
        expect_fail(PARAM, acl.rt.create_notify, 2)
        for call, args in ((acl.rt.destroy_notify, ()), (acl.rt.record_notify, (s,)),
                           (acl.rt.wait_and_reset_notify, (s, 0)), (acl.rt.notify_set_import_pid, ([1],))):
            expect_fail(ACL_PARAM, call, 0, *args)
            expect_fail(BAD_HANDLE, call, e, *args)  # an event's handle is not a notify's
            expect_fail(BAD_HANDLE, call, 0x4EFF_FFFF, *args)
        expect_fail(ACL_PARAM, acl.rt.notify_get_export_key, 0, 65, 0)
        expect_fail(BAD_HANDLE, acl.rt.notify_get_export_key, e, 65, 0)
        expect_fail(PARAM, acl.rt.notify_get_export_key, plain, 1024, 0)  # beyond pyACL's key buffer
        expect_fail(PARAM, acl.rt.notify_get_export_key, plain, 0, 0)
        expect_fail(PARAM, acl.rt.notify_get_export_key, plain, 65, 1)  # 0x1 is not the notify's flag: 0x2 is
        expect_fail(PARAM, acl.rt.notify_get_export_key, plain, 64, 0)  # the key needs 65
        expect_fail(PARAM, acl.rt.notify_set_import_pid, plain, [1])  # no key yet
        expect_fail(ACL_PARAM, acl.rt.notify_set_import_pid, n, None)
        expect_fail(PARAM, acl.rt.notify_set_import_pid, n, [])
        expect_fail(PARAM, acl.rt.notify_set_import_pid, n, [0])
        expect_fail(PARAM, acl.rt.notify_set_import_pid_inter_server, 0, [{"sdid": 0, "pid": [1]}])
        expect_fail(PARAM, acl.rt.notify_set_import_pid_inter_server, n, [])
        expect_fail(PARAM, acl.rt.notify_set_import_pid_inter_server, n, [{"sdid": 0, "pid": [1, 2]}])
        expect_fail(PARAM, acl.rt.notify_set_import_pid_inter_server, n, [{"sdid": 0}])
        expect_fail(NOT_SUPPORTED, acl.rt.notify_set_import_pid_inter_server, n,
                    [{"sdid": runtime().config.server_id ^ 1, "pid": [1]}])  # another server: no transport here
        expect_fail(ACL_PARAM, acl.rt.notify_import_by_key, None, 0)
        expect_fail(PARAM, acl.rt.notify_import_by_key, key, 4)
        for bad in ("", key[:-1], key + "0", key.upper(), "ntf" + "0" * 24, "x" * 100):
            expect_fail(PARAM, acl.rt.notify_import_by_key, bad, 0)
        expect_fail(BAD_HANDLE, acl.rt.notify_import_by_key, "ntf" + "1" * 16 + key[-8:], 0)  # never given out
        mem_key = ok(acl.rt.ipc_mem_get_export_key(buf, 4096, 65, 1))
        expect_fail(PARAM, acl.rt.notify_import_by_key, mem_key, 0)  # a memory key is not a notify key
        expect_fail(PARAM, acl.rt.ipc_mem_import_by_key, key, 0)  # nor the other way round
        before = fd_count()
        msg = expect_fail(BAD_HANDLE, acl.rt.notify_import_by_key, "ntf" + mem_key, 0)  # memory under a notify's name
        assert "not an IPC notify" in msg
        assert fd_count() == before
        ok(acl.rt.ipc_mem_close(mem_key))
        expect_fail(PARAM, acl.rt.wait_and_reset_notify, n, s, -1)
        code = []
        import threading

        t = threading.Thread(target=lambda: code.append(acl.rt.create_notify(0)))
        t.start()
        t.join()
        assert code[0] == (0, NO_CONTEXT)
    finally:
        ok(acl.rt.destroy_event(e))
        ok(acl.rt.destroy_notify(plain))
        ok(acl.rt.free(buf))
    ok(acl.rt.destroy_notify(n))
    for call, args in ((acl.rt.destroy_notify, ()), (acl.rt.record_notify, (s,)),
                       (acl.rt.wait_and_reset_notify, (s, 0)), (acl.rt.notify_get_export_key, (65, 0))):
        expect_fail(BAD_HANDLE, call, n, *args)  # destroyed


def test_rule_20_nothing_leaks(acl, vmm, peer):
    b = peer()
    s = vmm.stream()
    for _ in range(2):  # the first round may open what lives on (the watcher's thread and eventfd)
        fds_before, maps, peer_fds = fds(), map_count(), b.call("!fd_count")
        n, key = exported(acl, NO_PID_CHECK)
        m = aok(b, "rt.notify_import_by_key", key, 0)
        ok(acl.rt.wait_and_reset_notify(n, s, 0))
        aok(b, "rt.record_notify", m, 0)
        ok(acl.rt.synchronize_stream(s))
        aok(b, "rt.destroy_notify", m)
        ok(acl.rt.destroy_notify(n))
    assert (fds(), map_count(), b.call("!fd_count")) == (fds_before, maps, peer_fds)
