"""Faults across servers (`stress/faults.py --fabric`): SIGKILL of the exporter, the importer, or either broker at
random points while the importer reads and writes the exporter's memory through the cross-server transport.

    vmmshare stress faults --fabric --trials 40 --seed 1 --json fabric-faults.json

One test cluster of two servers (network namespaces, fabric_cluster.py) for the run; each trial starts a
fresh exporter on server 1 (2-3 allocations with a seeded pattern, exported as FABRIC handles trusting the importer)
and a fresh importer on server 2, which imports and maps them all and then loops: read a whole mapping back and
check it against the pattern, write a pattern of its own into a second page and read it back. A timer kills the
chosen victim after a random delay, in the middle of whatever is under way. Checked in every trial:
- no wrong bytes: every read that succeeds holds exactly what was written (a copy either works or fails with
  507022; a dead exporter's memory stays intact for its importers, rule 14);
- no hang: every call returns (the actors are guarded by the hang guard);
- after a dead exporter, its handles import as 107017; after a dead broker, it restarts and serves again;
- no leak: once the trial's processes are gone, server 1's broker serves nothing (no memfd mapped, no remote
  importer listed, no export), and its fd count is back to the run's baseline.
Needs root and the engine (pip install 'vmmshare[fabric]').
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fabric_cluster import TestCluster, cluster_problem, eventually
from procs import Actor, ActorDied
from stressio import count_option, emit, entry, prog, seconds_option, whole
from vmmshare.cli.console import NarrowHelp, check_outputs

VICTIMS = ("exporter", "importer", "exporting broker", "importing broker")
PROP = {"handleType": 0, "allocationType": 0, "memAttr": 5, "location": {"id": 0, "type": 1}, "reserve": 0}
M2 = 2 << 20
FABRIC, IPC, BAD_HANDLE = 2, 507022, 107017


def pattern(seed: int, n: int) -> bytes:
    block = hashlib.sha256(f"{seed}".encode()).digest()
    return (block * (n // len(block) + 1))[:n]


class Trial:
    def __init__(self, c: TestCluster, rng: random.Random, number: int) -> None:
        self.c, self.rng, self.number = c, rng, number
        self.victim = VICTIMS[number % len(VICTIMS)]
        self.reads = self.failed_reads = 0
        self.violations: list[str] = []

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.violations.append(f"trial {self.number} ({self.victim}): {what}")

    def run(self) -> None:
        c = self.c
        exporter, importer = c.actor(1), c.actor(2)
        shared = []
        for i in range(self.rng.randrange(2, 4)):
            seed = self.rng.randrange(1 << 30)
            h, _ = exporter.call("rt.malloc_physical", M2, PROP, 0)
            p, _ = exporter.call("rt.reserve_mem_address", M2, 0, 0, 0)
            exporter.call("rt.map_mem", p, M2, 0, h, 0)
            exporter.call("!write_bytes", p, pattern(seed, M2 // 2))
            s, ret = exporter.call("rt.mem_export_to_shareable_handle_v2", h, 0, FABRIC)
            self.check(ret == 0, f"export {i} failed: {exporter.last_err}")
            exporter.call("rt.mem_set_pid_to_shareable_handle_v2", s, FABRIC, [importer.pid])
            ih, ret = importer.call("rt.mem_import_from_shareable_handle_v2", s, FABRIC, 0)
            self.check(ret == 0, f"import {i} failed: {importer.last_err}")
            rp, _ = importer.call("rt.reserve_mem_address", M2, 0, 0, 0)
            importer.call("rt.map_mem", rp, M2, 0, ih, 0)
            shared.append((s, seed, rp))
        buf, _ = importer.call("rt.malloc_host", M2)
        delay = self.rng.uniform(0.0, 0.6)
        killer = threading.Timer(delay, self._kill, (exporter, importer))
        killer.start()
        deadline = time.monotonic() + delay + 1.5
        try:
            while time.monotonic() < deadline:
                s, seed, rp = self.rng.choice(shared)
                ret = importer.call("rt.memcpy", buf, M2, rp, M2 // 2, 2)
                if ret == 0:
                    self.reads += 1
                    want = hashlib.sha256(pattern(seed, M2 // 2)).hexdigest()
                    self.check(importer.call("!sha256", buf, M2 // 2) == want, "a read returned wrong bytes")
                else:
                    self.failed_reads += 1
                    self.check(ret == IPC, f"a failed read gave {ret}: {importer.last_err!r}")
                mark = pattern(seed ^ 0x5A5A, 4096)
                importer.call("!write_bytes", buf, mark)
                if importer.call("rt.memcpy", rp + M2 // 2, 4096, buf, 4096, 1) == 0:
                    importer.call("!write", buf, 0, 4096)
                    if importer.call("rt.memcpy", buf, 4096, rp + M2 // 2, 4096, 2) == 0:
                        got = importer.call("!read", buf, 4096)
                        self.check(got == mark, "a page read back is not what was written")
        except ActorDied:
            self.check(self.victim == "importer", "the importer died unasked")
        finally:
            killer.cancel()
            killer.join()
        self._after(exporter, importer, shared)

    def _kill(self, exporter: Actor, importer: Actor) -> None:
        if self.victim == "exporter":
            exporter.kill()
        elif self.victim == "importer":
            importer.kill()
        elif self.victim == "exporting broker":
            self.c.brokers[1].signal(signal.SIGKILL)
        else:
            self.c.brokers[2].signal(signal.SIGKILL)

    def _after(self, exporter: Actor, importer: Actor, shared: list[tuple[bytes, int, int]]) -> None:
        c = self.c
        if self.victim == "exporter":  # rule 14: revoked for new imports; the importer's memory is intact
            late = c.actor(2)
            self.check(late.call("rt.mem_import_from_shareable_handle_v2", shared[0][0], FABRIC, 0)[-1] == BAD_HANDLE,
                       "a dead exporter's handle still imports")
            late.kill()
        for n in (1, 2):
            if not c.brokers[n].alive():
                c.brokers[n].start()
        for a in (exporter, importer):
            a.kill()
        eventually(lambda: _serves_nothing(c), f"trial {self.number}: server 1 still serves memory of a dead trial")


def _serves_nothing(c: TestCluster) -> bool:
    b = c.brokers[1]
    return b.memfd_mappings() == 0 and b.listing()["exports"] == []


ENGINE_FDS = {"unix": 2, "other": 10}  # what the transfer engine opens when a broker first serves another server
# (epolls, eventfds, a timerfd, TCP listeners and a lane, an abstract Unix socket; in the HTTP metadata mode its
# client's connection to the node's metadata service and an unnamed socket pair): a broker's count grows by this
# set with its first cross-server export, which is after the run's baseline (the "18 fds after the run, 9 before")


SETTLE_S = 10.0  # how long the broker may take to serve the hang-up of the last connection closed


def fd_kinds(pid: int) -> dict[str, int]:
    """The broker's fds by kind: those vmmshare itself holds for what it serves (memfds, pidfds, Unix sockets:
    the listener, its clients, its socket pairs) and the rest (its log, /dev/null, the event loop, the fabric's
    TCP control port, and the engine's, an abstract-named Unix socket among them)."""
    unix = set()
    with open(f"/proc/{pid}/net/unix") as f:  # the broker's network namespace: its Unix sockets, by inode
        for line in list(f)[1:]:
            fields = line.split()
            if len(fields) >= 7 and not (len(fields) >= 8 and fields[7].startswith("@")):
                unix.add(fields[6])  # an abstract name (@...) is the engine's, not the broker's
    kinds = {"memfd": 0, "pidfd": 0, "unix": 0, "other": 0}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("/memfd:"):
            kinds["memfd"] += 1
        elif link == "anon_inode:[pidfd]":
            kinds["pidfd"] += 1
        elif link.startswith("socket:[") and link[8:-1] in unix:
            kinds["unix"] += 1
        else:
            kinds["other"] += 1
    return kinds


def fd_violations(base: dict[str, int], after: dict[str, int]) -> list[str]:
    """The exact check once every trial's processes are gone: vmmshare's own fds are back to the baseline's, one
    for one; the others may have grown by the engine's fixed set (started on the first cross-server export, after
    the baseline was taken), never more."""
    bad = [f"server 1's broker holds {after[k]} {k} fds after the run, {base[k]} before"
           + (f" (the transfer engine's set adds {ENGINE_FDS[k]})" if k in ENGINE_FDS else "")
           for k in ("memfd", "pidfd", "unix") if after[k] - base[k] not in (0, ENGINE_FDS.get(k, 0))]
    if after["other"] > base["other"] + ENGINE_FDS["other"]:
        bad.append(f"server 1's broker holds {after['other']} other fds after the run: {base['other']} before, "
                   f"and the transfer engine opens {ENGINE_FDS['other']}")
    return bad


def run(trials: int, seed: int, seconds: float | None = None) -> dict[str, Any]:
    problem = cluster_problem()
    if problem:
        raise SystemExit(f"stress/faults.py --fabric cannot run here: {problem}")
    rng = random.Random(seed)
    c = TestCluster(2, timeout=1.0)
    result: dict[str, Any] = {"seed": seed, "trials": 0, "violations": [], "reads": 0, "failed_reads": 0,
                              "by_victim": {v: 0 for v in VICTIMS}}
    t0 = time.monotonic()
    try:
        base = fd_kinds(c.brokers[1].pid)
        for number in range(trials):
            if seconds is not None and time.monotonic() - t0 > seconds:
                break
            trial = Trial(c, rng, number)
            trial.run()
            c.actors.clear()
            result["trials"] += 1
            result["by_victim"][trial.victim] += 1
            result["reads"] += trial.reads
            result["failed_reads"] += trial.failed_reads
            result["violations"] += trial.violations
        # the broker now serving (a restarted one starts as the first did), once it has hung up on the last
        # connection closed (the last check's listing): a hang-up is served after the close returns; a leak stays
        deadline = time.monotonic() + SETTLE_S
        after = fd_kinds(c.brokers[1].pid)
        while fd_violations(base, after) and time.monotonic() < deadline:
            time.sleep(0.05)
            after = fd_kinds(c.brokers[1].pid)
        result["broker_fds"] = {"baseline": base, "after": after}
        result["violations"] += fd_violations(base, after)
    finally:
        c.close()
    result["wall_s"] = round(time.monotonic() - t0, 1)
    return result


def main(argv: list[str]) -> int:
    ap = NarrowHelp(prog=prog(__file__), description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--trials", type=count_option, default=40, help="trials (default 40)")
    ap.add_argument("--seed", type=whole, default=None, help="random seed (default: random, and recorded)")
    ap.add_argument("--seconds", type=seconds_option, default=None, help="cap on the run's time")
    ap.add_argument("--json", help="write the result here ('-': stdout, instead of the summary)")
    args = ap.parse_args(argv)
    check_outputs(ap, json=None if args.json == "-" else args.json)
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    result = run(args.trials, seed, args.seconds)
    lines = [f"fabric faults: {result['trials']} trials, {result['reads']} reads checked "
             f"({result['failed_reads']} failed cleanly), {len(result['violations'])} violations, seed {seed}"]
    lines += ["  " + v for v in result["violations"][:20]]
    emit(lines, result, args.json)
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    entry(lambda: main(sys.argv[1:]))
