"""Flood: one user's clients keep the broker busy with its costliest requests; a client of another user only wants
its imports.

    vmmshare stress flood --flooders 64 --depth 4 --seconds 20 --seed 1 --json flood.json

For each kind of flood (`--kinds`, all by default), one process of the flooding user (`nobody` where this runs as
root, else the same user as the victim, which the result says) holds `--flooders` connections, each with one
allocation exported, and keeps `--depth` requests in flight on each:

- same-pid: SET_PIDS of 4,096 entries that are all one pid (cheap to send, 16 KiB to decode and check);
- distinct-pids: SET_PIDS of 4,096 distinct pids (the live processes of the machine first, then pids nobody has,
  which are looked up again on every request: one pidfd_open each);
- export: CHARGE, EXPORT with a trustlist of 1,000 of those distinct pids, RELEASE, again and again (1,000: 64 x 4
  of them in flight stay within the user's quota of trustlist entries);
- list: LIST of the whole node's listing, whose exports all carry full trustlists (the JSON pages of `vmmshare ls`).

Meanwhile a victim process imports and releases a handle exported on another connection, timing each IMPORT round
trip (p50 / p99 / p99.9). The victim runs once alone (the baseline), then during each flood.

Also measured: the broker's resident memory before the first flood, during it, and once every flooder left.

Checked (exit status 0 when all hold): every victim import succeeds, every flood request gets the reply it should,
the broker is alive, its fds are back at the baseline at the end, and its log has no traceback. The latencies are
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
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as c
import identity as ident
import rawsock
from stressio import count_option, emit, entry, kinds, prog, readable, seconds_option, whole
from vmmshare.cli.console import NarrowHelp, check_outputs
from vmmshare.wire import local as P

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


EXPORT_PIDS = 1000  # the export flood's trustlists: 256 in flight stay within the user's quota of entries
KINDS = ("same-pid", "distinct-pids", "export", "list")
EXPECTED = {"same-pid": (P.Ok,), "distinct-pids": (P.Ok,), "export": (P.Token, P.Exported, P.Ok), "list": (P.Listing,)}


# ================================================================ roles (processes of their own)


class _Chain:
    """One request always in flight on a connection (`slot`: its request id), and what to send after each reply."""

    def __init__(self, kind: str, conn: c.Raw, slot: int, handle: int, pids: tuple[int, ...], memfd: int) -> None:
        self.kind, self.conn, self.slot, self.memfd = kind, conn, slot, memfd
        if kind == "same-pid":
            self.packet = P.encode(P.SetPids(handle, DEFAULT, (os.getpid(),) * 4096), slot)
        elif kind == "distinct-pids":
            self.packet = P.encode(P.SetPids(handle, DEFAULT, pids), slot)
        elif kind == "list":
            self.packet = P.encode(P.List(0), slot)
        self.pids = pids

    def send(self, reply: P.Message | None) -> None:
        if self.kind != "export":
            self.conn.sock.send(self.packet)
        elif isinstance(reply, P.Token):
            export = P.Export(reply.hold, 0, 0, DEFAULT, 0, 0, *PROP, self.pids[:EXPORT_PIDS])
            rawsock.send(self.conn.sock, P.encode(export, self.slot), (self.memfd,))
            self.hold = reply.hold
        elif isinstance(reply, P.Exported):
            self.conn.sock.send(P.encode(P.Release(self.hold), self.slot))
        else:
            self.conn.sock.send(P.encode(P.Charge(0, 0), self.slot))


def role_flooder(path: str, kind: str, count: int, depth: int, seconds: float, seed: int) -> int:
    """`count` connections, each exporting once, then `depth` chains of `kind` requests in flight on each."""
    conns = [c.Raw(path) for _ in range(count)]
    pids = flood_pids(seed)
    handles = [_export(conn, 0)[1] for conn in conns]
    if kind == "list":  # the listing to page through: every export with a full trustlist
        for conn, handle in zip(conns, handles, strict=True):
            assert isinstance(conn.ask(P.SetPids(handle, DEFAULT, pids)), P.Ok)
    memfd = rawsock.sealed_memfd(0, "flood")
    by_fd = {conn.sock.fileno(): conn for conn in conns}
    chains = {(conn.sock.fileno(), slot): _Chain(kind, conn, slot, handle, pids, memfd)
              for conn, handle in zip(conns, handles, strict=True) for slot in range(1, depth + 1)}
    print(json.dumps({"ev": "ready"}), flush=True)
    sys.stdin.readline()  # go
    for chain in chains.values():
        chain.send(None)
    sent, answered, bad = len(chains), 0, 0
    expected = EXPECTED[kind]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ready, _, _ = select.select([conn.sock for conn in conns], [], [], c.HANG_GUARD)
        if not ready:
            bad += 1
            break
        for sock in ready:
            frame, fds = by_fd[sock.fileno()].recv()
            for fd in fds:
                os.close(fd)
            answered += 1
            bad += not isinstance(frame.message, expected)
            chains[(sock.fileno(), frame.req)].send(frame.message)
            sent += 1
    for conn in conns:  # the replies still in flight
        for _ in range(depth):
            with contextlib.suppress(Exception):
                frame, _ = conn.recv()
                answered += 1
                bad += not isinstance(frame.message, expected)
    print(json.dumps({"ev": "done", "sent": sent, "answered": answered, "not_ok": bad}), flush=True)
    sys.stdin.readline()  # leave when told
    os.close(memfd)
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


def _flooder_user(env: dict[str, str], same_user: bool) -> tuple[list[str], dict[str, str], str]:
    """How to run the flooder as another user than the victim (`nobody`, as root): its command prefix and
    environment, and the user's name; as the victim's own user where that is not possible, or asked for."""
    prefix, _why = (None, "") if same_user else ident.other_user()
    if prefix is not None:
        full, _why = ident.nobody_env(prefix, env)
        if full is not None:
            return prefix, full, "nobody"
    return [], env, "the victim's own"


def _flood(broker: c.BrokerProc, kind: str, handle: int, flooders: int, depth: int, seconds: float, seed: int,
           user: tuple[list[str], dict[str, str], str]) -> dict[str, Any]:
    """One kind of flood, with the victim timing its imports meanwhile."""
    prefix, env, _ = user
    me = [*prefix, sys.executable, __file__, "--role", "flooder", "--kind", kind, "--path", str(broker.socket),
          "--count", str(flooders), "--depth", str(depth), "--seconds", str(seconds), "--seed", str(seed)]
    flood = c.Worker(me, env, f"flooder {kind}")
    try:
        flood.until("ready", c.HANG_GUARD * 4)
        flood.send({})
        out: dict[str, Any] = {"victim": _victim(broker, handle, seconds)}
        done, _ = flood.until("done", seconds + c.HANG_GUARD)
        out["flood"] = {k: done[k] for k in ("sent", "answered", "not_ok")}
        out["flood"]["requests_per_s"] = round(done["answered"] / seconds, 1)
        out["rss_kb"] = _rss_kb(broker.pid)
        flood.send({})
    finally:
        flood.close()
    return out


def run(flooders: int, seconds: float, seed: int, kinds: tuple[str, ...] = KINDS, depth: int = 4,
        same_user: bool = False) -> dict[str, Any]:
    work = ident.world_dir("vmmshare-flood-")
    env = c.clean_env(VMMSHARE_DEVICE_MEMORY="1G")
    user = _flooder_user(env, same_user)
    broker = c.LoggedBroker(work / "run", *(["--multi-user"] if user[0] else []), env=env)
    result: dict[str, Any] = {"script": "flood", "flooders": flooders, "depth": depth, "seconds": seconds,
                              "seed": seed, "flooding_user": user[2], "machine": c.machine(), "violations": [],
                              "floods": {}}
    v = result["violations"]
    try:
        baseline_fds = c.settled_fd_count(broker)
        exporter = c.Raw(broker.socket)
        _, handle = _export(exporter, c.MiB2, flags=NO_PID_CHECK)
        result["alone"] = _victim(broker, handle, seconds)
        result["rss_kb"] = {"before": _rss_kb(broker.pid)}
        for kind in kinds:
            got = result["floods"][kind] = _flood(broker, kind, handle, flooders, depth, seconds, seed, user)
            if got["victim"]["failed"] or not got["victim"]["latency"]["count"]:
                v.append(f"{kind}: {got['victim']['failed']} imports failed of {got['victim']['latency']}")
            if got["flood"]["not_ok"] or got["flood"]["answered"] < flooders:
                v.append(f"{kind}: flood requests not answered as they should be: {got['flood']}")
        exporter.close()
        after = c.settled_fd_count(broker)
        result["rss_kb"]["after_they_left"] = _rss_kb(broker.pid)
        result["broker_fds"] = {"before": baseline_fds, "after": after}
        if result["alone"]["failed"] or not result["alone"]["latency"]["count"]:
            v.append(f"alone: {result['alone']['failed']} imports failed")
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
    parser = NarrowHelp(prog=prog(__file__), description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["flooder", "victim"], help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--handle", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--kind", choices=KINDS, default=KINDS[0], help=argparse.SUPPRESS)
    parser.add_argument("--flooders", type=count_option, default=64, help="flooding connections (default 64)")
    parser.add_argument("--depth", type=count_option, default=4,
                        help="requests each flooding connection keeps in flight (default 4)")
    parser.add_argument("--kinds", type=kinds(KINDS), default=list(KINDS),
                        help=f"floods to run, comma-separated (default all: {','.join(KINDS)})")
    parser.add_argument("--seconds", type=seconds_option, default=20.0,
                        help="seconds of each victim phase (default 20)")
    parser.add_argument("--same-user", action="store_true",
                        help="flood as the victim's own user (default: as nobody where this runs as root)")
    parser.add_argument("--seed", type=whole, default=1)
    parser.add_argument("--json", help="write the result here ('-': stdout, instead of the summary)")
    args = parser.parse_args(argv)
    check_outputs(parser, json=None if args.json == "-" else args.json)
    if args.role == "flooder":
        return role_flooder(args.path, args.kind, args.count, args.depth, args.seconds, args.seed)
    if args.role == "victim":
        return role_victim(args.path, args.handle, args.seconds)
    result = run(args.flooders, args.seconds, args.seed, tuple(args.kinds), args.depth, args.same_user)
    lines = [f"flooding user: {result['flooding_user']}",
             f"{'alone':14s} import latency (µs): {readable(result.get('alone', {}).get('latency'))}"]
    lines += [f"{kind:14s} import latency (µs): {readable(got['victim']['latency'])}; flood: {readable(got['flood'])}"
              for kind, got in result["floods"].items()]
    lines += [f"broker RSS kB: {readable(result.get('rss_kb'))}"]
    lines += [f"VIOLATION: {readable(line)}" for line in result["violations"]]
    emit(lines, result, args.json)
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    entry(main)
