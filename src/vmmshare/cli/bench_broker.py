"""What `vmmshare bench` measures of the broker: the floors of a round trip (a raw fd round trip between two Python
processes, and the physical one: a blocking request/reply carrying the fd, then mmap, both ends in C), import + free
round trips per second with the CPU each side spends, and the CPU of an idle broker."""

from __future__ import annotations

import array
import mmap
import multiprocessing as mp
import os
import socket
import time
from multiprocessing.connection import Connection
from typing import Any

from .bench_measures import MiB, Step, now_ns, quiet, stats_of, us_between
from .console import quiet_child, start_child

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
    t0 = os.times()
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        handle, ret = rt.mem_import_from_shareable_handle_v2(value, 1, 0)
        if ret or rt.free_physical(handle):
            raise SystemExit(f"import+free failed: {vmmshare.acl.get_recent_err_msg()}")
        n += 1
    t1 = os.times()
    conn.send((n, t1.user - t0.user, t1.system - t0.system))


def cpu_of(pid: int) -> float:
    """CPU seconds `pid` has used (user + system), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def broker_pid() -> int:
    from .._process import runtime

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
        out[str(n)] = clients_point(ctx, str(h), n, seconds, broker)
    mem.close()
    return out


def clients_point(ctx: Any, text: str, n: int, seconds: float, broker: int) -> dict[str, float]:
    """One throughput point: `n` client processes of the multiprocessing context `ctx` import and free the handle
    `text` for `seconds`, all started together; round trips per second and the CPU one costs (µs): the clients'
    (with its user and system parts) and the broker's (`broker`, its pid)."""
    start = ctx.Event()
    pipes, procs = [], []
    for _ in range(n):
        a, b = ctx.Pipe()
        p = ctx.Process(target=quiet_child, args=(_tp_client, text, seconds, start, b))
        start_child(p)
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
    ops = max(sum(d[0] for d in done), 1)
    user, system = sum(d[1] for d in done) / ops * 1e6, sum(d[2] for d in done) / ops * 1e6
    return {"ops_per_s": sum(d[0] for d in done) / elapsed, "client_cpu_us": user + system, "client_user_us": user,
            "client_system_us": system, "broker_cpu_us": broker_cpu / ops * 1e6}


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
    server = ctx.Process(target=quiet_child, args=(_floor_server, b))
    start_child(server)
    b.close()
    rtt: list[float] = []
    rtt_map: list[float] = []
    anc = socket.CMSG_SPACE(4)
    try:
        for i in range(reps + 100):
            t0 = now_ns()
            a.send(b"x" * 24)
            while True:
                try:
                    _, got, _, _ = a.recvmsg(256, anc, socket.MSG_DONTWAIT)
                    break
                except BlockingIOError:
                    os.sched_yield()
            fd = int.from_bytes(got[0][2][:4], "little")
            t1 = now_ns()
            m = mmap.mmap(fd, 2 * MiB)
            t2 = now_ns()
            m.close()
            os.close(fd)
            if i >= 100:
                rtt.append(us_between(t0, t1))
                rtt_map.append(us_between(t0, t2))
    finally:
        a.close()
        server.join(10)
    return {"fd_round_trip": stats_of(rtt), "fd_round_trip_mmap": stats_of(rtt_map)}


def _c_floor_server(sock: socket.socket, cpu: int | None) -> None:
    """The C floor's other end: answer each packet with the same bytes and a 2 MiB memfd, all in C."""
    from ..sockets import _fastpackets

    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    fd = os.memfd_create("vmmshare-floor", os.MFD_CLOEXEC)
    os.ftruncate(fd, 2 * MiB)
    _fastpackets.floor_serve(sock.fileno(), fd)


def c_floor(reps: int, step: Step = quiet) -> dict[str, Any]:
    """The physical floor of an import: one blocking request over SOCK_SEQPACKET and a reply carrying a 2 MiB memfd,
    then its mmap, both ends in C (the compiled fast path's helpers); once free to run on any core (the reply
    wakes the other side, often on another core) and once with both ends on one core. Empty where the fast path
    is not built."""
    from ..sockets import packets

    if not packets.FAST_AVAILABLE:
        return {}
    from ..sockets import _fastpackets

    ctx = mp.get_context("spawn")
    out: dict[str, Any] = {}
    mine = os.sched_getaffinity(0)
    for where, cpu in (("any_core", None), ("one_core", min(mine))):
        step(f"the floor in C, {where.replace('_', ' ')}")
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server = ctx.Process(target=quiet_child, args=(_c_floor_server, b, cpu))
        start_child(server)
        b.close()
        try:
            if cpu is not None:
                os.sched_setaffinity(0, {cpu})
            trip, mapped = _fastpackets.floor_trips(a.fileno(), reps + 100, 2 * MiB)
        finally:
            os.sched_setaffinity(0, mine)
            a.close()
            server.join(10)
        out[where] = {"fd_round_trip": stats_of([t / 1000 for t in trip[100:]]),
                      "fd_round_trip_mmap": stats_of([t / 1000 for t in mapped[100:]])}
    return out
