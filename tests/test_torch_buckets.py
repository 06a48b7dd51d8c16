"""vmmshare.torch buckets: a Publisher writes versions of a state dict into one shared allocation (a MemoryPool of
one chunk), Subscribers in other processes see whole versions only, pins hold a version against overwrite, and a
dead reader or publisher costs the other side nothing (SPEC rule 14)."""

from __future__ import annotations

import gc
import json
import os
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import vmmshare  # noqa: E402
import vmmshare.torch as vt  # noqa: E402
from procs import python_c  # noqa: E402
from vmmshare._process import runtime  # noqa: E402

MiB = 1 << 20

READER = r"""
import json, pickle, sys
import torch
import vmmshare.torch as vt
print(json.dumps(vt.bare_pid()), flush=True)
try:
    sub = vt.Subscriber(pickle.loads(bytes.fromhex(sys.stdin.readline())))
    print(json.dumps({"ok": None}), flush=True)
except Exception as exc:
    print(json.dumps({"err": f"{type(exc).__name__}: {exc}", "code": getattr(exc, "code", None)}), flush=True)
    sys.exit(0)
held = None
for line in sys.stdin:
    env = {"sub": sub, "torch": torch, "vt": vt, "held": held, "json": json}
    try:
        exec(line.encode().decode("unicode_escape"), env)
        out = {"ok": env.get("result")}
    except Exception as exc:
        out = {"err": f"{type(exc).__name__}: {exc}", "code": getattr(exc, "code", None)}
    held = env.get("held")
    print(json.dumps(out), flush=True)
"""


class Reader:
    """A subscriber in another process; `run(code)` executes code with `sub` bound and returns its `result`."""

    def __init__(self) -> None:
        self.proc = python_c(READER)
        assert self.proc.stdout is not None
        self.pid = json.loads(self.proc.stdout.readline())

    def subscribe(self, pub: vt.Publisher | None = None, ticket: str | None = None) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(ticket or pickle.dumps(pub.ticket()).hex() + "\n")
        reply = json.loads(self.proc.stdout.readline())
        if "err" in reply:
            raise RuntimeError(reply["err"])

    def run(self, code: str) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(textwrap.dedent(code).strip().encode("unicode_escape").decode() + "\n")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"reader died (exit {self.proc.wait(10)})")
        reply = json.loads(line)
        if "err" in reply:
            raise RuntimeError(reply["err"])
        return reply["ok"]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def reader() -> Iterator[Any]:
    made: list[Reader] = []

    def make() -> Reader:
        r = Reader()
        made.append(r)
        return r

    yield make
    for r in made:
        r.kill()


def state(version: float, n: int = 6) -> dict[str, Any]:
    """A state dict whose every element is `version` (so a torn read shows as mixed values)."""
    return {f"layer{i}.weight": torch.full((64, 32 + i), float(version)) for i in range(n)} | {
        "step": torch.tensor(int(version)), "mask": torch.full((17,), bool(int(version) % 2))}


SUMMARY = """
result = [snap.version, sorted({float(v.double().mean()) for k, v in snap.tensors.items() if k.startswith('layer')}),
          int(snap['step'])]
"""


def test_layout_is_one_aligned_allocation_with_one_handle() -> None:
    sd = state(1)
    with vt.Publisher(sd, alignment=512) as pub:
        assert len(pub.pool.chunks) == 1  # one allocation, one export
        offsets = [e.offset for e in pub.entries]
        assert all(o % 512 == 0 for o in offsets) and offsets == sorted(offsets)
        assert [e.name for e in pub.entries] == list(sd)
        assert sum(e.nbytes for e in pub.entries) == sum(t.numel() * t.element_size() for t in sd.values())
        assert pub.nbytes % 4096 == 0 and pub.pool.chunks[0].shareable is not None


def test_a_subscriber_maps_the_latest_version_as_views(reader: Any) -> None:
    r = reader()
    pub = vt.Publisher(state(0), pids=[r.pid])
    assert pub.publish(state(1)) == 1
    r.subscribe(pub)
    assert r.run("result = sub.version") == 1
    assert r.run(f"snap = sub.latest(); {SUMMARY.strip()}; snap.release()") == [1, [1.0], 1]
    assert pub.publish(state(2)) == 2
    got = r.run("""
        with sub.latest() as snap:
            dtypes = {k: str(v.dtype) for k, v in snap.tensors.items()}
            result = [snap.version, dtypes['step'], dtypes['mask'], bool(snap['mask'].any()),
                      list(snap['layer3.weight'].shape)]
    """)
    assert got == [2, "torch.int64", "torch.bool", False, [64, 35]]
    v, local = r.run("v, local = sub.copy_latest(); result = [v, float(local['layer0.weight'].sum())]")
    assert v == 2 and local == 2 * 64 * 32


def test_a_partial_update_brings_the_stale_slot_up_to_date(reader: Any) -> None:
    """Only the names given are read from the caller; the slot being reused also gets what changed since it was
    written, from the current slot, so every version is whole."""
    r = reader()
    sd = state(0)
    pub = vt.Publisher(sd, pids=[r.pid])
    pub.publish(sd)
    r.subscribe(pub)
    expect = {k: v.clone() for k, v in sd.items()}
    for step, name in enumerate(["layer1.weight", "layer4.weight", "step", "layer1.weight", "mask"], start=2):
        new = torch.full_like(expect[name], step) if name != "mask" else ~expect[name]
        expect[name] = new
        assert pub.publish({name: new}, changed=[name]) == step
        sums = r.run("with sub.latest() as s: result = {k: float(v.double().sum()) for k, v in s.tensors.items()}")
        assert sums == {k: float(v.double().sum()) for k, v in expect.items()}


@pytest.mark.slow
def test_subscribers_never_see_a_torn_version(reader: Any) -> None:
    """Readers take snapshots as fast as they can while the publisher writes version after version: every
    snapshot holds one version in every tensor."""
    readers = [reader(), reader()]
    pub = vt.Publisher(state(0, n=16), pids=[r.pid for r in readers], versions=2)
    pub.publish(state(1, n=16))
    for r in readers:
        r.subscribe(pub)
        assert r.proc.stdin is not None
        # each reader checks snapshots in a loop until it has seen the last version, then answers once
        r.proc.stdin.write(textwrap.dedent("""
            checks = torn = 0; seen = set()
            while True:
                with sub.latest() as snap:
                    vals = {float(v.double().mean()) for k, v in snap.tensors.items() if k.startswith('layer')}
                    if vals != {float(snap.version)} or int(snap['step']) != snap.version: torn += 1
                    checks += 1; seen.add(snap.version)
                    if snap.version >= 60: break
            result = [checks, torn, len(seen)]
        """).strip().encode("unicode_escape").decode() + "\n")
    for version in range(2, 61):
        pub.publish(state(version, n=16))
    for r in readers:
        assert r.proc.stdout is not None
        checks, torn, seen = json.loads(r.proc.stdout.readline())["ok"]
        assert torn == 0 and checks >= 1 and seen >= 1


def test_a_held_snapshot_is_never_overwritten(reader: Any) -> None:
    r = reader()
    pub = vt.Publisher(state(0), pids=[r.pid])
    pub.publish(state(1))
    r.subscribe(pub)
    assert r.run("held = sub.latest(); result = held.version") == 1
    pub.publish(state(2))  # into the other slot
    with pytest.raises(vmmshare.MemoryAllocationError, match=str(r.pid)):
        pub.publish(state(3), timeout=0)  # the only slot it could use holds version 1, pinned
    assert r.run(f"snap = held; {SUMMARY.strip()}") == [1, [1.0], 1]  # still version 1, whole
    r.run("held.release(); held = None")
    assert pub.publish(state(3), timeout=0) == 3
    assert r.run(f"snap = sub.latest(); {SUMMARY.strip()}; snap.release()") == [3, [3.0], 3]


def test_three_versions_leave_room_while_a_reader_holds_one(reader: Any) -> None:
    r = reader()
    pub = vt.Publisher(state(0), pids=[r.pid], versions=3)
    pub.publish(state(1))
    r.subscribe(pub)
    r.run("held = sub.latest()")
    for v in range(2, 6):
        assert pub.publish(state(v), timeout=0) == v
    assert r.run(f"snap = held; {SUMMARY.strip()}") == [1, [1.0], 1]


@pytest.mark.slow
def test_rule_14_a_reader_that_dies_holding_a_snapshot_does_not_block_the_publisher(reader: Any) -> None:
    r, other = reader(), reader()
    pub = vt.Publisher(state(0), pids=[r.pid, other.pid])
    pub.publish(state(1))
    r.subscribe(pub)
    other.subscribe(pub)
    r.run("held = sub.latest()")
    pub.publish(state(2))
    r.kill()
    # the next slot is pinned by a dead reader: the publisher waits until the broker no longer lists it as
    # importing (its connection closed), then drops the pin
    assert pub.publish(state(3), timeout=60) == 3
    assert other.run(f"snap = sub.latest(); {SUMMARY.strip()}; snap.release()") == [3, [3.0], 3]


@pytest.mark.slow
def test_rule_14_publisher_death_leaves_the_last_version_with_the_subscriber(reader: Any) -> None:
    r = reader()
    code = textwrap.dedent(f"""
        import pickle, sys, torch
        import vmmshare.torch as vt
        sd = {{"a": torch.full((1000,), 7.0), "b": torch.arange(10)}}
        pub = vt.Publisher(sd, pids=[{r.pid}])
        pub.publish(sd)
        sys.stdout.write(pickle.dumps(pub.ticket()).hex() + "\\n")
        sys.stdout.flush()
        sys.stdin.readline()
        import os
        os.kill(os.getpid(), 9)
    """)
    producer = python_c(code)
    try:
        assert producer.stdout is not None and producer.stdin is not None
        ticket = producer.stdout.readline()
        r.subscribe(ticket=ticket)
        assert r.run("held = sub.latest(); result = float(held['a'].sum())") == 7000.0
        producer.stdin.write("die\n")
        producer.stdin.flush()
        assert producer.wait(30) == -9
        assert r.run("result = [float(held['a'].sum()), held['b'].tolist()]") == [7000.0, list(range(10))]
        assert r.run("result = sub.copy_latest()[0]") == 1
    finally:
        if producer.poll() is None:
            producer.kill()
        producer.wait(10)


def test_a_process_that_is_not_a_subscriber_is_refused(reader: Any) -> None:
    r = reader()
    pub = vt.Publisher(state(0), pids=[os.getpid()])
    pub.publish(state(0))
    with pytest.raises(RuntimeError, match=f"NoPermissionError.*{r.pid}"):
        r.subscribe(pub)  # it cannot even import the bucket: not on the trustlist


def test_allow_adds_a_subscriber_later(reader: Any) -> None:
    r = reader()
    pub = vt.Publisher(state(0))
    pub.publish(state(4))
    pub.allow([r.pid])
    r.subscribe(pub)
    assert r.run(f"snap = sub.latest(); {SUMMARY.strip()}; snap.release()") == [1, [4.0], 4]


@pytest.mark.parametrize("call", [
    lambda: vt.Publisher({}),
    lambda: vt.Publisher({"a": [1, 2]}),
    lambda: vt.Publisher({"a": torch.ones(2)}, versions=1),
    lambda: vt.Publisher({"a": torch.ones(2)}, versions=9),
    lambda: vt.Publisher({"a": torch.ones(2)}, alignment=3),
    lambda: vt.Publisher({"a": torch.ones(2)}, pids=[0]),
    lambda: vt.Subscriber("ticket"),
])
def test_bad_arguments_are_clear_errors(call: Any) -> None:
    gc.collect()  # earlier tests' garbage goes before the count, not during it
    before = runtime().counts()
    with pytest.raises(vmmshare.InvalidParamError):
        call()
    gc.collect()
    assert runtime().counts() == before


def test_publish_checks_what_it_is_given() -> None:
    with vt.Publisher({"a": torch.ones(4), "b": torch.zeros(2, dtype=torch.int32)}) as pub:
        for bad, changed in [({"c": torch.ones(4)}, None), ({"a": torch.ones(5)}, None),
                             ({"b": torch.zeros(2)}, None), ({}, ["a"]), ({"a": "x"}, None)]:
            with pytest.raises(vmmshare.InvalidParamError):
                pub.publish(bad, changed=changed)
        assert pub.version == 0
        assert pub.publish({"a": torch.full((4,), 2.0)}) == 1
        with pytest.raises(vmmshare.InvalidParamError):
            pub.publish({}, timeout=-1)


def test_closing_the_publisher_frees_the_bucket() -> None:
    gc.collect()  # earlier tests' garbage goes before the count, not during it
    before = runtime().counts()
    pub = vt.Publisher(state(0))
    pub.publish(state(1))
    pub.close()
    with pytest.raises(vmmshare.InvalidParamError):
        pub.publish(state(2))
    del pub
    gc.collect()
    assert runtime().counts() == before


# ---------------------------------------------------------------- FABRIC buckets across servers (SPEC §8)

PUBLISHER = r"""
import pickle, sys, torch
import vmmshare.torch as vt
sd = {"w": torch.zeros(300, 1000), "b": torch.zeros(77, dtype=torch.int64)}
pub = vt.Publisher(sd, share_type="fabric")
print("ready", flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "ticket":  # made once the reader is allowed: it names each reader's record
        print(pickle.dumps(pub.ticket()).hex(), flush=True)
        continue
    if cmd == "allow":
        pub.allow([int(args[0])], server=int(args[1]))
    elif cmd == "publish":
        v = float(args[0])
        print(pub.publish({"w": torch.full((300, 1000), v), "b": torch.full((77,), int(v))}), flush=True)
        continue
    print("ok", flush=True)
"""

SUBSCRIBER = r"""
import pickle, sys, torch
import vmmshare
import vmmshare.torch as vt
print(vt.bare_pid(), flush=True)
sub = vt.Subscriber(pickle.loads(bytes.fromhex(sys.stdin.readline())))
try:
    sub.latest()
except vmmshare.FeatureNotSupportedError:
    print("no views", flush=True)
for line in sys.stdin:
    version, got = sub.copy_latest()
    print(version, float(got["w"].double().sum()), int(got["b"].sum()), flush=True)
"""


@pytest.mark.slow
def test_a_fabric_bucket_is_copied_into_local_tensors_on_another_server(request: pytest.FixtureRequest) -> None:
    from conftest import require
    from fabric_cluster import HANG_GUARD, cluster_problem

    require(not cluster_problem(), cluster_problem())  # namespaces and the transfer engine (CI has both)
    fabric = request.getfixturevalue("fabric")
    procs = []

    def start(n: int, code: str) -> subprocess.Popen[str]:
        cmd = fabric.cluster.server(n).command([sys.executable, "-c", code])
        p = subprocess.Popen(cmd, env=fabric.env(n), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             bufsize=1)
        procs.append(p)
        return p

    def ask(p: subprocess.Popen[str], line: str | None = None) -> str:
        assert p.stdin is not None and p.stdout is not None
        if line is not None:
            p.stdin.write(line + "\n")
        got = p.stdout.readline().strip()
        assert got, f"process exited {p.wait(HANG_GUARD)}"
        return got

    try:
        pub = start(1, PUBLISHER)
        assert ask(pub) == "ready"
        sub = start(2, SUBSCRIBER)
        pid = int(ask(sub))
        assert ask(pub, f"allow {pid} {fabric.server_id(2)}") == "ok"
        ticket = ask(pub, "ticket")
        assert ask(pub, "publish 1") == "1"
        assert ask(sub, ticket) == "no views"  # another server's memory: copies only
        assert ask(sub, "copy") == f"1 {300000.0} {77}"
        for v in (2, 3, 4):
            assert ask(pub, f"publish {v}") == str(v)
            assert ask(sub, "copy") == f"{v} {300000.0 * v} {77 * v}"
    finally:
        for p in procs:
            p.kill()
            p.wait(HANG_GUARD)


def test_a_ticket_whose_layout_lies_is_refused() -> None:
    from dataclasses import replace

    with vt.Publisher({"a": torch.ones(8), "b": torch.ones(3, dtype=torch.int16)}, pids=[os.getpid()]) as pub:
        pub.publish({"a": torch.full((8,), 5.0), "b": torch.ones(3, dtype=torch.int16)})
        t = pub.ticket()
        a = t.entries[0]
        for bad in (replace(a, offset=pub.nbytes), replace(a, nbytes=4), replace(a, dtype="nope"),
                    replace(a, offset=2), replace(a, shape=(1 << 40,)), replace(a, offset=-4),
                    replace(a, name=["a"])):  # a name that is not text could not key the snapshot's dict
            with pytest.raises(vmmshare.InvalidParamError):
                vt.Subscriber(vt.BucketTicket(t.header, t.slots, (bad,), t.records))
        sub = vt.Subscriber(t)  # the true layout: the publisher's own process may read its bucket too
        with sub.latest() as snap:
            assert snap.version == 1 and float(snap["a"].sum()) == 40.0
        sub.close()
        with pytest.raises(BufferError):  # like mmap: not while this process's tensors view it
            pub.close()
        del snap, sub


@pytest.mark.slow
def test_a_reader_that_scribbles_on_the_header_only_delays_a_publish(reader: Any) -> None:
    """Subscribers map the bucket writable (their pins live in it): one that overwrites the header's words cannot
    make the publisher write into a slot a reader holds, nor make the next version wrong."""
    bad, good = reader(), reader()
    pub = vt.Publisher(state(0), pids=[bad.pid, good.pid])
    pub.publish(state(1))
    bad.subscribe(pub)
    good.subscribe(pub)
    good.run("held = sub.latest()")  # version 1, pinned
    bad.run("""
        import ctypes
        h = sub._h
        for off in range(8, 128, 8):  # current, the slot count and every slot's version word
            ctypes.c_uint64.from_address(h.ptr + off).value = 0xDEAD0001
    """)
    assert pub.publish(state(2)) == 2  # into the free slot, whatever the header claims
    with pytest.raises(vmmshare.MemoryAllocationError):
        pub.publish(state(3), timeout=0)  # the other slot is still pinned by the good reader
    assert good.run(f"snap = held; {SUMMARY.strip()}") == [1, [1.0], 1]
    good.run("held.release(); held = None")
    assert pub.publish(state(3), timeout=0) == 3
    assert good.run(f"snap = sub.latest(); {SUMMARY.strip()}; snap.release()") == [3, [3.0], 3]


def test_a_hostile_subscriber_can_neither_move_another_readers_pin_nor_get_its_snapshot_overwritten(
        reader: Any) -> None:
    """The attack: a subscriber writes the bucket header's `current` and one slot's version word naming a version
    never published (777). The victim's latest() pinned "777" on that slot, the publisher saw no reader on it and
    overwrote it, and the victim's snapshot changed under it; and every reader's pin lay in the header, so the
    attacker could also clear the victim's. Each reader now goes by a record of its own that only it and the
    publisher can write: the victim pins the version truly published, its pin keeps its slot whatever the attacker
    writes in the bucket, and the attacker cannot import the victim's record."""
    bad, victim = reader(), reader()
    pub = vt.Publisher(state(0), pids=[bad.pid, victim.pid])
    assert pub.publish(state(1)) == 1
    ticket = pickle.dumps(pub.ticket()).hex() + "\n"
    bad.subscribe(ticket=ticket)
    victim.subscribe(ticket=ticket)
    bad.run("""
        import ctypes
        word = lambda off, v: setattr(ctypes.c_uint64.from_address(sub._h.ptr + off), "value", v)
        slot = ctypes.c_uint64.from_address(sub._h.ptr + 8).value & 0xFF
        word(8, 777 << 8 | slot)  # current: a version never published, in the slot that holds version 1
        word(24 + 8 * slot, 777)  # and that slot's version word
    """)
    taken = victim.run(f"held = sub.latest(); snap = held; {SUMMARY.strip()}")
    bad.run("""
        import ctypes
        for off in range(128, 4096, 8):  # every reader record the header had, the victim's pin among them
            ctypes.c_uint64.from_address(sub._h.ptr + off).value = 0
    """)
    assert pub.publish(state(2)) == 2  # into the free slot
    with pytest.raises(vmmshare.MemoryAllocationError, match=str(victim.pid)):
        pub.publish(state(3), timeout=0)  # the only other slot is the victim's, pinned
    assert victim.run(f"snap = held; {SUMMARY.strip()}") == taken == [1, [1.0], 1], (
        "the victim's snapshot was not the version published, or was overwritten under it")
    assert victim.run("result = sub.version") == 2
    refused = bad.run(f"""
        import pickle
        t = pickle.loads(bytes.fromhex({ticket.strip()!r}))
        blob = [b for server, pid, b in t.records if pid == {victim.pid}][0]
        try:
            pickle.loads(blob)
            result = "imported"
        except Exception as exc:
            result = getattr(exc, "code", repr(exc))
    """)
    assert refused == 207006, f"another subscriber's record was open to the attacker: {refused}"
    victim.run("held.release(); held = None")
    assert pub.publish(state(3), timeout=0) == 3
    assert victim.run(f"snap = sub.latest(); {SUMMARY.strip()}; snap.release()") == [3, [3.0], 3]
    assert bad.run(f"snap = sub.latest(); {SUMMARY.strip()}; snap.release()") == [3, [3.0], 3]


CLOSED_UNDER = r"""
import os, pickle, torch
import vmmshare
import vmmshare.torch as vt
pub = vt.Publisher({"a": torch.ones(8)}, pids=[os.getpid()])
pub.publish({"a": torch.full((8,), 2.0)})
mine = vt.Subscriber(pub.ticket())  # in the publisher's process
ticket = pickle.loads(pickle.dumps(pub.ticket()))
theirs = vt.Subscriber(ticket)
assert mine.version == theirs.version == 1
pub.close()  # frees the bucket: the pool its buffers lie in is unmapped here
assert ticket.header.pool.closed
for sub in (mine, theirs):
    for call in (lambda: sub.version, sub.latest, sub.copy_latest):
        try:
            call()
        except vmmshare.InvalidParamError as exc:
            print(exc.code, flush=True)
try:
    pub.publish({"a": torch.zeros(8)})
except vmmshare.InvalidParamError as exc:
    print(exc.code, flush=True)
mine.close(); theirs.close()
print("alive", flush=True)
"""


@pytest.mark.slow
def test_a_subscriber_whose_bucket_memory_was_closed_gets_an_error_not_a_crash() -> None:
    """A Subscriber's header words were loaded from the pool's address with no check: once the pool was closed
    (Publisher.close() in its own process, a Subscriber made there before it) reading `version` or taking a snapshot
    touched unmapped pages and killed the interpreter (SIGSEGV). Now each is 107000."""
    done = subprocess.run([sys.executable, "-c", CLOSED_UNDER], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["107000"] * 7 + ["alive"]
