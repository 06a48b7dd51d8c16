"""Rule 19 in vmmshare.torch: a reduced tensor carries an event, and the consumer's rebuilt tensor is returned only
once the producer's record completed (reduce_tensor's `event=`, install's `event=`)."""

from __future__ import annotations

import multiprocessing

import pytest

torch = pytest.importorskip("torch")

import event_children  # noqa: E402
import vmmshare  # noqa: E402
import vmmshare.torch as vt  # noqa: E402


def test_rule_19_a_rebuilt_tensor_waits_for_the_producers_event() -> None:
    t = vt.zeros(100)
    ev = vmmshare.Event()
    ctx = multiprocessing.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=event_children.tensor_consumer, args=(q, back))
    child.start()
    try:
        with event_children.held_stream() as (stream, gate):
            ev.record(stream)
            q.put(vt.reduce_tensor(t, validate_pids=False, event=ev))
            assert back.get(timeout=120) == "got"
            t += 3  # written before the stream reaches the record
            gate.set()
        assert back.get(timeout=120) == 300.0
    finally:
        child.join(60)
        ev.close()
    assert child.exitcode == 0


def test_rule_19_install_sends_the_event_with_every_tensor() -> None:
    ev = vmmshare.Event()
    vt.install(validate_pids=False, event=ev)
    ctx = torch.multiprocessing.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=event_children.installed_consumer, args=(q, back))
    child.start()
    try:
        assert back.get(timeout=120) == "ready"
        t = vt.zeros(10)
        with event_children.held_stream() as (stream, gate):
            ev.record(stream)
            q.put(t)
            t += 7
            gate.set()
        assert back.get(timeout=120) == 70.0
    finally:
        vt.uninstall()
        child.join(60)
        ev.close()
    assert child.exitcode == 0


def test_rule_19_an_event_argument_is_checked() -> None:
    t = vt.zeros(4)
    with pytest.raises(vmmshare.InvalidParamError):
        vt.reduce_tensor(t, event="not an event")  # type: ignore[arg-type]
    with pytest.raises(vmmshare.InvalidParamError):
        vt.install(event=object())  # type: ignore[arg-type]
    fn, args = vt.reduce_tensor(t, validate_pids=False)
    with pytest.raises(vmmshare.InvalidParamError):
        fn(*args, "zz")  # not hex
    with pytest.raises(vmmshare.AclError):
        fn(*args, bytes(64).hex())  # no event's handle
