"""Broker throughput with many clients, spawned against forked: import + free round trips per second from N client
processes started fresh (`spawn`, each its own interpreter) and from N forked off one process that had imported
vmmshare (`fork`, sharing its pages), in turn on the same broker, with the CPU one round trip costs each side.

The code the clients run is the same; what differs is how much memory they share. On a machine with few cores the
clients take turns on them, and a fresh interpreter brings its own copy of every object it touches.

    python benchmarks/bench_clients.py [--clients N] [--seconds S] [--rounds R] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from typing import Any

MiB = 1 << 20


def _client(value: int, seconds: float, start: Any, conn: Connection) -> None:
    """Import and free `value` until `seconds` after `start` is set; answer (round trips, user s, system s)."""
    import vmmshare.acl as acl

    rt = acl.rt
    rt.set_device(0)
    for _ in range(20):  # connect, and let the interpreter specialise the loop's code
        rt.free_physical(rt.mem_import_from_shareable_handle_v2(value, 1, 0)[0])
    conn.send("ready")
    start.wait()
    t0 = os.times()
    n = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        handle, ret = rt.mem_import_from_shareable_handle_v2(value, 1, 0)
        if ret or rt.free_physical(handle):
            raise SystemExit(f"import+free failed: {acl.get_recent_err_msg()}")
        n += 1
    t1 = os.times()
    conn.send((n, t1.user - t0.user, t1.system - t0.system))


def _point(ctx: Any, value: int, clients: int, seconds: float, broker: int) -> dict[str, float]:
    """One measurement: `clients` processes of the context's kind, all started together."""
    from vmmshare.cli.bench_broker import cpu_of

    start = ctx.Event()
    pipes, procs = [], []
    for _ in range(clients):
        a, b = ctx.Pipe()
        p = ctx.Process(target=_client, args=(value, seconds, start, b))
        p.start()
        pipes.append(a)
        procs.append(p)
    for a in pipes:
        a.recv()
    cpu = cpu_of(broker)
    t0 = time.perf_counter()
    start.set()
    done = [a.recv() for a in pipes]
    elapsed = max(time.perf_counter() - t0, seconds)
    cpu = cpu_of(broker) - cpu
    for p in procs:
        p.join()
    ops = sum(d[0] for d in done)
    return {"ops_per_s": ops / elapsed, "user_us": sum(d[1] for d in done) / ops * 1e6,
            "system_us": sum(d[2] for d in done) / ops * 1e6, "broker_us": cpu / ops * 1e6}


def _forking(value: int, clients: int, seconds: float, broker: int, conn: Connection) -> None:
    """A process with vmmshare imported and no runtime yet: its forked clients share its pages."""
    import vmmshare.acl  # noqa: F401  (the modules the clients run, loaded before the forks)

    conn.send(_point(mp.get_context("fork"), value, clients, seconds, broker))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the points here")
    args = ap.parse_args()

    import vmmshare
    from vmmshare.cli.bench_broker import broker_pid

    spawn = mp.get_context("spawn")
    mem = vmmshare.Device(0).allocate(2 * MiB)
    value = int(mem.export(validate_pids=False))
    broker = broker_pid()
    points: list[dict[str, Any]] = []
    print(f"{args.clients} clients, {args.seconds:g} s a point, import + free round trips")
    print(f"{'started':8s} {'round trips/s':>14s} {'client user µs':>15s} {'client sys µs':>14s} {'broker µs':>10s}")
    for _ in range(args.rounds):
        for kind in ("spawn", "fork"):
            if kind == "spawn":
                point = _point(spawn, value, args.clients, args.seconds, broker)
            else:
                a, b = spawn.Pipe()
                p = spawn.Process(target=_forking, args=(value, args.clients, args.seconds, broker, b))
                p.start()
                point = a.recv()
                p.join()
            point["kind"] = kind
            points.append(point)
            print(f"{kind:8s} {point['ops_per_s']:14,.0f} {point['user_us']:15.0f} {point['system_us']:14.0f} "
                  f"{point['broker_us']:10.0f}", flush=True)
    mem.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(points, f, indent=2)


if __name__ == "__main__":
    main()
