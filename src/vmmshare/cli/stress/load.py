"""Load: many client processes, paired, each running export / import / map / free cycles against one broker.

    vmmshare stress load --clients 64 --cycles 1000 --seconds 900 --seed 1 --json load.json

Clients are separate processes (this script with `--role worker`) that talk to the broker through
`vmmshare.acl` only. They come in pairs joined by two pipes; in every cycle each side of a pair

  1. allocates 2 MiB, maps it, writes a marker (its bare tgid, the cycle, the run's seed) at both ends;
  2. exports it (pid validation on) and trustlists its partner, or - in a seeded fraction of the cycles (the
     "refused" ones) - trustlists only itself or nobody;
  3. sends the shareable handle to its partner and receives the partner's;
  4. imports the partner's handle: a trustlisted import must succeed, be mapped and show the partner's marker,
     then is unmapped and freed; a refused one must return 207006;
  5. tells its partner it is done and waits for the partner's word, then unmaps and frees its own allocation.

Counted: unexpected errors (any other return code, a wrong marker: must be 0), trustlisted and refused imports,
and the latency of malloc, export, set_pid (trustlist), import+map, the refused import, the importer's
unmap+free, and the exporter's free (which revokes the handle). At the end, with every client gone: the broker's
fds are back at the baseline, the capacity is full (a fresh process's get_mem_info), nothing is listed, and no
process of the run is left. All clients start their cycles at once (after all have connected), so the wall time
and the throughput cover the cycles only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as c
from stressio import count_option, emit, entry, even_count, fraction, prog, readable, seconds_option, whole
from vmmshare.cli.console import NarrowHelp, check_outputs

SIZE = c.MiB2
MARK = struct.Struct("<8sQQQ")  # magic, tgid, cycle, seed
METRICS = ("malloc", "export", "set_pid", "import_map", "import_refused", "import_free", "free")


# ================================================================ the worker (one client process)


def worker(index: int, rx: int, tx: int, seed: int, refuse: float) -> int:
    import ctypes

    import vmmshare.acl as acl

    rt = acl.rt

    def emit(obj: dict[str, Any]) -> None:
        os.write(1, (json.dumps(obj) + "\n").encode())

    peer_in = os.fdopen(rx, "rb")

    def peer_send(text: str) -> None:
        os.write(tx, (text + "\n").encode())

    def peer_recv() -> list[str]:
        line = peer_in.readline()
        if not line:
            raise EOFError("the partner is gone")
        return line.decode().split()

    assert rt.set_device(0) == 0
    gpu = os.environ.get("VMMSHARE_BACKEND") == "cuda"  # GPU memory: the CPU reaches it through memcpy only
    bounce = ctypes.create_string_buffer(MARK.size)

    def put(ptr: int, data: bytes) -> None:
        if not gpu:
            ctypes.memmove(ptr, data, len(data))
            return
        ctypes.memmove(bounce, data, len(data))
        if rt.memcpy(ptr, len(data), ctypes.addressof(bounce), len(data), 1):
            error("memcpy to the device")

    def get(ptr: int, size: int) -> bytes:
        if not gpu:
            return ctypes.string_at(ptr, size)
        return bounce.raw[:size] if rt.memcpy(ctypes.addressof(bounce), size, ptr, size, 2) == 0 else b""

    me, ret = rt.device_get_bare_tgid()  # connects to the broker
    assert ret == 0, acl.get_recent_err_msg()
    mine, ret = rt.reserve_mem_address(SIZE, 0, 0, 0)
    assert ret == 0
    theirs, ret = rt.reserve_mem_address(SIZE, 0, 0, 0)
    assert ret == 0
    peer_send(str(me))
    partner = int(peer_recv()[0])
    emit({"ev": "ready", "tgid": me, "partner": partner})
    go = json.loads(sys.stdin.readline())
    cycles, deadline = int(go["cycles"]), float(go["deadline"])

    rng = random.Random(seed * 1_000_003 + index)
    lat: dict[str, list[float]] = {m: [] for m in METRICS}
    n = {"cycles": 0, "trusted_ok": 0, "refused_ok": 0, "errors": 0, "data_errors": 0}
    errors: list[str] = []

    def error(what: str, code: int | None = None) -> None:
        n["errors"] += 1
        if len(errors) < 5:
            errors.append(f"cycle {i}: {what} ({code}) {acl.get_recent_err_msg()[:160]}")

    def timed(metric: str, fn: Any, *args: Any) -> Any:
        t0 = time.perf_counter_ns()
        out = fn(*args)
        lat[metric].append((time.perf_counter_ns() - t0) / 1000)
        return out

    i = 0
    for i in range(cycles):
        stop = i == cycles - 1 or time.monotonic() > deadline
        refused = rng.random() < refuse
        h, ret = timed("malloc", rt.malloc_physical, SIZE, c.PROP, 0)
        sh = 0
        if ret:
            error("malloc", ret)
            h = 0
        else:
            if rt.map_mem(mine, SIZE, 0, h, 0):
                error("map own")
            mark = MARK.pack(b"vmmload1", me, i, seed)
            put(mine, mark)
            put(mine + SIZE - MARK.size, mark)
            sh, ret = timed("export", rt.mem_export_to_shareable_handle_v2, h, 0, c.DEFAULT)
            if ret:
                error("export", ret)
                sh = 0
            elif not refused:
                ret = timed("set_pid", rt.mem_set_pid_to_shareable_handle_v2, sh, c.DEFAULT, [partner])
                if ret:
                    error("set_pid", ret)
            elif rng.random() < 0.5:  # a trustlist without the partner: only the exporter itself
                ret = timed("set_pid", rt.mem_set_pid_to_shareable_handle_v2, sh, c.DEFAULT, [me])
                if ret:
                    error("set_pid self", ret)
        peer_send(f"{i} {sh} {int(refused)} {int(stop)}")
        pi, psh, prefused, pstop = (int(x) for x in peer_recv())
        if pi != i:
            error(f"partner at cycle {pi}")
        if psh == 0:
            pass  # the partner's export failed (counted on its side)
        elif prefused:
            ih, ret = timed("import_refused", rt.mem_import_from_shareable_handle_v2, psh, c.DEFAULT, 0)
            if ret == 0:
                rt.free_physical(ih)
            if ret == c.NO_PERMISSION:
                n["refused_ok"] += 1
            else:
                error("refused import", ret)
        else:
            t0 = time.perf_counter_ns()
            ih, ret = rt.mem_import_from_shareable_handle_v2(psh, c.DEFAULT, 0)
            mret = rt.map_mem(theirs, SIZE, 0, ih, 0) if ret == 0 else ret
            lat["import_map"].append((time.perf_counter_ns() - t0) / 1000)
            if ret or mret:
                error("import+map", ret or mret)
            else:
                want = MARK.pack(b"vmmload1", partner, i, seed)
                head = get(theirs, MARK.size)
                tail = get(theirs + SIZE - MARK.size, MARK.size)
                if head != want or tail != want:
                    n["data_errors"] += 1
                    error("wrong marker in the partner's memory")
                else:
                    n["trusted_ok"] += 1
                t0 = time.perf_counter_ns()
                r1, r2 = rt.unmap_mem(theirs), rt.free_physical(ih)
                lat["import_free"].append((time.perf_counter_ns() - t0) / 1000)
                if r1 or r2:
                    error("unmap/free import", r1 or r2)
            if ret == 0 and mret:
                rt.free_physical(ih)
        peer_send(f"ack {i}")
        ack = peer_recv()
        if ack != ["ack", str(i)]:
            error(f"partner said {ack}")
        if h:
            if rt.unmap_mem(mine):
                error("unmap own")
            ret = timed("free", rt.free_physical, h)
            if ret:
                error("free", ret)
        n["cycles"] += 1
        if stop or pstop:
            break
    rt.release_mem_address(mine)
    rt.release_mem_address(theirs)
    emit({"ev": "done", "counts": n, "errors": errors,
          "lat": {m: [round(v, 1) for v in vs] for m, vs in lat.items()}})
    sys.stdin.readline()  # stay until told (EOF), so the pair's pipes stay open while the partner finishes
    return 0


# ================================================================ the controller


def run(clients: int, cycles: int, seconds: float | None, seed: int, refuse: float = 0.25,
        workdir: Path | None = None, backend_env: dict[str, str] | None = None) -> dict[str, Any]:
    if clients < 2 or clients % 2:
        raise ValueError("--clients must be an even number >= 2 (clients work in pairs)")
    own = workdir is None
    base = Path(tempfile.mkdtemp(prefix="vmmshare-load-")) if workdir is None else workdir
    folder = base / "run"
    backend_env = backend_env or {}
    gpu = backend_env.get("VMMSHARE_BACKEND") == "cuda"
    env = c.clean_env(VMMSHARE_BROKER_IDLE="600", **backend_env)
    broker = c.BrokerProc(folder, env=env)
    workers: list[c.Worker] = []
    violations: list[dict[str, Any]] = []
    try:
        fds0 = c.settled_fd_count(broker)
        _, total = c.raw_mem_info(broker.socket)
        me = str(Path(__file__).resolve())
        t_spawn = time.monotonic()
        for k in range(clients // 2):
            a_rx, b_tx = os.pipe()
            b_rx, a_tx = os.pipe()
            for idx, rx, tx in ((2 * k, a_rx, a_tx), (2 * k + 1, b_rx, b_tx)):
                workers.append(c.Worker([sys.executable, me, "--role", "worker", "--index", str(idx), "--rx", str(rx),
                                         "--tx", str(tx), "--seed", str(seed), "--refuse", str(refuse)],
                                        broker.env, name=f"client{idx}", pass_fds=(rx, tx)))
            for fd in (a_rx, b_tx, b_rx, a_tx):
                os.close(fd)
        for w in workers:
            w.until("ready", 120)
        spawn_s = time.monotonic() - t_spawn
        connected_fds = broker.fd_count()
        deadline = time.monotonic() + (seconds if seconds is not None else 1e9)
        t0 = time.perf_counter()
        for w in workers:
            w.send({"op": "go", "cycles": cycles, "deadline": deadline})
        done = [w.until("done", (seconds or 0) + 600)[0] for w in workers]
        wall = time.perf_counter() - t0
        for w in workers:
            rc = w.close()
            if rc != 0:
                violations.append({"what": "a client did not exit cleanly", "client": w.name, "rc": rc})
        workers = []
        c.barrier(broker.socket)
        fds = c.settled_fd_count(broker)
        free_raw, _ = c.raw_mem_info(broker.socket)
        free, total2 = c.actor_mem_info(broker.env)
        listing = c.raw_listing(broker.socket)
        exports, gpu_used = listing["exports"], listing["gpu_used"]
        broker.kill()
        stray = c.processes_mentioning(str(base))
    finally:
        for w in workers:
            w.kill()
        broker.kill()
        for pid, _ in c.processes_mentioning(str(base)):
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
        if own:
            shutil.rmtree(base, ignore_errors=True)

    totals = {k: sum(d["counts"][k] for d in done) for k in done[0]["counts"]}
    lat = {m: c.percentiles([v for d in done for v in d["lat"][m]]) for m in METRICS}
    errors = [e for d in done for e in d["errors"]][:20]
    if totals["errors"]:
        violations.append({"what": "unexpected errors", "count": totals["errors"], "first": errors})
    if fds != fds0:
        violations.append({"what": "broker fds not back to baseline", "fds": fds, "baseline": fds0})
    if not gpu and ((free, total2) != (total, total) or free_raw != total):
        violations.append({"what": "capacity not full at the end", "free": free, "total": total2})
    if gpu_used:
        violations.append({"what": "GPU memory still recorded at the end", "gpu_used": gpu_used})
    if exports:
        violations.append({"what": "exports still listed at the end", "count": len(exports)})
    if stray:
        violations.append({"what": "processes left running", "processes": stray})
    exports_done = totals["cycles"]  # one export (and one import of the partner's) per client cycle
    return {
        "script": "load", "seed": seed, "clients": clients, "cycles_asked": cycles, "seconds_cap": seconds,
        "refuse_fraction": refuse, "machine": c.machine(),
        "cycles_done": totals["cycles"], "cycles_per_client_min": min(d["counts"]["cycles"] for d in done),
        "counts": totals, "latency_us": lat,
        "wall_s": round(wall, 3), "spawn_and_connect_s": round(spawn_s, 2),
        "throughput": {"client_cycles_per_s": round(exports_done / wall, 1),
                       "broker_requests_per_s_approx": round(_requests(totals) / wall, 1)},
        "broker_fds": {"baseline": fds0, "with_clients": connected_fds, "end": fds},
        "capacity": {"free_end": free, "total": total2},
        "violations": violations,
    }


def _requests(t: dict[str, int]) -> int:
    """Broker round trips of the counted cycles: per cycle malloc, export, free's revoke and release on the exporter
    side (4), a trustlist call in most, and an import (plus its release when it succeeded) on the importer side."""
    return t["cycles"] * 4 + t["trusted_ok"] * 3 + t["refused_ok"] * 1


def main(argv: list[str] | None = None) -> int:
    ap = NarrowHelp(prog=prog(__file__), description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=even_count, default=64, help="client processes, an even number (default 64)")
    ap.add_argument("--cycles", type=count_option, default=1000, help="cycles per client (default 1000)")
    ap.add_argument("--seconds", type=seconds_option, default=None,
                    help="stop the cycles after this long (counts recorded)")
    ap.add_argument("--seed", type=whole, default=None, help="random seed (default: random, and recorded)")
    ap.add_argument("--refuse", type=fraction, default=0.25, help="fraction of cycles whose import must be refused")
    ap.add_argument("--json", help="write the result here ('-': stdout, instead of the summary)")
    ap.add_argument("--backend", choices=["host", "cuda", "fakecuda"], default="host",
                    help="device memory: host memfds (default), a real GPU, or fakecuda/ (the CPU stand-in for "
                         "the CUDA driver, built with $CC)")
    ap.add_argument("--role", choices=["worker"], help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rx", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tx", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    check_outputs(ap, json=None if args.json == "-" else args.json)
    if args.role:
        return worker(args.index, args.rx, args.tx, args.seed or 0, args.refuse)
    if problem := c.backend_problem(args.backend):
        ap.exit(2, f"{ap.prog}: {problem}\n")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    with c.backend_env(args.backend) as extra:
        result = run(args.clients, args.cycles, args.seconds, seed, args.refuse, backend_env=extra)
    result["backend"] = args.backend
    lines = [f"load: {args.backend} backend, seed {seed}, {args.clients} clients, {result['cycles_done']} client "
             f"cycles in {result['wall_s']} s ({result['throughput']['client_cycles_per_s']}/s), "
             f"{result['counts']['errors']} unexpected error(s), {len(result['violations'])} violation(s)",
             "  latency (µs):"]
    lines += [f"    {m:15s} {readable(p)}" for m, p in result["latency_us"].items()]
    lines += [f"  VIOLATION {readable(v)[:400]}" for v in result["violations"]]
    emit(lines, result, args.json)
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    entry(main)
