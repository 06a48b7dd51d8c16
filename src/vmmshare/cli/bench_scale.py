"""vmmshare bench --fabric --servers N: every server of an N-server test cluster imports every other's FABRIC share.

Each server (a network namespace of this machine, `vmmshare cluster`) exports one 4 MiB FABRIC handle; then every
server's process imports and maps every other's, reads it back and checks its bytes, twice: all at once (N importers
on this machine's few cores: its throughput under oversubscription, and every link made), then, after freeing, paced
(at most K servers import at a time, every link and earlier hold live: what an import costs at scale N). Per N it
reports both phases' import latency, a lone importer's, the CPU per import by hop, the memory per server, the
brokers' idle CPU by part, whether `cluster down` left anything behind, and the targets met or missed.
Needs root (network namespaces) and the engine (pip install 'vmmshare[fabric]').
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .bench_fabric import PROP
from .bench_scale_probes import (
    PARTS,
    broker_pids,
    cpu_by_hop,
    cpu_by_part,
    cpu_seconds,
    left_behind,
    rss,
    shm_entries,
    started,
)
from .bench_scale_report import PHASES, plot_scale, print_scale

KiB, MiB = 1 << 10, 1 << 20


SHARE = 4 * MiB  # each server's one FABRIC export
IDLE_S = 10.0  # seconds the brokers' CPU is sampled for, every import held
LONE_REPS = 30  # import + map cycles of the lone importer


def _worker(n: int, count: int) -> None:
    """One server's process: export SHARE bytes filled with its number, print the handle; then do what each line of
    stdin says. `import`: import and map every other server's (each import timed, the process's first one apart,
    and the CPU this thread spent on them); `check`: read and byte-check each one held; `free`: unmap and free them
    all; `copy M K`: K timed copies from the import of server M's memory. Copies wait for `check`: a job's start-up
    imports its peers' memory before it moves bytes, and the import figures are then the imports' own, not the
    copies' of the other servers running alongside."""
    import hashlib

    import vmmshare.acl as acl

    acl.rt.set_device(0)
    h, ret = acl.rt.malloc_physical(SHARE, PROP, 0)
    p, _ = acl.rt.reserve_mem_address(SHARE, 0, 0, 0)
    acl.rt.map_mem(p, SHARE, 0, h, 0)
    acl.rt.memset(p, SHARE, n & 0xFF, SHARE)
    shareable, ret = acl.rt.mem_export_to_shareable_handle_v2(h, 1, 2)  # 1: any pid may import it
    if ret:
        raise SystemExit(f"export failed: {acl.get_recent_err_msg()}")
    print(json.dumps({"handle": shareable.hex()}), flush=True)
    handles: dict[str, str] = json.loads(sys.stdin.readline())
    buf, _ = acl.rt.malloc_host(SHARE)
    others = [m for m in range(n + 1, count + 1)] + [m for m in range(1, n)]  # each server starts at its next one
    held: list[tuple[int, int, int]] = []  # (server, reserved address, imported handle)
    failed: list[str] = []
    imported = False
    for line in sys.stdin:
        command = line.strip()
        if command == "import":
            times = []
            cpu0 = time.thread_time()
            for m in others:
                t0 = time.perf_counter()
                ih, ret = acl.rt.mem_import_from_shareable_handle_v2(bytes.fromhex(handles[str(m)]), 2, 0)
                rp, ret2 = acl.rt.reserve_mem_address(SHARE, 0, 0, 0) if ret == 0 else (0, ret)
                ret3 = acl.rt.map_mem(rp, SHARE, 0, ih, 0) if ret2 == 0 else ret2
                times.append(time.perf_counter() - t0)
                if ret3 != 0:
                    failed.append(f"server {m}: {acl.get_recent_err_msg()}")
                    continue
                held.append((m, rp, ih))
            cpu = time.thread_time() - cpu0
            first = None if imported or not times else times.pop(0)
            imported = True
            print(json.dumps({"first": first, "later": times, "cpu": cpu}), flush=True)
        elif command == "check":
            verified = 0
            for m, rp, _ in held:
                if acl.rt.memcpy(buf, SHARE, rp, SHARE, 2) != 0:
                    failed.append(f"server {m}: copy: {acl.get_recent_err_msg()}")
                    continue
                got = hashlib.sha256(ctypes.string_at(buf, SHARE)).digest()
                if got == hashlib.sha256(bytes([m & 0xFF]) * SHARE).digest():
                    verified += 1
                else:
                    failed.append(f"server {m}: the bytes read are not what it wrote")
            print(json.dumps({"verified": verified, "failed": failed}), flush=True)
            failed = []
        elif command.startswith("copy "):  # copy M K: K timed copies from the import of server M's memory
            _, m_text, k_text = command.split()
            source = next((rp for m, rp, _ in held if m == int(m_text)), 0)
            copies = []
            for _ in range(int(k_text) if source else 0):
                t0 = time.perf_counter()
                ret = acl.rt.memcpy(buf, SHARE, source, SHARE, 2)
                copies.append([ret, time.perf_counter() - t0])
            print(json.dumps({"copies": copies}), flush=True)
        elif command == "free":
            for m, rp, ih in held:
                if acl.rt.unmap_mem(rp) or acl.rt.release_mem_address(rp) or acl.rt.free_physical(ih):
                    failed.append(f"server {m}: free: {acl.get_recent_err_msg()}")
            print(json.dumps({"freed": len(held)}), flush=True)
            held = []
        else:
            raise SystemExit(f"unknown command {command!r}")
    # stdin closed: the run is done with the idle brokers; everything still held goes with the process


def _lone(handle: str) -> None:
    """A process importing alone: for each line `cycles K` on stdin, K imports + maps of the same handle back to back
    (each timed, as the paced importers' are: no free between them), then K frees, with the CPU its thread spent on
    them all; the run sends one batch before the paced phase (this fresh process's first import) and one between
    each two waves, so its figures are of the same minutes."""
    import vmmshare.acl as acl

    acl.rt.set_device(0)
    raw = bytes.fromhex(handle)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if len(words) != 2 or words[0] != "cycles":
            raise SystemExit(f"unknown command {line.strip()!r}")
        times: list[float] = []
        held: list[tuple[int, int]] = []
        cpu0 = time.thread_time()
        for _ in range(int(words[1])):
            t0 = time.perf_counter()
            ih, ret = acl.rt.mem_import_from_shareable_handle_v2(raw, 2, 0)
            rp, _ = acl.rt.reserve_mem_address(SHARE, 0, 0, 0)
            if ret or acl.rt.map_mem(rp, SHARE, 0, ih, 0):
                raise SystemExit(f"the lone import failed: {acl.get_recent_err_msg()}")
            times.append(time.perf_counter() - t0)
            held.append((rp, ih))
        for rp, ih in held:
            if acl.rt.unmap_mem(rp) or acl.rt.release_mem_address(rp) or acl.rt.free_physical(ih):
                raise SystemExit(f"the lone importer's free failed: {acl.get_recent_err_msg()}")
        print(json.dumps({"times": times, "cpu": time.thread_time() - cpu0}), flush=True)


class _Lone:
    """The run's side of the lone importer, on server 1, of server 2's handle: its first import, then a batch of
    imports between each two waves of the paced phase, and the CPU of each hop per import + map + free (its own
    thread, its broker's loop and metadata service, the exporting broker's loop and service)."""

    def __init__(self, cluster: Any, me: list[str], env: dict[str, str], handle: str,
                 brokers: dict[int, list[int]]) -> None:
        cmd = cluster.server(1).command([*me, "--role", "lone", "--info", handle])
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.brokers = {n: brokers[n] for n in (1, 2)}
        self.first = 0.0
        self.later: list[float] = []
        self.cpu = {"client": 0.0, **{f"{side} {k}": 0.0 for side in ("importing", "exporting")
                                      for k in ("broker loop", "metadata service")}}
        _reply(1, self.proc, "starting the lone importer")
        self.first = self._cycles(1, count=False)[0]

    def _cycles(self, k: int, count: bool = True) -> list[float]:
        before = {n: cpu_by_hop({n: pids}) for n, pids in self.brokers.items()}
        _send(self.proc, f"cycles {k}")
        got = _reply(1, self.proc, "importing alone")
        if count:
            after = {n: cpu_by_hop({n: pids}) for n, pids in self.brokers.items()}
            self.cpu["client"] += got["cpu"]
            for n, side in ((1, "importing"), (2, "exporting")):
                for key in after[n]:
                    self.cpu[f"{side} {key}"] += after[n][key] - before[n][key]
        times: list[float] = got["times"]
        return times

    def between_waves(self, waves: int) -> None:
        """One gap between waves (of `waves` in all): its share of LONE_REPS cycles, at least two."""
        self.later += self._cycles(max(2, -(-LONE_REPS // waves)))

    def close(self) -> dict[str, Any]:
        """Stop the process; its figures: first, later (seconds) and CPU per cycle by hop (ms)."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(30)
        cycles = max(len(self.later), 1)
        return {"first": self.first, "later": self.later, "cpu_ms": {k: v / cycles * 1e3 for k, v in self.cpu.items()}}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _send(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def _reply(number: int, proc: subprocess.Popen[str], doing: str) -> dict[str, Any]:
    """The next line a server's process printed, as JSON; RuntimeError if it died instead."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the process of server {number} died while {doing} (its error is above)")
    reply: dict[str, Any] = json.loads(line)
    return reply


def _phase(procs: dict[int, subprocess.Popen[str]], waves: list[list[int]], brokers: dict[int, list[int]],
           between: Callable[[int], None] | None = None) -> dict[str, Any]:
    """One import phase: for each wave (server numbers), its servers import all their peers at once, then read and
    byte-check them, before the next wave starts (`between` runs after each wave). The CPU per import by hop is
    summed over the waves' import parts alone (the copies of the checks are not in it)."""
    reports: dict[int, dict[str, Any]] = {}
    hops = {"broker loop": 0.0, "metadata service": 0.0}
    client = 0.0
    for wave in waves:
        before = cpu_by_hop(brokers)
        for n in wave:
            _send(procs[n], "import")
        for n in wave:
            reports[n] = _reply(n, procs[n], "importing")
        after = cpu_by_hop(brokers)
        for k in hops:
            hops[k] += after[k] - before[k]
        for n in wave:
            _send(procs[n], "check")
        for n in wave:
            reports[n].update(_reply(n, procs[n], "reading"))
            client += reports[n]["cpu"]
        if between is not None:
            between(len(waves))
    imports = sum(len(r["later"]) + (r["first"] is not None) for r in reports.values())
    later = [t for r in reports.values() for t in r["later"]]
    firsts = [r["first"] for r in reports.values() if r["first"] is not None]
    ms = 1e3
    return {
        "waves": len(waves), "at_once": max(len(w) for w in waves),
        "verified": sum(r["verified"] for r in reports.values()),
        "failed": [f for r in reports.values() for f in r["failed"]],
        "later_ms": _spread(later),
        "first_ms": _spread(firsts) if firsts else None,
        "cpu_per_import_ms": {"client": client / max(imports, 1) * ms,
                              **{k: v / max(imports, 1) * ms for k, v in hops.items()}},
    }


def _spread(seconds: list[float]) -> dict[str, float]:
    """Median, p99 and max of `seconds`, in ms."""
    ms = 1e3
    return {"median": statistics.median(seconds) * ms if seconds else 0.0,
            "p99": _percentile(seconds, 0.99) * ms, "max": max(seconds, default=0.0) * ms}


def run_scale(count: int, idle_s: float = IDLE_S, at_once: int | None = None,
              fabric_timeout: float = 5.0) -> dict[str, Any]:
    """All-to-all FABRIC imports on `count` servers, all at once and then paced (`at_once` servers importing at a
    time, this machine's cores by default): import latency, a lone importer's, memory, idle CPU, targets."""
    from .cluster import Cluster

    pace = min(count, at_once or os.cpu_count() or 1)
    root = Path(tempfile.mkdtemp(prefix="vmmshare-bench-"))
    cluster = Cluster(f"s{os.getpid() % 10000}", count, root=root, timeout=fabric_timeout)
    me = [sys.executable, "-m", "vmmshare.cli.bench_scale"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VMMSHARE_")}
    env["VMMSHARE_BROKER_IDLE"] = "600"
    procs: dict[int, subprocess.Popen[str]] = {}
    shm_before = shm_entries()
    ran: set[tuple[int, int]] = set()  # (pid, start time) of every process seen on the cluster's servers
    t_up = time.perf_counter()
    cluster.up()
    up_s = time.perf_counter() - t_up
    res: dict[str, Any] = {"servers": count, "imports": count * (count - 1), "cluster_up_s": up_s}
    try:
        handles = {}
        for s in cluster.servers:
            cmd = s.command([*me, "--role", "worker", "--server", str(s.number), "--count", str(count)])
            procs[s.number] = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                               text=True)
        for n, proc in procs.items():
            handles[str(n)] = _reply(n, proc, "exporting")["handle"]
        for proc in procs.values():
            _send(proc, json.dumps(handles))
        workers = {p.pid for p in procs.values()}
        numbers = sorted(procs)
        brokers = {n: broker_pids(cluster, n, workers) for n in numbers}
        t0 = time.perf_counter()
        res["all_at_once"] = _phase(procs, [numbers], brokers)
        res["all_at_once"]["seconds"] = time.perf_counter() - t0
        for proc in procs.values():  # every link is made; the paced phase starts from no import held
            _send(proc, "free")
        for n, proc in procs.items():
            _reply(n, proc, "freeing")
        lone = _Lone(cluster, me, env, handles["2"], brokers)  # its first import, before the paced phase's
        try:
            t0 = time.perf_counter()
            res["paced"] = _phase(procs, [numbers[i:i + pace] for i in range(0, count, pace)], brokers,
                                  lone.between_waves)
            res["paced"]["seconds"] = time.perf_counter() - t0
        finally:
            alone = lone.close()
        every = [p for pids in brokers.values() for p in pids]
        before = sum(cpu_seconds(p) for p in every)
        parts_before = cpu_by_part(brokers, workers)
        t0 = time.monotonic()
        time.sleep(idle_s)  # a measurement window, not synchronisation: every paced import is held meanwhile
        window = time.monotonic() - t0
        idle = (sum(cpu_seconds(p) for p in every) - before) / window
        parts_after = cpu_by_part(brokers, workers)
        res["idle_cores_by_part"] = {k: (parts_after[k] - parts_before[k]) / window for k in PARTS}
        per_server = [sum(rss(p) for p in [*brokers[n], procs[n].pid]) for n in numbers]
        if count >= 3:
            res["killed"] = _kill_one(cluster, procs, brokers, 2)
        for proc in procs.values():
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(60)
    finally:
        for s in cluster.servers:
            ran.update(started(p) for p in cluster.pids(s.number))
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        t_down = time.perf_counter()
        cluster.down()
        res["cluster_down_s"] = time.perf_counter() - t_down
        shutil.rmtree(root, ignore_errors=True)
    ms = 1e3
    res.update({
        "lone_ms": {"first": alone["first"] * ms, "median": statistics.median(alone["later"]) * ms,
                    "cycles": len(alone["later"])},
        "lone_cpu_per_cycle_ms": alone["cpu_ms"],
        "memory_per_server_mib": statistics.mean(per_server) / MiB,
        "idle_brokers_cores": idle,
        "left_behind": left_behind(cluster, ran, shm_before),
    })
    res["targets"] = targets(res)
    return res


KILL_COPIES = 3  # copies each server's process tries from a killed broker's memory


def _kill_one(cluster: Any, procs: dict[int, subprocess.Popen[str]], brokers: dict[int, list[int]],
              victim: int) -> dict[str, Any]:
    """Kill server `victim`'s broker while every other server holds an import of its memory: each of them then
    copies from it KILL_COPIES times (all at once), and every copy must fail (507022) within the fabric timeout,
    the first and each later one; then the holds the victim's own process had on the other servers are freed by
    their exporters when the lease of the victim's dead links ends (waited for, and timed)."""
    import signal

    from ..fabric.serving import LEASE_FACTOR

    timeout = float(cluster.timeout or 5.0)
    for pid in brokers[victim]:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"metadata_service" not in f.read():
                os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    others = [n for n in procs if n != victim]
    for n in others:
        _send(procs[n], f"copy {victim} {KILL_COPIES}")
    copies = [_reply(n, procs[n], "copying from the killed broker's memory")["copies"] for n in others]
    firsts = [c[0][1] for c in copies if c]
    laters = [t for c in copies for _, t in c[1:]]
    mark = f"{cluster.server(victim).server_id:#x}:"
    deadline = killed_at + (LEASE_FACTOR + 3) * timeout + 30.0  # the lease, the link's death noticed, a margin
    freed_after = None
    while freed_after is None and time.monotonic() < deadline:
        if not any(mark in row for n in others for e in _listing(cluster, n)["exports"]
                   for row in e.get("remote_importers", [])):
            freed_after = time.monotonic() - killed_at
        else:
            time.sleep(0.2)  # polled: an exporter frees a dead link's holds at the end of its lease, on its own
    return {"copies": sum(len(c) for c in copies), "failed": sum(1 for c in copies for ret, _ in c if ret != 0),
            "codes": sorted({ret for c in copies for ret, _ in c}), "first_max_s": max(firsts, default=0.0),
            "later_max_s": max(laters, default=0.0), "timeout_s": timeout, "lease_s": LEASE_FACTOR * timeout,
            "holds_freed_after_s": freed_after}


def _listing(cluster: Any, n: int) -> dict[str, Any]:
    """What `vmmshare ls --json` shows on server `n` (asked from this process: the broker's socket is a file)."""
    from dataclasses import replace

    from ..client.connection import BrokerClient
    from ..config import Config

    client = BrokerClient(replace(Config.from_env(), socket_path=Path(cluster.server(n).env["VMMSHARE_SOCKET"])),
                          autostart=False)
    try:
        return client.listing()
    finally:
        client.close()


def targets(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The issue's targets at scale, each {value, target, met}: what flat in N means, measured by the paced phase
    against the lone importer of the same run, and what an idle supernode costs."""
    paced, lone = res["paced"]["later_ms"], res["lone_ms"]
    t: dict[str, dict[str, Any]] = {
        "later_median_paced_vs_lone": {"value": paced["median"] / lone["median"], "target": "<= 2"},
        "later_p99_paced_ms": {"value": paced["p99"], "target": "<= 20"},
        "first_import_ms": {"value": lone["first"], "target": "<= 5"},
        "idle_brokers_cores": {"value": res["idle_brokers_cores"], "target": "<= 0.05"},
    }
    k = res.get("killed")
    if k:
        t["killed_broker_slowest_copy_s"] = {"value": max(k["first_max_s"], k["later_max_s"]),
                                             "target": f"<= {k['timeout_s']:g}"}
    for v in t.values():
        v["met"] = v["value"] <= float(v["target"].split()[1])
    if k:  # and every copy failed, none hung: else the target is not met whatever the times say
        t["killed_broker_slowest_copy_s"]["met"] &= k["failed"] == k["copies"] > 0
    return t


def counts_option(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: server counts, comma-separated (e.g. 4,8,16)") from None
    if not counts or not all(2 <= c <= 254 for c in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: each count is 2 to 254")
    return counts


def run_counts(counts: list[int], json_path: str | None, plot: str | None, idle_s: float = IDLE_S,
               at_once: int | None = None, fabric_timeout: float = 5.0) -> int:
    from .cluster import ClusterError
    from .console import FAILED, OK, say_error

    results = []
    for count in counts:
        try:
            results.append(run_scale(count, idle_s, at_once, fabric_timeout))
        except (ClusterError, RuntimeError, OSError, ValueError) as exc:
            say_error("vmmshare bench --fabric --servers", f"at {count} servers: {exc}")
            return FAILED
        print_scale(results[-1:])
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2))
    if plot:
        why = plot_scale(results, plot)
        print(f"  plot: {why or plot}")
    complete = all(r[key]["verified"] == r["imports"] for r in results for key in PHASES)
    complete = complete and not any(r["left_behind"] for r in results)
    complete = complete and all(r["targets"]["killed_broker_slowest_copy_s"]["met"] for r in results if "killed" in r)
    return OK if complete else FAILED


def main(argv: list[str]) -> int:
    """A server's process of the run (the roles the run starts), or the run itself for the counts given."""
    from .console import OK, Parser

    ap = Parser(prog="vmmshare bench --fabric --servers", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--role", choices=("worker", "lone"), help=argparse.SUPPRESS)
    ap.add_argument("--server", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--info", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "worker":
        _worker(args.server, args.count)
    elif args.role == "lone":
        _lone(args.info)
    return OK


if __name__ == "__main__":
    from .console import run_main

    sys.exit(run_main(lambda: main(sys.argv[1:])))
