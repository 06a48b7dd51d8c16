"""Rule 19 on the Pythonic API: `vmmshare.Event` travels by pickle with the memory it guards (a multiprocessing
child, a forked child), is opened once per process, and its waits raise the runtime's errors."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import pickle

import pytest

import event_children
import vmmshare
from conftest import read, write
from vmmshare.runtime.syncpage import futex_wait

SYNC_TIMEOUT = 507047




def test_rule_19_an_event_travels_with_its_memory_to_a_child() -> None:
    """The producer records on a held stream, sends memory and event; the child finds the event not done, waits,
    and reads what was written before the stream reached the record."""
    memory = vmmshare.Device(0).allocate(2 << 20, location="host")
    memory.export(validate_pids=False)
    m = memory.map()
    ev = vmmshare.Event()
    ctx = multiprocessing.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=event_children.consumer, args=(q, back))
    child.start()
    try:
        with event_children.held_stream() as (stream, gate):
            ev.record(stream)
            assert not ev.done
            q.put((memory, ev, ev))
            assert back.get(timeout=120) == ("opened", False, True)  # one open serves both arrivals
            write(m.ptr, b"before the record!")
            gate.set()
        assert back.get(timeout=120) == ("read", b"before the record!")
    finally:
        child.join(60)
        m.close()
        memory.close()
        ev.close()
    assert child.exitcode == 0


def test_rule_19_an_event_is_opened_once_per_process_and_waits_raise() -> None:
    ev = vmmshare.Event()
    try:
        again = pickle.loads(pickle.dumps(ev))  # in its own process: an open of its own, once
        assert again is pickle.loads(pickle.dumps(ev)) and again.opened and not ev.opened
        assert ev.done and again.done  # never recorded
        again.wait(0)
        with event_children.held_stream() as (stream, _):
            ev.record(stream)
            assert not again.done
            with pytest.raises(vmmshare.AclError) as err:
                again.wait(0.02)
            assert err.value.code == SYNC_TIMEOUT
        again.wait()
        ev.record()  # no stream: done at once
        assert again.done
        again.close()
    finally:
        ev.close()
    assert ev.closed
    ev.close()  # twice is nothing
    with pytest.raises(vmmshare.InvalidParamError):
        ev.wait()
    with pytest.raises(TypeError):
        pickle.dumps(ev)
    for bad in (b"x" * 63, "text", bytes(64)):
        with pytest.raises(vmmshare.AclError):
            vmmshare.Event.open(bad)
    for bad_timeout in (-1, float("nan")):
        with pytest.raises(vmmshare.InvalidParamError):
            vmmshare.Event().wait(bad_timeout)


def test_rule_19_a_timeout_past_any_timespec_is_no_limit() -> None:
    """An infinite or vast timeout is no limit, never an overflow: the futex wait takes it (and returns at once,
    the word not being what it expects), and an event's wait with it returns once the record completed."""
    word = ctypes.c_uint32(5)
    for timeout in (float("inf"), 1e30, 2**80):
        assert futex_wait(ctypes.addressof(word), 7, timeout)
    with event_children.held_stream() as (stream, gate):
        ev = vmmshare.Event()
        ev.record(stream)
        gate.set()
        ev.wait(float("inf"))
        assert ev.done
        ev.close()


def test_rule_19_a_forked_child_opens_the_event_it_inherited() -> None:
    ev = vmmshare.Event()
    memory = vmmshare.Device(0).allocate(2 << 20, location="host")
    m = memory.map()
    r, w = os.pipe()
    try:
        with event_children.held_stream() as (stream, gate):
            ev.record(stream)
            pid = os.fork()
            if pid == 0:  # the child: waits for the parent's record, then reads the shared mapping
                code = 1
                try:
                    os.close(r)
                    os.write(w, b"w")
                    ev.wait()
                    code = 0 if read(m.ptr, 6) == b"forked" else 2
                finally:
                    os._exit(code)
            os.close(w)
            assert os.read(r, 1) == b"w"
            write(m.ptr, b"forked")
            gate.set()
            _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        os.close(r)
        m.close()
        memory.close()
        ev.close()
