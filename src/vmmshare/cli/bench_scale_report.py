"""The report of `vmmshare bench --fabric --servers N`: its table, per-N lines and target lines, and the plot of
import latency against N (the run itself is bench_scale.py)."""

from __future__ import annotations

import os
from typing import Any

PHASES = ("all_at_once", "paced")  # in the order they run: the first makes every link the paced one finds live


TARGET_NAMES = {
    "later_median_paced_vs_lone": "later import median, paced / lone importer's",
    "later_p99_paced_ms": "later import p99, paced, ms",
    "first_import_ms": "first import of a fresh process (the lone one), ms",
    "idle_brokers_cores": "idle CPU of all brokers, cores",
    "killed_broker_slowest_copy_s": "killed broker: slowest failed copy from it, s",
}


def print_scale(results: list[dict[str, Any]]) -> None:
    cores = os.cpu_count() or 1
    print("all-to-all FABRIC imports of 4 MiB (every server imports, maps and byte-checks every other's), servers "
          f"as network namespaces of this machine ({cores} cores): import + reserve + map, ms")
    print(f"  {'N':>3s} {'phase':27s} {'verified':>11s}  {'later med':>9s} {'p99':>7s} {'max':>7s}  "
          f"{'first med':>9s} {'max':>7s}  {'CPU/import':>10s}")
    for r in results:
        for key in PHASES:
            ph = r[key]
            la, fi = ph["later_ms"], ph["first_ms"]
            label = (f"all at once ({r['servers']} importing)" if key == "all_at_once"
                     else f"paced ({ph['at_once']} at a time)")
            first = f"{fi['median']:9.2f} {fi['max']:7.2f}" if fi else f"{'-':>9s} {'-':>7s}"
            print(f"  {r['servers'] if key == PHASES[0] else '':>3} {label:27s} "
                  f"{ph['verified']:>5d}/{r['imports']:<5d}  {la['median']:9.2f} {la['p99']:7.2f} {la['max']:7.2f}  "
                  f"{first}  {sum(ph['cpu_per_import_ms'].values()):10.3f}")
        lo = r["lone_ms"]
        print(f"      lone importer: median {lo['median']:.2f}, a fresh process's first {lo['first']:.2f}; "
              f"{r['memory_per_server_mib']:.1f} MiB per server; idle, all brokers: "
              f"{r['idle_brokers_cores']:.4f} cores")
        for key in PHASES:
            ph = r[key]
            cpu = ph["cpu_per_import_ms"]
            total = sum(cpu.values())
            print(f"      CPU per import, {key.replace('_', ' ')}, ms: {total:.3f} ("
                  + ", ".join(f"{k} {v:.3f}" for k, v in cpu.items())
                  + f"): {ph['at_once']} importing at once need {ph['at_once'] * total:.1f} ms of CPU a round, "
                  f"{ph['at_once'] * total / cores:.1f} ms on {cores} cores")
        lone_cpu = r.get("lone_cpu_per_cycle_ms", {})
        if lone_cpu:
            print("      lone importer, CPU per import + map + free, ms: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in lone_cpu.items()))
        parts = r.get("idle_cores_by_part", {})
        if parts:
            print("      idle, cores: " + ", ".join(f"{k} {v:.4f}" for k, v in parts.items()))
        for f in [f for key in PHASES for f in r[key]["failed"]][:5]:
            print(f"      failed: {f}")
        k = r.get("killed")
        if k:
            freed = (f"freed {k['holds_freed_after_s']:.1f} s after" if k["holds_freed_after_s"] is not None
                     else "NOT freed within the lease after")
            print(f"      killed broker (server 2): {k['failed']}/{k['copies']} copies from it failed (codes "
                  f"{', '.join(map(str, k['codes']))}), the slowest first {k['first_max_s']:.3f} s, later "
                  f"{k['later_max_s']:.3f} s (timeout {k['timeout_s']:g} s); its process's holds elsewhere "
                  f"{freed} the kill (lease {k['lease_s']:g} s)")
        if r["left_behind"]:
            print(f"      left behind by cluster down: {', '.join(r['left_behind'][:20])}")
        else:
            print("      cluster down left nothing: no namespace, process or /dev/shm entry of the run")
        print(f"      targets at {r['servers']} servers:")
        for name, v in r["targets"].items():
            print(f"        {TARGET_NAMES.get(name, name):52} {v['value']:9.3f}  {v['target']:7}  "
                  f"{'met' if v['met'] else 'MISSED'}")


def plot_scale(results: list[dict[str, Any]], path: str) -> str:
    """Latency against N as a PNG at `path` (matplotlib, optional): "" when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    ns = [r["servers"] for r in results]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    pace = results[0]["paced"]["at_once"] if results else 0
    for key, label, style in (("paced", f"paced ({pace} at a time)", "-"), ("all_at_once", "all at once", "--")):
        for stat, marker in (("median", "o"), ("p99", "v")):
            ax.plot(ns, [r[key]["later_ms"][stat] for r in results], marker=marker, linestyle=style,
                    label=f"{label}, later import {stat}")
    ax.plot(ns, [r["lone_ms"]["median"] for r in results], marker="^", color="black",
            label="lone importer, median")
    ax.set_xlabel("servers (all-to-all)")
    ax.set_ylabel("import + reserve + map, ms")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return ""

