"""Broker throughput with many clients, spawned against forked: import + free round trips per second from N client
processes started fresh (`spawn`, each its own interpreter, as `vmmshare bench`'s are) and from N forked off one
process that had imported vmmshare (`fork`, sharing its pages), in turn on the same broker, with the CPU one round
trip costs each side.

The code the clients run is the same; what differs is how much memory they share. On a machine with few cores the
clients take turns on them, and a fresh interpreter brings its own copy of every object it touches.

    python benchmarks/bench_clients.py [--clients N] [--seconds S] [--rounds R] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
from multiprocessing.connection import Connection
from typing import Any

MiB = 1 << 20


def _forking(text: str, clients: int, seconds: float, broker: int, conn: Connection) -> None:
    """A process with vmmshare imported and no runtime yet: the clients it forks share its pages."""
    from vmmshare.cli.bench_broker import clients_point

    conn.send(clients_point(mp.get_context("fork"), text, clients, seconds, broker))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the points here")
    args = ap.parse_args()

    import vmmshare
    from vmmshare.cli.bench_broker import broker_pid, clients_point

    spawn = mp.get_context("spawn")
    mem = vmmshare.Device(0).allocate(2 * MiB)
    text = str(mem.export(validate_pids=False))
    broker = broker_pid()
    points: list[dict[str, Any]] = []
    print(f"{args.clients} clients, {args.seconds:g} s a point, import + free round trips")
    print(f"{'started':8s} {'round trips/s':>14s} {'client user µs':>15s} {'client sys µs':>14s} {'broker µs':>10s}")
    for _ in range(args.rounds):
        for kind in ("spawn", "fork"):
            if kind == "spawn":
                point = clients_point(spawn, text, args.clients, args.seconds, broker)
            else:
                a, b = spawn.Pipe()
                p = spawn.Process(target=_forking, args=(text, args.clients, args.seconds, broker, b))
                p.start()
                point = a.recv()
                p.join()
            point["kind"] = kind
            points.append(point)
            print(f"{kind:8s} {point['ops_per_s']:14,.0f} {point['client_user_us']:15.0f} "
                  f"{point['client_system_us']:14.0f} {point['broker_cpu_us']:10.0f}", flush=True)
    mem.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(points, f, indent=2)


if __name__ == "__main__":
    main()
