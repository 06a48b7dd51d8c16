"""Configuration read once, into a Config, by each entry point: nothing reads the environment on import, so the
refusals of bad values can be checked in this process (the command line's too)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vmmshare import config
from vmmshare.cli import commands
from vmmshare.cli.console import USAGE
from vmmshare.config import Config, ConfigError, Quotas


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """A clean VMMSHARE_* environment with its own socket path."""
    for name in list(os.environ):
        if name.startswith("VMMSHARE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("VMMSHARE_SOCKET", str(tmp_path / "s" / "broker.sock"))
    return monkeypatch


def test_the_spin_windows_come_from_the_config(env: pytest.MonkeyPatch) -> None:
    assert Config.from_env().spin == config.CLIENT_SPIN_US / 1e6
    assert Config.from_env(broker=True).broker_spin == config.BROKER_SPIN_US / 1e6
    env.setenv("VMMSHARE_SPIN_US", "0")
    env.setenv("VMMSHARE_BROKER_SPIN_US", "1500")
    assert Config.from_env().spin == 0.0
    assert Config.from_env(broker=True).broker_spin == pytest.approx(0.0015)


@pytest.mark.parametrize(("variable", "broker"), [("VMMSHARE_SPIN_US", False), ("VMMSHARE_BROKER_SPIN_US", True),
                                                  ("VMMSHARE_QUOTA_HOLDS", True)])
def test_each_side_reads_its_own_variables_and_names_a_bad_one(env: pytest.MonkeyPatch, variable: str,
                                                               broker: bool) -> None:
    """A client's variable is the client's, the broker's the broker's: a bad one stops only the side that reads it."""
    env.setenv(variable, "-7")
    with pytest.raises(ConfigError, match=f"{variable}='-7'") as info:
        Config.from_env(broker=broker)
    assert info.value.name == variable
    Config.from_env(broker=not broker)  # the other side runs


def test_the_broker_config_carries_its_quotas(env: pytest.MonkeyPatch) -> None:
    assert Config.from_env(broker=True).quotas == Quotas()
    env.setenv("VMMSHARE_QUOTA_EXPORTS", "12")
    env.setenv("VMMSHARE_QUOTA_MEMORY", "1G")
    got = Config.from_env(broker=True).quotas
    assert (got.exports, got.memory) == (12, 1 << 30)


def test_the_visible_devices_are_read_with_the_rest(env: pytest.MonkeyPatch) -> None:
    env.delenv(config.VISIBLE_DEVICES, raising=False)
    assert Config.from_env().visible_devices is None
    env.setenv(config.VISIBLE_DEVICES, "3,1")
    assert Config.from_env().visible_devices == "3,1"


def test_importing_reads_no_configuration(tmp_path: Path) -> None:
    """With every spin and quota variable bad, the client, the broker and the process's runtime still import: they
    read nothing then (a fresh interpreter, so that this one's modules stay as they are)."""
    bad = {name: "bad" for name in ("VMMSHARE_SPIN_US", "VMMSHARE_BROKER_SPIN_US", "VMMSHARE_QUOTA_HOLDS",
                                     "VMMSHARE_DEVICES")}
    modules = ("vmmshare.client.connection", "vmmshare.broker.server", "vmmshare.broker.daemon",
               "vmmshare.broker.__main__", "vmmshare._process", "vmmshare.acl")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VMMSHARE_")}
    env.update(bad, VMMSHARE_SOCKET=str(tmp_path / "s" / "broker.sock"))
    out = subprocess.run([sys.executable, "-c", "; ".join(f"import {m}" for m in modules)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-800:]


@pytest.mark.parametrize("command", [["ls"], ["version"], ["broker"], ["demo"], ["bench"], ["cluster", "status"]])
@pytest.mark.parametrize(("variable", "value"), [("VMMSHARE_SPIN_US", "abc"), ("VMMSHARE_BROKER_SPIN_US", "-1")])
def test_the_command_line_refuses_a_bad_value_in_process(env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                                         tmp_path: Path, command: list[str], variable: str,
                                                         value: str) -> None:
    env.setenv(variable, value)
    assert commands.main(command) == USAGE
    out = capsys.readouterr()
    assert out.out == ""
    assert f"{variable}={value!r}" in out.err and "Traceback" not in out.err
    assert len(out.err.strip().splitlines()) == 1, out.err
    assert not (tmp_path / "s").exists(), "a broker was started despite the bad configuration"


def test_a_process_answers_a_bad_spin_variable_with_107000_naming_it(tmp_path: Path) -> None:
    """VMMSHARE_SPIN_US is read with the others on the first call: the import works, the call says what is wrong."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VMMSHARE_")}
    env.update(VMMSHARE_SPIN_US="abc", VMMSHARE_SOCKET=str(tmp_path / "s" / "broker.sock"))
    code = "import vmmshare.acl as acl; print(acl.rt.set_device(0), acl.get_recent_err_msg())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == ("107000 set_device: configuration: VMMSHARE_SPIN_US='abc' is not a number of "
                                  "microseconds (0 or more)"), out.stdout + out.stderr
    assert not (tmp_path / "s").exists(), "a broker was started despite the bad configuration"
