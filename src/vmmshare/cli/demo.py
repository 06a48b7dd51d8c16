"""vmmshare demo: an exporter and two importers, as three processes, on the node's default broker.

The broker is the one already running, or one the demo's first call starts (it exits by itself once idle for
VMMSHARE_BROKER_IDLE seconds, 60 by default).

Each role is the same module run with ``--role``; the conductor drives them over pipes (one JSON line per
step) and prints what each did. Every step's outcome is checked: the exit status is 0 only if all behaved.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import subprocess
import sys
import time
from typing import Any

from .. import acl
from .._process import runtime
from ..config import Config, parse_size
from .console import (
    FAILED,
    USAGE,
    Parser,
    Progress,
    environment_ok,
    memory_problem,
    plain,
    run_main,
    say_error,
    silence_stdout,
    socket_setting_problem,
)

PROP = {"handleType": 0, "allocationType": 0, "memAttr": acl.ACL_HBM_MEM_NORMAL,
        "location": {"id": 0, "type": acl.ACL_MEM_LOCATION_TYPE_DEVICE}, "reserve": 0}
CHUNK = 1 << 20


# ---------------------------------------------------------------- the roles (each in its own process)


class Role:
    """The state of one process of the demo: at most one mapping of the shared allocation."""

    def __init__(self) -> None:
        self.handle = 0
        self.ptr = 0
        self.size = 0
        self.gpu = False  # GPU memory (the CUDA backend): the CPU reaches it through memcpy only

    def _ok(self, ret: int, what: str) -> None:
        if ret != acl.ACL_SUCCESS:
            raise RuntimeError(f"{what} failed ({ret}): {acl.get_recent_err_msg()}")

    def hello(self) -> dict[str, Any]:
        self._ok(acl.rt.set_device(0), "set_device")
        pid, ret = acl.rt.device_get_bare_tgid()
        self._ok(ret, "device_get_bare_tgid")
        self.gpu = runtime().gpu is not None
        return {"pid": pid, "gpu": self.gpu}

    def _map(self, size: int) -> None:
        self.ptr, ret = acl.rt.reserve_mem_address(size, 0, 0, 0)
        self._ok(ret, "reserve_mem_address")
        self._ok(acl.rt.map_mem(self.ptr, size, 0, self.handle, 0), "map_mem")
        self.size = size

    def create(self, size: int, seed: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.handle, ret = acl.rt.malloc_physical(size, PROP, 0)
        self._ok(ret, "malloc_physical")
        self._map(size)
        vmm_us = (time.perf_counter() - t0) * 1e6
        return {"handle": self.handle, "sha256": self.fill(seed)["sha256"], "vmm_us": vmm_us}

    def export(self, pids: list[int]) -> dict[str, Any]:
        shareable, ret = acl.rt.mem_export_to_shareable_handle_v2(
            self.handle, acl.ACL_RT_VMM_EXPORT_FLAG_DEFAULT, acl.ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT)
        self._ok(ret, "mem_export_to_shareable_handle_v2")
        self._ok(acl.rt.mem_set_pid_to_shareable_handle_v2(shareable, acl.ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, pids),
                 "mem_set_pid_to_shareable_handle_v2")
        return {"shareable": shareable}

    def import_(self, shareable: int, size: int) -> dict[str, Any]:
        handle, ret = acl.rt.mem_import_from_shareable_handle_v2(shareable, acl.ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, 0)
        if ret != acl.ACL_SUCCESS:
            return {"ret": ret, "message": acl.get_recent_err_msg()}
        self.handle = handle
        self._map(size)
        return {"ret": ret, "handle": handle}

    def fill(self, seed: int) -> dict[str, Any]:
        block = hashlib.shake_256(seed.to_bytes(8, "little")).digest(CHUNK)
        bounce = ctypes.create_string_buffer(block, CHUNK)
        for off in range(0, self.size, CHUNK):
            n = min(CHUNK, self.size - off)
            if self.gpu:
                self._ok(acl.rt.memcpy(self.ptr + off, n, ctypes.addressof(bounce), n, acl.ACL_MEMCPY_HOST_TO_DEVICE),
                         "memcpy")
            else:
                ctypes.memmove(self.ptr + off, block, n)
        return self.checksum()

    def checksum(self) -> dict[str, Any]:
        if not self.gpu:
            view = (ctypes.c_char * self.size).from_address(self.ptr)
            return {"sha256": hashlib.sha256(memoryview(view)).hexdigest()}
        digest, bounce = hashlib.sha256(), ctypes.create_string_buffer(CHUNK)
        for off in range(0, self.size, CHUNK):
            n = min(CHUNK, self.size - off)
            self._ok(acl.rt.memcpy(ctypes.addressof(bounce), n, self.ptr + off, n, acl.ACL_MEMCPY_DEVICE_TO_HOST),
                     "memcpy")
            digest.update(memoryview(bounce)[:n])
        return {"sha256": digest.hexdigest()}

    def release(self) -> dict[str, Any]:
        self._ok(acl.rt.unmap_mem(self.ptr), "unmap_mem")
        self._ok(acl.rt.release_mem_address(self.ptr), "release_mem_address")
        self._ok(acl.rt.free_physical(self.handle), "free_physical")
        self.ptr = self.size = self.handle = 0
        return {}


def serve_role() -> int:
    """One role process: run the conductor's requests until it closes the pipe (it does on Ctrl-C, see `Proc`)."""
    try:
        return _serve(Role())
    except KeyboardInterrupt:  # run by hand, without the conductor
        return 130
    except BrokenPipeError:  # the conductor is gone: nobody is left to tell
        silence_stdout()
        return 141


def _serve(role: Role) -> int:
    for line in sys.stdin:
        req = json.loads(line)
        t0 = time.perf_counter()
        try:
            out = getattr(role, req["do"])(*req.get("args", []))
        except Exception as exc:
            out = {"error": str(exc)}
        out["us"] = (time.perf_counter() - t0) * 1e6
        print(json.dumps(out), flush=True)
    return 0


# ---------------------------------------------------------------- the conductor


class Proc:
    """One role process, driven over its stdin and stdout. It runs in a session of its own, out of reach of the
    terminal's Ctrl-C (which would print a traceback from wherever its interpreter was, its imports included): the
    conductor alone gets the Ctrl-C, and stops it by closing its stdin."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.p = subprocess.Popen([sys.executable, "-m", "vmmshare.cli.demo", "--role"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, bufsize=1, start_new_session=True)
        self.pid = 0

    def do(self, what: str, *args: Any) -> dict[str, Any]:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(json.dumps({"do": what, "args": list(args)}) + "\n")
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited unexpectedly ({self.p.wait()})")
        out: dict[str, Any] = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"{self.name}: {out['error']}")
        return out

    def close(self) -> None:
        if self.p.stdin is not None:
            self.p.stdin.close()
        try:
            self.p.wait(30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def _human(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):g} {unit}"
    return f"{n} B"


def conduct(size: int, out: Any = sys.stdout) -> int:
    """Run the demo; print the report to `out`; 0 if every step behaved as the runtime's rules say."""
    with Progress("vmmshare demo") as progress:
        return _conduct(size, out, progress)


def _conduct(size: int, out: Any, progress: Progress) -> int:
    failures: list[str] = []
    new_sha = ""
    step = progress.step

    def say(text: str) -> None:
        progress.print(text, out)

    def check(cond: bool, what: str) -> None:
        say(f"   {'ok  ' if cond else 'FAIL'} {what}")
        if not cond:
            failures.append(what)

    g = 2 << 20
    size = -(-size // g) * g
    step("starting the exporter and two importers")
    procs: dict[str, Proc] = {}
    try:  # a Ctrl-C between two starts stops the ones started
        for name in ("exporter", "importer-A", "importer-B"):
            procs[name] = Proc(name)
        e, a, b = procs["exporter"], procs["importer-A"], procs["importer-B"]
        gpu = False
        for p in procs.values():
            hello = p.do("hello")
            p.pid, gpu = hello["pid"], gpu or hello["gpu"]
        kind = " of GPU memory (CUDA backend)" if gpu else ""
        say(f"vmmshare demo: {_human(size)}{kind} shared between three processes on the node broker")
        say("   " + ", ".join(f"{n} pid {p.pid}" for n, p in procs.items()))

        step(f"exporter: allocating, mapping and filling {_human(size)}")
        r = e.do("create", size, 1)
        say(f"1. exporter: malloc_physical + reserve + map {_human(size)} ({r['vmm_us']:.0f} µs), "
            f"then fill it ({(r['us'] - r['vmm_us']) / 1000:.0f} ms)")
        exp_sha = r["sha256"]
        r = e.do("export", [a.pid])
        shareable = r["shareable"]
        say(f"2. exporter: export V2 DEFAULT -> shareable handle {shareable:#018x}, trustlist [{a.pid}] "
            f"({r['us']:.0f} µs)")

        step("importer-A: importing and mapping")
        r = a.do("import_", shareable, size)
        say(f"3. importer-A (trustlisted): import + reserve + map ({r['us']:.0f} µs)")
        a_mapped = r["ret"] == 0
        check(a_mapped, f"importer-A imported (ret {r['ret']})")
        if a_mapped:
            step(f"importer-A: reading {_human(size)}, then writing it")
            check(a.do("checksum")["sha256"] == exp_sha, "importer-A reads the exporter's bytes (sha256 equal)")
            new_sha = a.do("fill", 2)["sha256"]
            step(f"exporter: reading {_human(size)}")
            check(e.do("checksum")["sha256"] == new_sha, "exporter reads importer-A's writes (sha256 equal)")

        step("importer-B: importing")
        r = b.do("import_", shareable, size)
        say(f"4. importer-B (not trustlisted): import -> {r['ret']}")
        check(r["ret"] == acl.ACL_ERROR_RT_NO_PERMISSION, f"importer-B refused with 207006: {r.get('message', '')}")

        r = e.do("release")
        say(f"5. exporter: unmap + free_physical: the handle is revoked ({r['us']:.0f} µs)")
        r = b.do("import_", shareable, size)
        say(f"6. late import by importer-B -> {r['ret']}")
        check(r["ret"] == acl.ACL_ERROR_RT_INVALID_HANDLE, f"late import refused with 107017: {r.get('message', '')}")
        if a_mapped:
            step(f"importer-A: reading {_human(size)} again")
            check(a.do("checksum")["sha256"] == new_sha, "importer-A's memory is intact after the exporter freed it")
            a.do("release")
    except RuntimeError as exc:
        failures.append(str(exc))
        say(f"   FAIL {exc}")
    finally:
        step("stopping the three processes")
        for p in procs.values():
            p.close()
    say("all steps behaved" if not failures else f"{len(failures)} step(s) misbehaved")
    return 0 if not failures else 1


def _capacity_problem(size: int) -> str | None:
    """Why a running broker cannot hold `size` bytes on a device (None if it can, or none runs: then the demo's
    first call starts one with this environment's values). A running broker keeps the capacity it started with."""
    from ..client.connection import BrokerClient
    from ..config import Config
    from ..errors import AclError

    config = Config.from_env()
    if config.backend != "host":  # GPU memory: the driver's capacity applies, not the broker's
        return None
    client = BrokerClient(config, autostart=False)
    try:
        listing = client.listing()
    except AclError:
        return None
    finally:
        client.close()
    capacity, pid = int(listing["capacity"]), int(listing["broker_pid"])
    if size <= capacity:
        return None
    ours = config.device_memory
    head = (f"{_human(size)} does not fit the running broker (pid {pid} at {config.socket_path}): it has "
            f"{_human(capacity)} per device, the VMMSHARE_DEVICE_MEMORY it was started with")
    if ours >= size:
        return (f"{head}; this environment's {_human(ours)} counts only for a broker started from it. Stop that "
                f"broker (kill {pid}) and run the demo again")
    return f"{head}. Raise VMMSHARE_DEVICE_MEMORY, stop that broker (kill {pid}) and run the demo again"


def main(argv: list[str] | None = None) -> int:
    """`vmmshare demo`: a closed stdout or Ctrl-C ends it without a traceback (the three processes are stopped)."""
    return run_main(lambda: _main(sys.argv[1:] if argv is None else argv), "vmmshare demo")


def _main(argv: list[str]) -> int:
    if "--fabric" in argv:  # across two servers made for the run (see --fabric --help)
        from .demo_fabric import main as fabric_main

        return fabric_main([a for a in argv if a != "--fabric"])
    ap = Parser(prog="vmmshare demo", description="\n\n".join(plain(__doc__).split("\n\n")[:2]),
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="Exit status: 0 every step behaved, 1 a step misbehaved (or the running broker cannot hold "
                       "--size), 2 bad usage or configuration.")
    ap.add_argument("--size", default="64M", help="bytes to share (K/M/G suffixes; rounded up to 2 MiB)")
    ap.add_argument("--fabric", action="store_true", help="memory shared across two servers made for the run "
                    "(network namespaces; needs root and vmmshare[fabric]; see --fabric --help)")
    ap.add_argument("--role", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role:
        return serve_role()
    try:
        size = parse_size(args.size)
    except ValueError as exc:
        ap.error(f"--size: {exc}")
    if size <= 0:
        ap.error("--size must be positive")
    if not environment_ok("vmmshare demo"):
        return USAGE
    size = -(-size // (2 << 20)) * (2 << 20)
    if Config.from_env().backend == "host" and (problem := memory_problem(size, f"--size {_human(size)}")):
        say_error("vmmshare demo", f"{problem} (the three processes share one copy, in host memory)")
        return USAGE
    if problem := socket_setting_problem():
        say_error("vmmshare demo", problem)
        return USAGE
    problem = _capacity_problem(size)
    if problem:
        say_error("vmmshare demo", problem)
        return FAILED
    os.environ.setdefault("VMMSHARE_LOG", "WARNING")
    return conduct(size)


if __name__ == "__main__":
    from .console import run_main

    sys.exit(run_main(lambda: main()))
