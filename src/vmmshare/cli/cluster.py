"""A test cluster on one machine: 1 to 254 "servers" (2 by default) as network namespaces on a private bridge
(`vmmshare cluster`).

Each server is a network namespace with one interface on a bridge that lives in a hub namespace of its own (the
machine's own namespace is not touched), a private address, its own broker socket and server id, and one cluster
key for all. `up` writes each server's VMMSHARE_* settings to ``server<N>.env`` in the cluster's folder; a program
runs on server N with ``vmmshare cluster exec N -- program``, whose brokers start themselves in that namespace.
Needs root (network namespaces).

Every server's interface has a MAC address derived from its number, and every server knows every other's as a
permanent neighbour entry: N servers on one bridge would otherwise need N(N-1) learned ARP entries, past the kernel's
neighbour table limit (`gc_thresh3`, 1024) from 33 servers on. `up` and `down` set up and take down the servers in
parallel.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..config import FABRIC_PORT

STATE_ROOT = Path("/run/vmmshare-cluster")
SUBNET = "10.77.0.0/24"
KEY_BYTES = 48
MAX_SERVERS = 254  # the hosts of SUBNET, a /24
PARALLEL = 8  # servers set up or taken down at once
_NAME = re.compile(r"^[a-z0-9]{1,8}$")


class ClusterError(RuntimeError):
    """A cluster that cannot be made, found or removed; the message says why and what to do."""


def _ip(*args: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    try:
        # a hang guard only: ip returns at once
        done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=60, input=stdin)
    except FileNotFoundError:
        raise ClusterError("the `ip` command (iproute2) is not installed: apt-get install iproute2") from None
    if check and done.returncode != 0:
        raise ClusterError(f"ip {' '.join(args)}: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done


@dataclass(frozen=True)
class Server:
    """One server of the cluster: its namespace, address and VMMSHARE_* settings."""

    number: int
    namespace: str
    address: str
    server_id: int
    env: dict[str, str]

    def command(self, argv: list[str], **extra: str) -> list[str]:
        """`argv` run on this server: in its namespace, with its settings (and `extra` ones)."""
        env = {**self.env, **extra}
        return ["ip", "netns", "exec", self.namespace, "env", *(f"{k}={v}" for k, v in env.items()), *argv]


class Cluster:
    """The cluster called `name` (its namespaces ``vmms-<name>-<n>`` and its folder under `root`)."""

    def __init__(self, name: str = "demo", servers: int = 2, root: Path | None = None, subnet: str = SUBNET,
                 port: int = FABRIC_PORT, timeout: float | None = None) -> None:
        if not _NAME.match(name):
            raise ClusterError(f"cluster name {name!r}: 1 to 8 lower-case letters or digits")
        if not 1 <= servers <= MAX_SERVERS:
            raise ClusterError(f"{servers} servers: a test cluster has 1 to {MAX_SERVERS}")
        self.name, self.count, self.port, self.timeout = name, servers, port, timeout
        self.folder = (root or STATE_ROOT) / name
        self.hub = f"vmms-{name}-hub"
        self.net = ipaddress.ip_network(subnet)
        self.key_file = self.folder / "cluster.key"

    def server(self, number: int) -> Server:
        if not 1 <= number <= self.count:
            raise ClusterError(f"server {number}: this cluster has servers 1 to {self.count}")
        address = str(self.net.network_address + number)
        server_id = (zlib.crc32(self.name.encode()) & 0xFFFFFF00) | number
        env = {
            "VMMSHARE_SOCKET": str(self.folder / f"server{number}" / "broker.sock"),
            "VMMSHARE_SERVER_ID": hex(server_id),
            "VMMSHARE_FABRIC": "tcp",
            "VMMSHARE_FABRIC_ADDR": address,
            "VMMSHARE_FABRIC_PORT": str(self.port),
            "VMMSHARE_CLUSTER_KEY_FILE": str(self.key_file),
        }
        if self.timeout is not None:
            env["VMMSHARE_FABRIC_TIMEOUT"] = f"{self.timeout:g}"
        return Server(number, f"vmms-{self.name}-{number}", address, server_id, env)

    @staticmethod
    def mac(number: int) -> str:
        """Server `number`'s interface address: locally administered, from its number (so every neighbour entry
        can be written before any server has spoken)."""
        return f"02:76:6d:00:{number >> 8 & 0xFF:02x}:{number & 0xFF:02x}"

    @property
    def servers(self) -> list[Server]:
        return [self.server(n) for n in range(1, self.count + 1)]

    # ------------------------------------------------------------ up, down, state

    def exists(self) -> bool:
        return self.hub in _namespaces()

    def up(self) -> None:
        """Make the namespaces, the bridge, the addresses, the key and the env files (all undone on failure)."""
        if os.geteuid() != 0:
            raise ClusterError("a test cluster needs root (network namespaces): run it with sudo")
        if self.exists():
            raise ClusterError(f"cluster {self.name!r} is up already: `vmmshare cluster down --name {self.name}` "
                               "first, or choose another --name")
        try:
            self._make()
        except BaseException:
            self.down()
            raise

    def _make(self) -> None:
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.folder, 0o700)
        fd = os.open(self.key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(KEY_BYTES))
        _ip("netns", "add", self.hub)
        _ip("-n", self.hub, "link", "set", "lo", "up")
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        servers = self.servers
        with ThreadPoolExecutor(PARALLEL) as pool:
            list(pool.map(self._make_server, servers))
            list(pool.map(lambda s: self._neighbours(s, servers), servers))

    def _make_server(self, s: Server) -> None:
        _ip("netns", "add", s.namespace)
        _ip("-n", self.hub, "link", "add", f"h{s.number}", "type", "veth", "peer", "name", "fab0",
            "address", self.mac(s.number), "netns", s.namespace)
        _ip("-n", self.hub, "link", "set", f"h{s.number}", "master", "br0", "up")
        _ip("-n", s.namespace, "addr", "add", f"{s.address}/{self.net.prefixlen}", "dev", "fab0")
        _ip("-n", s.namespace, "link", "set", "lo", "up")
        _ip("-n", s.namespace, "link", "set", "fab0", "up")
        folder = Path(s.env["VMMSHARE_SOCKET"]).parent
        folder.mkdir(mode=0o700, exist_ok=True)
        lines = "".join(f"{k}={shlex.quote(v)}\n" for k, v in s.env.items())
        (self.folder / f"server{s.number}.env").write_text(lines)

    def _neighbours(self, s: Server, servers: list[Server]) -> None:
        """Every other server as a permanent neighbour of `s` (one `ip -batch`)."""
        batch = "".join(f"neigh replace {o.address} lladdr {self.mac(o.number)} dev fab0 nud permanent\n"
                        for o in servers if o is not s)
        if batch:
            _ip("-n", s.namespace, "-batch", "-", stdin=batch)

    def down(self) -> None:
        """Stop every process left in the cluster's namespaces, then remove them, the bridge and the folder."""
        present = _namespaces()

        def remove(ns: str) -> None:
            if ns in present:
                _stop_processes(ns)
                _ip("netns", "del", ns, check=False)

        with ThreadPoolExecutor(PARALLEL) as pool:
            list(pool.map(remove, [s.namespace for s in self.servers]))
        remove(self.hub)
        if self.folder.is_dir():
            for path in sorted(self.folder.rglob("*"), reverse=True):
                with contextlib.suppress(OSError):
                    path.rmdir() if path.is_dir() else path.unlink()
            with contextlib.suppress(OSError):
                self.folder.rmdir()

    def link(self, number: int, up: bool) -> None:
        """Take server `number`'s link to the others down or up (a cable pulled, and put back)."""
        _ip("-n", self.server(number).namespace, "link", "set", "fab0", "up" if up else "down")

    def pids(self, number: int) -> list[int]:
        """The processes running on server `number`."""
        out = _ip("netns", "pids", self.server(number).namespace, check=False).stdout
        return [int(p) for p in out.split()]

    def describe(self) -> str:
        lines = [f"cluster {self.name!r}: {self.count} servers on {self.net}, key {self.key_file}"
                 f"{'' if self.exists() else ' (down)'}"]
        for s in self.servers:
            running = len(self.pids(s.number)) if self.exists() else 0
            lines.append(f"server {s.number}: namespace {s.namespace}, address {s.address}, server id "
                         f"{s.server_id:#x}, {running} process(es)")
            lines.append(f"  run there:  vmmshare cluster exec {s.number} --name {self.name} -- COMMAND")
            lines.extend(f"  {k}={v}" for k, v in s.env.items())
        return "\n".join(lines)


def _namespaces() -> set[str]:
    out = _ip("netns", "list", check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _stop_processes(namespace: str) -> None:
    """SIGTERM the processes in `namespace`, then SIGKILL whatever is left after a moment."""
    for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
        pids = [int(p) for p in _ip("netns", "pids", namespace, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ---------------------------------------------------------------- `vmmshare cluster`


def _name_option(text: str) -> str:
    if not _NAME.match(text):
        raise argparse.ArgumentTypeError(f"{text!r}: a cluster name is 1 to 8 lower-case letters or digits")
    return text


def _servers_option(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_SERVERS:
        raise argparse.ArgumentTypeError(f"{text!r}: a test cluster has 1 to {MAX_SERVERS} servers")
    return value


def main(argv: list[str]) -> int:
    from .console import FAILED, OK, USAGE, Parser, count_option, say_error, seconds_option

    ap = Parser(prog="vmmshare cluster", description=" ".join((__doc__ or "").split("\n\n")[0].split()))
    ap.add_argument("action", choices=("up", "down", "status", "exec"))
    ap.add_argument("number", nargs="?", type=count_option, help="exec: the server to run on (1, 2, ...)")
    ap.add_argument("--name", type=_name_option, default="demo",
                    help="the cluster's name: 1 to 8 lower-case letters or digits (default demo)")
    ap.add_argument("--servers", type=_servers_option, default=2,
                    help=f"up: how many servers, 1 to {MAX_SERVERS} (default 2)")
    ap.add_argument("--timeout", type=seconds_option, default=None, metavar="SECONDS",
                    help="up: VMMSHARE_FABRIC_TIMEOUT for every server (a positive number of seconds)")
    ap.epilog = ("exec runs: vmmshare cluster exec N [--name NAME] -- COMMAND [ARGS], with this install's folder "
                 f"({os.path.dirname(sys.executable)}) first on PATH, so that `vmmshare` there is this one")
    split = argv.index("--") if "--" in argv else len(argv)
    args, command = ap.parse_args(argv[:split]), argv[split + 1 :]
    prog = f"vmmshare cluster {args.action}"
    try:
        cluster = _found(args.name, args.servers, args.timeout) if args.action != "up" else Cluster(
            args.name, args.servers, timeout=args.timeout)
        if args.action == "up":
            cluster.up()
            print(cluster.describe())
        elif args.action == "down":
            was_up = cluster.exists()
            cluster.down()
            print(f"cluster {args.name!r} is down" if was_up else f"cluster {args.name!r} was not up")
        elif args.action == "status":
            if not cluster.exists():
                raise ClusterError(f"cluster {args.name!r} is not up: `vmmshare cluster up --name {args.name}`")
            print(cluster.describe())
        else:
            if args.number is None or not command:
                ap.error("exec takes a server number and -- COMMAND")
            if not cluster.exists():
                raise ClusterError(f"cluster {args.name!r} is not up: `vmmshare cluster up --name {args.name}`")
            # this interpreter's folder first on PATH: `vmmshare` and `python` there are this install's, venv or not
            here = os.path.dirname(sys.executable)
            rest = [p for p in os.environ.get("PATH", os.defpath).split(os.pathsep) if p != here]
            path = os.pathsep.join([here, *rest])
            return subprocess.call(cluster.server(args.number).command(command, PATH=path))
    except ClusterError as exc:
        say_error(prog, str(exc))
        return FAILED if args.action != "exec" else USAGE
    return OK


def _found(name: str, servers: int, timeout: float | None) -> Cluster:
    """The cluster as `up` made it: its server count and timeout are read back from its env files."""
    probe = Cluster(name, 1)
    files = sorted(probe.folder.glob("server*.env")) if probe.folder.is_dir() else []
    if files:
        servers = len(files)
        text = files[0].read_text()
        found = re.search(r"^VMMSHARE_FABRIC_TIMEOUT=(\S+)$", text, re.MULTILINE)
        timeout = float(found.group(1)) if found else timeout
    return Cluster(name, servers, timeout=timeout)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
