"""vmmshare bench: sharing costs against the anchors, in one run on the auto-started default broker.

Measured side by side (medians over repetitions, with the 10th–90th percentile spread):
- share latency by step — allocate, map, export, trustlist | import, reserve+map, first touch — against
  `multiprocessing.shared_memory` (create | attach), sending the bytes through `multiprocessing.Pipe`, and
  `torch.Tensor.share_memory_()` passed through a queue (when torch is installed);
- broker throughput: import+free round trips per second with 1, 4 and 16 client processes;
- steady-state read bandwidth of an imported mapping against a private buffer of the same size;
- first-touch bandwidth on import, with and without pre-populating the mapping.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from .console import (
    FAILED,
    OK,
    USAGE,
    Parser,
    Progress,
    check_outputs,
    count_option,
    counts_option,
    environment_ok,
    plain,
    run_main,
    say_error,
    seconds_option,
    sizes_option,
)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PAGE = 4096
Step = Callable[[str], None]  # told what the run measures now (a progress line on a terminal)


def _quiet(_: str) -> None:
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


def _peer(conn: Connection) -> None:
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
                  with_torch: bool, step: Step = _quiet) -> dict[str, Any]:
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
            step(f"share latency{' with first touch' if touch else ''}, {_fmt_size(size)}, round {i + 1} of {n + 1}")
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
        step(f"multiprocessing.Pipe, {_fmt_size(size)}")
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
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        handle, ret = rt.mem_import_from_shareable_handle_v2(value, 1, 0)
        if ret or rt.free_physical(handle):
            raise SystemExit(f"import+free failed: {vmmshare.acl.get_recent_err_msg()}")
        n += 1
    conn.send(n)


def throughput(clients: list[int], seconds: float, step: Step = _quiet) -> dict[str, float]:
    import vmmshare

    ctx = mp.get_context("spawn")
    mem = vmmshare.Device(0).allocate(2 * MiB)
    h = mem.export(validate_pids=False)
    out = {}
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
        t0 = time.perf_counter()
        start.set()
        total = sum(a.recv() for a in pipes)
        elapsed = max(time.perf_counter() - t0, seconds)
        for p in procs:
            p.join()
        out[str(n)] = total / elapsed
    mem.close()
    return out


# ---------------------------------------------------------------- bandwidth


def bandwidth(peer: Connection, peer_pid: int, size: int, reps: int, step: Step = _quiet) -> dict[str, Any]:
    import vmmshare

    step(f"read bandwidth and first touch, {_fmt_size(size)}")
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


# ---------------------------------------------------------------- report


def targets(res: dict[str, Any]) -> dict[str, Any]:
    lat = res["latency"]
    t: dict[str, Any] = {}

    def med(size: int, key: str) -> float | None:
        row = lat.get(str(size))
        return row[key]["median"] if row and key in row else None

    s2, c2, a2 = med(2 * MiB, "share"), med(2 * MiB, "shm_share"), med(2 * MiB, "shm_attach")
    i2 = med(2 * MiB, "import")
    if s2 and c2:
        t["share_2MiB_vs_shm"] = {"value": s2 / c2, "target": "<= 1.0"}
    if i2 is not None and a2:
        rm = med(2 * MiB, "reserve_map") or 0.0
        t["importer_2MiB_vs_attach"] = {"value": (i2 + rm) / a2, "target": "<= 1.2"}
    s1g = med(GiB, "share")
    if s1g and s2:
        t["share_1GiB_vs_2MiB"] = {"value": s1g / s2, "target": "<= 1.2"}
    s256, p256 = med(256 * MiB, "share"), med(256 * MiB, "pipe")
    if s256 and p256:
        t["pipe_256MiB_vs_share"] = {"value": p256 / s256, "target": ">= 1000"}
    if "bandwidth" in res:
        t["read_bw_imported_vs_private"] = {"value": res["bandwidth"]["read_ratio"], "target": ">= 0.95"}
    if "throughput" in res and "16" in res["throughput"]:
        t["broker_16_clients_ops"] = {"value": res["throughput"]["16"], "target": ">= 20000"}
    for v in t.values():
        tgt = v["target"]
        bound = float(tgt.split()[1])
        v["met"] = v["value"] <= bound if tgt.startswith("<=") else v["value"] >= bound
    return t


def _fmt_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def print_report(res: dict[str, Any], out: Any = sys.stdout) -> None:
    cols = ("allocate", "map", "export_trustlist", "import", "reserve_map", "share", "shm_create", "shm_attach",
            "shm_share", "pipe", "torch_share", "first_touch", "shm_touch")
    print("share latency, µs (median):", file=out)
    print("size    " + " ".join(f"{c:>16}" for c in cols), file=out)
    for row in res["latency"].values():
        cells = [f"{row[c]['median']:16.1f}" if c in row else f"{'-':>16}" for c in cols]
        print(f"{_fmt_size(row['size']):8}" + " ".join(cells), file=out)
    print("spread, p10–p90 µs:", file=out)
    for row in res["latency"].values():
        spread = "  ".join(f"{c} {row[c]['p10']:.0f}–{row[c]['p90']:.0f}" for c in ("share", "shm_share", "import",
                                                                                 "shm_attach", "pipe") if c in row)
        print(f"  {_fmt_size(row['size']):8}{spread}", file=out)
    if "throughput" in res:
        print("broker import+free round trips/s: " + ", ".join(
            f"{n} client(s): {v:,.0f}" for n, v in res["throughput"].items()), file=out)
    if "bandwidth" in res:
        b = res["bandwidth"]
        print(f"read bandwidth {_fmt_size(b['size'])}: imported {b['read_GBps']['imported']:.2f} GB/s, private "
              f"{b['read_GBps']['private']:.2f} GB/s (ratio {b['read_ratio']:.3f})", file=out)
        for k, v in b["first_touch"].items():
            print(f"first touch on import ({k}): map {v['map']:.0f} µs + touch {v['touch']:.0f} µs "
                  f"= {v['first_touch_GBps']:.2f} GB/s", file=out)
    print("targets:", file=out)
    for name, v in res["targets"].items():
        print(f"  {name:32} {v['value']:12.3f}  target {v['target']:8}  {'met' if v['met'] else 'MISSED'}", file=out)


def plot(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    rows = list(res["latency"].values())
    sizes = [r["size"] for r in rows]
    for key, label in (("share", "vmmshare share (export+import+map)"), ("share_with_touch", "vmmshare + first touch"),
                       ("shm_share", "SharedMemory create+attach"), ("pipe", "multiprocessing.Pipe"),
                       ("torch_share", "torch share_memory_() + queue")):
        pts = [(r["size"], r[key]["median"]) for r in rows if key in r]
        if pts:
            ax1.loglog([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax1.set_xlabel("bytes shared")
    ax1.set_ylabel("µs (median)")
    ax1.set_title("share latency vs size")
    ax1.set_xticks(sizes)
    ax1.set_xticklabels([_fmt_size(s) for s in sizes], rotation=45)
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    if "throughput" in res:
        tp = res["throughput"]
        ax2.plot([int(k) for k in tp], list(tp.values()), marker="o", label="import+free round trips/s")
        ax2.axhline(20000, color="gray", linestyle="--", label="target 20,000/s")
        ax2.set_xlabel("client processes")
        ax2.set_ylabel("round trips / s")
        ax2.set_title("broker throughput")
        ax2.grid(True, alpha=0.3)
        ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(
    quick: bool, with_torch: bool | None = None, sizes: list[int] | None = None, reps_override: int | None = None,
    clients: list[int] | None = None, seconds: float | None = None, step: Step = _quiet,
) -> dict[str, Any]:
    import vmmshare

    vmmshare.acl.rt.set_device(0)
    if with_torch is None:
        try:
            import torch  # noqa: F401

            with_torch = True
        except ImportError:
            with_torch = False
    def reps(size: int) -> int:
        if reps_override:
            return reps_override
        if quick:
            return 10 if size <= 64 * MiB else 3
        return 50 if size <= 16 * MiB else (15 if size <= 256 * MiB else 7)

    if sizes is None:
        sizes = [4 * KiB, 2 * MiB, 64 * MiB, 256 * MiB] if quick else [
            4 * KiB, 64 * KiB, 2 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, GiB]
    clients = clients or [1, 4, 16]
    seconds = seconds or (1.0 if quick else 3.0)
    bw_size = min(max(sizes), 64 * MiB if quick else 256 * MiB)
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    step("starting the peer process")
    peer = ctx.Process(target=_peer, args=(b,))
    peer.start()
    b.close()  # the peer's end lives in the peer: if it dies, recv() here sees the pipe close instead of waiting
    peer_pid = a.recv()
    res: dict[str, Any] = {"quick": quick, "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
    try:
        res["latency"] = share_latency(a, peer_pid, sizes, reps, with_torch, step)
        res["bandwidth"] = bandwidth(a, peer_pid, bw_size, reps_override or 5, step)
    finally:
        with contextlib.suppress(OSError):  # a peer that died has closed its end
            a.send(("stop",))
        peer.join()
    res["throughput"] = throughput(clients, seconds, step)
    res["targets"] = targets(res)
    return res


def _gpu_backend() -> bool:
    """Whether this process's device memory would be GPU memory (VMMSHARE_BACKEND=cuda, or auto with a GPU)."""
    backend = os.environ.get("VMMSHARE_BACKEND", "").strip().lower()
    if backend == "auto":
        from .backends.cuda import available

        return available()
    return backend == "cuda"


def write_json(res: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(res, f, indent=2)


def main(argv: list[str] | None = None) -> int:
    """`vmmshare bench`: a closed stdout or Ctrl-C ends it without a traceback."""
    return run_main(lambda: _main(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> int:
    if "--fabric" in argv:  # copies across servers, in a test cluster made for the run (see --fabric --help)
        from . import bench_fabric

        return bench_fabric.main([a for a in argv if a != "--fabric"])
    if "--gpu" in argv or _gpu_backend():
        from . import bench_gpu  # device memory is GPU memory: the CPU-side measurements below do not apply

        return bench_gpu.main([a for a in argv if a != "--gpu"])
    ap = Parser(prog="vmmshare bench", description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="Needs numpy (pip install 'vmmshare[bench]'); --plot needs matplotlib. Exit status: 0 done, "
                       "1 a measurement failed, 2 bad usage or configuration.")
    ap.add_argument("--gpu", action="store_true",
                    help="GPU memory with the CUDA backend instead, against torch CUDA IPC (see --gpu --help); "
                         "the default when VMMSHARE_BACKEND gives GPU memory (cuda, or auto with a GPU)")
    ap.add_argument("--fabric", action="store_true",
                    help="copies across servers (two network namespaces) against the transfer engine and a TCP "
                         "socket (see --fabric --help; needs root and vmmshare[fabric])")
    ap.add_argument("--quick", action="store_true", help="CI-sized: fewer sizes and repetitions")
    ap.add_argument("--json", help="write the results to this file")
    ap.add_argument("--plot", help="write a PNG: latency vs size (log-log) and throughput vs clients")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch comparison even if torch is installed")
    ap.add_argument("--sizes", type=sizes_option, help="comma-separated sizes to share, e.g. 4K,2M,1G")
    ap.add_argument("--reps", type=count_option, help="repetitions per size (default: by size)")
    ap.add_argument("--clients", type=counts_option,
                    help="comma-separated client counts for the throughput test (default 1,4,16)")
    ap.add_argument("--seconds", type=seconds_option, help="seconds per throughput point")
    args = ap.parse_args(argv)
    if not environment_ok("vmmshare bench"):
        return USAGE
    check_outputs(ap, json=args.json, plot=args.plot)
    try:
        import numpy  # noqa: F401  (the measuring processes use it)
    except ImportError:
        say_error("vmmshare bench", "needs numpy, which is not installed: pip install 'vmmshare[bench]'")
        return USAGE
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("--plot needs matplotlib, which is not installed: pip install 'vmmshare[bench]'")
    from .errors import AclError

    try:
        with Progress("vmmshare bench") as progress:
            res = run(args.quick, False if args.no_torch else None, args.sizes, args.reps, args.clients,
                      args.seconds, progress.step)
    except AclError as exc:
        say_error("vmmshare bench", f"failed: {exc}")
        return FAILED
    except (EOFError, OSError):  # the pipe to a measuring process: it died
        say_error("vmmshare bench", "failed: a measuring process exited early (its error is above)")
        return FAILED
    try:  # the files first: a reader that stops early (| head) must not cost them
        if args.json:
            write_json(res, args.json)
        if args.plot:
            plot(res, args.plot)
    except OSError as exc:
        say_error("vmmshare bench", f"cannot write {exc.filename}: {exc.strerror}")
        return FAILED
    print_report(res)
    return OK


if __name__ == "__main__":
    sys.exit(main())
