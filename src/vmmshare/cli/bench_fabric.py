"""vmmshare bench --fabric: copies across servers against the transfer engine itself and a raw TCP socket.

A test cluster of two servers (network namespaces of this machine, `vmmshare cluster`) is made for the run. Server 1
exports memory as a FABRIC handle; it also runs a bare transfer engine with a registered buffer of the same size and
a plain TCP socket server. Server 2 measures, in one run and interleaved:
- remote read and write throughput (memcpy between a remote mapping and malloc_host memory) at each size, against
  the bare engine (`transfer_sync_read/write` on pre-registered buffers) and the TCP socket (the link's limit);
- 4 KiB read latency against the same two;
- import + reserve + map of the remote handle, in microseconds.
Needs root (network namespaces) and the engine (pip install 'vmmshare[fabric]').
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

KiB, MiB = 1 << 10, 1 << 20
SIZES = [MiB, 16 * MiB, 256 * MiB]
TCP_PORT = 17100
PROP = {"handleType": 0, "allocationType": 0, "memAttr": 5, "location": {"id": 0, "type": 1}, "reserve": 0}


# ---------------------------------------------------------------- server 1: the memory, a bare engine, a socket


def _exporter(size: int) -> None:
    import vmmshare.acl as acl

    from ..fabric.engine import load

    acl.rt.set_device(0)
    h, ret = acl.rt.malloc_physical(size, PROP, 0)
    p, _ = acl.rt.reserve_mem_address(size, 0, 0, 0)
    acl.rt.map_mem(p, size, 0, h, 0)
    acl.rt.memset(p, size, 0x5A, size)  # touched: no first-fault costs in the measurements
    shareable, ret = acl.rt.mem_export_to_shareable_handle_v2(h, 1, 2)
    if ret:
        raise SystemExit(f"export failed: {acl.get_recent_err_msg()}")
    module = load(5.0)
    raw = module.TransferEngine()
    address = os.environ["VMMSHARE_FABRIC_ADDR"]
    raw.initialize(address, "P2PHANDSHAKE", "tcp", "")
    buf = ctypes.create_string_buffer(size)
    ctypes.memset(buf, 0x5A, size)
    raw.register_memory(ctypes.addressof(buf), size)
    srv = socket.create_server((address, TCP_PORT))
    threading.Thread(target=_tcp_server, args=(srv, size), daemon=True).start()
    print(json.dumps({"handle": shareable.hex(), "segment": f"{address}:{raw.get_rpc_port()}",
                      "address": ctypes.addressof(buf), "tcp": [address, TCP_PORT]}), flush=True)
    sys.stdin.read()  # until the measuring side is done


def _tcp_server(srv: socket.socket, size: int) -> None:
    data = bytearray(size)
    view = memoryview(data)
    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            head = _recv_exact(conn, view[:9])
            if head is None:
                break
            op, n = struct.unpack("<cQ", bytes(view[:9]))
            if op == b"r":
                conn.sendall(view[:n])
            elif _recv_exact(conn, view[:n]) is not None:
                conn.sendall(b"k")
        conn.close()


def _recv_exact(conn: socket.socket, view: memoryview) -> int | None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if not n:
            return None
        got += n
    return got


# ---------------------------------------------------------------- server 2: the measurements


def _time(fn: Any, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


GRANULE = 2 << 20  # device memory is allocated in these: a size such as 1M is carried by a 2 MiB allocation


def _granular(size: int) -> int:
    return -(-size // GRANULE) * GRANULE


def _measurer(info: dict[str, Any], sizes: list[int], reps: int, latency_reps: int) -> dict[str, Any]:
    import vmmshare.acl as acl

    from ..fabric.engine import load

    acl.rt.set_device(0)
    top = _granular(max(sizes))
    shareable = bytes.fromhex(info["handle"])
    t0 = time.perf_counter()
    h, ret = acl.rt.mem_import_from_shareable_handle_v2(shareable, 2, 0)
    if ret:
        raise SystemExit(f"import failed: {acl.get_recent_err_msg()}")
    rp, _ = acl.rt.reserve_mem_address(top, 0, 0, 0)
    acl.rt.map_mem(rp, top, 0, h, 0)
    first_import_us = (time.perf_counter() - t0) * 1e6
    buf, _ = acl.rt.malloc_host(top)
    acl.rt.memset(buf, top, 1, top)
    raw = load(5.0).TransferEngine()
    raw.initialize(os.environ["VMMSHARE_FABRIC_ADDR"], "P2PHANDSHAKE", "tcp", "")
    local = ctypes.create_string_buffer(top)
    ctypes.memset(local, 1, top)
    la = ctypes.addressof(local)
    raw.register_memory(la, top)
    seg, ra = info["segment"], info["address"]
    from .._process import runtime

    served: Any = runtime().memory.allocation(h).mem  # where the exporting node's broker serves the memory
    to_broker = load(5.0).TransferEngine()  # a bare engine told what this process's is: its metadata namespace
    node: Any = runtime().node
    to_broker.initialize(os.environ["VMMSHARE_FABRIC_ADDR"], node.metadata_url, "tcp", "")
    to_broker.register_memory(la, top)
    sock = socket.create_connection(tuple(info["tcp"]))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sview = memoryview(bytearray(top))

    def tcp_read(n: int) -> None:
        sock.sendall(struct.pack("<cQ", b"r", n))
        _recv_exact(sock, sview[:n])

    def tcp_write(n: int) -> None:
        sock.sendall(struct.pack("<cQ", b"w", n))
        sock.sendall(sview[:n])
        _recv_exact(sock, sview[:1])

    def check(rc: int) -> None:
        if rc != 0:
            raise SystemExit("a transfer failed")

    ways = {
        "read": {
            "vmmshare": lambda n: check(acl.rt.memcpy(buf, n, rp, n, 2)),
            "engine": lambda n: check(raw.transfer_sync_read(seg, la, ra, n)),
            "engine_to_broker": lambda n: check(to_broker.transfer_sync_read(served.segment, la, served.address, n)),
            "tcp": tcp_read,
        },
        "write": {
            "vmmshare": lambda n: check(acl.rt.memcpy(rp, n, buf, n, 1)),
            "engine": lambda n: check(raw.transfer_sync_write(seg, la, ra, n)),
            "engine_to_broker": lambda n: check(to_broker.transfer_sync_write(served.segment, la, served.address, n)),
            "tcp": tcp_write,
        },
    }
    res: dict[str, Any] = {"throughput": {}, "latency_4k_us": {}}
    for op, by in ways.items():
        for fn in by.values():
            fn(4 * KiB)  # first contact made before any timing
        for size in sizes:
            times: dict[str, list[float]] = {k: [] for k in by}
            for _ in range(reps if size < 256 * MiB else max(2, reps // 4)):
                for name, fn in by.items():  # interleaved: drifts of a busy machine hit all three alike
                    times[name] += _time(lambda fn=fn, size=size: fn(size), 1)
            res["throughput"][f"{op} {size >> 20} MiB"] = {k: size / statistics.median(v) / 1e9 for k, v in
                                                          times.items()}
    lat: dict[str, list[float]] = {k: [] for k in ways["read"]}
    for _ in range(latency_reps):
        for name, fn in ways["read"].items():
            lat[name] += _time(lambda fn=fn: fn(4 * KiB), 1)
    res["latency_4k_us"] = {k: statistics.median(v) * 1e6 for k, v in lat.items()}
    acl.rt.unmap_mem(rp)
    acl.rt.release_mem_address(rp)
    acl.rt.free_physical(h)
    cycles = []
    for _ in range(20):
        t0 = time.perf_counter()
        h, _ = acl.rt.mem_import_from_shareable_handle_v2(shareable, 2, 0)
        rp, _ = acl.rt.reserve_mem_address(top, 0, 0, 0)
        acl.rt.map_mem(rp, top, 0, h, 0)
        cycles.append(time.perf_counter() - t0)
        acl.rt.unmap_mem(rp)
        acl.rt.release_mem_address(rp)
        acl.rt.free_physical(h)
    res["import_map_us"] = {"first": first_import_us, "median": statistics.median(cycles) * 1e6}
    return res


# ---------------------------------------------------------------- the run


def run(sizes: list[int], reps: int, latency_reps: int) -> dict[str, Any]:
    from .cluster import Cluster

    root = Path(tempfile.mkdtemp(prefix="vmmshare-bench-"))
    cluster = Cluster(f"b{os.getpid() % 10000}", 2, root=root)
    cluster.up()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("VMMSHARE_")}
        me = [sys.executable, "-m", "vmmshare.cli.bench_fabric"]
        role = [*me, "--role", "export", "--size", str(_granular(max(sizes)))]
        exporter = subprocess.Popen(cluster.server(1).command(role), env=env, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True)
        assert exporter.stdout is not None and exporter.stdin is not None
        line = exporter.stdout.readline()
        if not line:
            raise RuntimeError("the exporting process failed (its error is above)")
        measure = cluster.server(2).command([*me, "--role", "measure", "--info", line.strip(),
                                             "--sizes", ",".join(map(str, sizes)), "--reps", str(reps),
                                             "--latency-reps", str(latency_reps)])
        out = subprocess.run(measure, env=env, capture_output=True, text=True)
        exporter.stdin.close()
        exporter.wait(60)
        if out.returncode != 0:
            raise RuntimeError(f"the measuring process failed: {out.stderr.strip()[-2000:]}")
        res: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        cluster.down()
        shutil.rmtree(root, ignore_errors=True)
    res["ratios"] = {
        "throughput_vs_engine": {k: v["vmmshare"] / v["engine"] for k, v in res["throughput"].items()},
        "throughput_vs_tcp": {k: v["vmmshare"] / v["tcp"] for k, v in res["throughput"].items()},
        "latency_4k_vs_engine": res["latency_4k_us"]["vmmshare"] / res["latency_4k_us"]["engine"],
        "latency_4k_vs_tcp": res["latency_4k_us"]["vmmshare"] / res["latency_4k_us"]["tcp"],
    }
    res["targets"] = {
        "throughput >= 0.9x engine": all(r >= 0.9 for r in res["ratios"]["throughput_vs_engine"].values()),
        "4 KiB latency <= 1.2x engine": res["ratios"]["latency_4k_vs_engine"] <= 1.2,
    }
    return res


def print_report(res: dict[str, Any]) -> None:
    print("cross-server copies (two network namespaces over veth, TCP): GB/s, medians")
    print(f"  {'':18s} {'vmmshare':>9s} {'engine':>9s} {'tcp':>9s}   vs engine  vs tcp")
    for key, v in res["throughput"].items():
        print(f"  {key:18s} {v['vmmshare']:9.2f} {v['engine']:9.2f} {v['tcp']:9.2f}   "
              f"{v['vmmshare'] / v['engine']:8.2f}x {v['vmmshare'] / v['tcp']:6.2f}x")
    lat = res["latency_4k_us"]
    print(f"  4 KiB read latency, µs: vmmshare {lat['vmmshare']:.1f}, engine {lat['engine']:.1f}, tcp {lat['tcp']:.1f}"
          f" ({res['ratios']['latency_4k_vs_engine']:.2f}x engine); the bare engine reading the broker's served "
          f"memory: {lat['engine_to_broker']:.1f}")
    im = res["import_map_us"]
    print(f"  import + reserve + map of a remote handle: {im['median']:.0f} µs (the process's first, which "
          f"auto-starts the node's broker and its engine: {im['first']:.0f} µs)")
    for target, met in res["targets"].items():
        print(f"  target {target}: {'met' if met else 'NOT met'}")


# ---------------------------------------------------------------- all-to-all at scale (--servers N)

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


def run_scale(count: int) -> dict[str, Any]:
    """All-to-all FABRIC imports on `count` servers: import latency, a lone importer's, memory, idle CPU."""
    from .cluster import Cluster

    root = Path(tempfile.mkdtemp(prefix="vmmshare-bench-"))
    cluster = Cluster(f"s{os.getpid() % 10000}", count, root=root, timeout=5.0)
    me = [sys.executable, "-m", "vmmshare.cli.bench_fabric"]
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
        time.sleep(IDLE_S)  # a measurement window, not synchronisation: every import is held meanwhile
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


def main(argv: list[str]) -> int:
    from .console import FAILED, OK, USAGE, Parser, say_error, sizes_option

    ap = Parser(prog="vmmshare bench --fabric", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--role", choices=("export", "measure", "worker", "lone"), help=argparse.SUPPRESS)
    ap.add_argument("--server", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--servers", type=_counts_option, help=(
        "all-to-all at scale instead: every one of N servers imports every other's 4 MiB FABRIC handle "
        "(a comma list, e.g. 4,8,16,32; 2 to 254)"))
    ap.add_argument("--plot", help="with --servers: write a plot of import latency against N here (matplotlib)")
    ap.add_argument("--size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--info", help=argparse.SUPPRESS)
    ap.add_argument("--latency-reps", type=int, default=200, help="4 KiB reads per path (default 200)")
    ap.add_argument("--sizes", type=sizes_option, default=SIZES, help="throughput sizes (default 1M,16M,256M)")
    ap.add_argument("--reps", type=int, default=12, help="copies per size and path (default 12; a quarter at 256 MiB)")
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args(argv)
    if args.role == "export":
        _exporter(args.size)
        return OK
    if args.role == "measure":
        print(json.dumps(_measurer(json.loads(args.info), args.sizes, args.reps, args.latency_reps)))
        return OK
    if args.role == "worker":
        _worker(args.server, args.count)
        return OK
    if args.role == "lone":
        _lone(args.info)
        return OK
    from ..fabric.engine import missing
    from .cluster import ClusterError

    if os.geteuid() != 0:
        say_error("vmmshare bench --fabric", "needs root: it makes two network namespaces for the run")
        return USAGE
    if missing():
        say_error("vmmshare bench --fabric", missing())
        return USAGE
    if args.servers:
        return _main_scale(args.servers, args.json, args.plot)
    try:
        res = run(args.sizes, args.reps, args.latency_reps)
    except (ClusterError, RuntimeError) as exc:
        say_error("vmmshare bench --fabric", str(exc))
        return FAILED
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    print_report(res)
    return OK


def _counts_option(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: server counts, comma-separated (e.g. 4,8,16)") from None
    if not counts or not all(2 <= c <= 254 for c in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: each count is 2 to 254")
    return counts


def _main_scale(counts: list[int], json_path: str | None, plot: str | None) -> int:
    from .cluster import ClusterError
    from .console import FAILED, OK, say_error

    results = []
    for count in counts:
        try:
            results.append(run_scale(count))
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


if __name__ == "__main__":
    from .console import run_main

    sys.exit(run_main(lambda: main(sys.argv[1:])))
