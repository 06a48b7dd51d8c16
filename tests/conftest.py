"""Shared fixtures and helpers: real memory (memfd + mmap), no mocks.

`acl` sets device 0 in the test thread and checks, at teardown, that the runtime's tables hold nothing the test
created. `vmm` creates objects through the pyACL surface and cleans them up in the right order, so a failing test
does not leak into the next one.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import gc
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

# The harness the tests share with the stress runs (procs, actor, rawsock, fabric_cluster, fakecuda) ships in the
# package, in vmmshare/cli/stress/; its modules import one another by bare name, so that folder goes on sys.path.
STRESS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "vmmshare", "cli", "stress")
if STRESS not in sys.path:
    sys.path.insert(0, STRESS)

# A private broker for this test session (SPEC §5 starts one on first use): the capacity numbers and tables the
# tests check must not be shared with other processes on the machine. Set before the runtime is first created.
# The folder is made by whoever first needs it (the broker client makes it 0700) and removed at exit.
_SESSION_DIR = os.path.join(tempfile.gettempdir(), f"vmmshare-tests-{os.getpid()}-{secrets.token_hex(4)}")
atexit.register(shutil.rmtree, _SESSION_DIR, True)
os.environ["VMMSHARE_SOCKET"] = os.path.join(_SESSION_DIR, "broker.sock")
os.environ["VMMSHARE_BROKER_IDLE"] = "1"
for _var in ("VMMSHARE_DEVICE_MEMORY", "VMMSHARE_PREPOPULATE", "VMMSHARE_BACKEND"):
    os.environ.pop(_var, None)

import vmmshare.acl as _acl  # noqa: E402
from cacl import c_name  # noqa: E402
from procs import Actor, BrokerProc, start_zygote, stop_zygote, zygote_for  # noqa: E402
from vmmshare._process import runtime  # noqa: E402
from vmmshare.errors import set_recent_error  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
G2M = 2 * MiB
ARENA_START = 16 << 40
ARENA_END = 24 << 40

ACL_PARAM = 100000  # ACL_ERROR_INVALID_PARAM: a check of the acl layer itself (SPEC §4a)
PARAM = 107000
BAD_DEVICE = 107001
NO_CONTEXT = 107002
BAD_HANDLE = 107017
BAD_MEMORY_TYPE = 107016
NOT_SUPPORTED = 207000
NO_MEMORY = 207001
INTERNAL = 507000

DEVICE = 1
HOST = 0
NONE, READ, READWRITE = 0x0, 0x1, 0x3

SIGSEGV_RC = -signal.SIGSEGV


# ---------------------------------------------------------------- running in parallel (pytest-xdist)

# scripts/test.sh runs the suite on several workers (`-n N --dist loadgroup`). Each worker is a process of its own,
# with its own private broker above. A test marked `alone` changes or measures what the whole machine shares (the
# kernel's next pid, the hugetlb pool): it runs with no other test of the run in progress, on one worker (the
# xdist_group "alone"), after every other test. Tests marked `slow` start first, so the run does not end waiting on
# one long test.
ALONE = "alone"


class RunLock:
    """Lets an `alone` test run only while no other test of this run does: every test holds `room` shared, an alone
    test holds it exclusive; `gate` (taken to enter) makes a waiting alone test block newcomers, so it is not
    starved by a stream of shared holders. flock(2) locks are the workers' own (close-on-exec, never inherited)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        os.makedirs(folder, mode=0o700, exist_ok=True)
        self.gate = os.open(os.path.join(folder, "gate"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.room = os.open(os.path.join(folder, "room"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    @contextlib.contextmanager
    def held(self, alone: bool) -> Iterator[None]:
        fcntl.flock(self.gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(self.gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self.room, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(self.gate, fcntl.LOCK_UN)


_RUN_LOCK: RunLock | None = None


def pytest_configure(config: pytest.Config) -> None:
    """In an xdist worker (and only there: not in a pytest that a test runs), open the run's lock. Every worker opens
    it before any test runs (tests are handed out once all have collected), so whichever worker ends first may
    remove the folder: the others keep locking the same files through the fds they hold. In each process that runs
    tests, start the zygote that forks the tests' actors and `run_child` children (stress/zygote.py)."""
    global _RUN_LOCK
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        _RUN_LOCK = RunLock(os.path.join(tempfile.gettempdir(), f"vmmshare-tests-run-{workerinput['testrunuid']}"))
    if workerinput is not None or not config.pluginmanager.hasplugin("xdist") or not config.getoption("numprocesses"):
        import importlib.util

        start_zygote({k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"},
                     torch=importlib.util.find_spec("torch") is not None)


def pytest_unconfigure(config: pytest.Config) -> None:
    stop_zygote()
    if _RUN_LOCK is not None:
        shutil.rmtree(_RUN_LOCK.folder, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Slow tests first, alone tests last (and in one xdist group); otherwise the order of the files."""
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            if item.get_closest_marker(ALONE) is not None:
                item.add_marker(pytest.mark.xdist_group(ALONE))

    def rank(item: pytest.Item) -> int:
        if item.get_closest_marker(ALONE) is not None:
            return 2
        return 0 if item.get_closest_marker("slow") is not None else 1

    items.sort(key=rank)  # stable: the order within each rank is kept


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move what collection built (modules, items, parameters) out of the collector's reach: many tests call
    gc.collect() to count only their own objects, and each call would otherwise walk the whole heap again."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Setup, call and teardown of each test under the run's lock (see RunLock)."""
    if _RUN_LOCK is None:
        return (yield)
    with _RUN_LOCK.held(item.get_closest_marker(ALONE) is not None):
        return (yield)


# ---------------------------------------------------------------- tests that need something this machine may lack

ROOT_GATE = "VMMSHARE_REQUIRE_ROOT_TESTS"  # CI runs as root: the tests that need root or a kernel feature must run
CUDA_GATE = "VMMSHARE_REQUIRE_CUDA_TESTS"  # CI: the CUDA backend's tests must run (on the CPU stand-in at least)


def require(condition: object, why: str, gate: str = ROOT_GATE) -> None:
    """Skip the test (or, called at import, the module) unless `condition` holds, saying `why`; where `gate` is set
    to 1 (CI sets it), fail instead: a test CI counts on must not vanish into a skip."""
    __tracebackhide__ = True  # reported at the caller's line
    if not condition:
        cannot_run(why, gate)


def cannot_run(why: str, gate: str = ROOT_GATE) -> NoReturn:
    """`require` with a condition already known to be false."""
    __tracebackhide__ = True
    if os.environ.get(gate) == "1":
        pytest.fail(f"{gate}=1, so this test must run, but it cannot: {why}", pytrace=False)
    pytest.skip(why, allow_module_level=True)


# ---------------------------------------------------------------- process probes


def fd_count() -> int:
    """Open file descriptors of this process."""
    return len(os.listdir("/proc/self/fd"))


def map_count() -> int:
    """Lines (VMAs) of /proc/self/maps."""
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def memfds() -> dict[int, str]:
    """fd -> link target for every memfd this process holds."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("/memfd:"):
            out[int(name)] = target
    return out


def vmas(lo: int = 0, hi: int = 1 << 64) -> list[tuple[int, int, str]]:
    """(start, end, perms) of every VMA of this process that overlaps [lo, hi)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split(None, 2)[:2]
            a, b = (int(x, 16) for x in span.split("-"))
            if a < hi and b > lo:
                out.append((a, b, perms))
    return out


def perms_at(addr: int) -> str | None:
    """The permissions of the VMA holding `addr` ("rw-s", "---p", ...), None when nothing is mapped there."""
    found = vmas(addr, addr + 1)
    return found[0][2] if found else None


def perms_over(lo: int, hi: int) -> set[str]:
    """The set of permissions seen over [lo, hi); raises AssertionError when part of it is not mapped at all."""
    cursor, seen = lo, set()
    for a, b, perms in vmas(lo, hi):
        assert a <= cursor, f"hole at {cursor:#x} in [{lo:#x}, {hi:#x})"
        seen.add(perms)
        cursor = b
    assert cursor >= hi, f"[{lo:#x}, {hi:#x}) is not mapped past {cursor:#x}"
    return seen


def rss_kb(lo: int, hi: int) -> int:
    """Resident kB of the VMAs that lie inside [lo, hi) (from /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                a, b = (int(x, 16) for x in head.split("-"))
                inside = lo <= a and b <= hi
            elif inside and head == "Rss:":
                total += int(line.split()[1])
    return total


# ---------------------------------------------------------------- argument builders


def loc(dev: int = 0, loc_type: int = DEVICE) -> dict[str, int]:
    return {"id": dev, "type": loc_type}


def prop(attr: int = 5, dev: int = 0, loc_type: int = DEVICE, handle_type: int = 0) -> dict[str, Any]:
    """An aclrtPhysicalMemProp dict (default memAttr 5, ACL_HBM_MEM_NORMAL: valid on any location)."""
    return {"handleType": handle_type, "allocationType": 0, "memAttr": attr, "location": loc(dev, loc_type),
            "reserve": 0}


def desc(flags: int, dev: int = 0, loc_type: int = DEVICE) -> dict[str, Any]:
    """One aclrtMemAccessDesc dict."""
    return {"flags": flags, "location": loc(dev, loc_type)}


# ---------------------------------------------------------------- checking results


# The surface the running test's `acl` fixture gave (vmmshare.acl, or the C library through `cacl`): the helpers
# below read its recent message.
SURFACE: list[Any] = [_acl]


def clear_err() -> None:
    if SURFACE[-1] is _acl:
        set_recent_error("")
    else:  # the C library keeps the last message until another call fails: a call that fails for certain
        SURFACE[-1].lib.aclrtGetDevice(None)


def ret_of(result: Any) -> int:
    """The ret of a pyACL call: the last value, or the value itself for calls without outputs."""
    return result[-1] if isinstance(result, tuple) else result


def expect_fail(code: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """Call `fn`, which must return `code` last, set a fresh informative recent message, and not raise."""
    clear_err()
    result = fn(*args, **kwargs)
    assert ret_of(result) == code, f"{fn.__name__}{args!r} returned {result!r}, expected code {code}"
    msg = SURFACE[-1].get_recent_err_msg()
    assert isinstance(msg, str) and msg.strip(), f"{fn.__name__}{args!r} failed with {code} but left no message"
    assert len(msg) >= 15, f"message too short to act on: {msg!r}"
    assert fn.__name__ in msg or c_name(fn.__name__) in msg, f"message {msg!r} does not say which call failed " \
        f"({fn.__name__})"
    if isinstance(result, tuple):  # failed outputs are the neutral defaults, never half-made objects
        assert all(v in (0, None, "") for v in result[:-1]), f"{fn.__name__} failed but returned outputs {result!r}"
    return msg


def ok(result: Any) -> Any:
    """Assert a pyACL call succeeded; return its outputs (one value, a tuple, or None)."""
    assert ret_of(result) == 0, f"call failed with {result!r}: {SURFACE[-1].get_recent_err_msg()}"
    if not isinstance(result, tuple):
        return None
    return result[0] if len(result) == 2 else result[:-1]


def write(ptr: int, data: bytes) -> None:
    ctypes.memmove(ptr, data, len(data))


def read(ptr: int, size: int) -> bytes:
    return ctypes.string_at(ptr, size)


# ---------------------------------------------------------------- child processes


def private_broker_env(folder: Any, **variables: str) -> dict[str, str]:
    """Environment for a child with its own broker (in `folder`), so VMMSHARE_* settings such as capacity apply."""
    return {"VMMSHARE_SOCKET": os.path.join(str(folder), "broker.sock"), "VMMSHARE_BROKER_IDLE": "1", **variables}


def run_child(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter with its own runtime and its own broker (unless `env` names a socket);
    `env` adds to or, with "" values, removes variables."""
    full = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    if not (env or {}).get("VMMSHARE_SOCKET"):  # its own broker: a child that dies must not touch our numbers
        os.makedirs(_SESSION_DIR, mode=0o700, exist_ok=True)
        full.update(private_broker_env(tempfile.mkdtemp(dir=_SESSION_DIR)))
    for k, v in (env or {}).items():
        if v == "":
            full.pop(k, None)
        else:
            full[k] = v
    code = textwrap.dedent(code)
    zygote = zygote_for(full, code)
    if zygote is None:  # a hang guard only: no assertion depends on timing
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=300)
    child = zygote.spawn({"kind": "code", "code": code}, full, stderr_pipe=True)
    out, err = child.communicate(timeout=300)
    return subprocess.CompletedProcess([sys.executable, "-c", code], child.wait(), out, err)


CHILD_PRELUDE = """
import ctypes, os, sys
import vmmshare.acl as acl
from vmmshare._process import runtime
M = 1 << 20
def P(dev=0, attr=5, t=1):
    return {"handleType": 0, "allocationType": 0, "memAttr": attr, "location": {"id": dev, "type": t}, "reserve": 0}
def ok(r):
    assert (r[-1] if isinstance(r, tuple) else r) == 0, (r, acl.get_recent_err_msg())
    return r[0] if isinstance(r, tuple) and len(r) == 2 else r
"""


def child_ok(code: str, env: dict[str, str] | None = None) -> str:
    """Run prelude + code in a child that must exit 0 and print DONE; return its stdout."""
    proc = run_child(CHILD_PRELUDE + textwrap.dedent(code) + "\nprint('DONE')\n", env)
    assert proc.returncode == 0 and "DONE" in proc.stdout, (
        f"child failed rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    return proc.stdout


# ---------------------------------------------------------------- fixtures


@pytest.fixture
def acl():
    """`vmmshare.acl` with device 0 set in this thread; teardown asserts the runtime tables are back where they were."""
    yield from surface_acl("python")


def c_counts() -> dict[str, int]:
    """What the C library's objects hold in this process, as the system shows it: open fds (memfds among them) and
    mappings in the arena (reservations, mappings, blocks)."""
    arena = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            start = int(line.split("-", 1)[0], 16)
            arena += ARENA_START <= start < ARENA_END
    return {"fds": len(os.listdir("/proc/self/fd")), "arena mappings": arena}


def surface_acl(surface: str) -> Iterator[Any]:
    """The `acl` of a surface ("python": vmmshare.acl; "c": the C library through `cacl`) with device 0 set in
    this thread; teardown asserts that what the test made is gone again."""
    if surface == "python":
        rt = runtime()
        assert _acl.rt.set_device(0) == 0
        gc.collect()  # an earlier test's garbage, collected during this one, would read as this test's doing
        before = rt.counts()
        yield _acl
        after = rt.counts()
        _acl.rt.reset_device(0)
        assert after == before, f"the test left runtime objects behind: {before} -> {after}"
        return
    import cacl

    lib = cacl.load()
    assert lib.rt.set_device(0) == 0, lib.get_recent_err_msg()
    ok(lib.rt.get_mem_info(0))  # the broker connection is made before the count (it stays for the process)
    gc.collect()
    before = c_counts()
    SURFACE.append(lib)
    try:
        yield lib
    finally:
        SURFACE.pop()
    after = c_counts()
    lib.rt.reset_device(0)
    assert after == before, f"the test left C library objects behind: {before} -> {after}"


class Vmm:
    """Creates objects through acl.rt (asserting success) and removes whatever is left, in order, at teardown."""

    def __init__(self, acl_mod: Any) -> None:
        self.rt = acl_mod.rt
        self.handles: list[int] = []
        self.reservations: list[int] = []
        self.mappings: list[int] = []
        self.host_blocks: list[int] = []
        self.streams: list[int] = []

    def alloc(self, size: int = G2M, **prop_kw: Any) -> int:
        h = ok(self.rt.malloc_physical(size, prop(**prop_kw), 0))
        assert isinstance(h, int) and h != 0
        self.handles.append(h)
        return h

    def reserve(self, size: int = G2M, expect_ptr: int = 0) -> int:
        p = ok(self.rt.reserve_mem_address(size, 0, expect_ptr, 0))
        assert isinstance(p, int) and p != 0
        self.reservations.append(p)
        return p

    def map(self, ptr: int, size: int, handle: int, no_access: bool = False) -> int:
        fn = self.rt.mem_map_no_access if no_access else self.rt.map_mem
        ok(fn(ptr, size, 0, handle, 0))
        self.mappings.append(ptr)
        return ptr

    def mapped(self, size: int = G2M, **prop_kw: Any) -> tuple[int, int]:
        """A fresh allocation mapped at the start of its own reservation: (ptr, handle)."""
        h = self.alloc(size, **prop_kw)
        p = self.reserve(size)
        self.map(p, size, h)
        return p, h

    def host(self, size: int = 4096) -> int:
        p = ok(self.rt.malloc_host(size))
        self.host_blocks.append(p)
        return p

    def stream(self) -> int:
        s = ok(self.rt.create_stream())
        self.streams.append(s)
        return s

    def unmap(self, ptr: int) -> None:
        ok(self.rt.unmap_mem(ptr))
        self.mappings.remove(ptr)

    def free(self, handle: int) -> None:
        ok(self.rt.free_physical(handle))
        self.handles.remove(handle)

    def release(self, ptr: int) -> None:
        ok(self.rt.release_mem_address(ptr))
        self.reservations.remove(ptr)

    def cleanup(self) -> None:
        for p in reversed(self.mappings):
            self.rt.unmap_mem(p)
        for h in reversed(self.handles):
            self.rt.free_physical(h)
        for p in reversed(self.reservations):
            self.rt.release_mem_address(p)
        for p in reversed(self.host_blocks):
            self.rt.free_host(p)
        for s in reversed(self.streams):
            self.rt.destroy_stream(s)
        self.__init__(_acl)  # type: ignore[misc]


@pytest.fixture
def vmm(acl):
    v = Vmm(acl)
    yield v
    v.cleanup()


@pytest.fixture
def fabric() -> Any:
    """A two-server test cluster (fabric_cluster.py) for one test, which may stop, restart or reconfigure its
    brokers and links; its brokers' logs are printed when it fails."""
    from fabric_cluster import TestCluster

    c = TestCluster(2)
    try:
        yield c
    except BaseException:
        print(c.logs())
        raise
    finally:
        c.close()


@pytest.fixture(scope="module")
def module_fabric() -> Iterator[Any]:
    """One two-server test cluster for the tests of a module that use `shared_fabric`."""
    from fabric_cluster import TestCluster

    c = TestCluster(2)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def shared_fabric(module_fabric: Any) -> Iterator[Any]:
    """The module's cluster, for a test that neither stops, restarts nor reconfigures its brokers or links. At the
    test's end its actors are killed and both brokers must come back to holding and serving nothing (the releases
    between servers take a round trip: waited for); where they do not, the cluster is made afresh for the next
    test."""
    from fabric_cluster import eventually

    c = module_fabric
    yield c
    for a in c.actors:
        a.kill()
    c.actors.clear()
    try:
        eventually(c.unchanged, "the test left a broker of the shared cluster holding or serving memory")
    except AssertionError as exc:
        left, logs = c.holdings(), c.logs()
        c.renew()
        raise AssertionError(f"{exc}: {left}\n{logs}") from None


# ---------------------------------------------------------------- brokers started by the tests


@pytest.fixture(scope="module")
def broker_env() -> dict[str, str]:
    """The environment the brokers below start with, which their clients get too (`broker.env`); a module overrides
    this fixture for settings of its own (a capacity, a server id)."""
    from procs import clean_env

    return clean_env()


@pytest.fixture
def own_broker(tmp_path: Any, broker_env: dict[str, str]) -> Iterator[Any]:
    """A broker of this test alone (SIGKILLed at its end), for a test that kills, stops, restarts or limits it."""
    from procs import BrokerProc

    b = BrokerProc(tmp_path / "broker", env=broker_env)
    try:
        yield b
    finally:
        b.kill()  # an idle broker acts on SIGTERM only at its next event: SIGKILL is how the tests end it


@pytest.fixture(scope="module")
def module_broker(tmp_path_factory: pytest.TempPathFactory, broker_env: dict[str, str]) -> Iterator[Any]:
    """One broker for the tests of a module that use `broker`."""
    from procs import BrokerProc

    b = BrokerProc(tmp_path_factory.mktemp("broker"), env=broker_env)
    try:
        yield b
    finally:
        b.kill()


def broker_state(b: Any) -> dict[str, Any]:
    """What a test must leave in a shared broker as it found it: once the broker has dropped every connection closed
    before this call (a barrier: two round trips on a connection of our own), its clients (ours alone), charges,
    exports, device 0's free and total memory, and its open fds."""
    import common
    from vmmshare.wire import local as P

    with common.Raw(b.socket) as c:
        for _ in range(2):
            assert isinstance(c.ask(P.BareTgid()), P.Pid)
        state: dict[str, Any] = {"used": {}, "gpu_used": {}, "exports": []}
        offset: int | None = 0
        while offset is not None:
            page = c.ask(P.List(offset))
            assert isinstance(page, P.Listing), page
            head = json.loads(page.page)
            offset = head.pop("next")
            state["used"].update(head.pop("used"))
            state["gpu_used"].update(head.pop("gpu_used"))
            state["exports"] += head.pop("exports")
            state.update(head)  # the node's figures: clients, capacity, export_count, broker_pid
        mem = c.ask(P.MemInfo(0))
        assert isinstance(mem, P.Mem), mem
        state["mem_info"] = (mem.free, mem.total)
        state["fds"] = b.fd_count()
        return state


SETTLE_SECONDS = 10.0  # how long a shared broker may take to see the last client of a test go


@pytest.fixture
def broker(module_broker: Any) -> Iterator[Any]:
    """The module's broker, for a test that neither kills, stops nor limits it. The test must leave it as it found
    it (checked at its end, see `broker_state`: a stronger leak check than a fresh broker per test); where it does
    not, the broker is started afresh for the next test."""
    before = broker_state(module_broker)
    yield module_broker
    after = broker_state(module_broker)
    settled = time.monotonic() + SETTLE_SECONDS  # a client that just exited may not be hung up on yet
    while after != before and time.monotonic() < settled:
        time.sleep(0.02)
        after = broker_state(module_broker)
    if after != before:
        module_broker.kill()
        module_broker.start()
        raise AssertionError(f"the test left the shared broker changed: {before} -> {after}")


@pytest.fixture(scope="module")
def as_nobody() -> list[str]:
    """The command prefix that runs a process as another user (`nobody`), or a skip saying why there is none."""
    import identity

    prefix, why = identity.other_user()
    require(prefix is not None, why)
    assert prefix is not None
    return prefix


class Node:
    """A broker of its own, and actors on it on either surface (vmmshare.acl, or the C library through `cacl`)."""

    def __init__(self, folder: Path) -> None:
        self.broker = BrokerProc(folder)
        self.made: list[Actor] = []

    def actor(self, surface: str) -> Actor:
        a = Actor({**self.broker.env, "VMMSHARE_ACTOR_SURFACE": surface})
        self.made.append(a)
        return a

    def ls(self) -> dict[str, Any]:
        out = subprocess.run([sys.executable, "-m", "vmmshare", "ls", "--json"], capture_output=True, text=True,
                             env=self.broker.env, check=True).stdout
        return dict(json.loads(out))


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    try:
        yield n
    finally:
        for a in n.made:
            a.kill()
        n.broker.kill()
