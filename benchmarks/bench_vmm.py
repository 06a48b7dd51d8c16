"""Single-process VMM costs: the allocate/reserve/map/unmap/free cycle, and first-touch bandwidth of a fresh
mapping with normal and huge-page attributes against a plain anonymous mmap of the same size, in one run.

    python benchmarks/bench_vmm.py [--reps N] [--json FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import statistics
import time
from typing import Any

import vmmshare.acl as acl
from vmmshare._process import runtime

MiB, GiB = 1 << 20, 1 << 30


def prop(attr: int) -> dict[str, Any]:
    return {"handleType": 0, "allocationType": 0, "memAttr": attr, "location": {"id": 0, "type": 1}, "reserve": 0}


def ok(ret: int) -> None:
    if ret:
        raise SystemExit(f"call failed ({ret}): {acl.get_recent_err_msg()}")


def cycle(size: int, reps: int) -> dict[str, float]:
    """Median microseconds of each step of malloc_physical + reserve + map_mem + unmap + release + free."""
    steps: dict[str, list[float]] = {k: [] for k in ("malloc", "reserve", "map", "unmap", "release", "free", "total")}
    p = prop(acl.ACL_HBM_MEM_NORMAL)
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        h, ret = acl.rt.malloc_physical(size, p, 0)
        t1 = time.perf_counter_ns()
        ptr, ret2 = acl.rt.reserve_mem_address(size, 0, 0, 0)
        t2 = time.perf_counter_ns()
        ret3 = acl.rt.map_mem(ptr, size, 0, h, 0)
        t3 = time.perf_counter_ns()
        ret4 = acl.rt.unmap_mem(ptr)
        t4 = time.perf_counter_ns()
        ret5 = acl.rt.release_mem_address(ptr)
        t5 = time.perf_counter_ns()
        ret6 = acl.rt.free_physical(h)
        t6 = time.perf_counter_ns()
        for r in (ret, ret2, ret3, ret4, ret5, ret6):
            ok(r)
        for k, a, b in (("malloc", t0, t1), ("reserve", t1, t2), ("map", t2, t3), ("unmap", t3, t4),
                        ("release", t4, t5), ("free", t5, t6), ("total", t0, t6)):
            steps[k].append((b - a) / 1000)
    return {k: statistics.median(v) for k, v in steps.items()}


def touch_vmm(size: int, attr: int) -> tuple[float, str]:
    """GB/s of the first write to every byte of a fresh mapping, and how its pages were backed."""
    h, ret = acl.rt.malloc_physical(size, prop(attr), 0)
    ok(ret)
    ptr, ret = acl.rt.reserve_mem_address(size, 0, 0, 0)
    ok(ret)
    ok(acl.rt.map_mem(ptr, size, 0, h, 0))
    pages = runtime().memory.allocation(h).mem.pages
    t0 = time.perf_counter()
    ctypes.memset(ptr, 1, size)
    dt = time.perf_counter() - t0
    ok(acl.rt.unmap_mem(ptr))
    ok(acl.rt.release_mem_address(ptr))
    ok(acl.rt.free_physical(h))
    return size / dt / 1e9, pages


def touch_mmap(size: int) -> float:
    m = mmap.mmap(-1, size)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    t0 = time.perf_counter()
    ctypes.memset(addr, 1, size)
    dt = time.perf_counter() - t0
    del addr
    m.close()
    return size / dt / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--touch-reps", type=int, default=3)
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args()
    ok(acl.rt.set_device(0))
    cycle(2 * MiB, 5)  # warm up (the first call may start the broker)
    results: dict[str, Any] = {
        "cycle_2MiB_us": cycle(2 * MiB, args.reps),
        "cycle_1GiB_us": cycle(GiB, max(5, args.reps // 10)),
    }
    normal, huge, plain, kinds = [], [], [], set()
    for _ in range(args.touch_reps):
        plain.append(touch_mmap(GiB))
        bw, _ = touch_vmm(GiB, acl.ACL_HBM_MEM_NORMAL)
        normal.append(bw)
        bw, kind_huge = touch_vmm(GiB, acl.ACL_HBM_MEM_HUGE)
        huge.append(bw)
        kinds.add(kind_huge)
    results["first_touch_1GiB_GBps"] = {
        "plain_mmap": statistics.median(plain),
        "vmm_normal": statistics.median(normal),
        "vmm_huge": statistics.median(huge),
        "vmm_huge_pages_used": sorted(kinds),
    }
    ft = results["first_touch_1GiB_GBps"]
    ft["ratio_normal_vs_mmap"] = ft["vmm_normal"] / ft["plain_mmap"]
    ft["ratio_huge_vs_mmap"] = ft["vmm_huge"] / ft["plain_mmap"]
    for name in ("cycle_2MiB_us", "cycle_1GiB_us"):
        row = results[name]
        print(f"{name:16s} " + "  ".join(f"{k}={v:8.1f}" for k, v in row.items()))
    print("first touch 1 GiB (GB/s): " + "  ".join(
        f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in ft.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
