"""Identity: who may import is decided by the kernel's idea of the peer, never by what a client claims.

    vmmshare stress identity --reuse 200 --containers 50 --guesses 1000000 --seed 1 --json identity.json

(a) pid reuse. This process exports a handle (pid validation on) and, per trial, forks a process A, trustlists A's
    pid, kills A, sets /proc/sys/kernel/ns_last_pid to A-1 and forks B, which then has A's pid, and has B import.
    B must be refused (207006) every time. Trials are "fast" (A forked as a clock tick begins and B right after it:
    usually within that tick, 1/CLK_TCK s) or "slow" (B forked once the tick has moved on); each records whether B got
    the pid and whether its start time (/proc/<pid>/stat, in ticks) equals A's. `--reuse-ns` trials run the same
    thing inside a fresh pid namespace (`unshare --pid --fork --mount-proc`, broker included), where pids restart
    at 1. Runs as root (ns_last_pid needs CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE); skipped with the reason
    otherwise.
(b) pid namespaces. Per trial, two processes in pid namespaces of their own (`unshare --pid --fork --kill-child`),
    both pid 1 inside: the one trustlisted by its bare tgid (device_get_bare_tgid: the host pid) imports, the
    other is refused.
(c) another uid. A client running as `nobody` (setpriv / runuser) against a broker started by root: without
    --multi-user it cannot connect (507022, the message names the socket); with the socket reachable anyway
    (folder 0755, socket 0666) the broker's own uid check refuses it (logged, connection closed); with
    --multi-user it connects and the trustlist decides (207006 / import), and `vmmshare ls --json` masks the
    handle values it shows to nobody.
(d) guessing. A raw client sends IMPORT frames with random 64-bit DEFAULT handles, pipelined, while a handful of
    real exports without pid validation are live (a hit would import): every reply must be 107017. Positive
    control: the real handles, sent the same way, do import.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import pwd
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as c
from stressio import emit, entry, prog, readable, seconds_option, whole
from vmmshare.cli.console import NarrowHelp, check_outputs
from vmmshare.wire import local as P

NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")
CLK_TCK = os.sysconf("SC_CLK_TCK")
ME = str(Path(__file__).resolve())


# ================================================================ (a) pid reuse


def _start_ticks(pid: int) -> int | None:
    from vmmshare.broker.identity import process_start_time

    return process_start_time(pid)


def _boot_ticks() -> int:
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * CLK_TCK)


def ns_last_pid_refusal() -> str:
    """Why this process cannot steer the kernel's next pid through ns_last_pid, "" when it can. Only a write tells:
    it needs CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE, and the file is mode 0666 on some kernels."""
    try:
        NS_LAST_PID.write_text(NS_LAST_PID.read_text())  # the value it has: steers nothing
    except OSError as exc:
        return f"{NS_LAST_PID} is not writable here ({exc.strerror}): cannot make the kernel reuse a pid"
    return ""


def reuse_scenario(trials: int, mode: str, seed: int, limit: float) -> dict[str, Any]:
    """Run in a small process of its own (forks are cheap there): start a broker, export, and force pid reuse."""
    why = ns_last_pid_refusal()
    if why:
        return {"skipped": why}
    work = Path(tempfile.mkdtemp(prefix="vmmshare-reuse-"))
    broker = c.BrokerProc(work / "run", env=c.clean_env())
    os.environ["VMMSHARE_SOCKET"] = str(broker.socket)
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    deadline = c.Deadline(limit)
    try:
        import vmmshare.acl as acl

        rt = acl.rt
        assert rt.set_device(0) == 0
        h, ret = rt.malloc_physical(c.MiB2, c.PROP, 0)
        assert ret == 0, acl.get_recent_err_msg()
        sh, ret = rt.mem_export_to_shareable_handle_v2(h, 0, c.DEFAULT)
        assert ret == 0, acl.get_recent_err_msg()
        for _ in range(trials):
            if deadline.passed():
                break
            slow = mode == "slow" or (mode == "mixed" and rng.random() < 0.5)
            r, w = os.pipe()
            if not slow:  # fork A as a clock tick begins: B, forked right after, then has the rest of it
                tick = _boot_ticks()
                while _boot_ticks() == tick:  # at most one tick (1/CLK_TCK s)
                    pass
            a = os.fork()
            if a == 0:  # A: alive while it is trustlisted
                os.close(w)
                os.read(r, 1)
                os._exit(0)
            os.close(r)
            a_start = _start_ticks(a)
            ret = rt.mem_set_pid_to_shareable_handle_v2(sh, c.DEFAULT, [a])
            assert ret == 0, acl.get_recent_err_msg()
            os.kill(a, signal.SIGKILL)
            os.waitpid(a, 0)
            os.close(w)
            if slow and a_start is not None:  # poll the clock (bounded) until B cannot share A's start tick
                wait = c.Deadline(2.0)
                while _boot_ticks() <= a_start + 1 and not wait.passed():
                    time.sleep(1 / CLK_TCK / 4)
            NS_LAST_PID.write_text(str(a - 1))
            rr, ww = os.pipe()
            b = os.fork()
            if b == 0:  # B: the process that (usually) got A's pid; imports as that pid
                code = 1
                try:
                    os.close(rr)
                    start = _start_ticks(os.getpid())
                    assert rt.set_device(0) == 0
                    hh, ret = rt.mem_import_from_shareable_handle_v2(sh, c.DEFAULT, 0)
                    if ret == 0:
                        rt.free_physical(hh)
                    os.write(ww, json.dumps({"start": start, "ret": ret,
                                             "msg": acl.get_recent_err_msg()[:200]}).encode())
                    code = 0
                finally:
                    os._exit(code)
            os.close(ww)
            with os.fdopen(rr, "rb") as f:
                data = f.read()
            _, status = os.waitpid(b, 0)
            got = json.loads(data) if data else {"start": None, "ret": None, "msg": f"B died ({status})"}
            rows.append({"pid": a, "slow": slow, "reused": b == a, "same_tick": got["start"] == a_start,
                         "ret": got["ret"], "msg": got["msg"]})
        rt.free_physical(h)
    finally:
        broker.kill()
        shutil.rmtree(work, ignore_errors=True)
    reused = [r for r in rows if r["reused"]]
    accepted = [r for r in reused if r["ret"] != c.NO_PERMISSION]
    return {
        "mode": mode, "trials": len(rows), "reused": len(reused),
        "reused_same_tick": sum(r["same_tick"] for r in reused),
        "reused_later_tick": sum(not r["same_tick"] for r in reused),
        "refused": sum(r["ret"] == c.NO_PERMISSION for r in reused),
        "accepted_same_tick": sum(r["same_tick"] for r in accepted),
        "accepted_later_tick": sum(not r["same_tick"] for r in accepted),
        "accepted_examples": accepted[:5],
        "refusal_messages": sorted({r["msg"] for r in reused if r["ret"] == c.NO_PERMISSION})[:3],
    }


def run_reuse(trials: int, mode: str, seed: int, in_pidns: bool = False, limit: float = 120.0) -> dict[str, Any]:
    """`reuse_scenario` in a fresh small process (optionally inside a new pid namespace); its result."""
    cmd = [sys.executable, ME, "--role", "reuse", "--trials", str(trials), "--mode", mode, "--seed", str(seed),
           "--seconds", str(limit)]
    if in_pidns:
        if shutil.which("unshare") is None:
            return {"skipped": "no unshare(1) here"}
        cmd = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", *cmd]
    # a hang guard only: nothing asserts on time
    out = subprocess.run(cmd, env=c.clean_env(), capture_output=True, text=True, timeout=limit + 60)
    if out.returncode != 0:
        if in_pidns and "unshare" in out.stderr:
            return {"skipped": f"cannot create a pid namespace here: {out.stderr.strip()[-300:]}"}
        raise RuntimeError(f"reuse scenario failed ({out.returncode}): {out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout)
    result["in_pid_namespace"] = in_pidns
    return result


# ================================================================ (b) pid namespaces


UNSHARE_PID = ["unshare", "--pid", "--fork", "--kill-child"]


def container_actor(env: dict[str, str]) -> tuple[c.Actor, int]:
    """An Actor in a pid namespace of its own, and its host pid (the one child of `unshare`)."""
    a = c.Actor(env, prefix=UNSHARE_PID)
    kids = c.host_children(a.proc.pid)
    if len(kids) != 1:
        a.kill()
        raise RuntimeError(f"unshare {a.proc.pid} has children {kids}, expected one")
    return a, kids[0]


def ok(a: c.Actor, name: str, *args: Any) -> Any:
    result = a.call(name, *args)
    ret = result[-1] if isinstance(result, tuple) else result
    if ret != 0:
        raise AssertionError(f"{name}{args!r} in pid {a.pid} returned {result!r}: {a.last_err}")
    if not isinstance(result, tuple):
        return None
    return result[0] if len(result) == 2 else result[:-1]


def export_mapped(a: c.Actor, flags: int = 0, pids: list[int] | None = None, fill: int = 0x5A) -> tuple[int, int, str]:
    """(shareable, ptr, sha256) of a fresh 2 MiB allocation in `a`, filled, mapped, exported (V2 DEFAULT)."""
    h = ok(a, "rt.malloc_physical", c.MiB2, c.PROP, 0)
    p = ok(a, "rt.reserve_mem_address", c.MiB2, 0, 0, 0)
    ok(a, "rt.map_mem", p, c.MiB2, 0, h, 0)
    a.call("!write", p, fill, c.MiB2)
    a.call("!write_bytes", p, os.urandom(64))
    sh = ok(a, "rt.mem_export_to_shareable_handle_v2", h, flags, c.DEFAULT)
    if pids:
        ok(a, "rt.mem_set_pid_to_shareable_handle_v2", sh, c.DEFAULT, pids)
    return sh, p, a.call("!sha256", p, c.MiB2)


def import_digest(a: c.Actor, sh: int) -> str:
    """Import (V2), map, and return the sha256 of the bytes `a` sees; then unmap and free."""
    h = ok(a, "rt.mem_import_from_shareable_handle_v2", sh, c.DEFAULT, 0)
    p = ok(a, "rt.reserve_mem_address", c.MiB2, 0, 0, 0)
    ok(a, "rt.map_mem", p, c.MiB2, 0, h, 0)
    digest: str = a.call("!sha256", p, c.MiB2)
    ok(a, "rt.unmap_mem", p)
    ok(a, "rt.free_physical", h)
    ok(a, "rt.release_mem_address", p)
    return digest


def namespace_trials(trials: int, limit: float) -> dict[str, Any]:
    if shutil.which("unshare") is None:
        return {"skipped": "no unshare(1) here"}
    work = Path(tempfile.mkdtemp(prefix="vmmshare-pidns-"))
    broker = c.BrokerProc(work / "run", env=c.clean_env())
    n: Counter[str] = Counter()
    problems: list[str] = []
    deadline = c.Deadline(limit)
    e = c.Actor(broker.env)
    try:
        for _ in range(trials):
            if deadline.passed():
                break
            try:
                c1, host1 = container_actor(broker.env)
            except RuntimeError as exc:
                return {"skipped": f"cannot start a process in a new pid namespace: {exc}"}
            c2, _ = container_actor(broker.env)
            try:
                n["trials"] += 1
                if (c1.pid, c2.pid) != (1, 1):
                    problems.append(f"inner pids {c1.pid}, {c2.pid}, expected 1, 1")
                tgid = ok(c1, "rt.device_get_bare_tgid")
                if tgid != host1:
                    problems.append(f"bare tgid {tgid} is not the host pid {host1}")
                sh, _p, digest = export_mapped(e, pids=[tgid])
                if import_digest(c1, sh) != digest:
                    problems.append("the trustlisted container saw other bytes")
                else:
                    n["imports_by_bare_tgid"] += 1
                ret = c2.call("rt.mem_import_from_shareable_handle_v2", sh, c.DEFAULT, 0)[-1]
                if ret != c.NO_PERMISSION:
                    problems.append(f"a second container, also pid 1 inside, got {ret}")
                else:
                    n["sibling_refused"] += 1
            finally:
                c1.kill()
                c2.kill()
    finally:
        e.kill()
        broker.kill()
        shutil.rmtree(work, ignore_errors=True)
    return {**n, "problems": problems}


# ================================================================ (c) another uid


def other_user() -> tuple[list[str] | None, str]:
    """A command prefix that runs a program as `nobody` (or None), and why not."""
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        return None, "there is no user nobody"
    if os.geteuid() != 0:
        return None, "only root can run a process as nobody here"
    if shutil.which("setpriv"):
        return ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups"], ""
    if shutil.which("runuser"):
        return ["runuser", "-u", "nobody", "--"], ""
    return None, "neither setpriv nor runuser is installed"


def nobody_env(prefix: list[str], env: dict[str, str]) -> tuple[dict[str, str] | None, str]:
    """`env` plus what a process running as nobody needs to import vmmshare and run actor.py, or the reason
    it cannot: tried as is, with PYTHONPATH=src, and with a world-readable copy of src."""
    probe = "import vmmshare.acl, sys; open(sys.argv[1]).close()"
    tries: list[dict[str, str]] = [{}, {"PYTHONPATH": str(c.SRC)}]
    copy = None
    last = ""
    for extra in [*tries, None]:
        if extra is None:  # last resort: a copy of the package that nobody can read
            copy = Path(tempfile.mkdtemp(prefix="vmmshare-src-"))
            atexit.register(shutil.rmtree, copy, True)
            os.chmod(copy, 0o755)
            shutil.copytree(c.SRC / "vmmshare", copy / "vmmshare",
                            ignore=shutil.ignore_patterns("__pycache__"))
            for root, dirs, files in os.walk(copy):
                for d in dirs:
                    os.chmod(os.path.join(root, d), 0o755)
                for f in files:
                    os.chmod(os.path.join(root, f), 0o644)
            extra = {"PYTHONPATH": str(copy)}
        full = {**env, "PYTHONNOUSERSITE": "1", **extra}
        out = subprocess.run([*prefix, sys.executable, "-c", probe, str(c.TESTS / "actor.py")], env=full,
                             capture_output=True, text=True, timeout=c.HANG_GUARD)
        if out.returncode == 0:
            return full, ""
        last = out.stderr.strip()[-300:]
    return None, f"a process running as nobody cannot import vmmshare or read actor.py: {last}"


def world_dir(prefix: str) -> Path:
    """A fresh folder that every user can traverse (0755), inside /tmp."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(d, 0o755)
    return d


def ls_json(env: dict[str, str], prefix: list[str] | None = None) -> dict[str, Any]:
    out = subprocess.run([*(prefix or []), sys.executable, "-m", "vmmshare.cli", "ls", "--json"], env=env,
                         capture_output=True, text=True, timeout=c.HANG_GUARD)
    if out.returncode != 0:
        raise RuntimeError(f"vmmshare ls --json failed ({out.returncode}): {out.stderr[-1000:]}")
    result: dict[str, Any] = json.loads(out.stdout)
    result["_raw"] = out.stdout
    return result


def other_uid_scenarios() -> dict[str, Any]:
    """The three (c) scenarios once; the outcomes (the test file asserts the same things, one test each)."""
    prefix, why = other_user()
    if prefix is None:
        return {"skipped": why}
    base = world_dir("vmmshare-uid-")
    out: dict[str, Any] = {}
    try:
        # 1. single-user broker, folder 0700: nobody cannot reach it
        b = c.LoggedBroker(base / "single", env=c.clean_env())
        env, why = nobody_env(prefix, b.env)
        if env is None:
            b.kill()
            return {"skipped": why}
        a = c.Actor(env, prefix=prefix)
        ret = a.call("rt.get_mem_info", 0)[-1]
        out["single_user"] = {"ret": ret, "names_socket": str(b.socket) in a.last_err, "msg": a.last_err}
        # 2. the same broker with its socket reachable anyway: the broker's own uid check refuses
        os.chmod(b.folder, 0o755)
        os.chmod(b.socket, 0o666)
        ret = a.call("rt.get_mem_info", 0)[-1]
        c.barrier(b.socket)
        uid = os.stat(f"/proc/{a.pid}").st_uid
        logged = f"refused pid {a.pid} of uid {uid}" in b.log_text()
        out["reachable_single_user"] = {"ret": ret, "names_socket": str(b.socket) in a.last_err,
                                        "broker_logged_refusal": logged, "msg": a.last_err}
        a.kill()
        b.kill()
        # 3. multi-user broker: the trustlist decides
        m = c.LoggedBroker(base / "multi", "--multi-user", env=c.clean_env())
        env, _ = nobody_env(prefix, m.env)
        assert env is not None
        root_actor = c.Actor(m.env)
        nob = c.Actor(env, prefix=prefix)
        try:
            sh, _p, digest = export_mapped(root_actor)
            first = nob.call("rt.mem_import_from_shareable_handle_v2", sh, c.DEFAULT, 0)[-1]
            tgid = ok(nob, "rt.device_get_bare_tgid")
            ok(root_actor, "rt.mem_set_pid_to_shareable_handle_v2", sh, c.DEFAULT, [tgid])
            seen = import_digest(nob, sh)
            mine = ls_json(m.env)
            theirs = ls_json(env, prefix)
            out["multi_user"] = {
                "folder_mode": oct(stat.S_IMODE(m.folder.stat().st_mode)),
                "socket_mode": oct(stat.S_IMODE(m.socket.stat().st_mode)),
                "not_trustlisted_ret": first, "trustlisted_import_same_bytes": seen == digest,
                "root_sees": mine["exports"][0]["handle"], "nobody_sees": theirs["exports"][0]["handle"],
                "full_value_hidden_from_nobody": f"{sh:016x}" not in theirs["_raw"] and str(sh) not in theirs["_raw"],
            }
        finally:
            nob.kill()
            root_actor.kill()
            m.kill()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return out


# ================================================================ (d) guessing


def guess(path: Path, count: int, seed: int, batch: int = 32, limit: float | None = None,
          control: list[int] | None = None) -> dict[str, Any]:
    """Send `count` IMPORT frames with random 64-bit handles over one raw connection, `batch` at a time.

    Returns how many came back as anything but 107017 (a hit, or another error), the rate, and, for the handles
    in `control` (real exports), what the same path answers."""
    rng = random.Random(seed)
    deadline = c.Deadline(limit)
    replies: Counter[str] = Counter()
    odd: list[dict[str, Any]] = []
    sent = 0
    with c.Raw(path) as raw:
        t0 = time.perf_counter()
        while sent < count and not deadline.passed():
            n = min(batch, count - sent)
            handles = [rng.getrandbits(64) for _ in range(n)]
            for k, handle in enumerate(handles):
                raw.sock.send(P.encode(P.Import(handle, c.DEFAULT, bytes(32)), sent + k + 1))
            for k, handle in enumerate(handles):
                frame, fds = raw.recv()
                for fd in fds:
                    os.close(fd)
                reply = frame.message
                if isinstance(reply, P.Error) and reply.code == c.BAD_HANDLE and frame.req == sent + k + 1:
                    replies["107017"] += 1
                else:
                    key = str(reply.code) if isinstance(reply, P.Error) else reply.TYPE.name
                    replies[key] += 1
                    if len(odd) < 10:
                        odd.append({"handle": handle, "reply": key, "req": frame.req})
            sent += n
        elapsed = time.perf_counter() - t0
        controls = []
        for handle in control or []:
            controls.append(raw.ask(P.Import(handle, c.DEFAULT, bytes(32))).TYPE.name)
    return {"guesses": sent, "not_107017": sent - replies["107017"], "replies": dict(replies), "odd": odd,
            "seconds": round(elapsed, 3), "guesses_per_s": round(sent / elapsed, 1) if elapsed else None,
            "control_replies": controls}


def guessing_run(count: int, seed: int, exports: int = 8, limit: float | None = None) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="vmmshare-guess-"))
    broker = c.BrokerProc(work / "run", env=c.clean_env())
    e = c.Actor(broker.env)
    try:
        real = [export_mapped(e, flags=c.NO_PID_CHECK)[0] for _ in range(exports)]
        result = guess(broker.socket, count, seed, limit=limit, control=real)
        result["live_exports"] = exports
        result["odds_per_guess"] = exports / 2**64
        result["expected_hits"] = result["guesses"] * exports / 2**64
        # what `vmmshare ls` shows other users (the top 16 bits) would leave 48 bits to guess
        rate = result["guesses_per_s"] or 1
        result["years_to_expect_a_hit_knowing_16_bits"] = round(2**48 / exports / rate / 3.156e7, 1)
        result["broker_alive"] = broker.alive()
    finally:
        e.kill()
        broker.kill()
        shutil.rmtree(work, ignore_errors=True)
    return result


# ================================================================ main


def main(argv: list[str] | None = None) -> int:
    ap = NarrowHelp(prog=prog(__file__), description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reuse", type=whole, default=200, help="pid-reuse trials on the host (half fast, half slow)")
    ap.add_argument("--reuse-ns", type=whole, default=50, help="pid-reuse trials inside a fresh pid namespace")
    ap.add_argument("--containers", type=whole, default=50, help="pid-namespace trials")
    ap.add_argument("--guesses", type=whole, default=1_000_000, help="random handle guesses")
    ap.add_argument("--seconds", type=seconds_option, default=None, help="cap on each part's time")
    ap.add_argument("--seed", type=whole, default=None, help="random seed (default: random, and recorded)")
    ap.add_argument("--json", help="write the result here ('-': stdout, instead of the summary)")
    ap.add_argument("--role", choices=["reuse"], help=argparse.SUPPRESS)
    ap.add_argument("--trials", type=int, default=10, help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=["fast", "slow", "mixed"], default="mixed", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    check_outputs(ap, json=None if args.json == "-" else args.json)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    if args.role == "reuse":
        print(json.dumps(reuse_scenario(args.trials, args.mode, seed, args.seconds or 600)))
        return 0
    limit = args.seconds or 600.0
    t0 = time.monotonic()
    result: dict[str, Any] = {"script": "identity", "seed": seed, "machine": c.machine(), "seconds_cap": args.seconds}
    parts: dict[str, Any] = {}
    parts["reuse_host"] = run_reuse(args.reuse, "mixed", seed, limit=limit)
    parts["reuse_pid_namespace"] = run_reuse(args.reuse_ns, "mixed", seed + 1, in_pidns=True, limit=limit)
    parts["pid_namespaces"] = namespace_trials(args.containers, limit)
    parts["other_uid"] = other_uid_scenarios()
    parts["guessing"] = guessing_run(args.guesses, seed, limit=limit)
    result.update(parts)
    violations = []
    for key in ("reuse_host", "reuse_pid_namespace"):
        r = parts[key]
        if "skipped" not in r and r["refused"] != r["reused"]:
            violations.append({"part": key, "what": "a process that reused a trustlisted pid imported",
                               "accepted_same_tick": r["accepted_same_tick"],
                               "accepted_later_tick": r["accepted_later_tick"], "of_reused": r["reused"]})
    ns = parts["pid_namespaces"]
    if "skipped" not in ns and ns["problems"]:
        violations.append({"part": "pid_namespaces", "problems": ns["problems"][:5]})
    u = parts["other_uid"]
    if "skipped" not in u:
        bad = []
        if u["single_user"]["ret"] != c.IPC_ERROR or not u["single_user"]["names_socket"]:
            bad.append("single-user broker")
        r = u["reachable_single_user"]
        if r["ret"] != c.IPC_ERROR or not r["broker_logged_refusal"]:
            bad.append("uid check")
        mu = u["multi_user"]
        if mu["not_trustlisted_ret"] != c.NO_PERMISSION or not mu["trustlisted_import_same_bytes"] or \
                not mu["full_value_hidden_from_nobody"]:
            bad.append("multi-user")
        if bad:
            violations.append({"part": "other_uid", "failed": bad})
    g = parts["guessing"]
    if g["not_107017"] or any(x != "IMPORTED" for x in g["control_replies"]) or not g["broker_alive"]:
        violations.append({"part": "guessing", "not_107017": g["not_107017"], "control": g["control_replies"]})
    result["violations"] = violations
    result["wall_s"] = round(time.monotonic() - t0, 2)
    lines = [f"identity: seed {seed}, {len(violations)} violation(s) in {result['wall_s']} s"]
    lines += [f"  VIOLATION {readable(v)[:400]}" for v in violations]
    emit(lines, result, args.json)
    return 1 if violations else 0


if __name__ == "__main__":
    entry(main)
