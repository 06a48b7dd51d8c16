"""vmmshare bench: sharing costs against the anchors, in one run on the auto-started default broker.

Measured side by side (medians over repetitions, with the 10th–90th percentile spread):
- share latency by step — allocate, map, export, trustlist | import, reserve+map, first touch — against
  `multiprocessing.shared_memory` (create | attach), sending the bytes through `multiprocessing.Pipe`, and
  `torch.Tensor.share_memory_()` passed through a queue (when torch is installed);
- the floor: a raw request/reply with an fd between two Python processes (and the mmap of it), and each
  importer step's ratio to it;
- broker throughput: import+free round trips per second with 1, 4 and 16 client processes, the CPU time each
  round trip costs the clients and the broker, and the broker's CPU use when idle;
- steady-state read bandwidth of an imported mapping against a private buffer of the same size;
- first-touch bandwidth on import, with and without pre-populating the mapping.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
from typing import Any

from .bench_broker import floor, idle_cpu, throughput
from .bench_measures import (
    GiB,
    KiB,
    MiB,
    Step,
    bandwidth,
    fmt_size,
    peer_main,
    quiet,
    share_latency,
)
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
    memory_problem,
    plain,
    quiet_child,
    run_main,
    say_error,
    seconds_option,
    sizes_option,
    start_child,
)

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
    s256s, c256 = med(256 * MiB, "share"), med(256 * MiB, "shm_share")
    if s256s and c256:
        t["share_256MiB_vs_shm"] = {"value": s256s / c256, "target": "<= 1.0"}
    if i2 is not None and a2:
        rm = med(2 * MiB, "reserve_map") or 0.0
        t["importer_2MiB_vs_attach"] = {"value": (i2 + rm) / a2, "target": "<= 1.5"}
    s1g = med(GiB, "share")
    if s1g and s2:
        t["share_1GiB_vs_2MiB"] = {"value": s1g / s2, "target": "<= 1.2"}
    s256, p256 = med(256 * MiB, "share"), med(256 * MiB, "pipe")
    if s256 and p256:
        t["pipe_256MiB_vs_share"] = {"value": p256 / s256, "target": ">= 1000"}
    if "bandwidth" in res:
        t["read_bw_imported_vs_private"] = {"value": res["bandwidth"]["read_ratio"], "target": ">= 0.95"}
    if "throughput" in res and "16" in res["throughput"]:
        t["broker_16_clients_ops"] = {"value": res["throughput"]["16"]["ops_per_s"], "target": ">= 20000"}
    for v in t.values():
        tgt = v["target"]
        bound = float(tgt.split()[1])
        v["met"] = v["value"] <= bound if tgt.startswith("<=") else v["value"] >= bound
    return t


def floor_ratios(res: dict[str, Any]) -> dict[str, float]:
    """Each importer step at 2 MiB against the floor: what the round trip and the mapping cost beyond it."""
    row = res["latency"].get(str(2 * MiB))
    f = res["floor"]
    rtt, rtt_map = f["fd_round_trip"]["median"], f["fd_round_trip_mmap"]["median"]
    if not row or "import" not in row or not rtt:
        return {}
    imp, rm = row["import"]["median"], row["reserve_map"]["median"]
    return {"import (request, reply with fd)": imp / rtt, "import + reserve + map": (imp + rm) / rtt_map,
            "SharedMemory attach": row["shm_attach"]["median"] / rtt_map}


def print_report(res: dict[str, Any], out: Any = sys.stdout) -> None:
    cols = ("allocate", "map", "export_trustlist", "import", "reserve_map", "share", "shm_create", "shm_attach",
            "shm_share", "pipe", "torch_share", "first_touch", "shm_touch")
    print("share latency, µs (median):", file=out)
    print("size    " + " ".join(f"{c:>16}" for c in cols), file=out)
    for row in res["latency"].values():
        cells = [f"{row[c]['median']:16.1f}" if c in row else f"{'-':>16}" for c in cols]
        print(f"{fmt_size(row['size']):8}" + " ".join(cells), file=out)
    print("spread, p10–p90 µs:", file=out)
    for row in res["latency"].values():
        spread = "  ".join(f"{c} {row[c]['p10']:.0f}–{row[c]['p90']:.0f}" for c in ("share", "shm_share", "import",
                                                                                 "shm_attach", "pipe") if c in row)
        print(f"  {fmt_size(row['size']):8}{spread}", file=out)
    if "floor" in res:
        f = res["floor"]
        print(f"the floor (raw fd round trip between two Python processes, receiver polling): "
              f"{f['fd_round_trip']['median']:.1f} µs, with the mmap of the fd {f['fd_round_trip_mmap']['median']:.1f}"
              " µs", file=out)
        for name, v in res.get("floor_ratios", {}).items():
            print(f"  {name:40} {v:6.2f}x the floor", file=out)
    if "throughput" in res:
        print("broker import+free round trips/s: " + ", ".join(
            f"{n} client(s): {v['ops_per_s']:,.0f}" for n, v in res["throughput"].items()), file=out)
        print("CPU per round trip, µs (clients | broker): " + ", ".join(
            f"{n}: {v['client_cpu_us']:.0f} | {v['broker_cpu_us']:.0f}" for n, v in res["throughput"].items()),
              file=out)
    if "idle_cpu" in res:
        print(f"broker CPU while idle: {res['idle_cpu'] * 100:.2f}% of a core", file=out)
    if "bandwidth" in res:
        b = res["bandwidth"]
        print(f"read bandwidth {fmt_size(b['size'])}: imported {b['read_GBps']['imported']:.2f} GB/s, private "
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
    ax1.set_xticklabels([fmt_size(s) for s in sizes], rotation=45)
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    if "throughput" in res:
        tp = res["throughput"]
        ax2.plot([int(k) for k in tp], [v["ops_per_s"] for v in tp.values()], marker="o",
                 label="import+free round trips/s")
        ax2.axhline(20000, color="gray", linestyle="--", label="target 20,000/s")
        ax2.set_xlabel("client processes")
        ax2.set_ylabel("round trips / s")
        ax2.set_title("broker throughput")
        ax2.grid(True, alpha=0.3)
        ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


PEAK_COPIES = 3  # the most copies of one size a run holds at once (Pipe: sender and receiver, plus a shared one)


def default_sizes(quick: bool) -> list[int]:
    """The sizes shared when --sizes is not given."""
    return [4 * KiB, 2 * MiB, 64 * MiB, 256 * MiB] if quick else [
        4 * KiB, 64 * KiB, 2 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, GiB]


def run(
    quick: bool, with_torch: bool | None = None, sizes: list[int] | None = None, reps_override: int | None = None,
    clients: list[int] | None = None, seconds: float | None = None, step: Step = quiet,
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
        sizes = default_sizes(quick)
    clients = clients or [1, 4, 16]
    seconds = seconds or (1.0 if quick else 3.0)
    bw_size = min(max(sizes), 64 * MiB if quick else 256 * MiB)
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    step("starting the peer process")
    peer = ctx.Process(target=quiet_child, args=(peer_main, b))
    start_child(peer)
    b.close()  # the peer's end lives in the peer: if it dies, recv() here sees the pipe close instead of waiting
    res: dict[str, Any] = {"quick": quick, "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
    try:  # from its first answer on: a Ctrl-C while the peer still starts is told to it as "stop" too
        peer_pid = a.recv()
        res["latency"] = share_latency(a, peer_pid, sizes, reps, with_torch, step)
        res["bandwidth"] = bandwidth(a, peer_pid, bw_size, reps_override or 5, step)
    finally:
        with contextlib.suppress(OSError):  # a peer that died has closed its end
            a.send(("stop",))
        peer.join()
    res["floor"] = floor(reps_override or (300 if quick else 3000), step)
    res["floor_ratios"] = floor_ratios(res)
    res["throughput"] = throughput(clients, seconds, step)
    step("the broker's CPU while idle")
    res["idle_cpu"] = idle_cpu(1.0 if quick else 2.0)
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
    largest = max(args.sizes or default_sizes(args.quick))
    problem = memory_problem(PEAK_COPIES * largest, f"sharing {fmt_size(largest)} ({PEAK_COPIES} copies at once: "
                             "the sender's, a Pipe's receiver's, and the shared one)")
    if problem:
        say_error("vmmshare bench", problem)
        return USAGE
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
    sys.exit(run_main(lambda: main()))
