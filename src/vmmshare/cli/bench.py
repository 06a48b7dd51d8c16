"""vmmshare bench: sharing costs against the anchors, in one run on the auto-started default broker (the waits on
private brokers of their own).

Measured side by side (medians over repetitions, with the 10th–90th percentile spread):
- share latency by step — allocate, map, export, trustlist | import, reserve+map, first touch — against
  `multiprocessing.shared_memory` (create | attach), sending the bytes through `multiprocessing.Pipe`, and
  `torch.Tensor.share_memory_()` passed through a queue (when torch is installed);
- the floors: a raw request/reply with an fd between two Python processes (and the mmap of it), and the physical
  one, the same with both ends in C (on any core, and with both ends on one core), and each importer step's ratio
  to them;
- the C library: a 2 MiB share between two C processes (the importer's import + reserve + map, the exporter's
  allocate + map + export + trustlist), against C shm_open + mmap and the floor of one request and a reply with an
  fd between the same two C processes (bench_c.c);
- broker throughput: import+free round trips per second with 1, 4 and 16 client processes, the CPU time each
  round trip costs the clients and the broker, and the broker's CPU use when idle;
- steady-state read bandwidth of an imported mapping against a private buffer of the same size;
- first-touch bandwidth on import, with and without pre-populating the mapping;
- the producer/consumer wake-up across two processes: an IPC event's record -> wait against a pipe's write -> read
  between the same two processes, from the same stream (the floor of a cross-process wake-up);
- the waits, on the idle machine and with every usable core kept busy by CPU hogs, each with the client's and the
  broker's polling windows on (the defaults) and off, on private brokers started for it: the 2 MiB share by step
  against SharedMemory under the same load, and import+free round trips/s with 1 client and the most of
  --clients, with the CPU each round trip costs.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import sys
from collections.abc import Sequence
from typing import Any

from .bench_broker import c_floor, floor, idle_cpu, throughput
from .bench_busy import LOADS, SPINS, PassError, waits
from .bench_c import c_share
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
    write_json,
)
from .bench_sync import wakeup
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
    socket_setting_problem,
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
    c = res.get("c_share")
    if c:
        t["c_importer_2MiB_vs_floor"] = {"value": c["importer_vs_floor"], "target": "<= 2.0"}
        t["c_share_2MiB_vs_3_floors"] = {"value": c["exporter_vs_3_floors"], "target": "<= 2.0"}
    if "bandwidth" in res:
        t["read_bw_imported_vs_private"] = {"value": res["bandwidth"]["read_ratio"], "target": ">= 0.95"}
    if "throughput" in res and "16" in res["throughput"]:
        t["broker_16_clients_ops"] = {"value": res["throughput"]["16"]["ops_per_s"], "target": ">= 20000"}
    if "wakeup" in res:
        t["event_wakeup_vs_pipe"] = {"value": res["wakeup"]["ratio"], "target": res["wakeup"]["target"]}
    if "waits" in res:  # a wait may spin only while a core is free for it: it must win idle and not lose busy
        ratio = res["waits"]["spins_on_vs_off"]
        t["spins_win_idle"] = {"value": ratio["idle"], "target": "< 1.0"}
        t["spins_do_not_lose_busy"] = {"value": ratio["busy"], "target": "<= 1.1"}
    for v in t.values():
        op, bound_text = v["target"].split()
        bound = float(bound_text)
        v["met"] = {"<=": v["value"] <= bound, "<": v["value"] < bound, ">=": v["value"] >= bound}[op]
    return t


def floor_ratios(res: dict[str, Any]) -> dict[str, float]:
    """Each importer step at 2 MiB against the floor: what the round trip and the mapping cost beyond it."""
    row = res["latency"].get(str(2 * MiB))
    f = res["floor"]
    rtt, rtt_map = f["fd_round_trip"]["median"], f["fd_round_trip_mmap"]["median"]
    if not row or "import" not in row or not rtt:
        return {}
    imp, rm = row["import"]["median"], row["reserve_map"]["median"]
    out = {"import (request, reply with fd)": imp / rtt, "import + reserve + map": (imp + rm) / rtt_map,
           "SharedMemory attach": row["shm_attach"]["median"] / rtt_map}
    physical = res.get("c_floor", {}).get("any_core")
    if physical:
        c_rtt, c_map = physical["fd_round_trip"]["median"], physical["fd_round_trip_mmap"]["median"]
        out.update({"import, vs the C floor": imp / c_rtt, "import + reserve + map, vs the C floor": (imp + rm) / c_map,
                    "SharedMemory attach, vs the C floor": row["shm_attach"]["median"] / c_map})
    return out


TARGET_NAMES = {  # each target as the question it answers
    "share_2MiB_vs_shm": "share 2 MiB, vs SharedMemory create+attach",
    "share_256MiB_vs_shm": "share 256 MiB, vs SharedMemory create+attach",
    "importer_2MiB_vs_attach": "importer's side at 2 MiB, vs SharedMemory attach",
    "share_1GiB_vs_2MiB": "share 1 GiB, vs share 2 MiB",
    "pipe_256MiB_vs_share": "Pipe 256 MiB, vs share 256 MiB",
    "read_bw_imported_vs_private": "read bandwidth, imported vs private",
    "broker_16_clients_ops": "broker round trips/s, 16 clients",
    "spins_win_idle": "spins win idle: importer, spins on vs off",
    "spins_do_not_lose_busy": "spins do not lose busy: importer, on vs off",
    "c_importer_2MiB_vs_floor": "C importer at 2 MiB, vs the C floor (request + fd reply)",
    "c_share_2MiB_vs_3_floors": "C exporter's share at 2 MiB, vs three C floors",
    "event_wakeup_vs_pipe": "event record -> wait across processes, vs pipe",
}


def _cell(stats: dict[str, float] | None) -> str:
    """A median with its p10–p90 spread, in µs: `153 (140–170)`."""
    if not stats:
        return "-"
    return f"{stats['median']:,.0f} ({stats['p10']:,.0f}–{stats['p90']:,.0f})"


def _table(title: str, head: tuple[str, ...], rows: Sequence[tuple[str, ...]], out: Any) -> None:
    """One narrow table: a title line (the question it answers), a header, right-aligned cells."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    print(f"\n{title}", file=out)
    for r in [head, *rows]:
        print("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths,
                                                                                              strict=True))),
              file=out)


def print_report(res: dict[str, Any], out: Any = sys.stdout) -> None:
    """The run as a few narrow tables, one per question; each latency a median with its p10–p90 spread, µs."""
    lat = list(res["latency"].values())
    m = res.get("machine", {})
    print(f"vmmshare bench{' --quick' if res.get('quick') else ''}: {m.get('when', '')}, {m.get('commit', '')}",
          file=out)
    print("  on " + ", ".join(p for p in (m.get("cpu"), m.get("cpus") and f"{m['cpus']} cores",
                                          m.get("kernel") and f"Linux {m['kernel']}") if p), file=out)
    if "load" in m:
        print(f"  load average {m['load'][0]:.2f} at the start, {res.get('load_after', m['load'])[0]:.2f} at the end; "
              f"packets: {m.get('packets', '?')}", file=out)
    if m.get("cpus") is not None and m["cpus"] <= 4:
        print("  (few cores: other load on the machine moves these numbers; compare ratios within one run)", file=out)
    alternatives = [("share", "vmmshare"), ("shm_share", "SharedMemory"), ("pipe", "Pipe"),
                    ("torch_share", "torch")]
    shown = [(k, n) for k, n in alternatives if any(k in r for r in lat)]
    _table("What does handing memory to another process cost? µs, median (p10–p90)",
           ("size", *(n for _, n in shown)), [(fmt_size(r["size"]), *(_cell(r.get(k)) for k, _ in shown))
                                              for r in lat], out)
    _table("Where vmmshare's share goes, µs (median)", ("size", "allocate", "map", "export", "import", "reserve+map"),
           [(fmt_size(r["size"]), *(f"{r[k]['median']:,.1f}" if k in r else "-" for k in
                                    ("allocate", "map", "export_trustlist", "import", "reserve_map"))) for r in lat],
           out)
    if any("share_with_touch" in r for r in lat):
        _table("... and with every page touched by the importer, µs, median (p10–p90)",
               ("size", "vmmshare", "SharedMemory"),
               [(fmt_size(r["size"]), _cell(r.get("share_with_touch")), _cell(r.get("shm_share_with_touch")))
                for r in lat], out)
    if "floor" in res:
        f = res["floor"]
        rows = [("raw fd round trip, Python (the floor)", _cell(f["fd_round_trip"]), "floor"),
                ("... with the fd's mmap", _cell(f["fd_round_trip_mmap"]), "floor, mapped")]
        for where, c in res.get("c_floor", {}).items():
            rows += [(f"blocking fd round trip in C, {where.replace('_', ' ')}", _cell(c["fd_round_trip"]),
                      "C floor" if where == "any_core" else ""),
                     ("... with the fd's mmap", _cell(c["fd_round_trip_mmap"]),
                      "C floor, mapped" if where == "any_core" else "")]
        if "c_floor" in res and not res["c_floor"]:
            rows.append(("the C floor", "-", "not built here"))
        rows += [(name, "", f"{v:.2f}x") for name, v in res.get("floor_ratios", {}).items()]
        _table("The floors: what two Python processes, and two C ones, pay to pass an fd; µs, median (p10–p90)",
               ("", "µs", "vs floor"), rows, out)
    if res.get("c_share"):
        c = res["c_share"]
        _table("The C library: a 2 MiB share between two C processes; µs, median (p10–p90)", ("", "µs", "ratio"),
               [("importer: import + reserve + map", _cell(c["c_importer"]), f"{c['importer_vs_floor']:.2f}x floor"),
                ("exporter: allocate + map + export + trustlist", _cell(c["c_exporter"]),
                 f"{c['exporter_vs_3_floors']:.2f}x 3 floors"),
                ("POSIX shared memory: open + mmap (attach)", _cell(c["shm_attach"]), ""),
                ("POSIX shared memory: open + truncate + mmap (create)", _cell(c["shm_create"]), ""),
                ("request + fd reply, C to C (the floor)", _cell(c["floor"]), "floor")], out)
    if "throughput" in res:
        _table("How many import+free round trips a broker serves", ("clients", "round trips/s", "client CPU µs",
                                                                     "broker CPU µs"),
               [(n, f"{v['ops_per_s']:,.0f}", f"{v['client_cpu_us']:.0f}", f"{v['broker_cpu_us']:.0f}")
                for n, v in res["throughput"].items()], out)
    if "idle_cpu" in res:
        print(f"  broker CPU while idle: {res['idle_cpu'] * 100:.2f}% of a core", file=out)
    if "wakeup" in res:
        wk = res["wakeup"]
        _table("Producer/consumer: how soon does the consumer wake? µs, median (p10–p90)", ("", "µs", ""),
               [("IPC event: record -> wait", _cell(wk["event_record_to_wait"]),
                 f"{wk['ratio']:.2f}x"),
                ("pipe write -> read (the floor)", _cell(wk["pipe_write_to_read"]), "floor")], out)
    if "waits" in res:
        _waits_table(res["waits"], out)
    if "bandwidth" in res:
        b = res["bandwidth"]
        rows = [("read, imported", f"{b['read_GBps']['imported']:.2f}", ""),
                ("read, private", f"{b['read_GBps']['private']:.2f}", "")]
        rows += [(f"first touch ({k})", f"{v['first_touch_GBps']:.2f}",
                  f"map {v['map']:,.0f} + touch {v['touch']:,.0f}") for k, v in b["first_touch"].items()]
        _table(f"Reading {fmt_size(b['size'])} of shared memory, GB/s", ("", "GB/s", "µs"), rows, out)
    print("\ntargets:", file=out)
    for name, v in res["targets"].items():
        print(f"  {TARGET_NAMES.get(name, name):50} {v['value']:10.3f}  {v['target']:8}  "
              f"{'met' if v['met'] else 'MISSED'}", file=out)


def _waits_table(w: dict[str, Any], out: Any) -> None:
    """The waits pass: each figure with the polling windows on and off, idle and with every core busy (medians:
    four columns with their spread would not fit; the spread is in --json)."""
    cols = [w["passes"][load][spins] for load in LOADS for spins in SPINS]

    def lat(key: str) -> tuple[str, ...]:
        return tuple(f"{c['latency'][key]['median']:,.0f}" for c in cols)

    rows = [("import", *lat("import")), ("reserve+map", *lat("reserve_map")),
            ("SharedMemory attach", *lat("shm_attach")),
            ("importer / attach", *(f"{c['importer_vs_attach']:.2f}x" for c in cols)),
            ("share", *lat("share")), ("SharedMemory create+attach", *lat("shm_share")),
            ("share / SharedMemory", *(f"{c['share_vs_shm']:.2f}x" for c in cols))]
    for n in w["clients"]:
        tp = [c["throughput"][str(n)] for c in cols]
        rows += [(f"round trips/s, {n} client{'s' if n > 1 else ''}", *(f"{t['ops_per_s']:,.0f}" for t in tp)),
                 ("  client CPU µs per round trip", *(f"{t['client_cpu_us']:.0f}" for t in tp)),
                 ("  broker CPU µs per round trip", *(f"{t['broker_cpu_us']:.0f}" for t in tp))]
    _table(f"Do the waits' spins pay, idle and with all {w['cores']} cores busy? {fmt_size(w['size'])}, µs, median",
           ("", *(f"{load}, spins {spins}" for load in LOADS for spins in SPINS)), rows, out)
    win, ratio = w["windows_us"]["on"], w["spins_on_vs_off"]
    print(f"  spins on: the client polls {win['client']} µs, the broker {win['broker']} µs; off: neither polls",
          file=out)
    print(f"  importer (import + reserve + map), spins on vs off: idle {ratio['idle']:.2f}x, "
          f"busy {ratio['busy']:.2f}x", file=out)


def _label(res: dict[str, Any]) -> str:
    """Where and when the run happened, for the report's first line and the figure."""
    m = res.get("machine", {})
    parts = [m.get("cpu") or "", f"{m['cpus']} cores" if m.get("cpus") else "", m.get("kernel") and
             f"Linux {m['kernel']}", m.get("when", ""), m.get("commit", "")]
    return ", ".join(p for p in parts if p)


def machine_facts() -> dict[str, Any]:
    """The machine, the time and the code of a run: printed with it, and written on its figure."""
    import datetime
    import platform
    import subprocess

    from .. import __version__

    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    commit = f"vmmshare {__version__}"
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        rev = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        if rev.returncode == 0 and rev.stdout.strip():
            commit += f" @ {rev.stdout.strip()}"
    except (OSError, subprocess.SubprocessError):
        pass
    from ..config import pure_python
    from ..sockets import packets

    return {"cpus": os.cpu_count(), "python": sys.version.split()[0], "cpu": " ".join(cpu.split()),
            "load": list(os.getloadavg()),
            "packets": "compiled" if packets.FAST_AVAILABLE and not pure_python() else "pure Python",
            "kernel": platform.release(), "when": datetime.datetime.now(datetime.timezone.utc).strftime(
                "%Y-%m-%d %H:%M UTC"), "commit": commit}


def plot(res: dict[str, Any], path: str) -> None:
    """Write the run's figure (`figure`) to `path` as a PNG."""
    import matplotlib.pyplot as plt

    fig = figure(res)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figure(res: dict[str, Any]) -> Any:
    """Three panels a reader takes in at once: share latency against the alternatives, the same with every page
    touched, and the broker's throughput; medians with their p10–p90 spread drawn, log x axes, throughput from
    zero with its target, the machine, date and commit written on the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 5.2))
    rows = list(res["latency"].values())
    sizes = [r["size"] for r in rows]

    def curves(ax: Any, keys: tuple[tuple[str, str], ...]) -> None:
        for key, label in keys:
            pts = [(r["size"], r[key]) for r in rows if key in r]
            if not pts:
                continue
            xs, med = [p[0] for p in pts], [p[1]["median"] for p in pts]
            low = [max(0.0, p[1]["median"] - p[1]["p10"]) for p in pts]
            high = [max(0.0, p[1]["p90"] - p[1]["median"]) for p in pts]
            ax.errorbar(xs, med, yerr=[low, high], marker="o", capsize=3, label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("bytes shared")
        ax.set_ylabel("µs: median, bars p10–p90")
        ax.set_xticks(sizes)
        ax.set_xticklabels([fmt_size(s) for s in sizes], rotation=45)
        ax.minorticks_off()
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)

    curves(ax1, (("share", "vmmshare (export + import + map)"), ("shm_share", "SharedMemory create + attach"),
                 ("pipe", "multiprocessing.Pipe (copies)"), ("torch_share", "torch share_memory_() + queue")))
    ax1.set_title("handing memory to another process")
    curves(ax2, (("share_with_touch", "vmmshare, importer touches every page"),
                 ("shm_share_with_touch", "SharedMemory, importer touches every page")))
    ax2.set_title("the same, with first touch")
    if "throughput" in res:
        tp = res["throughput"]
        clients = [int(k) for k in tp]
        ax3.plot(clients, [v["ops_per_s"] for v in tp.values()], marker="o", label="import+free round trips/s")
        ax3.axhline(20000, color="gray", linestyle="--", label="target 20,000/s")
        ax3.set_xscale("log", base=2)
        ax3.set_xticks(clients)
        ax3.set_xticklabels([str(c) for c in clients])
        ax3.minorticks_off()
        ax3.set_ylim(bottom=0, top=max(25000, 1.1 * max(v["ops_per_s"] for v in tp.values())))
        ax3.set_xlabel("client processes")
        ax3.set_ylabel("round trips / s")
        ax3.set_title("broker throughput")
        ax3.grid(True, alpha=0.3)
        ax3.legend(fontsize=8)
    fig.suptitle(f"vmmshare bench{' --quick' if res.get('quick') else ''}: {_label(res)}", fontsize=10)
    fig.tight_layout()
    return fig


PEAK_COPIES = 3  # the most copies of one size a run holds at once (Pipe: sender and receiver, plus a shared one)


def default_sizes(quick: bool) -> list[int]:
    """The sizes shared when --sizes is not given."""
    return [4 * KiB, 2 * MiB, 64 * MiB, 256 * MiB] if quick else [
        4 * KiB, 64 * KiB, 2 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, GiB]


def run(
    quick: bool, with_torch: bool | None = None, sizes: list[int] | None = None, reps_override: int | None = None,
    clients: list[int] | None = None, seconds: float | None = None, step: Step = quiet, with_waits: bool = True,
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
    res: dict[str, Any] = {"quick": quick, "machine": machine_facts()}
    try:  # from its first answer on: a Ctrl-C while the peer still starts is told to it as "stop" too
        peer_pid = a.recv()
        res["latency"] = share_latency(a, peer_pid, sizes, reps, with_torch, step)
        res["bandwidth"] = bandwidth(a, peer_pid, bw_size, reps_override or 5, step)
    finally:
        with contextlib.suppress(OSError):  # a peer that died has closed its end
            a.send(("stop",))
        peer.join()
    res["floor"] = floor(reps_override or (300 if quick else 3000), step)
    res["c_floor"] = c_floor(reps_override or (1000 if quick else 10000), step)
    res["floor_ratios"] = floor_ratios(res)
    res["c_share"] = c_share(reps_override or (200 if quick else 1000), step)
    res["wakeup"] = wakeup(reps_override or (100 if quick else 500), step)
    res["throughput"] = throughput(clients, seconds, step)
    step("the broker's CPU while idle")
    res["idle_cpu"] = idle_cpu(1.0 if quick else 2.0)
    if with_waits:  # 1 client and the most: a point per round trip's cost alone, and one of contention
        res["waits"] = waits(reps_override or (25 if quick else 100), min(seconds, 0.4 if quick else 1.5),
                             sorted({1, max(clients)}), step)
    res["targets"] = targets(res)
    res["load_after"] = list(os.getloadavg())
    return res


def _gpu_backend() -> bool:
    """Whether this process's device memory would be GPU memory (VMMSHARE_BACKEND=cuda, or auto with a GPU)."""
    backend = os.environ.get("VMMSHARE_BACKEND", "").strip().lower()
    if backend == "auto":
        from ..backends.cuda import available

        return available()
    return backend == "cuda"


def main(argv: list[str] | None = None) -> int:
    """`vmmshare bench`: a closed stdout or Ctrl-C ends it without a traceback."""
    return run_main(lambda: _main(sys.argv[1:] if argv is None else argv), "vmmshare bench")


def _main(argv: list[str]) -> int:
    if "--fabric" in argv:  # copies across servers, in a test cluster made for the run (see --fabric --help)
        from . import bench_fabric

        return bench_fabric.main([a for a in argv if a != "--fabric"])
    if "--torch" in argv:  # sharing a state dict with torch's own ways (see --torch --help)
        from . import bench_torch

        return bench_torch.main([a for a in argv if a != "--torch"])
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
    ap.add_argument("--torch", action="store_true",
                    help="a state dict to another process: a vmmshare bucket against torch.multiprocessing and "
                         "pickling, per update, and 1,000 small tensors (see --torch --help; needs torch)")
    ap.add_argument("--quick", action="store_true", help="CI-sized: fewer sizes and repetitions")
    ap.add_argument("--json", help="write the results to this file")
    ap.add_argument("--plot", help="write a PNG: latency vs size (log-log) and throughput vs clients")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch comparison even if torch is installed")
    ap.add_argument("--sizes", type=sizes_option, help="comma-separated sizes to share, e.g. 4K,2M,1G")
    ap.add_argument("--reps", type=count_option,
                    help="repetitions per size (default: by size; for the waits pass 100, 25 with --quick)")
    ap.add_argument("--clients", type=counts_option,
                    help="comma-separated client counts for the throughput test (default 1,4,16); the waits "
                         "pass uses 1 and the most of them")
    ap.add_argument("--seconds", type=seconds_option,
                    help="seconds per throughput point (default 3, 1 with --quick; the waits pass's points take "
                         "at most 1.5, 0.4 with --quick)")
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
    if problem := socket_setting_problem():  # the node broker's part of the run
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
    from ..errors import AclError

    try:
        with Progress("vmmshare bench") as progress:
            res = run(args.quick, False if args.no_torch else None, args.sizes, args.reps, args.clients,
                      args.seconds, progress.step)
    except (AclError, PassError) as exc:
        say_error("vmmshare bench", f"failed: {exc}")
        return FAILED
    except (EOFError, OSError):  # the pipe to a measuring process: it died
        say_error("vmmshare bench", "failed: a measuring process exited early (its error is above)")
        return FAILED
    where = args.json
    try:  # the files first: a reader that stops early (| head) must not cost them
        if args.json:
            write_json(res, args.json)
        where = args.plot
        if args.plot:
            plot(res, args.plot)
    except OSError as exc:  # a write's error names no file: the one being written is named
        say_error("vmmshare bench", f"cannot write {exc.filename or where}: {exc.strerror}")
        return FAILED
    print_report(res)
    return OK


if __name__ == "__main__":
    sys.exit(run_main(lambda: main()))
