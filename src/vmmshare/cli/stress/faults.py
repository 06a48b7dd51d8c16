"""Faults: SIGKILL of the exporter, of an importer and of the broker at random points of export / import / map.

    vmmshare stress faults --trials 200 --seconds 900 --seed 1 --json faults.json

Three kinds of trial, each against a broker of its own (`procs.BrokerProc`):

exporter  A fresh exporter loops allocate -> reserve -> map -> write a pattern -> export -> trustlist -> publish
          (keeping its last few exports live, freeing older ones); a long-lived importer imports every published
          handle as it comes, maps it and checks the pattern (keeping some mappings). The exporter is SIGKILLed
          after a random number of its operations. Then: every mapping the importer kept still holds the exact
          pattern; every handle the dead exporter published imports as 107017; the importer frees all; capacity
          and the broker's fds are back where they were.
importer  A long-lived exporter exports a few handles; a long-lived importer maps them all; a fresh victim
          importer loops import -> reserve -> map -> checksum -> unmap -> free over them and is SIGKILLed after a
          random number of operations. Then: the survivor's and the exporter's bytes are intact; the listing
          shows only the survivor as importer and exactly the exporter's bytes charged; the handles still import.
broker    A long-lived exporter and importer loop as in `exporter`, and the broker is SIGKILLed after a random
          number of their operations, then restarted with BrokerProc.start() (while the clients that noticed wait
          on the broker start lock, as SPEC §5's auto-start makes them). Then: every kept mapping is intact; the
          clients go on by themselves (new exports import); the restarted broker charges exactly the allocations
          that are alive; everything freed gives full capacity; the broker's fds are back to its baseline.
          `--double-kill F`: in a fraction F of the trials the restarted broker is killed again as soon as a client
          has reconnected (while it re-charges its allocations), and restarted once more.

Every kind ends by closing its clients and checking: broker fds at the no-client baseline, full capacity seen by a
fresh process's get_mem_info, no export listed, no process left that mentions the run's folder.

Known defects are told apart from other violations by their signature and listed under "defects" (the run still
exits 1): D1, a call under way when the broker dies fails with 507022 (at most one per client and death); D2, after
a reconnection that failed mid-way (D1, or a double kill) the restarted broker no longer charges some live
allocations. Both are pinned by regression tests in tests/test_faults.py; see docs/reliability.md §6.

`--fabric` runs the cross-server kind instead (stress/fabric_faults.py): SIGKILL of the exporter, the importer or
either broker while the importer reads and writes the exporter's memory on another server.

Worker roles (internal): `--role exporter|importer --progress FILE --seed S`, driven by JSON lines on stdin.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import random
import re
import select
import shutil
import sys
import tempfile
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as c
from stressio import count_option, emit, entry, fraction, kinds, prog, readable, seconds_option, whole
from vmmshare.cli.console import NarrowHelp, check_outputs

KINDS = ("exporter", "importer", "broker")

SIZE = c.MiB2
# phases a worker announces before each step (Progress); the name of the one a kill interrupted is recorded
PHASES = ["idle", "malloc", "reserve", "map", "write", "export", "set_pid", "publish", "unmap", "free", "release",
          "import", "verify"]
PH = {name: i for i, name in enumerate(PHASES)}


# ================================================================ workers (separate processes)


def _emit(obj: dict[str, Any]) -> None:
    os.write(1, (json.dumps(obj) + "\n").encode())  # one write: a kill never leaves half a line


class _NodeCallFailures(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        code = re.search(r"\((\d{6})\)", msg)
        _emit({"ev": "fail", "phase": "node_call", "code": int(code.group(1)) if code else -1, "msg": msg[:200]})


class _WorkerBase:
    def __init__(self, progress: Path, run_seed: int) -> None:

        import vmmshare.acl as acl

        # the runtime swallows a failed release/revoke in free_physical and logs "node call ... failed": report each
        # one as an event instead, so that the controller sees it (and stderr stays quiet)
        lg = logging.getLogger("vmmshare")
        lg.setLevel(logging.WARNING)
        lg.propagate = False
        lg.addHandler(_NodeCallFailures())
        self.acl = acl
        self.rt = acl.rt
        self.prog = c.Progress(progress)
        self.run_seed = run_seed
        self.gpu = os.environ.get("VMMSHARE_BACKEND") == "cuda"  # device memory is GPU memory: no CPU access
        assert self.rt.set_device(0) == 0
        tgid, ret = self.rt.device_get_bare_tgid()  # connects to the broker
        assert ret == 0, acl.get_recent_err_msg()
        self.tgid = tgid

    def step(self, phase: str) -> None:
        self.prog.step(PH[phase])

    def fail(self, phase: str, code: int, **extra: Any) -> None:
        _emit({"ev": "fail", "phase": phase, "code": code, "msg": self.acl.get_recent_err_msg()[:300], **extra})

    def check(self, ptr: int, seed: int) -> bool:
        return self.read(ptr, SIZE) == c.pattern(seed, SIZE)

    def read(self, ptr: int, n: int) -> bytes:
        """The bytes at `ptr`: read directly, or for GPU memory copied to the host (b"" if the copy fails)."""
        if not self.gpu:
            return ctypes.string_at(ptr, n)
        buf = ctypes.create_string_buffer(n)
        return buf.raw if self.rt.memcpy(ctypes.addressof(buf), n, ptr, n, 2) == 0 else b""

    def write(self, ptr: int, data: bytes) -> None:
        if not self.gpu:
            ctypes.memmove(ptr, data, len(data))
            return
        buf = ctypes.create_string_buffer(data, len(data))
        ret = self.rt.memcpy(ptr, len(data), ctypes.addressof(buf), len(data), 1)
        if ret:
            self.fail("write", ret)

    def reserve_map(self, h: int, **where: Any) -> tuple[int, int]:
        """Reserve a range and map `h` there: (address, 0), or (0, the code) after reporting the failure and
        freeing `h`."""
        self.step("reserve")
        p, ret = self.rt.reserve_mem_address(SIZE, 0, 0, 0)
        if ret:
            self.fail("reserve", ret, **where)
            self.rt.free_physical(h)
            return 0, ret
        self.step("map")
        ret = self.rt.map_mem(p, SIZE, 0, h, 0)
        if ret:
            self.fail("map", ret, **where)
            self.rt.free_physical(h)
            self.rt.release_mem_address(p)
            return 0, ret
        return int(p), 0

    def unmap_free(self, h: int, p: int) -> None:
        self.step("unmap")
        ret = self.rt.unmap_mem(p)
        if ret:
            self.fail("unmap", ret)
        self.step("free")
        ret = self.rt.free_physical(h)
        if ret:
            self.fail("free", ret)
        self.step("release")
        ret = self.rt.release_mem_address(p)
        if ret:
            self.fail("release", ret)
        self.step("idle")

    def common_op(self, op: str) -> bool:
        if op == "ping":
            _emit({"ev": "pong"})
        elif op == "counts":
            from vmmshare._process import runtime

            _emit({"ev": "counts", "fds": len(os.listdir("/proc/self/fd")), "rt": runtime().counts(),
                   "live": self.live_count()})
        else:
            return False
        return True

    def live_count(self) -> int:
        raise NotImplementedError


class ExporterWorker(_WorkerBase):
    def __init__(self, progress: Path, run_seed: int) -> None:
        super().__init__(progress, run_seed)
        self.live: deque[tuple[int, int, int, int]] = deque()  # (index, handle, ptr, seed)
        self.index = 0

    def live_count(self) -> int:
        return len(self.live)

    def cycle(self, flags: int, trust: list[int], keep: int) -> None:
        rt = self.rt
        i = self.index
        self.index += 1
        seed = c.seed_of(self.run_seed, os.getpid(), i)
        self.step("malloc")
        h, ret = rt.malloc_physical(SIZE, c.PROP, 0)
        if ret:
            return self.fail("malloc", ret, i=i)
        p, ret = self.reserve_map(h, i=i)
        if ret:
            return None
        self.step("write")
        self.write(p, c.pattern(seed, SIZE))
        self.live.append((i, h, p, seed))
        self.step("export")
        sh, ret = rt.mem_export_to_shareable_handle_v2(h, flags, c.DEFAULT)
        if ret:
            self.fail("export", ret, i=i)
        else:
            published = True
            if trust:
                self.step("set_pid")
                ret = rt.mem_set_pid_to_shareable_handle_v2(sh, c.DEFAULT, trust)
                if ret:
                    self.fail("set_pid", ret, i=i, sh=sh)
                    published = False
            if published:
                self.step("publish")
                _emit({"ev": "exp", "i": i, "sh": sh, "seed": seed})
        while len(self.live) > keep:
            _, oh, op_, _ = self.live.popleft()
            self.unmap_free(oh, op_)
        self.step("idle")
        return None

    def serve(self) -> None:
        _emit({"ev": "hello", "pid": os.getpid(), "tgid": self.tgid})
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "loop":
                for _ in range(int(cmd["n"])):
                    self.cycle(int(cmd.get("flags", 0)), list(cmd.get("trust", [])), int(cmd.get("keep", 1)))
                _emit({"ev": "looped"})
            elif op == "verify":
                bad = [i for i, _h, p, seed in self.live if not self.check(p, seed)]
                _emit({"ev": "verified", "n": len(self.live), "bad": bad})
            elif op == "free_all":
                n = len(self.live)
                while self.live:
                    _, h, p, _ = self.live.popleft()
                    self.unmap_free(h, p)
                _emit({"ev": "freed", "n": n})
            elif not self.common_op(op):
                _emit({"ev": "error", "msg": f"unknown op {op}"})
        while self.live:
            _, h, p, _ = self.live.popleft()
            self.unmap_free(h, p)


class ImporterWorker(_WorkerBase):
    def __init__(self, progress: Path, run_seed: int) -> None:
        super().__init__(progress, run_seed)
        self.held: dict[int, tuple[int, int, int]] = {}  # shareable -> (handle, ptr, seed)

    def live_count(self) -> int:
        return len(self.held)

    def import_one(self, sh: int, seed: int, keep: bool, report: bool = True) -> tuple[int, bool | None]:
        """import -> reserve -> map -> check; then keep it or unmap -> free -> release. (ret, data ok)."""
        rt = self.rt
        self.step("import")
        h, ret = rt.mem_import_from_shareable_handle_v2(sh, c.DEFAULT, 0)
        if ret:
            self.step("idle")
            if report:
                _emit({"ev": "imp", "sh": sh, "ret": ret, "msg": self.acl.get_recent_err_msg()[:200]})
            return ret, None
        p, ret = self.reserve_map(h, sh=sh)
        if ret:
            return ret, None
        self.step("verify")
        ok = self.check(p, seed)
        if report:
            _emit({"ev": "imp", "sh": sh, "ret": 0, "ok": ok, "kept": keep})
        if keep:
            self.held[sh] = (h, p, seed)
            self.step("idle")
        else:
            self.unmap_free(h, p)
        return 0, ok

    def serve(self) -> None:
        _emit({"ev": "hello", "pid": os.getpid(), "tgid": self.tgid})
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "import":
                for sh, seed, keep in cmd["handles"]:
                    self.import_one(int(sh), int(seed), bool(keep))
            elif op == "loop":  # the victim: no events per import, only a summary
                imports, bad, rets = 0, [], Counter[str]()
                for _ in range(int(cmd["rounds"])):
                    for sh, seed in cmd["handles"]:
                        ret, ok = self.import_one(int(sh), int(seed), False, report=False)
                        rets[str(ret)] += 1
                        imports += ret == 0
                        if ok is False:
                            bad.append(sh)
                _emit({"ev": "looped", "imports": imports, "bad": bad, "rets": dict(rets)})
            elif op == "probe":  # imports that must fail: a success is undone at once and reported
                probed: dict[str, int] = {}
                for sh in cmd["handles"]:
                    if int(sh) in self.held:
                        continue
                    h, ret = self.rt.mem_import_from_shareable_handle_v2(int(sh), c.DEFAULT, 0)
                    if ret == 0:
                        self.rt.free_physical(h)
                    probed[str(sh)] = ret
                _emit({"ev": "probed", "rets": probed})
            elif op == "verify":
                bad = [sh for sh, (_h, p, seed) in self.held.items() if not self.check(p, seed)]
                _emit({"ev": "verified", "n": len(self.held), "bad": bad})
            elif op == "free_all":
                n = len(self.held)
                for h, p, _ in list(self.held.values()):
                    self.unmap_free(h, p)
                self.held.clear()
                _emit({"ev": "freed", "n": n})
            elif not self.common_op(op):
                _emit({"ev": "error", "msg": f"unknown op {op}"})
        for h, p, _ in list(self.held.values()):
            self.unmap_free(h, p)


# ================================================================ the controller


class Run:
    """One faults run: counters, kill points and the violations of the invariants, per kind."""

    def __init__(self, seed: int, workdir: Path, capacity: int = 1 << 30,
                 backend_env: dict[str, str] | None = None) -> None:
        self.backend_env = backend_env or {}
        self.gpu = self.backend_env.get("VMMSHARE_BACKEND") == "cuda"
        self.used_key = "gpu_used" if self.gpu else "used"  # where `vmmshare ls` counts the memory
        self.seed = seed
        self.rng = random.Random(seed)
        self.workdir = workdir
        self.capacity = capacity
        self.kinds: dict[str, dict[str, Any]] = {}
        self.violations: list[dict[str, Any]] = []
        self.defects: list[dict[str, Any]] = []  # manifestations of the known defects D1 and D2 (see the docs)

    # ------------------------------------------------------------ plumbing

    def worker(self, role: str, env: dict[str, str], progress: Path) -> tuple[c.Worker, c.Progress, dict[str, Any]]:
        prog = c.Progress(progress, create=True)
        w = c.Worker([sys.executable, str(Path(__file__).resolve()), "--role", role, "--progress", str(progress),
                      "--seed", str(self.seed)], env, name=f"{role}-{progress.stem}")
        hello, _ = w.until("hello")
        return w, prog, hello

    def mem_info(self, broker: c.BrokerProc) -> tuple[int, int]:
        """(free, total) as the broker accounts them; for GPU memory, which it records but does not cap, the total
        is this run's capacity and free what the recorded allocations leave of it."""
        if not self.gpu:
            return c.raw_mem_info(broker.socket)
        return self.capacity - sum(c.raw_listing(broker.socket)["gpu_used"].values()), self.capacity

    def violate(self, kind: str, trial: int, what: str, **detail: Any) -> None:
        self.violations.append({"kind": kind, "trial": trial, "what": what, **detail})

    def new_broker(self, kind: str) -> tuple[c.BrokerProc, dict[str, str], Path]:
        folder = self.workdir / kind
        folder.mkdir(parents=True, exist_ok=True)
        env = c.clean_env(VMMSHARE_DEVICE_MEMORY=str(self.capacity), VMMSHARE_BROKER_IDLE="600", **self.backend_env)
        broker = c.BrokerProc(folder / "run", env=env)
        return broker, broker.env, folder

    def start_kind(self, broker: c.BrokerProc) -> tuple[Counter[str], Counter[str], int]:
        """A kind's counters (trial outcomes, kill phases) and the broker's fd count before any client."""
        return Counter(), Counter(), c.settled_fd_count(broker)

    def verify(self, kind: str, t: int, w: c.Worker, what: str) -> int:
        """Have `w` re-check every mapping it keeps (a violation, `what`, if any changed); how many it checked."""
        got = w.call({"op": "verify"}, "verified")
        if got["bad"]:
            self.violate(kind, t, what, bad=got["bad"])
        return int(got["n"])

    def check_nothing_held(self, kind: str, t: int, broker: c.BrokerProc, fds_base: int) -> None:
        """After a trial, with everything freed: full capacity, and the broker's fds at the trial baseline."""
        free, total = self.mem_info(broker)
        if free != total:
            self.violate(kind, t, "capacity not full after everything was freed", free=free, total=total)
        fds = c.settled_fd_count(broker)
        if fds != fds_base:
            self.violate(kind, t, "broker fds not at the baseline", fds=fds, baseline=fds_base)

    def finish_kind(self, kind: str, broker: c.BrokerProc, env: dict[str, str], folder: Path, fds0: int,
                    workers: list[c.Worker], counters: Counter[str], phases: Counter[str]) -> None:
        """Close the kind's clients; then the broker is back to its no-client fds, capacity is full, nothing is
        listed, and no process mentions the kind's folder."""
        for w in workers:
            rc = w.close()
            if rc != 0:
                self.violate(kind, -1, "a client did not exit cleanly", rc=rc, worker=w.name)
        c.barrier(broker.socket)
        fds = c.settled_fd_count(broker)
        if fds != fds0:
            self.violate(kind, -1, "broker fds not back to baseline after all clients exited", fds=fds, baseline=fds0)
        free, total = self.mem_info(broker) if self.gpu else c.actor_mem_info(env)
        if free != total:
            self.violate(kind, -1, "capacity not full after all clients exited", free=free, total=total)
        exports = c.raw_listing(broker.socket)["exports"]
        if exports:
            self.violate(kind, -1, "exports still listed after all clients exited", exports=exports[:3])
        broker.kill()
        stray = c.processes_mentioning(str(folder))
        if stray:
            self.violate(kind, -1, "processes left running", processes=stray)
            for pid, _ in stray:
                with contextlib.suppress(OSError):
                    os.kill(pid, 9)
        self.kinds[kind] = {
            "trials": counters.pop("trials", 0), "counters": dict(counters), "kill_phases": dict(phases),
            "leak_checks": 1, "final": {"broker_fds": fds, "baseline_fds": fds0, "free": free, "total": total,
                                        "stray_processes": len(stray)},
        }

    def check_imp_event(self, kind: str, t: int, ev: dict[str, Any], stats: Counter[str], kept: set[int],
                        allowed: tuple[int, ...] = (c.BAD_HANDLE,)) -> None:
        if ev.get("ev") == "fail":
            self.violate(kind, t, "importer step failed", event=ev)
            return
        if ev.get("ev") != "imp":
            self.violate(kind, t, "unexpected importer event", event=ev)
            return
        if ev["ret"] == 0:
            stats["imports_ok"] += 1
            stats["data_checks"] += 1
            if not ev["ok"]:
                self.violate(kind, t, "an importer saw wrong data right after import", sh=ev["sh"])
            if ev.get("kept"):
                kept.add(int(ev["sh"]))
        elif ev["ret"] in allowed:
            stats[f"imports_{ev['ret']}"] += 1
        else:
            self.violate(kind, t, "import failed with an unexpected code", event=ev)

    def kill_when(self, prog: c.Progress, target: int, watch: list[c.Worker], on_event: Any,
                  done: Any, limit: float = c.HANG_GUARD) -> None:
        """Serve events of `watch` until `prog` shows `target` operations done (or `done()`), bounded by time.

        The progress counter lives in shared memory, so it can only be polled: the wait between polls is a
        select on the workers' pipes (their events are handled as they come)."""
        deadline = c.Deadline(limit)
        fds = {w.fd: w for w in watch}
        for _ in range(10_000_000):
            if prog.read()[0] >= target or done() or deadline.passed():
                return
            # a target that cannot be reached: just serve events until done(), sleeping on the pipes
            wait = min(deadline.left(), 1.0) if target >= 1 << 62 else 0.0002
            ready, _, _ = select.select(list(fds), [], [], wait)
            for fd in ready:
                w = fds[fd]
                w.fill()
                for ev in w.take():
                    on_event(w, ev)
                if w.eof:
                    fds.pop(fd)
            if not fds:
                return

    def drain(self, w: c.Worker, on_event: Any) -> None:
        """All events of a worker up to the answer to a ping (so everything it was sent before is done)."""
        assert w.send({"op": "ping"})
        _, before = w.until("pong")
        for ev in before:
            on_event(w, ev)

    # ------------------------------------------------------------ exporter kills

    def exporter_kills(self, trials: int, deadline: c.Deadline) -> None:
        kind = "exporter"
        broker, env, folder = self.new_broker(kind)
        stats, phases, fds0 = self.start_kind(broker)
        imp, _iprog, ihello = self.worker("importer", env, folder / "imp.progress")
        fds_base = c.settled_fd_count(broker)
        imp_fds = imp.call({"op": "counts"}, "counts")["fds"]
        t = -1
        for t in range(trials):
            if deadline.passed():
                t -= 1
                break
            exp, prog, _ = self.worker("exporter", env, folder / f"e{t}.progress")
            flags = self.rng.choice([0, c.NO_PID_CHECK])
            trust = [ihello["tgid"]] if flags == 0 else []
            n, keep = self.rng.randint(2, 8), self.rng.randint(1, 3)
            target = self.rng.randint(1, n * 9)
            published: dict[int, int] = {}
            kept: set[int] = set()
            state = {"looped": False}

            def on_event(w: c.Worker, ev: dict[str, Any], t: int = t, published: dict[int, int] = published,
                         kept: set[int] = kept, state: dict[str, bool] = state, exp: c.Worker = exp) -> None:
                if w is exp:
                    if ev["ev"] == "exp":
                        published[int(ev["sh"])] = int(ev["seed"])
                        stats["published"] += 1
                        if ev["seed"] != c.seed_of(self.seed, exp.pid, ev["i"]):
                            self.violate(kind, t, "exporter published a foreign seed", event=ev)
                        if not state["looped"]:
                            imp.send({"op": "import", "handles": [[ev["sh"], ev["seed"], self.rng.random() < 0.5]]})
                    elif ev["ev"] == "looped":
                        state["looped"] = True
                    elif ev["ev"] != "fail":  # an exporter step can fail only when it is killed mid-way
                        self.violate(kind, t, "unexpected exporter event", event=ev)
                else:
                    self.check_imp_event(kind, t, ev, stats, kept)

            exp.send({"op": "loop", "n": n, "keep": keep, "flags": flags, "trust": trust})
            self.kill_when(prog, target, [exp, imp], on_event, lambda state=state: state["looped"])
            _, phase = prog.read()
            looped_before_kill = state["looped"]
            exp.kill()
            phases["after_loop" if looped_before_kill else PHASES[phase]] += 1
            state["looped"] = True  # publish nothing more to the importer
            for ev in exp.take():
                on_event(exp, ev)
            self.drain(imp, on_event)
            c.barrier(broker.socket)  # the broker has dropped the dead exporter
            stats["kept_checked_after_kill"] += self.verify(kind, t, imp, "kept mappings changed as the exporter died")
            probe = imp.call({"op": "probe", "handles": [sh for sh in published if sh not in kept]}, "probed")
            for sh, ret in probe["rets"].items():
                stats["probes"] += 1
                if ret != c.BAD_HANDLE:
                    self.violate(kind, t, "a dead exporter's handle was not revoked", sh=int(sh), ret=ret)
            imp.call({"op": "free_all"}, "freed")
            self.check_nothing_held(kind, t, broker, fds_base)
            if imp.call({"op": "counts"}, "counts")["fds"] != imp_fds:
                self.violate(kind, t, "importer fds leaked")
            prog.close()
            stats["trials"] += 1
        self.finish_kind(kind, broker, env, folder, fds0, [imp], stats, phases)

    # ------------------------------------------------------------ importer kills

    def importer_kills(self, trials: int, deadline: c.Deadline) -> None:
        kind = "importer"
        broker, env, folder = self.new_broker(kind)
        stats, phases, fds0 = self.start_kind(broker)
        exp, _eprog, _ = self.worker("exporter", env, folder / "exp.progress")
        sur, _sprog, shello = self.worker("importer", env, folder / "sur.progress")
        fds_base = c.settled_fd_count(broker)
        for t in range(trials):
            if deadline.passed():
                break
            vic, prog, vhello = self.worker("importer", env, folder / f"v{t}.progress")
            flags = self.rng.choice([0, c.NO_PID_CHECK])
            trust = [shello["tgid"], vhello["tgid"]] if flags == 0 else []
            k = self.rng.randint(1, 4)
            exp.send({"op": "loop", "n": k, "keep": k, "flags": flags, "trust": trust})
            _, events = exp.until("looped")
            handles = [[int(e["sh"]), int(e["seed"])] for e in events if e["ev"] == "exp"]
            if len(handles) != k or len(events) != k:
                self.violate(kind, t, "the exporter did not export cleanly", events=events)
            kept: set[int] = set()
            sur.send({"op": "import", "handles": [[sh, seed, True] for sh, seed in handles]})
            for _ in handles:
                ev = sur.next()
                assert ev is not None
                self.check_imp_event(kind, t, ev, stats, kept, allowed=())
            rounds = self.rng.randint(1, 5)
            target = self.rng.randint(1, rounds * k * 8)
            state = {"looped": False}

            def on_event(w: c.Worker, ev: dict[str, Any], t: int = t, state: dict[str, bool] = state) -> None:
                if ev["ev"] == "looped":
                    state["looped"] = True
                    if ev["bad"]:
                        self.violate(kind, t, "the victim saw wrong data", bad=ev["bad"])
                    if set(ev["rets"]) != {"0"}:
                        self.violate(kind, t, "the victim's imports of live, trustlisted handles failed",
                                     rets=ev["rets"])
                else:
                    self.violate(kind, t, "unexpected victim event", event=ev)

            vic.send({"op": "loop", "handles": handles, "rounds": rounds})
            self.kill_when(prog, target, [vic], on_event, lambda state=state: state["looped"])
            _, phase = prog.read()
            vic.kill()
            phases["after_loop" if state["looped"] else PHASES[phase]] += 1
            c.barrier(broker.socket)
            stats["kept_checked_after_kill"] += self.verify(kind, t, sur, "a surviving importer's bytes changed")
            self.verify(kind, t, exp, "the exporter's bytes changed")
            listing = c.raw_listing(broker.socket)
            rows = {int(r["handle"], 16): r for r in listing["exports"]}
            for sh, _ in handles:
                row = rows.get(sh)
                if row is None:
                    self.violate(kind, t, "an export vanished when an importer died", sh=sh)
                elif row["importers"] != [shello["tgid"]]:
                    self.violate(kind, t, "the dead importer is still counted", sh=sh, importers=row["importers"])
            if listing[self.used_key] != {"0": SIZE * k}:
                self.violate(kind, t, "charged bytes are not exactly the exporter's", used=listing[self.used_key])
            # the exports are untouched: the survivor imports them again, with the right bytes
            sur.call({"op": "free_all"}, "freed")
            sur.send({"op": "import", "handles": [[sh, seed, False] for sh, seed in handles]})
            for _ in handles:
                ev = sur.next()
                assert ev is not None
                self.check_imp_event(kind, t, ev, stats, kept, allowed=())
            sur.call({"op": "ping"}, "pong")  # it reports each import before freeing it: wait for the last free
            exp.call({"op": "free_all"}, "freed")
            self.check_nothing_held(kind, t, broker, fds_base)
            prog.close()
            stats["trials"] += 1
        self.finish_kind(kind, broker, env, folder, fds0, [exp, sur], stats, phases)

    # ------------------------------------------------------------ broker kills

    def _restart(self, broker: c.BrokerProc) -> None:
        """SIGKILL the broker and start it again, while holding the start lock (clients that noticed wait)."""
        with c.start_lock(broker):
            broker.kill()
            broker.start()

    def broker_kills(self, trials: int, deadline: c.Deadline, double_kill: float = 0.0) -> None:
        kind = "broker"
        broker, env, folder = self.new_broker(kind)
        stats, phases, fds0 = self.start_kind(broker)
        exp, eprog, _ = self.worker("exporter", env, folder / "exp.progress")
        imp, iprog, ihello = self.worker("importer", env, folder / "imp.progress")
        fds_base = c.settled_fd_count(broker)
        imp_fds = imp.call({"op": "counts"}, "counts")["fds"]
        exp_fds = exp.call({"op": "counts"}, "counts")["fds"]
        _, total = self.mem_info(broker)
        for t in range(trials):
            if deadline.passed():
                break
            double = self.rng.random() < double_kill
            n, keep = self.rng.randint(3, 10), self.rng.randint(1, 3)
            prog = eprog if self.rng.random() < 0.6 else iprog
            target = prog.read()[0] + self.rng.randint(1, n * 7)
            kept: set[int] = set()
            state = {"looped": False}
            # what a broker death may cost a client: the trustlist call of a handle that the dead broker exported
            # (107017 from the new one), an import of such a handle (107017), and the one call that was under way
            # when the broker died, which fails with 507022 (defect D1 in docs/reliability.md: the client's
            # single retry connects into the dying broker's listener and is reset): at most one per client and kill
            kills = 2 if double else 1
            lost: Counter[str] = Counter()

            def on_event(w: c.Worker, ev: dict[str, Any], t: int = t, kept: set[int] = kept,
                         state: dict[str, bool] = state, kills: int = kills, lost: Counter[str] = lost) -> None:
                code = ev.get("code", ev.get("ret"))
                if ev["ev"] in ("fail", "imp") and code == c.IPC_ERROR:
                    lost[w.name] += 1
                    stats["calls_lost_507022"] += 1
                    self.defects.append({"defect": "D1", "kind": kind, "trial": t, "client": w.name,
                                         "phase": ev.get("phase", "import"), "msg": ev.get("msg", "")[:160]})
                    if lost[w.name] > kills:
                        self.violate(kind, t, "more calls failed than broker deaths happened", event=ev)
                    return
                if w is exp:
                    if ev["ev"] == "exp":
                        stats["published"] += 1
                        imp.send({"op": "import", "handles": [[ev["sh"], ev["seed"], self.rng.random() < 0.5]]})
                    elif ev["ev"] == "looped":
                        state["looped"] = True
                    elif ev["ev"] == "fail" and (ev["phase"], ev["code"]) == ("set_pid", c.BAD_HANDLE):
                        stats["exporter_set_pid_107017"] += 1
                    elif ev["ev"] == "fail" and (ev["phase"], ev["code"]) == ("node_call", c.BAD_HANDLE):
                        # a release under way when the broker died, retried on the new broker, which never
                        # charged that allocation: harmless (free_physical succeeds and nothing is charged)
                        stats["exporter_release_107017"] += 1
                    else:
                        self.violate(kind, t, "unexpected exporter event", event=ev)
                elif ev["ev"] == "fail" and (ev["phase"], ev["code"]) == ("node_call", c.BAD_HANDLE):
                    stats["importer_release_107017"] += 1  # the same, for an import's release
                else:
                    self.check_imp_event(kind, t, ev, stats, kept)

            exp.send({"op": "loop", "n": n, "keep": keep, "flags": 0, "trust": [ihello["tgid"]]})
            self.kill_when(prog, target, [exp, imp], on_event, lambda state=state: state["looped"])
            phases[f"exporter:{PHASES[eprog.read()[1]]}"] += 1
            phases[f"importer:{PHASES[iprog.read()[1]]}"] += 1
            old = broker.pid
            self._restart(broker)
            stats["restarts"] += 1
            if double:
                # kill the new broker again as soon as a client has reconnected (it is re-charging, or about to)
                base = broker.fd_count()
                wait = c.Deadline(5.0)
                for _ in range(1_000_000):
                    if broker.fd_count() > base or wait.passed() or state["looped"]:
                        break
                    ready, _, _ = select.select([exp.fd, imp.fd], [], [], 0.0001)
                    for fd in ready:
                        w = exp if fd == exp.fd else imp
                        w.fill()
                        for ev in w.take():
                            on_event(w, ev)
                self._restart(broker)
                stats["double_kills"] += 1
            assert broker.pid != old
            # the loops go on by themselves on the restarted broker
            self.kill_when(prog, 1 << 62, [exp, imp], on_event, lambda state=state: state["looped"], limit=60)
            if not state["looped"]:
                self.violate(kind, t, "the exporter's loop did not finish after the restart")
                exp.until("looped", 60)
            self.drain(imp, on_event)
            stats["kept_checked_after_kill"] += self.verify(kind, t, imp, "mappings changed across the broker's death")
            self.verify(kind, t, exp, "the exporter's bytes changed across the broker's death")
            # the same clients go on: two fresh exports import, with the right bytes
            exp.send({"op": "loop", "n": 2, "keep": max(keep, 2), "flags": 0, "trust": [ihello["tgid"]]})
            _, events = exp.until("looped")
            fresh = [e for e in events if e["ev"] == "exp"]
            if len(fresh) != 2 or len(events) != 2:
                self.violate(kind, t, "the exporter did not go on after the restart", events=events)
            imp.send({"op": "import", "handles": [[e["sh"], e["seed"], False] for e in fresh]})
            for _ in fresh:
                ev = imp.next()
                assert ev is not None
                self.check_imp_event(kind, t, ev, stats, set(), allowed=())
                stats["imports_after_restart"] += ev.get("ret") == 0
            # the restarted broker charges exactly what is alive: the exporter's allocations
            imp.call({"op": "free_all"}, "freed")
            live = exp.call({"op": "counts"}, "counts")["live"]
            free, _ = self.mem_info(broker)
            if free != total - live * SIZE:
                detail = {"free": free, "expected": total - live * SIZE, "live": live, "double_kill": double}
                if double or lost[exp.name]:  # the exporter's reconnection failed mid-way: defect D2
                    stats["uncharged_allocations"] += (free - (total - live * SIZE)) // SIZE
                    self.defects.append({"defect": "D2", "kind": kind, "trial": t, **detail})
                else:
                    self.violate(kind, t, "the restarted broker does not charge exactly the live allocations",
                                 **detail)
            exp.call({"op": "free_all"}, "freed")
            self.check_nothing_held(kind, t, broker, fds_base)
            if imp.call({"op": "counts"}, "counts")["fds"] != imp_fds or \
                    exp.call({"op": "counts"}, "counts")["fds"] != exp_fds:
                self.violate(kind, t, "a client's fds leaked across the restart")
            stats["trials"] += 1
        self.finish_kind(kind, broker, env, folder, fds0, [exp, imp], stats, phases)


def run(kinds: list[str], trials: int, seconds: float | None, seed: int, double_kill: float = 0.0,
        workdir: Path | None = None, backend_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `trials` trials of each kind (each kind bounded by its share of `seconds`); returns the result."""
    own = workdir is None
    base = Path(tempfile.mkdtemp(prefix="vmmshare-faults-")) if workdir is None else workdir
    started = time.monotonic()
    r = Run(seed, base, backend_env=backend_env)
    try:
        for kind in kinds:
            share = None if seconds is None else seconds / len(kinds)
            deadline = c.Deadline(share)
            t0 = time.monotonic()
            if kind == "exporter":
                r.exporter_kills(trials, deadline)
            elif kind == "importer":
                r.importer_kills(trials, deadline)
            elif kind == "broker":
                r.broker_kills(trials, deadline, double_kill)
            else:
                raise ValueError(f"unknown kind {kind}")
            r.kinds[kind]["wall_s"] = round(time.monotonic() - t0, 2)
            r.kinds[kind]["trials_asked"] = trials
    finally:
        stray = c.processes_mentioning(str(base))
        for pid, _ in stray:
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
        if own:
            shutil.rmtree(base, ignore_errors=True)
    if stray:
        r.violations.append({"kind": "all", "trial": -1, "what": "processes left running", "processes": stray})
    return {"script": "faults", "seed": seed, "trials_per_kind": trials, "seconds_cap": seconds,
            "double_kill": double_kill, "machine": c.machine(), "kinds": r.kinds, "violations": r.violations,
            "defects": r.defects, "defect_counts": dict(Counter(d["defect"] for d in r.defects)),
            "wall_s": round(time.monotonic() - started, 2)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--fabric" in argv:  # across servers: stress/fabric_faults.py
        import fabric_faults

        return fabric_faults.main([a for a in argv if a != "--fabric"])
    ap = NarrowHelp(prog=prog(__file__), description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=count_option, default=200, help="trials of each kind (default 200)")
    ap.add_argument("--seconds", type=seconds_option, default=None,
                    help="cap on the whole run's time (split between kinds)")
    ap.add_argument("--seed", type=whole, default=None, help="random seed (default: random, and recorded)")
    ap.add_argument("--kinds", type=kinds(KINDS), default=list(KINDS),
                    help="comma-separated: exporter,importer,broker (default: all three)")
    ap.add_argument("--double-kill", type=fraction, default=0.0,
                    help="fraction of broker trials that kill the restarted broker again while clients reconnect")
    ap.add_argument("--json", help="write the result here ('-': stdout, instead of the summary)")
    ap.add_argument("--backend", choices=["host", "cuda", "fakecuda"], default="host",
                    help="device memory: host memfds (default), a real GPU, or fakecuda/ (the CPU stand-in for "
                         "the CUDA driver, built with $CC)")
    ap.add_argument("--role", choices=["exporter", "importer"], help=argparse.SUPPRESS)
    ap.add_argument("--progress", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    check_outputs(ap, json=None if args.json == "-" else args.json)
    if args.role:
        cls = ExporterWorker if args.role == "exporter" else ImporterWorker
        cls(args.progress, args.seed or 0).serve()
        return 0
    if problem := c.backend_problem(args.backend):
        ap.exit(2, f"{ap.prog}: {problem}\n")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    with c.backend_env(args.backend) as extra:
        result = run(args.kinds, args.trials, args.seconds, seed, args.double_kill, backend_env=extra)
    result["backend"] = args.backend
    lines = [f"faults: {args.backend} backend, seed {seed}, {len(result['violations'])} violation(s), "
             f"known defects seen: {readable(result['defect_counts'])}"]
    lines += [f"  {k:9s} {v.get('trials')} trials in {v.get('wall_s')} s" for k, v in result["kinds"].items()]
    lines += [f"  VIOLATION {readable(v)[:400]}" for v in result["violations"][:20]]
    emit(lines, result, args.json)
    return 1 if result["violations"] or result["defects"] else 0


if __name__ == "__main__":
    entry(main)
