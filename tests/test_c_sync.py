"""Rules 19 and 20 with the C library on one side or both: an IPC event or notify made by a C process is waited on
or recorded by a Python process and the other way round (the shared page of docs/synchronisation.md is one
format), a record queued behind a held stream completes only when the stream gets there, a producer that dies
fails the waiters with 507057, and bad handles get the runtime's codes."""

from __future__ import annotations

import pytest

from conftest import Node
from procs import PROP, Actor, MiB2, fails, ok

IPC = 0x40
NOT_READY, COMPLETE = 0, 1
SYNC_TIMEOUT, PRODUCER_DIED, BAD_HANDLE, NO_PERMISSION, PARAM = 507047, 507057, 107017, 207006, 107000
DISABLE_PID_CHECK = 0x2


def shared_memory(e: Actor, i: Actor) -> tuple[int, int, int, int]:
    """2 MiB the exporter `e` maps, and the importer `i` maps too: (e's handle, e's ptr, i's handle, i's ptr)."""
    h = ok(e, "rt.malloc_physical", MiB2, PROP, 0)
    p = ok(e, "rt.reserve_mem_address", MiB2, 0, 0, 0)
    ok(e, "rt.map_mem", p, MiB2, 0, h, 0)
    sh = ok(e, "rt.mem_export_to_shareable_handle_v2", h, 1, 1)
    ih = ok(i, "rt.mem_import_from_shareable_handle_v2", sh, 1, 0)
    ip = ok(i, "rt.reserve_mem_address", MiB2, 0, 0, 0)
    ok(i, "rt.map_mem", ip, MiB2, 0, ih, 0)
    return h, p, ih, ip


def held_stream(a: Actor) -> tuple[int, int, int]:
    """A stream of `a` held by a wait on a local notify (work queued on it waits), the notify, and a second stream
    that releases it: (held stream, notify, other stream)."""
    s, other = ok(a, "rt.create_stream"), ok(a, "rt.create_stream")
    n = ok(a, "rt.create_notify", 0)
    ok(a, "rt.wait_and_reset_notify", n, s, 0)
    return s, n, other


@pytest.mark.parametrize(("producer", "consumer"), [("c", "python"), ("python", "c"), ("c", "c")])
def test_rule_19_an_ipc_event_is_recorded_in_one_language_and_waited_in_the_other(
        node: Node, producer: str, consumer: str) -> None:
    """The producer writes, records behind held work, and the consumer, which waits through the 64-byte handle,
    sees the write once the stream got there (and not before: its timed wait runs out while the stream is held)."""
    p, c = node.actor(producer), node.actor(consumer)
    _, ptr, _, cptr = shared_memory(p, c)
    e = ok(p, "rt.create_event_ex_with_flag", IPC)
    handle = ok(p, "rt.ipc_get_event_handle", e)
    assert isinstance(handle, bytes) and len(handle) == 64
    ce = ok(c, "rt.ipc_open_event_handle", handle)
    assert ok(c, "rt.query_event_status", ce) == COMPLETE  # never recorded: complete
    ok(c, "rt.synchronize_event", ce)
    s, n, other = held_stream(p)
    p.call("!write_bytes", ptr, b"written before the record")
    ok(p, "rt.record_event", e, s)  # queued behind the held wait
    assert ok(p, "rt.query_event_status", e) == NOT_READY
    assert ok(c, "rt.query_event_status", ce) == NOT_READY
    fails(c, SYNC_TIMEOUT, "rt.synchronize_event_with_timeout", ce, 30)
    ok(p, "rt.record_notify", n, other)  # the stream goes on: the record completes
    ok(c, "rt.synchronize_event_with_timeout", ce, 30_000)
    assert c.call("!read", cptr, 25) == b"written before the record"
    ok(p, "rt.synchronize_stream", s)
    ok(c, "rt.destroy_event", ce)
    fails(c, BAD_HANDLE, "rt.synchronize_event", ce)  # destroyed
    ok(p, "rt.destroy_event", e)


@pytest.mark.parametrize(("exporter", "importer"), [("c", "python"), ("python", "c")])
def test_rule_20_a_notify_exported_in_one_language_is_recorded_from_the_other(
        node: Node, exporter: str, importer: str) -> None:
    """The exporter trusts the importer's pid; the importer imports by key and records; the exporter's wait takes
    the record (and resets it). A stranger is refused (207006)."""
    e, i, stranger = node.actor(exporter), node.actor(importer), node.actor(importer)
    n = ok(e, "rt.create_notify", 0)
    key = ok(e, "rt.notify_get_export_key", n, 65, 0)
    assert key.startswith("ntf") and len(key) == 27
    ok(e, "rt.notify_set_import_pid", n, [i.pid])
    fails(stranger, NO_PERMISSION, "rt.notify_import_by_key", key, 0, neutral=(0, None))
    mine = ok(i, "rt.notify_import_by_key", key, 0)
    s = ok(e, "rt.create_stream")
    ok(e, "rt.wait_and_reset_notify", n, s, 30)
    ok(i, "rt.record_notify", mine, 0)
    ok(e, "rt.synchronize_stream", s)  # the wait took the record
    ok(e, "rt.wait_and_reset_notify", n, s, 1)  # reset: a second wait has nothing to take
    fails(e, 107019, "rt.synchronize_stream", s)
    ok(i, "rt.destroy_notify", mine)
    ok(e, "rt.destroy_stream", s)
    ok(e, "rt.destroy_notify", n)


def test_rule_19_a_waiter_whose_c_producer_dies_gets_507057(node: Node) -> None:
    """A C producer records on a held stream and is killed before the stream gets there: the Python waiter, which
    waits without a time limit, fails with 507057 instead of hanging."""
    p, c = node.actor("c"), node.actor("python")
    e = ok(p, "rt.create_event_ex_with_flag", IPC)
    ce = ok(c, "rt.ipc_open_event_handle", ok(p, "rt.ipc_get_event_handle", e))
    s, _, _ = held_stream(p)
    ok(p, "rt.record_event", e, s)
    p.kill()
    fails(c, PRODUCER_DIED, "rt.synchronize_event", ce)


def test_rule_20_a_c_waiter_whose_importers_all_die_gets_507057(node: Node) -> None:
    e, i = node.actor("c"), node.actor("python")
    n = ok(e, "rt.create_notify", 0)
    key = ok(e, "rt.notify_get_export_key", n, 65, DISABLE_PID_CHECK)
    ok(i, "rt.notify_import_by_key", key, 0)
    s = ok(e, "rt.create_stream")
    ok(e, "rt.wait_and_reset_notify", n, s, 0)
    i.kill()
    fails(e, PRODUCER_DIED, "rt.synchronize_stream", s)


def test_the_c_librarys_event_and_notify_calls_refuse_bad_input(node: Node) -> None:
    a = node.actor("c")
    e = ok(a, "rt.create_event")
    n = ok(a, "rt.create_notify", 0)
    fails(a, PARAM, "rt.create_event_with_flag", IPC)  # the IPC flag is create_event_ex_with_flag's
    fails(a, PARAM, "rt.create_event_ex_with_flag", IPC | 1)
    fails(a, PARAM, "rt.ipc_get_event_handle", e, neutral=(None,))  # not an IPC event
    fails(a, BAD_HANDLE, "rt.synchronize_event", n)  # a notify's handle is no event's
    fails(a, BAD_HANDLE, "rt.record_notify", e, 0)
    fails(a, BAD_HANDLE, "rt.ipc_open_event_handle", bytes(64))
    fails(a, PARAM, "rt.notify_import_by_key", "ntf123", 0)
    fails(a, PARAM, "rt.notify_get_export_key", n, 65, 1, neutral=("",))  # the notify's flag is 0x2, not 0x1
    fails(a, PARAM, "rt.synchronize_event_with_timeout", e, 0)
    fails(a, 100000, "rt.record_event", 0, 0)
    ok(a, "rt.destroy_event", e)
    fails(a, BAD_HANDLE, "rt.destroy_event", e)
    ok(a, "rt.destroy_notify", n)
