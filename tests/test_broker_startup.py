"""How a broker starts and says why it cannot: its exit status, the socket path and folder it accepts, its log
level and polling variables; and the same limits on the auto-start of a client (docs/configuration.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from procs import BrokerProc, clean_env
from vmmshare.client import autostart
from vmmshare.config import MAX_SOCKET_PATH
from vmmshare.errors import AclError

HANG_GUARD = 30.0  # seconds; a guard against hangs only


def broker_module(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m vmmshare.broker ARGS` (what the auto-start runs), to its end."""
    return subprocess.run([sys.executable, "-m", "vmmshare.broker", *args], env=env or clean_env(),
                          capture_output=True, text=True, timeout=HANG_GUARD)


def _path_of(base: Path, size: int, name: str = "broker.sock") -> Path:
    """A socket path of exactly `size` bytes: `name` in a folder under `base` whose name pads it out."""
    pad = size - len(os.fsencode(str(base))) - 2 - len(name)
    assert pad > 0
    return base / ("d" * pad) / name


# ---------------------------------------------------------------- polling variables


@pytest.mark.parametrize(("module", "variable", "broker"),
                         [("vmmshare.client.connection", "VMMSHARE_SPIN_US", False),
                          ("vmmshare.broker.server", "VMMSHARE_BROKER_SPIN_US", True)])
@pytest.mark.parametrize("value", ["abc", "-5", "nan"])
def test_spin_variables_are_read_by_config_and_named_when_bad(module: str, variable: str, broker: bool,
                                                              value: str) -> None:
    """The polling windows are read once, into the Config an entry point builds (config.spin_seconds), never when a
    module is imported: a bad value is a ConfigError (a ValueError) naming the variable, never a bare float() error
    or a negative window."""
    env = clean_env(**{variable: value})
    imported = subprocess.run([sys.executable, "-c", f"import {module}"], env=env, capture_output=True, text=True,
                              timeout=HANG_GUARD)
    assert imported.returncode == 0, imported.stderr[-500:]
    out = subprocess.run([sys.executable, "-c", f"import {module}; from vmmshare.config import Config; "
                          f"Config.from_env(broker={broker})"], env=env, capture_output=True, text=True,
                         timeout=HANG_GUARD)
    assert out.returncode != 0
    assert f"ConfigError: {variable}={value!r} is not a number of microseconds" in out.stderr, out.stderr[-500:]


def test_a_bad_broker_spin_variable_ends_the_broker_with_status_2_and_no_traceback(tmp_path: Path) -> None:
    out = broker_module("--socket", str(tmp_path / "broker.sock"), env=clean_env(VMMSHARE_BROKER_SPIN_US="abc"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "VMMSHARE_BROKER_SPIN_US='abc'" in out.stderr, out.stderr


# ---------------------------------------------------------------- exit status


def test_exit_status_3_when_a_broker_already_serves_the_path(tmp_path: Path) -> None:
    b = BrokerProc(tmp_path / "run", env=clean_env())
    try:
        out = broker_module("--socket", str(b.socket), "--auto")
        assert out.returncode == 3, out
        assert "already serves" in out.stderr and "Traceback" not in out.stderr
        assert b.alive()
    finally:
        b.kill()


def test_exit_status_2_for_bad_configuration(tmp_path: Path) -> None:
    out = broker_module("--socket", str(tmp_path / "broker.sock"), env=clean_env(VMMSHARE_DEVICES="0"))
    assert out.returncode == 2 and "VMMSHARE_DEVICES" in out.stderr and "Traceback" not in out.stderr
    out = broker_module("--socket", str(tmp_path / "broker.sock"), env=clean_env(VMMSHARE_QUOTA_EXPORTS="many"))
    assert out.returncode == 2 and "VMMSHARE_QUOTA_EXPORTS='many'" in out.stderr


def test_exit_status_1_when_the_folder_cannot_be_used(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    out = broker_module("--socket", str(tmp_path / "file" / "broker.sock"))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out


@pytest.mark.parametrize("value", ["LOUD", "", "info2"])
def test_broker_log_level_is_checked(value: str, tmp_path: Path) -> None:
    """`--log-level` takes the levels of config.LOG_LEVELS: anything else ends with status 2 and the choices, no
    traceback (it used to be handed to logging as it was)."""
    out = broker_module("--socket", str(tmp_path / "broker.sock"), "--log-level", value)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "DEBUG, INFO, WARNING, ERROR, CRITICAL" in out.stderr
    out = broker_module("--socket", str(tmp_path / "broker.sock"), env=clean_env(VMMSHARE_LOG="LOUD"))
    assert out.returncode == 2 and "VMMSHARE_LOG='LOUD'" in out.stderr and "Traceback" not in out.stderr


# ---------------------------------------------------------------- the socket path and folder


def test_a_socket_path_of_108_bytes_is_refused_before_binding(tmp_path: Path) -> None:
    path = _path_of(tmp_path, MAX_SOCKET_PATH + 1)
    out = broker_module("--socket", str(path))
    assert out.returncode == 2 and f"at most {MAX_SOCKET_PATH} bytes" in out.stderr, out.stderr
    assert not path.parent.exists(), "the folder was made for a socket that cannot be bound"


def test_a_socket_path_of_107_bytes_is_served(tmp_path: Path) -> None:
    """The broker binds under a temporary name in the same folder first: that name must fit too."""
    path = _path_of(tmp_path, MAX_SOCKET_PATH)
    path.parent.mkdir()
    b = BrokerProc(path.parent, env=clean_env())
    try:
        assert len(os.fsencode(str(b.socket))) == MAX_SOCKET_PATH and b.socket.exists()
    finally:
        b.kill()


def test_the_broker_creates_only_the_sockets_own_folder(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "broker.sock"
    out = broker_module("--socket", str(path))
    assert out.returncode == 1 and "create its parent first" in out.stderr, out.stderr
    assert not (tmp_path / "a").exists()
    (tmp_path / "a").mkdir()
    b = BrokerProc(path.parent, env=clean_env())
    try:
        assert (path.parent.stat().st_mode & 0o777) == 0o700
    finally:
        b.kill()


def test_the_auto_start_creates_only_the_sockets_own_folder(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "broker.sock"
    with pytest.raises(AclError) as refused:
        autostart.reach_broker(path, start=True)
    assert str(tmp_path / "a") in refused.value.message
    assert not (tmp_path / "a").exists()


def test_an_unreachable_broker_is_said_with_the_reason_never_none(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(AclError) as failed:
        autostart.reach_broker(tmp_path / "file" / "broker.sock", start=False)
    assert "None" not in failed.value.message and "Not a directory" in failed.value.message
