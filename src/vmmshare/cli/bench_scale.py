"""vmmshare bench --fabric --servers N: every server of an N-server test cluster imports every other's FABRIC share.

Each server (a network namespace of this machine, `vmmshare cluster`) exports one 4 MiB FABRIC handle; then every
server's process, all at once, imports and maps every other's, reads it back and checks its bytes. Per N it reports
the import latency (median, p99, max; a process's first import apart), a lone importer's, the CPU per import by hop,
the memory per server, the brokers' idle CPU by part, and whether `cluster down` left anything behind.
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
from pathlib import Path
from typing import Any

from .bench_fabric import PROP

KiB, MiB = 1 << 10, 1 << 20


SHARE = 4 * MiB  # each server's one FABRIC export
IDLE_S = 10.0  # seconds the brokers' CPU is sampled for, every import held
LONE_REPS = 30  # import + map cycles of the lone importer


def _worker(n: int, count: int) -> None:
    """One server's process: export SHARE bytes filled with its number, print the handle; then import and map every
    other server's (each import timed, the first one of this process apart, and the CPU this thread spent on them),
    and only then read and byte-check each: a job's start-up imports its peers' memory before it moves bytes, and
    the import figures are then the imports' own, not the copies' of the other servers running alongside."""
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
    times, verified, failed = [], 0, []
    mapped: list[tuple[int, int]] = []
    others = [m for m in range(n + 1, count + 1)] + [m for m in range(1, n)]  # each server starts at its next one
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
        mapped.append((m, rp))
    cpu = time.thread_time() - cpu0
    print(json.dumps({"first": times[0] if times else None, "later": times[1:], "cpu": cpu}), flush=True)
    for m, rp in mapped:
        if acl.rt.memcpy(buf, SHARE, rp, SHARE, 2) != 0:
            failed.append(f"server {m}: copy: {acl.get_recent_err_msg()}")
            continue
        got = hashlib.sha256(ctypes.string_at(buf, SHARE)).digest()
        if got == hashlib.sha256(bytes([m & 0xFF]) * SHARE).digest():
            verified += 1
        else:
            failed.append(f"server {m}: the bytes read are not what it wrote")
    print(json.dumps({"verified": verified, "failed": failed}), flush=True)
    sys.stdin.readline()  # every import held until the run is done with the idle brokers


def _lone(handle: str) -> None:
    """A process alone on a quiet cluster: its first import (a fresh process's), then LONE_REPS import + map
    cycles of the same handle (each freed again); it prints the CPU its thread spent on those cycles too, and
    waits for a line on stdin before it leaves (the run reads the brokers' CPU meanwhile)."""
    import vmmshare.acl as acl

    acl.rt.set_device(0)
    raw = bytes.fromhex(handle)
    times: list[float] = []
    cpu = 0.0
    for _ in range(LONE_REPS + 1):
        if len(times) == 1:
            print(json.dumps({"ready": True}), flush=True)  # the first one done: the run samples the CPU from here
            sys.stdin.readline()
            cpu = time.thread_time()
        t0 = time.perf_counter()
        ih, ret = acl.rt.mem_import_from_shareable_handle_v2(raw, 2, 0)
        rp, _ = acl.rt.reserve_mem_address(SHARE, 0, 0, 0)
        if ret or acl.rt.map_mem(rp, SHARE, 0, ih, 0):
            raise SystemExit(f"the lone import failed: {acl.get_recent_err_msg()}")
        times.append(time.perf_counter() - t0)
        acl.rt.unmap_mem(rp)
        acl.rt.release_mem_address(rp)
        acl.rt.free_physical(ih)
    print(json.dumps({"first": times[0], "later": times[1:], "cpu": time.thread_time() - cpu}), flush=True)
    sys.stdin.readline()


def _cpu_seconds(pid: int, tid: int | None = None) -> float:
    """utime + stime of a process (all its threads), or of its thread `tid`; 0 once it is gone."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _on_cpu(pid: int, tid: int) -> float:
    """Seconds thread `tid` of `pid` has run (the scheduler's own count, in ns: finer than utime's ticks)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def _hops(cluster: Any, servers: list[int], workers: set[int]) -> dict[str, float]:
    """Seconds run so far, on servers `servers`, by the brokers' loop threads and by their metadata services."""
    out = {"broker loop": 0.0, "metadata service": 0.0}
    for n in servers:
        for pid in _brokers(cluster, n, workers):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    meta = b"metadata_service" in f.read()
                tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")] if meta else [pid]
            except OSError:
                continue
            out["metadata service" if meta else "broker loop"] += sum(_on_cpu(pid, t) for t in tids)
    return out


PARTS = ("broker loop", "broker engine", "metadata service", "importer engines")


def _parts(brokers: dict[int, list[int]], workers: set[int]) -> dict[str, float]:
    """CPU seconds so far of each part of every server: the broker's loop thread (its main thread), the broker's
    other threads (its transfer engine's), its metadata service child, and the importing processes' threads but
    their main one (their engines', which run while the imports are held)."""
    out = dict.fromkeys(PARTS, 0.0)
    for pids in brokers.values():
        for pid in pids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
                tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            except OSError:
                continue
            if b"metadata_service" in cmdline:
                out["metadata service"] += _cpu_seconds(pid)
                continue
            for tid in tids:
                out["broker loop" if tid == pid else "broker engine"] += _cpu_seconds(pid, tid)
    for pid in workers:
        with contextlib.suppress(OSError):
            for tid in (int(t) for t in os.listdir(f"/proc/{pid}/task")):
                if tid != pid:
                    out["importer engines"] += _cpu_seconds(pid, tid)
    return out


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * KiB
    return 0


def _brokers(cluster: Any, n: int, workers: set[int]) -> list[int]:
    """The broker's processes on server `n` (the broker and its metadata service): every process there but the
    workers (and the `ip netns exec` wrappers, which exec and are the workers themselves)."""
    return [p for p in cluster.pids(n) if p not in workers]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def run_scale(count: int, idle_s: float = IDLE_S) -> dict[str, Any]:
    """All-to-all FABRIC imports on `count` servers: import latency, a lone importer's, memory, idle CPU."""
    from .cluster import Cluster

    root = Path(tempfile.mkdtemp(prefix="vmmshare-bench-"))
    cluster = Cluster(f"s{os.getpid() % 10000}", count, root=root, timeout=5.0)
    me = [sys.executable, "-m", "vmmshare.cli.bench_scale"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VMMSHARE_")}
    env["VMMSHARE_BROKER_IDLE"] = "600"
    procs: list[subprocess.Popen[str]] = []
    shm_before = _shm()
    ran: set[tuple[int, int]] = set()  # (pid, start time) of every process seen on the cluster's servers
    t_up = time.perf_counter()
    cluster.up()
    up_s = time.perf_counter() - t_up
    res: dict[str, Any] = {"servers": count, "imports": count * (count - 1), "cluster_up_s": up_s}
    try:
        handles = {}
        for s in cluster.servers:
            cmd = s.command([*me, "--role", "worker", "--server", str(s.number), "--count", str(count)])
            procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for s, proc in zip(cluster.servers, procs, strict=True):
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the process of server {s.number} failed (its error is above)")
            handles[str(s.number)] = json.loads(line)["handle"]
        for proc in procs:  # all at once: every server imports every other's
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(handles) + "\n")
            proc.stdin.flush()
        workers = {p.pid for p in procs}
        numbers = [s.number for s in cluster.servers]
        hops_before = _hops(cluster, numbers, workers)
        reports = []
        for s, proc in zip(cluster.servers, procs, strict=True):
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the process of server {s.number} died while importing")
            reports.append(json.loads(line))
        hops_after = _hops(cluster, numbers, workers)  # the imports are done, the copies begin
        imports = count * (count - 1)
        res["cpu_per_import_ms"] = {
            "client": sum(r["cpu"] for r in reports) / imports * 1e3,
            **{k: (hops_after[k] - hops_before[k]) / imports * 1e3 for k in hops_after}}
        for r, (s, proc) in zip(reports, zip(cluster.servers, procs, strict=True), strict=True):
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the process of server {s.number} died while reading")
            r.update(json.loads(line))
        brokers = {s.number: _brokers(cluster, s.number, workers) for s in cluster.servers}
        every = [p for pids in brokers.values() for p in pids]
        before = sum(_cpu_seconds(p) for p in every)
        parts_before = _parts(brokers, workers)
        t0 = time.monotonic()
        time.sleep(idle_s)  # a measurement window, not synchronisation: every import is held meanwhile
        window = time.monotonic() - t0
        idle = (sum(_cpu_seconds(p) for p in every) - before) / window
        parts_after = _parts(brokers, workers)
        res["idle_cores_by_part"] = {k: (parts_after[k] - parts_before[k]) / window for k in PARTS}
        per_server = [sum(_rss(p) for p in [*brokers[s.number], procs[s.number - 1].pid]) for s in cluster.servers]
        lone = _run_lone(cluster, me, env, handles["2"], workers)
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(60)
    finally:
        for s in cluster.servers:
            ran.update(_started(p) for p in cluster.pids(s.number))
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        t_down = time.perf_counter()
        cluster.down()
        res["cluster_down_s"] = time.perf_counter() - t_down
        shutil.rmtree(root, ignore_errors=True)
    later = [t for r in reports for t in r["later"]]
    firsts = [r["first"] for r in reports if r["first"] is not None]
    ms = 1e3
    res.update({
        "verified": sum(r["verified"] for r in reports),
        "failed": [f for r in reports for f in r["failed"]],
        "later_ms": {"median": statistics.median(later) * ms if later else 0.0,
                     "p99": _percentile(later, 0.99) * ms, "max": max(later, default=0.0) * ms},
        "first_ms": {"median": statistics.median(firsts) * ms if firsts else 0.0,
                     "p99": _percentile(firsts, 0.99) * ms, "max": max(firsts, default=0.0) * ms},
        "lone_ms": {"first": lone["first"] * ms, "median": statistics.median(lone["later"]) * ms},
        "lone_cpu_per_cycle_ms": lone["cpu_ms"],
        "memory_per_server_mib": statistics.mean(per_server) / MiB,
        "idle_brokers_cores": idle,
        "left_behind": _left_behind(cluster, ran, shm_before),
    })
    return res


def _run_lone(cluster: Any, me: list[str], env: dict[str, str], handle: str, workers: set[int]) -> dict[str, Any]:
    """The lone importer on server 1, of server 2's handle: its times, and the CPU of each hop per import + map +
    free cycle (its own thread, its broker's loop and metadata service, the exporting broker's loop and service)."""
    cmd = cluster.server(1).command([*me, "--role", "lone", "--info", handle])
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        if not proc.stdout.readline():
            raise RuntimeError("the lone importer failed (its error is above)")
        before = {n: _hops(cluster, [n], workers | {proc.pid}) for n in (1, 2)}
        proc.stdin.write("\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("the lone importer failed (its error is above)")
        after = {n: _hops(cluster, [n], workers | {proc.pid}) for n in (1, 2)}
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    lone: dict[str, Any] = json.loads(line)
    cpu = {"client": lone["cpu"] / LONE_REPS * 1e3}
    for n, side in ((1, "importing"), (2, "exporting")):
        for k in after[n]:
            cpu[f"{side} {k}"] = (after[n][k] - before[n][k]) / LONE_REPS * 1e3
    lone["cpu_ms"] = cpu
    return lone


def _started(pid: int) -> tuple[int, int]:
    """(pid, start time in clock ticks since boot): a process, told apart from a later one reusing its pid; the
    start time is -1 for a process that is gone or has exited (a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return pid, int(fields[19]) if fields[0] != "Z" else -1
    except (OSError, ValueError, IndexError):
        return pid, -1


def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _in_use(paths: set[str]) -> set[str]:
    """Which of `paths` a live process has open or mapped (another program's, not a leftover)."""
    used: set[str] = set()
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target in paths:
                        used.add(target)
            with open(f"/proc/{pid}/maps") as maps:
                used.update(path for line in maps if (path := line.rstrip("\n").split(maxsplit=5)[-1]) in paths)
    return used


def _left_behind(cluster: Any, ran: set[tuple[int, int]], shm_before: set[str]) -> list[str]:
    """What `cluster down` left: its namespaces, any process that ran on its servers (brokers, their metadata
    services, the workers, whose threads are the engines), and /dev/shm entries made during the run that no live
    process holds."""
    from .cluster import _namespaces

    left = sorted(f"namespace {ns}" for ns in _namespaces() if ns.startswith(f"vmms-{cluster.name}-"))
    left += sorted(f"process {pid}" for pid, start in ran if start >= 0 and _started(pid) == (pid, start))
    fresh = {f"/dev/shm/{name}" for name in _shm() - shm_before}
    left += sorted(f"file {path}" for path in fresh - _in_use(fresh))
    return left


def print_scale(results: list[dict[str, Any]]) -> None:
    print("all-to-all FABRIC imports of 4 MiB (every server imports, maps and byte-checks every other's), servers "
          "as network namespaces of this machine: import + reserve + map, ms")
    print(f"  {'N':>3s} {'imports':>8s} {'verified':>8s}  {'later med':>9s} {'p99':>7s} {'max':>7s}  "
          f"{'first med':>9s} {'max':>7s}  {'lone':>6s} {'lone 1st':>8s}  {'MiB/server':>10s} {'idle cores':>10s}")
    for r in results:
        la, fi, lo = r["later_ms"], r["first_ms"], r["lone_ms"]
        print(f"  {r['servers']:3d} {r['imports']:8d} {r['verified']:8d}  {la['median']:9.2f} {la['p99']:7.2f} "
              f"{la['max']:7.2f}  {fi['median']:9.2f} {fi['max']:7.2f}  {lo['median']:6.2f} {lo['first']:8.2f}  "
              f"{r['memory_per_server_mib']:10.1f} {r['idle_brokers_cores']:10.4f}")
        cpu = r.get("cpu_per_import_ms", {})
        if cpu:
            total = sum(cpu.values())
            print(f"      CPU per import, ms: {total:.3f} (" + ", ".join(f"{k} {v:.3f}" for k, v in cpu.items())
                  + f"): {r['servers']} importers at once need {r['servers'] * total:.1f} ms of CPU a round, "
                  f"{r['servers'] * total / (os.cpu_count() or 1):.1f} ms on this machine's {os.cpu_count()} cores")
        lone_cpu = r.get("lone_cpu_per_cycle_ms", {})
        if lone_cpu:
            print("      lone importer, CPU per import + map + free, ms: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in lone_cpu.items()))
        parts = r.get("idle_cores_by_part", {})
        if parts:
            print("      idle, cores: " + ", ".join(f"{k} {v:.4f}" for k, v in parts.items()))
        for f in r["failed"][:5]:
            print(f"      failed: {f}")
        if r["left_behind"]:
            print(f"      left behind by cluster down: {', '.join(r['left_behind'][:20])}")
        else:
            print("      cluster down left nothing: no namespace, process or /dev/shm entry of the run")


def plot_scale(results: list[dict[str, Any]], path: str) -> str:
    """Latency against N as a PNG at `path` (matplotlib, optional): "" when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    ns = [r["servers"] for r in results]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("median", "later import, median"), ("p99", "later import, p99")):
        ax.plot(ns, [r["later_ms"][key] for r in results], marker="o", label=label)
    ax.plot(ns, [r["first_ms"]["median"] for r in results], marker="s", label="first import of a process, median")
    ax.plot(ns, [r["lone_ms"]["median"] for r in results], marker="^", label="lone importer, median")
    ax.set_xlabel("servers (all-to-all)")
    ax.set_ylabel("import + reserve + map, ms")
    ax.set_xscale("log", base=2)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return ""


def counts_option(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: server counts, comma-separated (e.g. 4,8,16)") from None
    if not counts or not all(2 <= c <= 254 for c in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: each count is 2 to 254")
    return counts


def run_counts(counts: list[int], json_path: str | None, plot: str | None, idle_s: float = IDLE_S) -> int:
    from .cluster import ClusterError
    from .console import FAILED, OK, say_error

    results = []
    for count in counts:
        try:
            results.append(run_scale(count, idle_s))
        except (ClusterError, RuntimeError, OSError, ValueError) as exc:
            say_error("vmmshare bench --fabric --servers", f"at {count} servers: {exc}")
            return FAILED
        print_scale(results[-1:])
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2))
    if plot:
        why = plot_scale(results, plot)
        print(f"  plot: {why or plot}")
    complete = all(r["verified"] == r["imports"] and not r["left_behind"] for r in results)
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
