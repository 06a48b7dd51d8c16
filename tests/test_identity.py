"""Identity, CI-sized (the full run is `stress/identity.py`, see docs/reliability.md §5): who may import is
decided by the kernel's view of the peer (SO_PEERCRED pid and uid, the process start time), never by a claim.

(a) pid reuse forced with /proc/sys/kernel/ns_last_pid, on the host and inside a fresh pid namespace; (b) processes
in pid namespaces of their own, trustlisted by their bare tgid; (c) a client running as `nobody` against brokers
started by root; (d) random 64-bit handle guesses against the broker's check. The parts that need root,
unshare(1) or the user nobody skip with the reason where those are missing, and fail instead where
VMMSHARE_REQUIRE_ROOT_TESTS=1 (CI runs as root: there they must run).
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

STRESS = Path(__file__).resolve().parents[1] / "src" / "vmmshare" / "cli" / "stress"

import common as c  # noqa: E402
import identity as ident  # noqa: E402
from conftest import require  # noqa: E402
from procs import ActorDied, refusal  # noqa: E402

SEED = int(os.environ.get("VMMSHARE_STRESS_SEED", "20240917"))


# ---------------------------------------------------------------- (a) pid reuse


SAME_TICK_ROUNDS = 8  # rounds of 12 fast trials: on a machine with idle cores nearly all reuse within the tick


def _reuse(trials: int, mode: str, in_pidns: bool, seed: int = SEED) -> dict[str, Any]:
    r = ident.run_reuse(trials, mode, seed, in_pidns=in_pidns, limit=60)
    require("skipped" not in r, r.get("skipped", ""))
    require(r["reused"] > 0, f"the kernel never handed the trustlisted pid to the next process in {trials} tries "
                             "(ns_last_pid had no effect, or a busy machine took every pid first)")
    return r


@pytest.mark.alone  # steers the kernel's next pid (ns_last_pid)
def test_a_reused_pid_is_refused_inside_a_fresh_pid_namespace() -> None:
    """Rule 12 where pids restart at 1: broker, exporter and both processes live in a new pid namespace; the pid
    of a trustlisted process that exited is handed (ns_last_pid) to a process started a clock tick later."""
    r = _reuse(4, "slow", in_pidns=True)
    assert r["reused_later_tick"] == r["reused"], r
    assert r["refused"] == r["reused"], f"a process that reused a trustlisted pid imported: {r['accepted_examples']}"
    assert all("reuse" in m for m in r["refusal_messages"]), r["refusal_messages"]


@pytest.mark.alone  # steers the kernel's next pid (ns_last_pid)
def test_a_pid_reused_within_the_same_clock_tick_is_refused() -> None:
    """Rule 12: "a later process that reuses the pid is refused" - also when it starts within the same clock tick
    (1/CLK_TCK s) as the trustlisted process did. The broker binds a trustlisted pid to the start time in
    /proc/<pid>/stat, which counts clock ticks, so a pid reused within one tick passed the check."""
    rounds = []
    for k in range(SAME_TICK_ROUNDS):  # until a reuse lands in the trustlisted process's tick
        rounds.append(_reuse(12, "fast", in_pidns=False, seed=SEED + k))
        if rounds[-1]["reused_same_tick"]:
            break
    require(any(r["reused_same_tick"] for r in rounds),
            f"no reuse landed in the trustlisted process's clock tick in {12 * len(rounds)} tries (a slow machine)")
    for r in rounds:
        assert r["accepted_same_tick"] == 0, (
            f"{r['accepted_same_tick']} of {r['reused_same_tick']} processes that got a trustlisted pid within the "
            f"same clock tick imported: {r['accepted_examples'][:3]}"
        )
        assert r["refused"] == r["reused"]


# ---------------------------------------------------------------- (b) pid namespaces


@pytest.fixture
def actors() -> Iterator[list[c.Actor]]:
    made: list[c.Actor] = []
    yield made
    for a in made:
        a.kill()


def _container(broker: c.BrokerProc, actors: list[c.Actor]) -> tuple[c.Actor, int]:
    require(shutil.which("unshare"), "no unshare(1) here")
    try:
        a, host_pid = ident.container_actor(broker.env)
    except ActorDied:  # expected only where unshare itself is refused: any other death fails the test
        why = refusal(ident.UNSHARE_PID)
        require(not why, f"cannot start a process in a new pid namespace: {why}")
        raise
    actors.append(a)
    return a, host_pid


def test_two_containers_both_pid_1_are_told_apart_by_their_bare_tgid(own_broker: c.BrokerProc,
                                                                      actors: list[c.Actor]) -> None:
    e = c.Actor(own_broker.env)
    actors.append(e)
    c1, host1 = _container(own_broker, actors)
    c2, host2 = _container(own_broker, actors)
    assert (c1.pid, c2.pid) == (1, 1), "each container sees itself as pid 1"
    assert host1 != host2
    assert ident.ok(c1, "rt.device_get_bare_tgid") == host1
    assert ident.ok(c2, "rt.device_get_bare_tgid") == host2
    sh, _p, digest = ident.export_mapped(e, pids=[host1])
    assert ident.import_digest(c1, sh) == digest
    assert c2.call("rt.mem_import_from_shareable_handle_v2", sh, c.DEFAULT, 0)[-1] == c.NO_PERMISSION
    assert "trustlist" in c2.last_err


def test_a_container_exports_to_a_host_process_named_by_its_bare_tgid(own_broker: c.BrokerProc,
                                                                       actors: list[c.Actor]) -> None:
    """The trustlist holds bare tgids, whichever side of a pid namespace the exporter is on."""
    box, host_box = _container(own_broker, actors)
    importer, stranger = c.Actor(own_broker.env), c.Actor(own_broker.env)
    actors += [importer, stranger]
    tgid = ident.ok(importer, "rt.device_get_bare_tgid")
    assert tgid == importer.pid
    sh, _p, digest = ident.export_mapped(box, pids=[tgid])
    assert ident.import_digest(importer, sh) == digest
    assert stranger.call("rt.mem_import_from_shareable_handle_v2", sh, c.DEFAULT, 0)[-1] == c.NO_PERMISSION
    (row,) = c.raw_listing(own_broker.socket)["exports"]
    assert row["owner_pid"] == host_box, "the broker names the exporter by its host pid"
    assert row["trustlist"] == [tgid]


# ---------------------------------------------------------------- (c) another uid


@pytest.fixture
def world(tmp_path: Path) -> Iterator[Path]:
    """A folder every user can traverse (pytest's tmp_path is private to root)."""
    d = ident.world_dir("vmmshare-uid-")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _nobody_actor(prefix: list[str], env: dict[str, str], actors: list[c.Actor]) -> tuple[c.Actor, dict[str, str]]:
    full, why = ident.nobody_env(prefix, env)
    require(full is not None, why)
    assert full is not None
    a = c.Actor(full, prefix=prefix)
    actors.append(a)
    assert os.stat(f"/proc/{a.pid}").st_uid != os.getuid(), "the actor does not run as another user"
    return a, full


def test_another_uid_cannot_reach_a_single_user_broker(as_nobody: list[str], world: Path,
                                                       actors: list[c.Actor]) -> None:
    b = c.LoggedBroker(world / "run", env=c.clean_env())
    try:
        assert stat.S_IMODE(b.folder.stat().st_mode) == 0o700
        a, _ = _nobody_actor(as_nobody, b.env, actors)
        free, total, ret = a.call("rt.get_mem_info", 0)
        assert ret == c.IPC_ERROR, (free, total, ret)
        assert str(b.socket) in a.last_err, f"the message does not name the socket: {a.last_err!r}"
        assert a.call("rt.malloc_physical", c.MiB2, c.PROP, 0)[-1] == c.IPC_ERROR
        assert c.processes_mentioning(str(world), exclude=[b.pid, a.pid]) == [], "nobody started a broker"
        assert c.raw_mem_info(b.socket)[1] > 0, "root is no longer served"
    finally:
        b.kill()


def test_a_single_user_broker_refuses_another_uid_that_reaches_its_socket(as_nobody: list[str], world: Path,
                                                                         actors: list[c.Actor]) -> None:
    """Defence in depth: with the folder and socket opened up by hand, the broker's own SO_PEERCRED uid check
    refuses the connection (and logs it); the client's call fails with 507022 naming the socket."""
    b = c.LoggedBroker(world / "run", env=c.clean_env())
    try:
        baseline = c.settled_fd_count(b)
        os.chmod(b.folder, 0o755)
        os.chmod(b.socket, 0o666)
        a, _ = _nobody_actor(as_nobody, b.env, actors)
        uid = os.stat(f"/proc/{a.pid}").st_uid
        ret = a.call("rt.get_mem_info", 0)[-1]
        assert ret == c.IPC_ERROR
        assert str(b.socket) in a.last_err, a.last_err
        c.barrier(b.socket)
        assert f"refused pid {a.pid} of uid {uid}" in b.log_text(), b.log_text()[-2000:]
        assert c.settled_fd_count(b) == baseline, "the refused connection was kept open"
        assert b.alive()
    finally:
        b.kill()


def test_a_multi_user_broker_lets_another_uid_in_and_the_trustlist_decides(as_nobody: list[str], world: Path,
                                                                           actors: list[c.Actor]) -> None:
    b = c.LoggedBroker(world / "run", "--multi-user", env=c.clean_env())
    try:
        assert stat.S_IMODE(b.folder.stat().st_mode) == 0o755
        assert stat.S_IMODE(b.socket.stat().st_mode) == 0o666
        root = c.Actor(b.env)
        actors.append(root)
        nob, nob_env = _nobody_actor(as_nobody, b.env, actors)
        tgid = ident.ok(nob, "rt.device_get_bare_tgid")
        assert tgid == nob.pid
        sh, _p, digest = ident.export_mapped(root)
        assert nob.call("rt.mem_import_from_shareable_handle_v2", sh, c.DEFAULT, 0)[-1] == c.NO_PERMISSION
        # only the exporter sets its trustlist, whoever asks
        assert nob.call("rt.mem_set_pid_to_shareable_handle_v2", sh, c.DEFAULT, [tgid]) == c.NO_PERMISSION
        assert nob.call("rt.mem_import_from_shareable_handle_v2", sh, c.DEFAULT, 0)[-1] == c.NO_PERMISSION
        ident.ok(root, "rt.mem_set_pid_to_shareable_handle_v2", sh, c.DEFAULT, [tgid])
        assert ident.import_digest(nob, sh) == digest
        # and the other way round: nobody exports, root imports once trustlisted
        nsh, _np, ndigest = ident.export_mapped(nob, pids=[root.pid])
        assert ident.import_digest(root, nsh) == ndigest

        full = f"{sh:#018x}"
        mine = ident.ls_json(b.env)
        assert full in [r["handle"] for r in mine["exports"]], "root sees the full handle value"
        theirs = ident.ls_json(nob_env, as_nobody)
        shown = {r["owner_pid"]: r["handle"] for r in theirs["exports"]}
        assert shown[root.pid] != full, "another user sees the exporter's full handle value"
        assert f"{sh:016x}" not in theirs["_raw"] and str(sh) not in theirs["_raw"], theirs["_raw"][:500]
        assert shown[nob.pid] == f"{nsh:#018x}", "a user sees its own handle values in full"
    finally:
        b.kill()


@pytest.mark.parametrize("extra", [(), ("--multi-user",)], ids=["single_user", "multi_user"])
def test_a_broker_leaves_an_existing_shared_folder_alone(tmp_path: Path, extra: tuple[str, ...]) -> None:
    """SPEC §5 makes the socket folder private (0700) or, multi-user, 0755 - a folder of the broker's own. Pointed
    at a socket inside an existing shared folder (mode 1777, like /tmp), the broker must not change that folder's
    mode (refusing to serve there is fine). It chmod-ed the socket's parent, whatever it was: as root,
    `VMMSHARE_SOCKET=/tmp/broker.sock vmmshare broker` turns /tmp into 0700 (or 0755), for every user."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    b = None
    try:
        try:
            b = c.BrokerProc(shared, *extra, env=c.clean_env())
        except RuntimeError:
            b = None  # it refused to serve in a shared folder: also correct
        mode = stat.S_IMODE(shared.stat().st_mode)
        assert mode == 0o1777, f"starting a broker changed the shared folder's mode from 0o1777 to {oct(mode)}"
    finally:
        if b is not None:
            b.kill()


# ---------------------------------------------------------------- (d) guessing


def test_random_handle_guesses_never_import() -> None:
    """20,000 random 64-bit DEFAULT handles sent as IMPORT frames while eight real exports without pid validation
    are live: every reply is 107017, and the real handles, sent the same way, do import (so a hit would show)."""
    r = ident.guessing_run(20_000, SEED, exports=8, limit=120)
    assert r["guesses"] == 20_000
    assert r["not_107017"] == 0, f"guesses that did not come back 107017: {r['odd']}"
    assert r["control_replies"] == ["IMPORTED"] * 8, r["control_replies"]
    assert r["broker_alive"]
