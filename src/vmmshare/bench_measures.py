"""What `vmmshare bench` measures, each in one function: share latency by step against the anchors, the floor of a
broker round trip, broker throughput (with the CPU each side spends), and read and first-touch bandwidth."""

from __future__ import annotations

import array
import mmap
import multiprocessing as mp
import os
import socket
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PAGE = 4096
Step = Callable[[str], None]  # told what the run measures now (a progress line on a terminal)


def fmt_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def quiet(_: str) -> None:
    pass


def _stats(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        v = values[0] if values else float("nan")
        return {"median": v, "p10": v, "p90": v}
    q = statistics.quantiles(values, n=10, method="inclusive")
    return {"median": statistics.median(values), "p10": q[0], "p90": q[-1]}


def _now() -> int:
    return time.perf_counter_ns()


def _us(t0: int, t1: int) -> float:
    return (t1 - t0) / 1000


def _touch(view: Any) -> None:
    """Read one byte of every page (faults each page in)."""
    view[::PAGE].sum()


# ---------------------------------------------------------------- the peer process


def peer_main(conn: Connection) -> None:
    """The other process: imports, attaches or receives on request and answers with its timings."""
    from multiprocessing import shared_memory

    import numpy as np

    import vmmshare

    conn.send(vmmshare.acl.rt.device_get_bare_tgid()[0])
    while True:
        msg = conn.recv()
        kind = msg[0]
        if kind == "stop":
            return
        if kind == "vmm":
            _, text, size, prepopulate, touch = msg
            t0 = _now()
            mem = vmmshare.import_handle(text)
            t1 = _now()
            m = mem.map(prepopulate=prepopulate)
            t2 = _now()
            view = m.numpy()
            if touch:
                _touch(view)
            t3 = _now()
            out: dict[str, float] = {"import": _us(t0, t1), "map": _us(t1, t2), "touch": _us(t2, t3)}
            del view
            m.close()
            mem.close()
            conn.send(out)
        elif kind == "bw":
            _, text, size, reps = msg
            mem = vmmshare.import_handle(text)
            m = mem.map(prepopulate=True)
            shared = m.numpy(np.uint64)
            private = np.ones(size // 8, dtype=np.uint64)
            res = {"imported": _read_bw(shared, reps), "private": _read_bw(private, reps)}
            del shared, private
            m.close()
            mem.close()
            conn.send(res)
        elif kind == "shm":
            _, name, size, touch = msg
            t0 = _now()
            shm = shared_memory.SharedMemory(name)
            t1 = _now()
            assert shm.buf is not None
            view = np.frombuffer(shm.buf, dtype=np.uint8)
            if touch:
                _touch(view)
            t2 = _now()
            del view
            shm.close()
            conn.send({"attach": _us(t0, t1), "touch": _us(t1, t2)})
        elif kind == "pipe":
            data = conn.recv_bytes()
            conn.send(len(data))


def _read_bw(array: Any, reps: int) -> float:
    array.sum()  # warm
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        array.sum()
        times.append(time.perf_counter() - t0)
    return float(array.nbytes / statistics.median(times) / 1e9)


# ---------------------------------------------------------------- share latency


def share_latency(peer: Connection, peer_pid: int, sizes: list[int], reps: Callable[[int], int],
                  with_torch: bool, step: Step = quiet) -> dict[str, Any]:
    from multiprocessing import shared_memory

    import numpy as np

    import vmmshare

    dev = vmmshare.Device(0)
    rows: dict[str, Any] = {}
    all_steps: dict[int, dict[str, list[float]]] = {size: {k: [] for k in (
        "allocate", "map", "export_trustlist", "import", "reserve_map", "first_touch",
        "share", "share_with_touch", "shm_create", "shm_attach", "shm_touch", "shm_share", "pipe")} for size in sizes}
    # every size's latency rounds first, then the rounds that touch every page: touching 1 GiB evicts every
    # cache and leaves the kernel freeing pages, which would slow whatever round came next
    plan = [(size, False, reps(size)) for size in sizes] + [(size, True, min(reps(size), 3)) for size in sizes]
    for size, touch, n in plan:
        steps = all_steps[size]
        for i in range(n + 1):
            step(f"share latency{' with first touch' if touch else ''}, {fmt_size(size)}, round {i + 1} of {n + 1}")
            t0 = _now()
            mem = dev.allocate(size)
            t1 = _now()
            m = mem.map()
            t2 = _now()
            h = mem.export(pids=[peer_pid])  # the trustlist rides on the export: one round trip
            t4 = _now()
            peer.send(("vmm", str(h), mem.size, False, touch))
            got = peer.recv()
            m.close()
            mem.close()
            t0s = _now()
            shm = shared_memory.SharedMemory(create=True, size=size)
            t1s = _now()
            peer.send(("shm", shm.name, size, touch))
            sgot = peer.recv()
            shm.close()
            shm.unlink()
            if i == 0:
                continue  # warm-up round
            exporter = _us(t0, t4)
            if touch:
                steps["first_touch"].append(got["touch"])
                steps["share_with_touch"].append(exporter + got["import"] + got["map"] + got["touch"])
                steps["shm_touch"].append(sgot["touch"])
                continue
            steps["allocate"].append(_us(t0, t1))
            steps["map"].append(_us(t1, t2))
            steps["export_trustlist"].append(_us(t2, t4))
            steps["import"].append(got["import"])
            steps["reserve_map"].append(got["map"])
            steps["share"].append(exporter + got["import"] + got["map"])
            steps["shm_create"].append(_us(t0s, t1s))
            steps["shm_attach"].append(sgot["attach"])
            steps["shm_share"].append(_us(t0s, t1s) + sgot["attach"])
    for size in sizes:
        steps = all_steps[size]
        n = reps(size)
        pipe_reps = max(2, min(n, (64 * MiB * 8) // size))
        step(f"multiprocessing.Pipe, {fmt_size(size)}")
        payload = np.ones(size, dtype=np.uint8).tobytes() if size <= 256 * MiB else None
        for _ in range(pipe_reps if payload is not None else 0):
            t0 = _now()
            peer.send(("pipe",))
            peer.send_bytes(payload)  # type: ignore[arg-type]
            peer.recv()
            steps["pipe"].append(_us(t0, _now()))
        row: dict[str, Any] = {k: _stats(v) for k, v in steps.items() if v}
        row["size"] = size
        rows[str(size)] = row
    if with_torch:
        step("torch share_memory_()")
        rows_t = torch_share(sizes, reps)
        for key, value in rows_t.items():
            rows[key]["torch_share"] = value
    return rows


def _torch_child(q: Any, back: Any) -> None:
    while True:
        t = q.get()
        if t is None:
            return
        back.put(int(t[0]))
        del t


def torch_share(sizes: list[int], reps: Callable[[int], int]) -> dict[str, dict[str, float]]:
    """torch: t.share_memory_() then a torch.multiprocessing queue to another process, which reads it."""
    import torch
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_torch_child, args=(q, back))
    p.start()
    out = {}
    for size in sizes:
        times = []
        for i in range(reps(size) + 1):
            t: Any = torch.ones(size, dtype=torch.uint8)
            t0 = _now()
            t.share_memory_()
            q.put(t)
            back.get()
            if i:
                times.append(_us(t0, _now()))
            del t
        out[str(size)] = _stats(times)
    q.put(None)
    p.join()
    return out


# ---------------------------------------------------------------- broker throughput


def _tp_client(text: str, seconds: float, start: Any, conn: Connection) -> None:
    import vmmshare

    rt = vmmshare.acl.rt
    rt.set_device(0)
    value = int(vmmshare.ShareableHandle.parse(text))
    rt.free_physical(rt.mem_import_from_shareable_handle_v2(value, 1, 0)[0])  # connect and warm up
    conn.send("ready")
    start.wait()
    n = 0
    cpu0 = _cpu_self()
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        handle, ret = rt.mem_import_from_shareable_handle_v2(value, 1, 0)
        if ret or rt.free_physical(handle):
            raise SystemExit(f"import+free failed: {vmmshare.acl.get_recent_err_msg()}")
        n += 1
    conn.send((n, _cpu_self() - cpu0))


def _cpu_self() -> float:
    t = os.times()
    return t.user + t.system


def cpu_of(pid: int) -> float:
    """CPU seconds `pid` has used (user + system), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def broker_pid() -> int:
    from ._process import runtime

    node: Any = runtime().node
    return int(node.listing()["broker_pid"])


def throughput(clients: list[int], seconds: float, step: Step = quiet) -> dict[str, Any]:
    """import+free round trips per second with each number of client processes, and the CPU time one round trip
    costs the clients and the broker (µs)."""
    import vmmshare

    ctx = mp.get_context("spawn")
    mem = vmmshare.Device(0).allocate(2 * MiB)
    h = mem.export(validate_pids=False)
    broker = broker_pid()
    out: dict[str, Any] = {}
    for n in clients:
        step(f"broker throughput, {n} client(s)")
        start = ctx.Event()
        pipes, procs = [], []
        for _ in range(n):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_tp_client, args=(str(h), seconds, start, b))
            p.start()
            pipes.append(a)
            procs.append(p)
        for a in pipes:
            a.recv()
        broker_cpu = cpu_of(broker)
        t0 = time.perf_counter()
        start.set()
        done = [a.recv() for a in pipes]
        elapsed = max(time.perf_counter() - t0, seconds)
        broker_cpu = cpu_of(broker) - broker_cpu
        for p in procs:
            p.join()
        ops = sum(d[0] for d in done)
        out[str(n)] = {"ops_per_s": ops / elapsed, "client_cpu_us": sum(d[1] for d in done) / max(ops, 1) * 1e6,
                       "broker_cpu_us": broker_cpu / max(ops, 1) * 1e6}
    mem.close()
    return out


def idle_cpu(seconds: float = 2.0) -> float:
    """The broker's CPU use while nothing happens, as a fraction of one core (it must sleep, not poll)."""
    pid = broker_pid()
    before = cpu_of(pid)
    time.sleep(seconds)
    return (cpu_of(pid) - before) / seconds


# ---------------------------------------------------------------- the floor


def _floor_server(sock: socket.socket) -> None:
    """Answer each packet with the same bytes and a 2 MiB memfd, as the broker answers an import."""
    fd = os.memfd_create("vmmshare-floor", os.MFD_CLOEXEC)
    os.ftruncate(fd, 2 * MiB)
    while True:
        data = sock.recv(256)
        if not data:
            return
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


def floor(reps: int, step: Step = quiet) -> dict[str, Any]:
    """The least an import can cost: two Python processes, one request over AF_UNIX SOCK_SEQPACKET and a reply
    carrying an fd (SCM_RIGHTS), the receiver polling (as vmmshare's client does), then mmap of the 2 MiB fd."""
    step("the floor: a raw fd round trip")
    ctx = mp.get_context("spawn")
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server = ctx.Process(target=_floor_server, args=(b,))
    server.start()
    b.close()
    rtt: list[float] = []
    rtt_map: list[float] = []
    anc = socket.CMSG_SPACE(4)
    try:
        for i in range(reps + 100):
            t0 = _now()
            a.send(b"x" * 24)
            while True:
                try:
                    _, got, _, _ = a.recvmsg(256, anc, socket.MSG_DONTWAIT)
                    break
                except BlockingIOError:
                    os.sched_yield()
            fd = int.from_bytes(got[0][2][:4], "little")
            t1 = _now()
            m = mmap.mmap(fd, 2 * MiB)
            t2 = _now()
            m.close()
            os.close(fd)
            if i >= 100:
                rtt.append(_us(t0, t1))
                rtt_map.append(_us(t0, t2))
    finally:
        a.close()
        server.join(10)
    return {"fd_round_trip": _stats(rtt), "fd_round_trip_mmap": _stats(rtt_map)}


# ---------------------------------------------------------------- bandwidth


def bandwidth(peer: Connection, peer_pid: int, size: int, reps: int, step: Step = quiet) -> dict[str, Any]:
    import vmmshare

    step(f"read bandwidth and first touch, {fmt_size(size)}")
    with vmmshare.Device(0).allocate(size) as mem:
        with mem.map() as m:
            v = m.numpy()
            v[:] = 1
            del v
        h = mem.export(pids=[peer_pid])
        peer.send(("bw", str(h), mem.size, reps))
        read = peer.recv()
        touch: dict[str, Any] = {}
        for prepopulate in (False, True):
            runs = []
            for _ in range(max(2, reps // 2)):
                peer.send(("vmm", str(h), mem.size, prepopulate, True))
                runs.append(peer.recv())
            med = {k: statistics.median(r[k] for r in runs) for k in ("map", "touch")}
            med["first_touch_GBps"] = size / (med["map"] + med["touch"]) / 1e3
            touch["prepopulated" if prepopulate else "lazy"] = med
    return {"size": size, "read_GBps": read, "read_ratio": read["imported"] / read["private"], "first_touch": touch}


