"""vmmshare bench --gpu: GPU sharing costs with the CUDA backend, against torch CUDA IPC, in one run.

- create (malloc_physical + reserve + map), export (+ trustlist) and import (+ reserve + map), µs medians;
- round trip: export, hand the handle to another process, which imports, maps and reads a byte, and answers
  — against a fresh torch CUDA tensor sent through a torch.multiprocessing queue and read in the child;
- bandwidth of a device-to-device copy into an imported mapping against one into a local allocation.

The bandwidth is measured at the largest size. Without torch on a GPU the torch anchor is left out (null).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from .. import acl
from .._process import runtime
from .bench_measures import write_json
from .console import (
    FAILED,
    OK,
    USAGE,
    Parser,
    Progress,
    check_outputs,
    count_option,
    environment_ok,
    plain,
    run_main,
    say_error,
    sizes_option,
)

MiB, GiB = 1 << 20, 1 << 30
PROP = {"handleType": 0, "allocationType": 0, "memAttr": 5, "location": {"id": 0, "type": 1}, "reserve": 0}
med = statistics.median


def ok(ret: int) -> None:
    if ret:
        raise SystemExit(f"vmmshare bench --gpu: failed ({ret}): {acl.get_recent_err_msg()}")


def us(t0: int) -> float:
    return (time.perf_counter_ns() - t0) / 1000


def create(size: int) -> tuple[int, int]:
    h, r1 = acl.rt.malloc_physical(size, PROP, 0)
    ok(r1)
    ptr, r2 = acl.rt.reserve_mem_address(size, 0, 0, 0)
    ok(r2)
    ok(acl.rt.map_mem(ptr, size, 0, h, 0))
    return h, ptr


def destroy(h: int, ptr: int) -> None:
    ok(acl.rt.unmap_mem(ptr))
    ok(acl.rt.release_mem_address(ptr))
    ok(acl.rt.free_physical(h))


def sync() -> None:
    gpu = runtime().gpu
    assert gpu is not None
    gpu.check(gpu.cu.cuCtxSynchronize()[0], "cuCtxSynchronize")


def copy_bandwidth(dst: int, src: int, size: int, reps: int = 5) -> float:
    """GB/s of cuMemcpy device-to-device, counting the bytes read and written."""
    gpu = runtime().gpu
    assert gpu is not None
    gpu.copy(dst, src, size, 0)
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        gpu.copy(dst, src, size, 0)
        sync()
        times.append(time.perf_counter() - t0)
    return 2 * size / med(times) / 1e9


def importer() -> None:
    ok(acl.rt.set_device(0))
    print(acl.rt.device_get_bare_tgid()[0], flush=True)
    host, ret = acl.rt.malloc_host(1)
    ok(ret)
    for line in sys.stdin:
        cmd, shareable, size_s = line.split()
        size = int(size_s)
        t0 = time.perf_counter_ns()
        h, ret = acl.rt.mem_import_from_shareable_handle_v2(int(shareable), 1, 0)
        ok(ret)
        ptr, ret = acl.rt.reserve_mem_address(size, 0, 0, 0)
        ok(ret)
        ok(acl.rt.map_mem(ptr, size, 0, h, 0))
        t_import = us(t0)
        ok(acl.rt.memcpy(host, 1, ptr, 1, 2))  # read a byte back
        out: dict[str, Any] = {"import_us": t_import}
        if cmd == "bw":
            src_h, src = create(size)
            loc_h, loc = create(size)
            out["bw_imported_GBps"] = copy_bandwidth(ptr, src, size)
            out["bw_local_GBps"] = copy_bandwidth(loc, src, size)
            destroy(src_h, src)
            destroy(loc_h, loc)
        destroy(h, ptr)
        print(json.dumps(out), flush=True)


def torch_ipc(size: int, reps: int) -> float:
    """Median µs: put a fresh CUDA tensor in a torch.multiprocessing queue, the child reads it and answers."""
    code = f"from vmmshare.cli.bench_gpu import torch_parent\nprint(torch_parent({size}, {reps}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise SystemExit(out.stderr)
    return float(out.stdout.strip().splitlines()[-1])


def torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def torch_child(q: Any, back: Any) -> None:
    while True:
        t = q.get()
        if t is None:
            return
        back.put(float(t[0].item()))
        del t


def torch_parent(size: int, reps: int) -> float:
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=torch_child, args=(q, back))
    p.start()
    times = []
    for i in range(reps + 2):
        t = torch.ones(size // 4, dtype=torch.float32, device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        q.put(t)
        back.get()
        if i >= 2:
            times.append(us(t0))
        del t
    q.put(None)
    p.join()
    return med(times)


def run(sizes: list[int], reps: int | None = None, progress: Progress | None = None) -> dict[str, Any]:
    """Measure every size (in this process and an importer child); the bandwidth at the largest. Each size's row
    is printed as soon as it is measured; `progress` shows the step in between."""
    step = progress.step if progress is not None else (lambda _: None)
    show = progress.print if progress is not None else print
    with_torch = torch_cuda()
    ok(acl.rt.set_device(0))
    child = subprocess.Popen([sys.executable, "-m", "vmmshare.cli.bench_gpu", "--importer"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, bufsize=1)
    assert child.stdin is not None and child.stdout is not None
    pid = int(child.stdout.readline())
    results: dict[str, Any] = {}
    for size in sizes:
        n = reps or (30 if size < GiB else 10)
        rows: dict[str, list[float]] = {"create_us": [], "export_us": [], "import_us": [], "round_trip_us": []}
        bw: dict[str, Any] = {}
        for i in range(n + 2):
            step(f"{size >> 20} MiB, " + (f"warm-up round {i + 1} of 2" if i < 2 else f"round {i - 1} of {n}"))
            t0 = time.perf_counter_ns()
            h, ptr = create(size)
            t_create = us(t0)
            t0 = time.perf_counter_ns()
            sh, ret = acl.rt.mem_export_to_shareable_handle_v2(h, 0, 1)
            ok(ret)
            ok(acl.rt.mem_set_pid_to_shareable_handle_v2(sh, 1, [pid]))
            t_export = us(t0)
            cmd = "bw" if size == max(sizes) and i == n + 1 else "go"
            child.stdin.write(f"{cmd} {sh} {size}\n")
            reply = json.loads(child.stdout.readline())
            t_round = us(t0)
            if i >= 2:
                rows["create_us"].append(t_create)
                rows["export_us"].append(t_export)
                rows["import_us"].append(reply["import_us"])
                if cmd == "go":
                    rows["round_trip_us"].append(t_round)
            if cmd == "bw":
                bw = reply
            destroy(h, ptr)
        row: dict[str, Any] = {k: med(v) for k, v in rows.items() if v}
        if with_torch:
            step(f"{size >> 20} MiB, torch CUDA IPC")
        row["torch_ipc_round_trip_us"] = torch_ipc(size, n) if with_torch else None
        row["round_trip_vs_torch"] = row["round_trip_us"] / row["torch_ipc_round_trip_us"] if with_torch else None
        if bw:
            row["d2d_into_imported_GBps"] = bw["bw_imported_GBps"]
            row["d2d_into_local_GBps"] = bw["bw_local_GBps"]
            row["d2d_ratio"] = bw["bw_imported_GBps"] / bw["bw_local_GBps"]
        results[f"{size >> 20}MiB"] = row
        shown = "  ".join(f"{k}={'n/a' if v is None else f'{v:.1f}' if v > 10 else f'{v:.3f}'}" for k, v in row.items())
        show(f"{size >> 20:>5} MiB: {shown}")
    child.stdin.close()
    child.wait()
    return results


def main(argv: list[str] | None = None) -> int:
    """`vmmshare bench --gpu`: a closed stdout or Ctrl-C ends it without a traceback."""
    return run_main(lambda: _main(sys.argv[1:] if argv is None else argv), "vmmshare bench")


def _main(argv: list[str]) -> int:
    ap = Parser(prog="vmmshare bench --gpu", description=plain(__doc__),
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results to this file")
    ap.add_argument("--quick", action="store_true", help="CI-sized: 2 MiB and 64 MiB, 5 repetitions")
    ap.add_argument("--sizes", type=sizes_option, default=[2 * MiB, GiB],
                    help="comma-separated sizes, multiples of 2 MiB (default 2M,1G)")
    ap.add_argument("--reps", type=count_option, help="repetitions per size (default 30 below 1 GiB, else 10)")
    ap.add_argument("--importer", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ["VMMSHARE_BACKEND"] = "cuda"  # this process and its children: device memory is GPU memory
    if args.importer:
        importer()
        return OK
    if not environment_ok("vmmshare bench --gpu"):
        return USAGE
    check_outputs(ap, json=args.json)
    sizes = [2 * MiB, 64 * MiB] if args.quick else args.sizes
    with Progress("vmmshare bench --gpu") as progress:
        results = run(sizes, args.reps or (5 if args.quick else None), progress)
    if args.json:
        try:
            write_json(results, args.json)
        except OSError as exc:
            say_error("vmmshare bench --gpu", f"cannot write {exc.filename}: {exc.strerror}")
            return FAILED
    return OK


if __name__ == "__main__":
    from .console import run_main

    sys.exit(run_main(lambda: main()))
