"""What `vmmshare bench` measures, each in one function: share latency by step against the anchors, and read and
first-touch bandwidth (the broker's own costs are in bench_broker.py)."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from .console import quiet_child, start_child

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


def stats_of(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        v = values[0] if values else float("nan")
        return {"median": v, "p10": v, "p90": v}
    q = statistics.quantiles(values, n=10, method="inclusive")
    return {"median": statistics.median(values), "p10": q[0], "p90": q[-1]}


def now_ns() -> int:
    return time.perf_counter_ns()


def us_between(t0: int, t1: int) -> float:
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
            t0 = now_ns()
            mem = vmmshare.import_handle(text)
            t1 = now_ns()
            m = mem.map(prepopulate=prepopulate)
            t2 = now_ns()
            view = m.numpy()
            if touch:
                _touch(view)
            t3 = now_ns()
            out: dict[str, float] = {"import": us_between(t0, t1), "map": us_between(t1, t2),
                                     "touch": us_between(t2, t3)}
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
            t0 = now_ns()
            shm = shared_memory.SharedMemory(name)
            t1 = now_ns()
            assert shm.buf is not None
            view = np.frombuffer(shm.buf, dtype=np.uint8)
            if touch:
                _touch(view)
            t2 = now_ns()
            del view
            shm.close()
            conn.send({"attach": us_between(t0, t1), "touch": us_between(t1, t2)})
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


def share_rounds(peer: Connection, peer_pid: int, size: int, n: int, touch: bool, steps: dict[str, list[float]],
                 step: Step = quiet) -> None:
    """`n` rounds (after one warm-up round, not kept) of sharing `size` bytes with the peer, vmmshare's way then
    SharedMemory's, each step's µs appended to its list in `steps`; with `touch`, the importer reads every page and
    only the rounds' totals with it are kept."""
    from multiprocessing import shared_memory

    import vmmshare

    dev = vmmshare.Device(0)
    for i in range(n + 1):
        which = "warm-up round" if i == 0 else f"round {i} of {n}"  # round 0 warms up and is not kept
        step(f"share latency{' with first touch' if touch else ''}, {fmt_size(size)}, {which}")
        t0 = now_ns()
        mem = dev.allocate(size)
        t1 = now_ns()
        m = mem.map()
        t2 = now_ns()
        h = mem.export(pids=[peer_pid])  # the trustlist rides on the export: one round trip
        t4 = now_ns()
        peer.send(("vmm", str(h), mem.size, False, touch))
        got = peer.recv()
        m.close()
        mem.close()
        t0s = now_ns()
        shm = shared_memory.SharedMemory(create=True, size=size)
        t1s = now_ns()
        peer.send(("shm", shm.name, size, touch))
        sgot = peer.recv()
        shm.close()
        shm.unlink()
        if i == 0:
            continue  # warm-up round
        exporter = us_between(t0, t4)
        if touch:
            steps["first_touch"].append(got["touch"])
            steps["share_with_touch"].append(exporter + got["import"] + got["map"] + got["touch"])
            steps["shm_touch"].append(sgot["touch"])
            steps["shm_share_with_touch"].append(us_between(t0s, t1s) + sgot["attach"] + sgot["touch"])
            continue
        steps["allocate"].append(us_between(t0, t1))
        steps["map"].append(us_between(t1, t2))
        steps["export_trustlist"].append(us_between(t2, t4))
        steps["import"].append(got["import"])
        steps["reserve_map"].append(got["map"])
        steps["share"].append(exporter + got["import"] + got["map"])
        steps["shm_create"].append(us_between(t0s, t1s))
        steps["shm_attach"].append(sgot["attach"])
        steps["shm_share"].append(us_between(t0s, t1s) + sgot["attach"])


def share_latency(peer: Connection, peer_pid: int, sizes: list[int], reps: Callable[[int], int],
                  with_torch: bool, step: Step = quiet) -> dict[str, Any]:
    import numpy as np

    rows: dict[str, Any] = {}
    all_steps: dict[int, dict[str, list[float]]] = {size: {k: [] for k in (
        "allocate", "map", "export_trustlist", "import", "reserve_map", "first_touch",
        "share", "share_with_touch", "shm_create", "shm_attach", "shm_touch", "shm_share", "shm_share_with_touch",
        "pipe")} for size in sizes}
    # every size's latency rounds first, then the rounds that touch every page: touching 1 GiB evicts every
    # cache and leaves the kernel freeing pages, which would slow whatever round came next
    plan = [(size, False, reps(size)) for size in sizes] + [(size, True, min(reps(size), 3)) for size in sizes]
    for size, touch, n in plan:
        share_rounds(peer, peer_pid, size, n, touch, all_steps[size], step)
    for size in sizes:
        steps = all_steps[size]
        n = reps(size)
        pipe_reps = max(2, min(n, (64 * MiB * 8) // size))
        step(f"multiprocessing.Pipe, {fmt_size(size)}")
        payload = np.ones(size, dtype=np.uint8).tobytes() if size <= 256 * MiB else None
        for _ in range(pipe_reps if payload is not None else 0):
            t0 = now_ns()
            peer.send(("pipe",))
            peer.send_bytes(payload)  # type: ignore[arg-type]
            peer.recv()
            steps["pipe"].append(us_between(t0, now_ns()))
        row: dict[str, Any] = {k: stats_of(v) for k, v in steps.items() if v}
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
    p = ctx.Process(target=quiet_child, args=(_torch_child, q, back))
    start_child(p)
    out = {}
    for size in sizes:
        times = []
        for i in range(reps(size) + 1):
            t: Any = torch.ones(size, dtype=torch.uint8)
            t0 = now_ns()
            t.share_memory_()
            q.put(t)
            back.get()
            if i:
                times.append(us_between(t0, now_ns()))
            del t
        out[str(size)] = stats_of(times)
    q.put(None)
    p.join()
    return out


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


def write_json(res: dict[str, Any], path: str) -> None:
    """A benchmark's results as indented JSON at `path` (OSError if it cannot be written)."""
    with open(path, "w") as f:
        json.dump(res, f, indent=2)
