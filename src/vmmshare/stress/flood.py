"""Flood: clients that keep the broker busy with the costliest requests, and a client that only wants its imports.

    vmmshare stress flood --flooders 64 --seconds 20 --seed 1 --json flood.json

One process holds `--flooders` connections; on each it exported one allocation and then sends, again and again,
a SET_PIDS of 4,096 distinct pids (the live processes of the machine first, then pids nobody has): every one is
looked up (pidfd_open) by the broker, so each request costs it milliseconds. Every connection always has one
request in flight. Meanwhile a victim process imports and releases a handle another connection exported,
timing each IMPORT round trip. The victim runs once alone (the baseline), then during the flood.

Also measured: the broker's resident memory before the flooders' exports, with their full trustlists, and once
they have left (what a full trustlist costs, and whether it is given back).

Checked (exit status 0 when all hold): every victim import succeeds, every flood request is answered OK, the
broker is alive, its fds are back at the baseline at the end, and its log has no traceback. The latencies are
reported, not asserted (docs/reliability.md, "Flood").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import select
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as c
import rawsock
from stressio import count_option, emit, entry, prog, readable, seconds_option, whole
from vmmshare import protocol as P
from vmmshare.console import check_outputs

DEFAULT = 1
NO_PID_CHECK = 1
PROP = (0, 0, 5, 1, 0)


def _export(conn: c.Raw, size: int, pids: tuple[int, ...] = (), flags: int = 0) -> tuple[int, int]:
    """Charge and export a sealed memfd of `size` bytes on `conn`: (hold, handle value)."""
    token = conn.ask(P.Charge(0, size))
    assert isinstance(token, P.Token), token
    fd = rawsock.sealed_memfd(size, "flood")
    try:
        conn.req += 1
        rawsock.send(conn.sock, P.encode(P.Export(token.hold, size, flags, DEFAULT, 0, 0, *PROP, pids), conn.req),
                     (fd,))
    finally:
        os.close(fd)
    frame, fds = conn.recv()
    for got in fds:
        os.close(got)
    assert isinstance(frame.message, P.Exported), frame.message
    return token.hold, int.from_bytes(frame.message.shareable, "little")


def flood_pids(seed: int) -> tuple[int, ...]:
    """4,096 distinct pids: the machine's live processes first (the costly lookups), then pids nobody has."""
    live = sorted(int(n) for n in os.listdir("/proc") if n.isdigit())[:4096]
    rng = random.Random(seed)
    rest: set[int] = set()
    while len(live) + len(rest) < 4096:
        pid = rng.randrange(1 << 20, 1 << 22)
        if pid not in live:
            rest.add(pid)
    return tuple(live) + tuple(sorted(rest))


# ================================================================ roles (processes of their own)


def role_flooder(path: str, count: int, seconds: float, seed: int) -> int:
    """`count` connections, each exporting once, then SET_PIDS of 4,096 pids, one always in flight on each."""
    conns = [c.Raw(path) for _ in range(count)]
    pids = flood_pids(seed)
    handles = [_export(conn, 0)[1] for conn in conns]
    packets = [P.encode(P.SetPids(h, DEFAULT, pids), 1) for h in handles]
    print(json.dumps({"ev": "ready"}), flush=True)
    sys.stdin.readline()  # go
    by_fd = {conn.sock.fileno(): i for i, conn in enumerate(conns)}
    for conn, packet in zip(conns, packets, strict=True):
        conn.sock.send(packet)
    sent, answered, bad = count, 0, 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ready, _, _ = select.select([conn.sock for conn in conns], [], [], c.HANG_GUARD)
        if not ready:
            bad += 1
            break
        for sock in ready:
            i = by_fd[sock.fileno()]
            frame, fds = conns[i].recv()
            for fd in fds:
                os.close(fd)
            answered += 1
            bad += not isinstance(frame.message, P.Ok)
            sock.send(packets[i])
            sent += 1
    for conn in conns:  # the replies still in flight
        with contextlib.suppress(Exception):
            frame, _ = conn.recv()
            answered += 1
            bad += not isinstance(frame.message, P.Ok)
    print(json.dumps({"ev": "done", "sent": sent, "answered": answered, "not_ok": bad}), flush=True)
    sys.stdin.readline()  # leave when told
    for conn in conns:
        conn.close()
    return 0


def role_victim(path: str, handle: int, seconds: float) -> int:
    """Import and release `handle` for `seconds`, timing each IMPORT round trip."""
    conn = c.Raw(path)
    assert isinstance(conn.ask(P.BareTgid()), P.Pid)
    print(json.dumps({"ev": "ready"}), flush=True)
    sys.stdin.readline()
    latencies: list[float] = []
    failed = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        conn.req += 1
        start = time.perf_counter()
        conn.sock.send(P.encode(P.Import(handle, DEFAULT, bytes(32)), conn.req))
        frame, fds = conn.recv()
        latencies.append((time.perf_counter() - start) * 1e6)
        for fd in fds:
            os.close(fd)
        if not isinstance(frame.message, P.Imported):
            failed += 1
            continue
        assert isinstance(conn.ask(P.Release(frame.message.hold)), P.Ok)
    conn.close()
    latency = c.percentiles(latencies)
    if latencies:  # the rare long waits are what a flood does to a client: the mean and p99.9 show them
        ranked = sorted(latencies)
        latency["p999_us"] = round(ranked[min(len(ranked) - 1, int(0.999 * len(ranked)))], 1)
        latency["mean_us"] = round(sum(ranked) / len(ranked), 1)
    print(json.dumps({"ev": "done", "latency": latency, "failed": failed,
                      "imports_per_s": round(len(latencies) / seconds, 1)}), flush=True)
    return 0


# ================================================================ the controller


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _victim(broker: c.BrokerProc, handle: int, seconds: float) -> dict[str, Any]:
    me = [sys.executable, __file__, "--role", "victim", "--path", str(broker.socket), "--handle", str(handle),
          "--seconds", str(seconds)]
    w = c.Worker(me, broker.env, "victim")
    try:
        w.until("ready", c.HANG_GUARD)
        w.send({})
        done, _ = w.until("done", seconds + c.HANG_GUARD)
    finally:
        w.close()
    return done


def run(flooders: int, seconds: float, seed: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="vmmshare-flood-"))
    broker = c.LoggedBroker(work / "run", env=c.clean_env(VMMSHARE_DEVICE_MEMORY="1G"))
    result: dict[str, Any] = {"script": "flood", "flooders": flooders, "seconds": seconds, "seed": seed,
                              "machine": c.machine(), "violations": []}
    try:
        baseline_fds = c.settled_fd_count(broker)
        exporter = c.Raw(broker.socket)
        _, handle = _export(exporter, c.MiB2, flags=NO_PID_CHECK)
        result["alone"] = _victim(broker, handle, seconds)
        rss_before = _rss_kb(broker.pid)
        me = [sys.executable, __file__, "--role", "flooder", "--path", str(broker.socket), "--count", str(flooders),
              "--seconds", str(seconds), "--seed", str(seed)]
        flood = c.Worker(me, broker.env, "flooder")
        try:
            flood.until("ready", c.HANG_GUARD * 4)
            flood.send({})
            result["flooded"] = _victim(broker, handle, seconds)
            done, _ = flood.until("done", seconds + c.HANG_GUARD)
            result["flood"] = {k: done[k] for k in ("sent", "answered", "not_ok")}
            result["flood"]["set_pids_per_s"] = round(done["answered"] / seconds, 1)
            result["rss_kb"] = {"before": rss_before, "full_trustlists": _rss_kb(broker.pid)}
            flood.send({})
        finally:
            flood.close()
        exporter.close()
        after = c.settled_fd_count(broker)
        result["rss_kb"]["after_they_left"] = _rss_kb(broker.pid)
        result["broker_fds"] = {"before": baseline_fds, "after": after}
        v = result["violations"]
        for phase in ("alone", "flooded"):
            if result[phase]["failed"] or not result[phase]["latency"]["count"]:
                v.append(f"{phase}: {result[phase]['failed']} imports failed of {result[phase]['latency']}")
        if result["flood"]["not_ok"] or result["flood"]["answered"] < flooders:
            v.append(f"flood requests not answered OK: {result['flood']}")
        if after != baseline_fds:
            v.append(f"broker fds {baseline_fds} -> {after}")
        if not broker.alive():
            v.append("the broker died")
        if "Traceback" in broker.log_text():
            v.append("traceback in the broker's log")
    finally:
        broker.kill()
        shutil.rmtree(work, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog(__file__), description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["flooder", "victim"], help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--handle", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--flooders", type=count_option, default=64, help="flooding connections (default 64)")
    parser.add_argument("--seconds", type=seconds_option, default=20.0,
                        help="seconds of each victim phase (default 20)")
    parser.add_argument("--seed", type=whole, default=1)
    parser.add_argument("--json", help="write the result here ('-': stdout, instead of the summary)")
    args = parser.parse_args(argv)
    check_outputs(parser, json=None if args.json == "-" else args.json)
    if args.role == "flooder":
        return role_flooder(args.path, args.count, args.seconds, args.seed)
    if args.role == "victim":
        return role_victim(args.path, args.handle, args.seconds)
    result = run(args.flooders, args.seconds, args.seed)
    lines = [f"{phase:8s} import latency (µs): {readable(result.get(phase, {}).get('latency'))}"
             for phase in ("alone", "flooded")]
    lines += [f"flood: {readable(result.get('flood'))}; broker RSS kB: {readable(result.get('rss_kb'))}"]
    lines += [f"VIOLATION: {readable(line)}" for line in result["violations"]]
    emit(lines, result, args.json)
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    entry(main)
