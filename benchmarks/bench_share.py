"""Cross-process share latency: exporter side (malloc + reserve + map + export + set_pid) and importer side
(import + reserve + map), against `multiprocessing.shared_memory` create and attach of the same size, in one run.

    python benchmarks/bench_share.py [--reps N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import vmmshare.acl as acl

MiB, GiB = 1 << 20, 1 << 30
PROP = {"handleType": 0, "allocationType": 0, "memAttr": 5, "location": {"id": 0, "type": 1}, "reserve": 0}


def ok(ret: int) -> None:
    if ret:
        raise SystemExit(f"call failed ({ret}): {acl.get_recent_err_msg()}")


def importer() -> None:
    """Child side: for each request line, import/attach, time it, tear down, and answer the microseconds."""
    ok(acl.rt.set_device(0))
    print(acl.rt.device_get_bare_tgid()[0], flush=True)
    for line in sys.stdin:
        kind, ident, size_s = line.split()
        size = int(size_s)
        if kind == "vmm":
            t0 = time.perf_counter_ns()
            h, ret = acl.rt.mem_import_from_shareable_handle_v2(int(ident), 1, 0)
            ptr, ret2 = acl.rt.reserve_mem_address(size, 0, 0, 0)
            ret3 = acl.rt.map_mem(ptr, size, 0, h, 0)
            dt = time.perf_counter_ns() - t0
            for r in (ret, ret2, ret3):
                ok(r)
            ok(acl.rt.unmap_mem(ptr))
            ok(acl.rt.release_mem_address(ptr))
            ok(acl.rt.free_physical(h))
        else:
            t0 = time.perf_counter_ns()
            shm = shared_memory.SharedMemory(ident)
            dt = time.perf_counter_ns() - t0
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]  # the creator owns it
            shm.close()
        print(dt / 1000, flush=True)


def run(reps: int, sizes: list[int]) -> dict[str, Any]:
    ok(acl.rt.set_device(0))
    child = subprocess.Popen([sys.executable, __file__, "--importer"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, bufsize=1)
    assert child.stdin is not None and child.stdout is not None
    pid = int(child.stdout.readline())
    out: dict[str, Any] = {}

    def ask(kind: str, ident: str, size: int) -> float:
        child.stdin.write(f"{kind} {ident} {size}\n")  # type: ignore[union-attr]
        return float(child.stdout.readline())  # type: ignore[union-attr]

    for size in sizes:
        exp_t, imp_t, shm_c, shm_a = [], [], [], []
        for i in range(reps + 2):
            t0 = time.perf_counter_ns()
            h, r1 = acl.rt.malloc_physical(size, PROP, 0)
            ptr, r2 = acl.rt.reserve_mem_address(size, 0, 0, 0)
            r3 = acl.rt.map_mem(ptr, size, 0, h, 0)
            sh, r4 = acl.rt.mem_export_to_shareable_handle_v2(h, 0, 1)
            r5 = acl.rt.mem_set_pid_to_shareable_handle_v2(sh, 1, [pid])
            dt = (time.perf_counter_ns() - t0) / 1000
            for r in (r1, r2, r3, r4, r5):
                ok(r)
            it = ask("vmm", str(sh), size)
            ok(acl.rt.unmap_mem(ptr))
            ok(acl.rt.release_mem_address(ptr))
            ok(acl.rt.free_physical(h))

            t0 = time.perf_counter_ns()
            shm = shared_memory.SharedMemory(create=True, size=size)
            sc = (time.perf_counter_ns() - t0) / 1000
            sa = ask("shm", shm.name, size)
            shm.close()
            shm.unlink()
            if i >= 2:  # the first rounds warm both paths up
                exp_t.append(dt)
                imp_t.append(it)
                shm_c.append(sc)
                shm_a.append(sa)
        med = statistics.median
        row = {
            "exporter_us": med(exp_t), "importer_us": med(imp_t),
            "shm_create_us": med(shm_c), "shm_attach_us": med(shm_a),
            "exporter_p90_us": statistics.quantiles(exp_t, n=10)[-1],
            "importer_p90_us": statistics.quantiles(imp_t, n=10)[-1],
        }
        row["share_us"] = row["exporter_us"] + row["importer_us"]
        row["shm_share_us"] = row["shm_create_us"] + row["shm_attach_us"]
        row["importer_vs_attach"] = row["importer_us"] / row["shm_attach_us"]
        row["share_vs_shm"] = row["share_us"] / row["shm_share_us"]
        out[f"{size >> 20}MiB"] = row
    child.stdin.close()
    child.wait()
    keys = list(out)
    out["share_1GiB_vs_2MiB"] = out[keys[-1]]["share_us"] / out[keys[0]]["share_us"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--json")
    ap.add_argument("--importer", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.importer:
        importer()
        return
    res = run(args.reps, [2 * MiB, GiB])
    for name, row in res.items():
        if isinstance(row, dict):
            print(f"{name:>8}: " + "  ".join(f"{k}={v:.2f}" for k, v in row.items()))
    print(f"share 1 GiB / 2 MiB = {res['share_1GiB_vs_2MiB']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
