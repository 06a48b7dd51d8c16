"""The fabric against an attacker on the fabric network (docs/security.md): a broker with the wrong key, replayed
and reflected proofs, requests before the proof, garbled frames, a broker that asks for another server's
processes, an exporting broker that lies about the memory, a flood of links, and key files others could read."""

from __future__ import annotations

import json
import os
import re
import signal
import textwrap
from pathlib import Path

import pytest

from conftest import require
from fabric_cluster import TestCluster, cluster_problem, eventually
from test_fabric_sharing import (
    FABRIC,
    IPC,
    M2,
    NO_PERMISSION,
    export,
    fails,
    import_map,
    ok,
    served_nothing,
    unmap_free,
)
from vmmshare.wire.handles import Endpoint

require(not cluster_problem(), cluster_problem())

IMP = "rt.mem_import_from_shareable_handle_v2"
BAD_HANDLE = 107017
ATTACK = """
import os, socket, struct, sys, hmac
from vmmshare.wire import peer as F
KEY = open(os.environ["VMMSHARE_CLUSTER_KEY_FILE"], "rb").read()
ME = int(os.environ["VMMSHARE_SERVER_ID"], 0)
EP1 = F.endpoint_bytes("10.77.0.1", 17017)

def dial(port=17017):
    s = socket.create_connection(("10.77.0.1", port), timeout=10)
    return s

def frames(s, want=1):
    r = F.FrameReader()
    got = []
    while len(got) < want:
        data = s.recv(65536)
        if not data:
            return got + ["CLOSED"]
        got += [m for _, m in r.feed(data)]
    return got

def closed(s):
    # the broker closes the connection (whatever it sent first, e.g. a challenge to a hello that came first)
    try:
        while s.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
"""


def attack(fabric: TestCluster, code: str, **env: str) -> str:
    """Run `code` on server 2 as an attacker (it knows the key only where the test says so)."""
    out = fabric.run(2, ATTACK + textwrap.dedent(code), **env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def still_serves(fabric: TestCluster) -> None:
    """Server 1's broker is alive and a real import from server 2 works."""
    assert fabric.brokers[1].alive()
    a, b = fabric.actor(1), fabric.actor(2)
    _, s, _ = export(a, pids=[b.pid])
    ok(b, "rt.free_physical", ok(b, IMP, s, FABRIC, 0))
    eventually(lambda: served_nothing(fabric), "remote holds left behind")


def test_a_broker_with_another_key_is_refused_and_gets_a_clear_error(fabric: TestCluster) -> None:
    other = fabric.root / "other.key"
    other.write_bytes(os.urandom(48))
    other.chmod(0o600)
    fabric.brokers[2].signal(signal.SIGTERM)
    fabric.brokers[2].start(VMMSHARE_CLUSTER_KEY_FILE=str(other))
    a, b = fabric.actor(1), fabric.actor(2)
    _, s, _ = export(a, pids=[b.pid])
    msg = fails(b, IPC, IMP, s, FABRIC, 0)
    assert "cluster key" in msg
    assert fabric.brokers[1].listing()["exports"][0]["importer_count"] == 0
    eventually(lambda: "before it proved the cluster key" in fabric.brokers[1].log.read_text(), "no log line")


def test_proofs_cannot_be_reflected_or_replayed_and_nothing_passes_before_them(shared_fabric: TestCluster) -> None:
    out = attack(shared_fabric, """
    # reflection: the broker's own proof sent back as ours
    s = dial()
    s.sendall(F.encode(F.Hello(ME, os.urandom(32)), 0))
    ch = frames(s)[0]
    s.sendall(F.encode(F.Proof(ch.proof), 0))
    print("reflected", closed(s))
    # replay: a proof made (with the key) for one connection, shown on the next
    s = dial()
    nonce = os.urandom(32)
    s.sendall(F.encode(F.Hello(ME, nonce), 0))
    ch = frames(s)[0]
    good = F.proof(KEY, b"initiator", F.transcript(ME, ch.server_id, nonce, ch.nonce, EP1))
    s2 = dial()
    s2.sendall(F.encode(F.Hello(ME, nonce), 0))
    frames(s2)
    s2.sendall(F.encode(F.Proof(good), 0))
    print("replayed", closed(s2))
    s.sendall(F.encode(F.Proof(good), 0))
    print("original", type(F.decode(s.recv(65536)[:12]).message).__name__)  # a sealed welcome: 12 bytes + MAC
    # requests before the proof: no answer, the link closes
    s3 = dial()
    s3.sendall(F.encode(F.Import(1, 2, bytes(32), ME, os.getpid(), 0, 0), 1))
    print("early request", closed(s3))
    s4 = dial()
    s4.sendall(F.encode(F.Hello(ME, os.urandom(32)), 0))
    frames(s4)
    s4.sendall(F.encode(F.Heartbeat(), 1))
    print("request instead of proof", closed(s4))
    """)
    assert "reflected True" in out and "replayed True" in out and "original Welcome" in out
    assert "early request True" in out and "request instead of proof True" in out
    still_serves(shared_fabric)


@pytest.mark.slow
def test_garbled_frames_close_the_link_and_the_broker_serves_on(shared_fabric: TestCluster) -> None:
    out = attack(shared_fabric, """
    import random
    rng = random.Random(7)
    for i in range(60):
        s = dial()
        junk = [b"GET / HTTP/1.1\\r\\n\\r\\n", rng.randbytes(rng.randrange(1, 300)),
                F.encode(F.Hello(ME, os.urandom(32)), 0)[:-5] + b"\\xff" * 40,
                struct.pack("<2sBBII", b"VF", 1, 1, 0, 1 << 30)][i % 4]
        s.sendall(junk)
        print("closed", closed(s))
    """)
    assert out.count("closed True") == 60
    still_serves(shared_fabric)


def test_a_broker_cannot_import_for_another_servers_processes(shared_fabric: TestCluster) -> None:
    a = shared_fabric.actor(1)
    victim = shared_fabric.server_id(1) ^ 0x55  # some third server
    _, s, _ = export(a, flags=1)
    out = attack(shared_fabric, f"""
    s = dial()
    ini = F.Initiator(KEY, ME, EP1)
    s.sendall(F.encode(ini.hello(), 0))
    s.sendall(F.encode(ini.answer(frames(s)[0]), 0))
    r = F.FrameReader()
    r.authenticate(ini.keys.responder_to_initiator)
    seal = F.Sealer(ini.keys.initiator_to_responder)
    got = []
    while not got:
        got = r.feed(s.recv(65536))
    assert isinstance(got[0].message, F.Welcome)
    h = bytes.fromhex({s.hex()!r})
    proof = F.secret_proof(h[64:96], ini.keys.session)
    value = int.from_bytes(h[16:24], "little")
    s.sendall(seal.seal(F.encode(F.Import(value, 2, proof, {victim}, os.getpid(), 0, 0), 5)))
    got = []
    while not got:
        got = r.feed(s.recv(65536))
    r = got[0].message
    print(type(r).__name__, r.code, r.message)
    """)
    assert f"Error {NO_PERMISSION}" in out and "its own processes" in out
    assert served_nothing(shared_fabric)


@pytest.mark.parametrize("lie", ["size", "address", "segment", "data host"])
def test_an_exporting_broker_that_lies_about_the_memory_is_refused(shared_fabric: TestCluster, lie: str) -> None:
    """A fake exporting broker (it has the key) answers an import with memory that does not match the handle, or
    with a data endpoint on another host than its own (the importer's engine would send its transfers there)."""
    a, b = shared_fabric.actor(1), shared_fabric.actor(2)
    _, s, _ = export(a, flags=1)
    fake = bytearray(s)
    fake[34:36] = (17018).to_bytes(2, "little")  # the handle now points at the fake broker's port
    server = f"""
import os, socket, sys
from vmmshare.wire import peer as F
KEY = open(os.environ["VMMSHARE_CLUSTER_KEY_FILE"], "rb").read()
ls = socket.create_server(("10.77.0.1", 17018))
print("ready", flush=True)
c, _ = ls.accept()
r = F.FrameReader()
res = F.Responder(KEY, int(os.environ["VMMSHARE_SERVER_ID"], 0), F.endpoint_bytes("10.77.0.1", 17018))
seal = None
while True:
    r.push(c.recv(65536) or sys.exit(1))
    while (frame := r.next()) is not None:
        req, m = frame
        if isinstance(m, F.Hello):
            c.sendall(F.encode(res.challenge(m), 0))
        elif isinstance(m, F.Proof):
            res.verify(m)
            seal = F.Sealer(res.keys.responder_to_initiator)
            r.authenticate(res.keys.initiator_to_responder)
            c.sendall(seal.seal(F.encode(F.Welcome(), 0)))
        elif isinstance(m, F.Import):
            size, addr, seg = {{"size": (4 << 20, 4096, "10.77.0.1:1"), "address": (2 << 20, 0, "10.77.0.1:1"),
                               "segment": (2 << 20, 4096, ""), "data host": (2 << 20, 4096, "127.0.0.1:15001")
                               }}[{lie!r}]
            c.sendall(seal.seal(F.encode(F.Imported(9, size, 0, 0, 0, 5, 1, 0, addr, seg), req)))
        elif isinstance(m, F.Release):
            print("released", m.hold, flush=True)
            c.sendall(seal.seal(F.encode(F.Ok(), req)))
            sys.exit(0)
"""
    import subprocess
    import sys

    cmd = shared_fabric.cluster.server(1).command([sys.executable, "-c", server])
    proc = subprocess.Popen(cmd, env=shared_fabric.env(1), stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        msg = fails(b, BAD_HANDLE if lie == "size" else IPC, IMP, bytes(fake), FABRIC, 0)
        assert "does not match" in msg
        assert proc.stdout.readline().strip() == "released 9"  # and the hold it was given goes back
    finally:
        proc.kill()
        proc.wait(30)


@pytest.mark.slow
def test_a_flood_of_links_is_bounded_and_the_broker_serves_on(shared_fabric: TestCluster) -> None:
    base = shared_fabric.brokers[1].fd_count()
    broker_pid = shared_fabric.brokers[1].pid
    out = attack(shared_fabric, f"""
    import time
    held = []
    for _ in range(300):
        try:
            held.append(dial())
        except OSError as exc:
            print("dial failed", exc)
            break
    def accept_queue():
        # the connections waiting for the broker's accept(): the LISTEN entry on 17017 of its namespace's TCP table
        with open("/proc/{broker_pid}/net/tcp") as f:
            for line in f.readlines()[1:]:
                fields = line.split()  # sl, local address, remote address, state, tx_queue:rx_queue, ...
                local, state, queues = fields[1], fields[3], fields[4]
                if local.endswith(":4279") and state == "0A":
                    return int(queues.split(":")[1], 16)
        raise SystemExit("the broker does not listen on 17017")
    deadline = time.monotonic() + 60  # a hang guard only
    while accept_queue():  # until the broker took every connection (kept as a link, or closed)
        assert time.monotonic() < deadline, "the broker left connections in its accept queue"
        time.sleep(0.01)
    print("broker fds", len(os.listdir("/proc/{broker_pid}/fd")))
    print("closed by the broker", sum(closed(s) for s in held[-50:]))
    """)
    fds = int(out.split("broker fds")[1].split()[0])
    assert fds <= base + 40, f"the broker holds {fds} fds under a flood of links ({base} before)"
    assert int(out.split("closed by the broker")[1].split()[0]) > 0
    still_serves(shared_fabric)


@pytest.mark.parametrize("problem", ["mode", "short", "owner", "missing"])
def test_a_key_file_that_others_could_read_or_that_is_too_short_is_refused(fabric: TestCluster, problem: str) -> None:
    key = fabric.root / f"key-{problem}"
    key.write_bytes(os.urandom(16 if problem == "short" else 48))
    key.chmod(0o644 if problem == "mode" else 0o600)
    if problem == "owner":
        os.chown(key, 65534, 65534)
    if problem == "missing":
        key.unlink()
    b = fabric.brokers[2]
    b.signal(signal.SIGTERM)
    with pytest.raises(RuntimeError) as failed:
        b.start(VMMSHARE_CLUSTER_KEY_FILE=str(key))
    said = str(failed.value)
    assert str(key) in said
    assert {"mode": "chmod 600", "short": "16 bytes", "owner": "chown", "missing": "cannot read"}[problem] in said
    assert not Path(b.socket).exists() or not b.alive()


def test_doctor_says_where_the_engines_ports_are_reachable(fabric: TestCluster) -> None:
    import subprocess
    import sys

    ns = fabric.cluster.server(1).namespace
    subprocess.run(["ip", "-n", ns, "link", "add", "extra0", "type", "veth", "peer", "name", "extra1"], check=True)
    subprocess.run(["ip", "-n", ns, "addr", "add", "10.99.0.1/24", "dev", "extra0"], check=True)
    subprocess.run(["ip", "-n", ns, "link", "set", "extra0", "up"], check=True)
    doctor = fabric.cluster.server(1).command([sys.executable, "-m", "vmmshare.cli", "doctor", "--json"])

    def findings() -> dict[str, dict[str, str]]:
        out = subprocess.run(doctor, env=fabric.env(1), capture_output=True, text=True, timeout=60)
        import json

        return {f["item"]: f for f in json.loads(out.stdout)}

    before = findings()
    assert before["fabric engine"]["status"] == "ok" and before["cluster key"]["status"] == "ok"
    exposure = before["fabric exposure"]  # the broker's engine runs from its start, on every interface
    assert exposure["status"] == "limit" and "10.99.0.1" in exposure["detail"] and "firewall" in exposure["fix"]
    a, b = fabric.actor(1), fabric.actor(2)
    _, s, _ = export(a, pids=[b.pid])
    h = ok(b, IMP, s, FABRIC, 0)
    exposure = findings()["fabric exposure"]
    assert exposure["status"] == "limit" and "10.99.0.1" in exposure["detail"] and "firewall" in exposure["fix"]
    ok(b, "rt.free_physical", h)


RELAY = """
import socket, sys, threading
up = socket.create_server(("10.77.0.2", 40001))
print("ready", flush=True)
seen = {"to exporter": 0, "to importer": 0}

def pipe(src, dst, name):
    while True:
        try:
            data = src.recv(65536)
        except OSError:
            data = b""
        if not data:
            break
        seen[name] += len(data)
        try:
            dst.sendall(data)
        except OSError:
            break
    for s in (src, dst):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

broker, _ = up.accept()  # its own broker, dialing the made-up handle's endpoint
exporter = socket.create_connection(("10.77.0.1", 17017), timeout=30)
threads = [threading.Thread(target=pipe, args=(broker, exporter, "to exporter")),
           threading.Thread(target=pipe, args=(exporter, broker, "to importer"))]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("relayed", seen["to exporter"], seen["to importer"], flush=True)
"""


@pytest.mark.slow
def test_a_handshake_relayed_between_two_brokers_by_a_keyless_user_fails(shared_fabric: TestCluster) -> None:
    """SPEC §8 (the relay): a user of server 2 without the key hands its broker a made-up FABRIC handle naming its
    own TCP listener, and relays every byte between its broker and server 1's fabric port. Neither broker may end up
    with a proved link through the relay; the import fails, saying why, and server 1 serves nothing."""
    import subprocess
    import sys

    a, b = shared_fabric.actor(1), shared_fabric.actor(2)
    _, s, _ = export(a, flags=1)  # any pid may import it: only the relay stands between the attacker and the bytes
    made_up = bytearray(s)
    made_up[32:64] = Endpoint(4, "10.77.0.2", 40001).pack()  # the attacker's listener
    cmd = shared_fabric.cluster.server(2).command([sys.executable, "-c", RELAY])
    relay = subprocess.Popen(cmd, env=shared_fabric.env(2), stdout=subprocess.PIPE, text=True)
    try:
        assert relay.stdout is not None and relay.stdout.readline().strip() == "ready"
        msg = fails(b, IPC, IMP, bytes(made_up), FABRIC, 0)
        assert "relay" in msg, msg
        relay.wait(60)
        line = relay.stdout.readline().split()
        assert line[0] == "relayed" and int(line[1]) > 0 and int(line[2]) > 0  # it did carry the handshake
    finally:
        relay.kill()
        relay.wait(30)
    assert served_nothing(shared_fabric)
    log = shared_fabric.brokers[1].log.read_text()
    assert "before it proved the cluster key" in log or "closed" in log
    still_serves(shared_fabric)


BARE_ENGINE = """
import ctypes, json, sys, urllib.error, urllib.request
import vmmshare.acl as acl
from vmmshare.client.connection import BrokerClient
from vmmshare.errors import IpcError
from vmmshare.fabric.engine import Engine

told = []  # what its broker told this importer: its hold's segment, address, and its metadata URL
import_remote = BrokerClient.import_remote
BrokerClient.import_remote = lambda self, handle: told.append(import_remote(self, handle)) or told[-1]
acl.rt.set_device(0)
h, ret = acl.rt.mem_import_from_shareable_handle_v2(bytes.fromhex(sys.argv[1]), 2, 0)
assert ret == 0, acl.get_recent_err_msg()
got = told[0]

def meta(key, value=None):
    req = urllib.request.Request(f"{got.metadata}?key={key}", method="GET" if value is None else "PUT",
                                 data=None if value is None else json.dumps(value).encode())
    try:
        return json.loads(urllib.request.urlopen(req, timeout=10).read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code

mine = meta(f"mooncake/ram/{got.segment}")  # what this process's engine is told: its own hold, nothing else
print("told", json.dumps([(b["addr"], b["length"]) for b in mine["buffers"]], separators=(",", ":")), got.address,
      got.size, flush=True)
# a bare engine of its own, in its own namespace, given a descriptor it wrote itself: the exporting engine's data
# host and port and the address it was told (what an attacker that kept them would do)
meta("mooncake/ram/forged", {**mine, "name": "forged", "buffers": [{"addr": got.address, "length": got.size,
                                                                      "name": "forged"}]})
bare = Engine("10.77.0.2", "tcp", 2.0, got.metadata)
buf = ctypes.create_string_buffer(64)
bare.register(ctypes.addressof(buf), 64)

def read(engine, segment):
    try:
        engine.read(segment, ctypes.addressof(buf), got.address, 16)
        return buf.raw[:16].hex()
    except IpcError:
        return "refused"

from vmmshare.fabric import engine as E
process_engine = E.process_engine("10.77.0.2", "tcp", 2.0, got.metadata)  # the one its first copy would make
print("held", read(bare, "forged"), read(process_engine, got.segment), flush=True)
acl.rt.free_physical(h)  # the hold ends
print("freed", meta(f"mooncake/ram/{got.segment}"), flush=True)  # its description is gone at once
sys.stdin.readline()  # the test saw the exporting broker drop the hold
print("after", read(bare, "forged"), read(process_engine, got.segment), flush=True)
"""


@pytest.mark.slow
def test_a_hold_that_ended_no_longer_reaches_the_memory_through_a_bare_engine(shared_fabric: TestCluster) -> None:
    """SPEC §8 (revocation reaches the data plane): an importer that freed its hold keeps its engine, a bare engine
    of its own with a descriptor it wrote itself, and the address and data port it was told; another importer of
    the same server still holds the same export, at an address of its own that this one was never told. The ended
    hold's address is unregistered: both engines' reads are refused, while the other importer keeps reading."""
    import subprocess
    import sys

    a, b = shared_fabric.actor(1), shared_fabric.actor(2)
    _, s, p = export(a, flags=1)
    ok(a, "rt.memset", p, M2, 0x5A, M2)
    kept, kept_p = import_map(b, s)  # the other importer, of the same server
    cmd = shared_fabric.cluster.server(2).command([sys.executable, "-c", BARE_ENGINE, s.hex()])
    attacker = subprocess.Popen(cmd, env=shared_fabric.env(2), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert attacker.stdout is not None and attacker.stdin is not None
        told, address, size = attacker.stdout.readline().split()[1:]
        assert json.loads(told) == [[int(address), int(size)]], "its engine is told of its own hold alone"
        assert attacker.stdout.readline().split() == ["held", "5a" * 16, "5a" * 16]  # while it holds, it reads
        assert attacker.stdout.readline().split() == ["freed", "404"]

        def remote_holds() -> int:
            return sum(len(r.get("remote_importers") or []) for r in shared_fabric.brokers[1].listing()["exports"])

        eventually(lambda: remote_holds() == 1, "the exporting broker kept the freed hold")
        attacker.stdin.write("go\n")
        attacker.stdin.flush()
        assert attacker.stdout.readline().split() == ["after", "refused", "refused"]
        assert attacker.wait(60) == 0
    finally:
        attacker.kill()
        attacker.wait(30)
    host = ok(b, "rt.malloc_host", 16)
    ok(b, "rt.memcpy", host, 16, kept_p, 16, 2)  # DEVICE_TO_HOST: the other importer still reads
    unmap_free(b, kept, kept_p)
    eventually(lambda: served_nothing(shared_fabric), "remote holds left behind")


NEVER_HELD = """
import json, sys, urllib.error, urllib.request
from vmmshare.fabric.engine import load
ports, meta_port, me = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
raw = load(2.0).TransferEngine()  # a bare engine, in the mode that asks a peer's RPC port for its descriptor
assert raw.initialize(me, "P2PHANDSHAKE", "tcp", "") == 0

def first(segment):
    try:
        return raw.get_first_buffer_address(segment)
    except Exception:
        return 0

print("descriptors", json.dumps({p: first(f"10.77.0.1:{p}") for p in ports}), flush=True)

def get(path, key):
    try:
        url = f"http://127.0.0.1:{meta_port}{path}?key={key}"
        return urllib.request.urlopen(url, timeout=10).status
    except urllib.error.HTTPError as exc:
        return exc.code

guesses = ["/metadata", "//metadata", "/x/metadata", "/" + "0" * 32 + "/metadata", "/../metadata", "/%2e%2e/metadata"]
keys = ["mooncake/ram/10.77.0.1", "mooncake/ram/10.77.0.2", "mooncake/rpc_meta/10.77.0.1"]
print("metadata", json.dumps(sorted({get(p, k) for p in guesses for k in keys})), flush=True)
"""


def listening_ports(pid: int) -> list[int]:
    """The TCP ports process `pid` listens on (its own sockets, in its network namespace)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    ports = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in list(f)[1:]:
                cols = line.split()
                if cols[3] == "0A" and int(cols[9]) in inodes:
                    ports.add(int(cols[1].split(":")[1], 16))
    return sorted(ports)


def metadata_service(fabric: TestCluster, n: int) -> int:
    """The pid of server `n`'s broker's metadata service child."""
    pid = fabric.brokers[n].pid
    children = [int(c) for t in os.listdir(f"/proc/{pid}/task")
                for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
    found = [c for c in children if b"vmmshare.fabric.metadata" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(found) == 1, children
    return found[0]


@pytest.mark.slow
def test_a_bare_engine_that_never_held_an_export_learns_no_address(shared_fabric: TestCluster) -> None:
    """SPEC §8 (a peer that never held an export cannot reach it): server 2 holds an export of server 1, so server
    1's engine serves it. A bare engine that never imported, on server 2 and as another user on server 1, asks every
    port server 1's broker listens on for its segment descriptor, and the node's metadata service for what it holds
    under every path but a token it was given: it learns no address (the engine answers 0, the service 404), and the
    tokens are on no command line or environment of the service."""
    import subprocess
    import sys

    a, b = shared_fabric.actor(1), shared_fabric.actor(2)
    _, s, p = export(a, pids=[b.pid])
    ok(a, "rt.memset", p, M2, 0x5A, M2)
    h, rp = import_map(b, s)
    buf = ok(b, "rt.malloc_host", 16)
    ok(b, "rt.memcpy", buf, 16, rp, 16, 2)  # server 1's engine now serves the hold
    ports = [port for port in listening_ports(shared_fabric.brokers[1].pid) if port != 17017]
    assert len(ports) >= 2, ports  # the engine's RPC and data ports at least
    nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
    for n, prefix, me in ((2, [], "10.77.0.2"), (1, nobody, "10.77.0.1")):
        service = metadata_service(shared_fabric, n)
        meta_port, = listening_ports(service)
        cmd = shared_fabric.cluster.server(n).command(
            [*prefix, sys.executable, "-c", NEVER_HELD, json.dumps(ports), str(meta_port), me])
        out = subprocess.run(cmd, env=shared_fabric.env(n), capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
        assert set(json.loads(lines["descriptors"]).values()) == {0}, f"server {n}: {lines['descriptors']}"
        assert json.loads(lines["metadata"]) == [404], f"server {n}: {lines['metadata']}"
        cmdline = Path(f"/proc/{service}/cmdline").read_bytes().split(b"\0")
        assert cmdline[1:3] == [b"-m", b"vmmshare.fabric.metadata_service"] and len(cmdline) == 4  # nothing else
        environ = Path(f"/proc/{service}/environ").read_bytes()
        words = set(re.findall(rb"[0-9a-f]{32}", environ + b"".join(cmdline)))
        for word in words:  # no path token there (a 32-hex-digit value that the service would answer under)
            probe = subprocess.run(shared_fabric.cluster.server(n).command(
                [sys.executable, "-c", f"import urllib.request as u, urllib.error as e\ntry: u.urlopen("
                 f"'http://127.0.0.1:{meta_port}/{word.decode()}/metadata?key=mooncake/ram/x', timeout=10)\n"
                 "except e.HTTPError as x: print(x.code)"]), env=shared_fabric.env(n), capture_output=True, text=True)
            assert probe.stdout.strip() == "404"
    ok(b, "rt.memcpy", buf, 16, rp, 16, 2)  # the holder still reads
    unmap_free(b, h, rp)
    eventually(lambda: served_nothing(shared_fabric), "remote holds left behind")
