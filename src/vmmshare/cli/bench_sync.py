"""What `vmmshare bench` measures of synchronisation: the producer/consumer wake-up across two processes.

One IPC event: the producer records it on a stream that is busy; the consumer, in another process, is in
`synchronize_event`; the time runs from the moment the producer's stream reaches the record (a stamp taken by the
stream's own thread, just before the record completes) to the moment the consumer's wait returns. Against it, in
the same run, between the same two processes and from the same stream, the floor of a cross-process wake-up: the
stream reaches a one-byte write to a pipe on which the consumer is blocked in read(2), from just before the write
to the return of the read. The clock is
CLOCK_MONOTONIC, the same in both processes. Before each trigger the producer lets SETTLE seconds pass after the
consumer said it is about to wait, so that the consumer is asleep in the kernel in both cases (a wake-up, not a
read of what is there already). Rounds of the two alternate, so that load on the machine falls on both alike.

    python -m vmmshare.cli.bench_sync [--reps N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from .bench_measures import Step, now_ns, quiet, stats_of
from .console import quiet_child, start_child

TARGET = 1.5  # the event's wake-up, at most this many times the pipe's
SETTLE = 0.002  # seconds the consumer is given to fall asleep before each trigger


def _consumer(ctrl: Connection, wake: Connection) -> None:
    """The consumer: on each request it says it is about to wait, waits (on the event, or in read(2) on the pipe),
    and answers the time its wait returned."""
    import vmmshare.acl as acl

    acl.rt.set_device(0)
    event = 0
    rfd = wake.fileno()  # a pipe's read end, read raw (one byte, no framing)
    ctrl.send(os.getpid())
    while True:
        msg = ctrl.recv()
        if msg[0] == "stop":
            break
        if msg[0] == "open":
            event, ret = acl.rt.ipc_open_event_handle(msg[1])
            ctrl.send(acl.get_recent_err_msg() if ret else 0)
            continue
        ctrl.send("waiting")
        if msg[0] == "event":
            ret = acl.rt.synchronize_event(event)
            t1 = now_ns()
            if ret:
                raise SystemExit(f"synchronize_event failed: {acl.get_recent_err_msg()}")
        else:
            got = os.read(rfd, 1)
            t1 = now_ns()
            if got != b"x":
                raise SystemExit("the pipe closed")
        ctrl.send(t1)
    if event:
        acl.rt.destroy_event(event)


def _hold(gate: threading.Event) -> None:
    gate.wait()


def _write(fd: int) -> None:
    os.write(fd, b"x")


def wakeup(reps: int, step: Step = quiet) -> dict[str, Any]:
    """`reps` rounds each of the event's and the pipe's one-way wake-up (µs: median, p10, p90), and their ratio."""
    import vmmshare.acl as acl
    from vmmshare._process import runtime

    acl.rt.set_device(0)
    ctx = mp.get_context("spawn")
    ctrl, theirs = ctx.Pipe()
    wake_r, wake_w = ctx.Pipe(duplex=False)
    wfd = wake_w.fileno()
    step("starting the consumer process")
    peer = ctx.Process(target=quiet_child, args=(_consumer, theirs, wake_r))
    start_child(peer)
    theirs.close()
    wake_r.close()
    event, ret = acl.rt.create_event_ex_with_flag(acl.ACL_EVENT_IPC)
    stream, ret2 = acl.rt.create_stream()
    if ret or ret2:
        raise RuntimeError(f"cannot make the event or the stream: {acl.get_recent_err_msg()}")
    events: list[float] = []
    pipes: list[float] = []
    try:
        ctrl.recv()  # the consumer's pid: it is up
        handle, ret = acl.rt.ipc_get_event_handle(event)
        if ret:
            raise RuntimeError(f"ipc_get_event_handle failed: {acl.get_recent_err_msg()}")
        ctrl.send(("open", handle))
        opened = ctrl.recv()
        if opened != 0:
            raise RuntimeError(f"the consumer could not open the event: {opened}")
        s = runtime().devices.stream(stream)
        step("producer/consumer wake-ups: event record -> wait, pipe write -> read")
        for i in range(reps + 2):  # the first two rounds warm up (the watcher's thread, the first futex)
            # the event: the stream, held by the producer's work, reaches the record once the work is done
            gate, stamp = threading.Event(), list[int]()
            s.submit("the producer's work", lambda gate=gate: _hold(gate))  # type: ignore[misc]
            s.submit("the stream reaches the record", lambda stamp=stamp: stamp.append(now_ns()))  # type: ignore[misc]
            if acl.rt.record_event(event, stream):
                raise RuntimeError(f"record_event failed: {acl.get_recent_err_msg()}")
            ctrl.send(("event",))
            ctrl.recv()  # "waiting"
            time.sleep(SETTLE)
            gate.set()
            t1 = ctrl.recv()
            # the pipe: the same stream, held the same way, reaches a one-byte write
            gate, pipe_stamp = threading.Event(), list[int]()
            s.submit("the producer's work", lambda gate=gate: _hold(gate))  # type: ignore[misc]
            s.submit("the stream reaches the write", lambda st=pipe_stamp: st.append(now_ns()))  # type: ignore[misc]
            s.submit("the write", lambda: _write(wfd))
            ctrl.send(("pipe",))
            ctrl.recv()
            time.sleep(SETTLE)
            gate.set()
            t1p = ctrl.recv()
            if i >= 2:
                events.append((t1 - stamp[0]) / 1000)
                pipes.append((t1p - pipe_stamp[0]) / 1000)
        acl.rt.synchronize_stream(stream)
    finally:
        ctrl.send(("stop",))
        peer.join()
        wake_w.close()
        acl.rt.destroy_stream(stream)
        acl.rt.destroy_event(event)
    ev, pp = stats_of(events), stats_of(pipes)
    return {"event_record_to_wait": ev, "pipe_write_to_read": pp, "ratio": ev["median"] / pp["median"],
            "target": f"<= {TARGET}", "reps": reps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vmmshare.cli.bench_sync", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=200, help="rounds of each (default 200)")
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    res = wakeup(max(2, args.reps))
    ev, pp = res["event_record_to_wait"], res["pipe_write_to_read"]
    print("Producer/consumer wake-up across two processes, µs, median (p10–p90)")
    print(f"  event record -> wait   {ev['median']:8.1f} ({ev['p10']:.1f}–{ev['p90']:.1f})")
    print(f"  pipe write -> read     {pp['median']:8.1f} ({pp['p10']:.1f}–{pp['p90']:.1f})")
    print(f"  ratio                  {res['ratio']:8.2f}x  (target {res['target']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
