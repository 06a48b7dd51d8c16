"""vmmshare bench --fabric: copies across servers against the transfer engine itself and a raw TCP socket.

A test cluster of two servers (network namespaces of this machine, `vmmshare cluster`) is made for the run. Server 1
exports memory as a FABRIC handle; it also runs a bare transfer engine with a registered buffer of the same size and
a plain TCP socket server. Server 2 measures, in one run and interleaved:
- remote read and write throughput (memcpy between a remote mapping and malloc_host memory) at each size, against
  the bare engine (`transfer_sync_read/write` on pre-registered buffers) and the TCP socket (the link's limit);
- the same copies by the C library (libascendcl.so, called in the same process through ctypes: `c`), which speaks
  the engine's TCP data protocol itself (docs/architecture.md, "One data plane");
- 4 KiB read latency against the same;
- import + reserve + map of the remote handle, in microseconds.
Needs root (network namespaces) and the engine (pip install 'vmmshare[fabric]').
"""

from __future__ import annotations

import argparse
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
    c_copy = _c_library(shareable, top)
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
            "c": lambda n: check(c_copy(n, False)),
            "engine": lambda n: check(raw.transfer_sync_read(seg, la, ra, n)),
            "engine_to_broker": lambda n: check(to_broker.transfer_sync_read(served.segment, la, served.address, n)),
            "tcp": tcp_read,
        },
        "write": {
            "vmmshare": lambda n: check(acl.rt.memcpy(rp, n, buf, n, 1)),
            "c": lambda n: check(c_copy(n, True)),
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


def _c_library(shareable: bytes, top: int) -> Any:
    """The C library in this process (a client of the node's broker of its own): the same handle imported,
    reserved and mapped through it, and a copy of `n` bytes between that mapping and its malloc_host memory
    (`write`: host to remote), which returns the call's code."""
    from ..sdk import library

    lib = ctypes.CDLL(str(library()))
    vp, u64 = ctypes.c_void_p, ctypes.c_uint64
    lib.aclrtMemcpy.argtypes = [vp, ctypes.c_size_t, vp, ctypes.c_size_t, ctypes.c_int]
    lib.aclrtMemImportFromShareableHandleV2.argtypes = [ctypes.c_char_p, ctypes.c_int, u64, ctypes.POINTER(vp)]
    lib.aclrtReserveMemAddress.argtypes = [ctypes.POINTER(vp), ctypes.c_size_t, ctypes.c_size_t, vp, u64]
    lib.aclrtMapMem.argtypes = [vp, ctypes.c_size_t, ctypes.c_size_t, vp, u64]
    lib.aclrtMallocHost.argtypes = [ctypes.POINTER(vp), ctypes.c_size_t]
    h, rp, buf = vp(), vp(), vp()
    for rc in (lib.aclrtSetDevice(0), lib.aclrtMemImportFromShareableHandleV2(shareable, 2, 0, ctypes.byref(h)),
               lib.aclrtReserveMemAddress(ctypes.byref(rp), top, 0, None, 0), lib.aclrtMapMem(rp, top, 0, h, 0),
               lib.aclrtMallocHost(ctypes.byref(buf), top)):
        if rc:
            raise SystemExit(f"the C library's import failed ({rc})")
    memcpy, r, b = lib.aclrtMemcpy, rp.value, buf.value
    assert r is not None and b is not None
    ctypes.memset(b, 1, top)

    def copy(n: int, write: bool) -> int:
        return int(memcpy(r, n, b, n, 1) if write else memcpy(b, n, r, n, 2))

    return copy


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
        "c_throughput_vs_engine": {k: v["c"] / v["engine"] for k, v in res["throughput"].items()},
        "c_throughput_vs_python": {k: v["c"] / v["vmmshare"] for k, v in res["throughput"].items()},
        "c_latency_4k_vs_engine": res["latency_4k_us"]["c"] / res["latency_4k_us"]["engine"],
        "c_latency_4k_vs_python": res["latency_4k_us"]["c"] / res["latency_4k_us"]["vmmshare"],
        "throughput_vs_tcp": {k: v["vmmshare"] / v["tcp"] for k, v in res["throughput"].items()},
        "latency_4k_vs_engine": res["latency_4k_us"]["vmmshare"] / res["latency_4k_us"]["engine"],
        "latency_4k_vs_tcp": res["latency_4k_us"]["vmmshare"] / res["latency_4k_us"]["tcp"],
    }
    res["targets"] = {
        "throughput >= 0.9x engine": all(r >= 0.9 for r in res["ratios"]["throughput_vs_engine"].values()),
        "4 KiB latency <= 1.2x engine": res["ratios"]["latency_4k_vs_engine"] <= 1.2,
        "C throughput >= 0.9x engine": all(r >= 0.9 for r in res["ratios"]["c_throughput_vs_engine"].values()),
        "C 4 KiB latency <= 1.2x engine": res["ratios"]["c_latency_4k_vs_engine"] <= 1.2,
    }
    return res


def print_report(res: dict[str, Any]) -> None:
    print("cross-server copies (two network namespaces over veth, TCP): GB/s, medians")
    print(f"  {'':18s} {'vmmshare':>9s} {'C':>9s} {'engine':>9s} {'tcp':>9s}   vs engine  C vs engine  vs tcp")
    for key, v in res["throughput"].items():
        print(f"  {key:18s} {v['vmmshare']:9.2f} {v['c']:9.2f} {v['engine']:9.2f} {v['tcp']:9.2f}   "
              f"{v['vmmshare'] / v['engine']:8.2f}x {v['c'] / v['engine']:11.2f}x {v['vmmshare'] / v['tcp']:6.2f}x")
    lat = res["latency_4k_us"]
    print(f"  4 KiB read latency, µs: vmmshare {lat['vmmshare']:.1f}, C {lat['c']:.1f}, engine {lat['engine']:.1f}, "
          f"tcp {lat['tcp']:.1f} ({res['ratios']['latency_4k_vs_engine']:.2f}x engine, C "
          f"{res['ratios']['c_latency_4k_vs_engine']:.2f}x); the bare engine reading the broker's served "
          f"memory: {lat['engine_to_broker']:.1f}")
    im = res["import_map_us"]
    print(f"  import + reserve + map of a remote handle: {im['median']:.0f} µs (the process's first, which "
          f"auto-starts the node's broker and its engine: {im['first']:.0f} µs)")
    for target, met in res["targets"].items():
        print(f"  target {target}: {'met' if met else 'NOT met'}")


def main(argv: list[str]) -> int:
    from .bench_scale import counts_option, run_counts
    from .console import FAILED, OK, USAGE, Parser, count_option, say_error, seconds_option, sizes_option

    ap = Parser(prog="vmmshare bench --fabric", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--role", choices=("export", "measure"), help=argparse.SUPPRESS)
    ap.add_argument("--servers", type=counts_option, help=(
        "all-to-all at scale instead: every one of N servers imports every other's 4 MiB FABRIC handle "
        "(a comma list, e.g. 4,8,16,32; 2 to 254)"))
    ap.add_argument("--plot", help="with --servers: write a plot of import latency against N here (matplotlib)")
    ap.add_argument("--idle-seconds", type=seconds_option, default=10.0, help=(
        "with --servers: how long the brokers' idle CPU is sampled, every import held (default 10)"))
    ap.add_argument("--at-once", type=count_option, help=(
        "with --servers: how many servers import at a time in the paced phase (default: this machine's cores)"))
    ap.add_argument("--fabric-timeout", type=seconds_option, default=5.0, help=(
        "with --servers: the cluster's VMMSHARE_FABRIC_TIMEOUT in seconds (default 5); a killed broker's copies must "
        "fail within it and its process's holds elsewhere are freed after 4 of it"))
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
    from ..fabric.engine import missing
    from .cluster import ClusterError

    if os.geteuid() != 0:
        say_error("vmmshare bench --fabric", "needs root: it makes two network namespaces for the run")
        return USAGE
    if missing():
        say_error("vmmshare bench --fabric", missing())
        return USAGE
    if args.servers:
        return run_counts(args.servers, args.json, args.plot, args.idle_seconds, args.at_once, args.fabric_timeout)
    try:
        res = run(args.sizes, args.reps, args.latency_reps)
    except (ClusterError, RuntimeError) as exc:
        say_error("vmmshare bench --fabric", str(exc))
        return FAILED
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    print_report(res)
    return OK


if __name__ == "__main__":
    from .console import run_main

    sys.exit(run_main(lambda: main(sys.argv[1:])))
