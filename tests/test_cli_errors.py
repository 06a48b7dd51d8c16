"""The `vmmshare` command line on a user's mistakes: every one is a single line on stderr that names the bad option
or variable, with the documented exit status (1 failed, 2 usage or configuration, 3 address in use); never a
traceback. Each case runs the installed console script (or `python -m vmmshare`) as its own process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from clirun import HANG_GUARD, ROOT, env_for, refused, vmmshare
from procs import Actor, BrokerProc, clean_env

USAGE, FAILED, IN_USE = 2, 1, 3


@pytest.fixture(scope="module")
def broker_env() -> dict[str, str]:
    """The tests' broker (conftest's `broker`, one for the module) has 8 MiB per device."""
    return clean_env(VMMSHARE_DEVICE_MEMORY="8M")


# ---------------------------------------------------------------- bad options


def test_a_log_level_that_does_not_exist_is_named_and_help_lists_the_levels(tmp_path: Path) -> None:
    line = refused(vmmshare(env_for(tmp_path), "broker", "--log-level", "LOUD"), USAGE, "--log-level", "'LOUD'")
    assert "DEBUG, INFO, WARNING, ERROR, CRITICAL" in line
    refused(vmmshare(env_for(tmp_path, VMMSHARE_LOG="loud"), "broker"), USAGE, "VMMSHARE_LOG", "'loud'")
    helped = vmmshare(env_for(tmp_path), "broker", "--help")
    assert helped.returncode == 0 and "DEBUG, INFO, WARNING, ERROR, CRITICAL" in " ".join(helped.stdout.split())
    assert not (tmp_path / "s").exists(), "a refused broker prepared its folder"


@pytest.mark.parametrize("args, option, said", [
    (["--clients", "abc"], "--clients", "'abc'"),
    (["--clients", "1,x"], "--clients", "'1,x'"),
    (["--reps", "abc"], "--reps", "'abc'"),
    (["--seconds", "nan"], "--seconds", "'nan'"),
    (["--sizes", "lots"], "--sizes", "not a size"),
    (["--gpu", "--reps", "x"], "--reps", "'x'"),
])
def test_bench_names_the_option_a_bad_number_came_from(tmp_path: Path, args: list[str], option: str, said: str) -> None:
    refused(vmmshare(env_for(tmp_path), "bench", *args), USAGE, option, said)


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_bench_checks_its_output_files_before_it_measures(tmp_path: Path, option: str) -> None:
    target = tmp_path / "nonexistent" / "x.out"
    out = vmmshare(env_for(tmp_path), "bench", "--quick", option, str(target))
    refused(out, USAGE, option, str(target.parent), "does not exist")
    assert out.stdout == "", "the benchmark ran before its output file was checked"
    refused(vmmshare(env_for(tmp_path), "bench", option, str(tmp_path)), USAGE, option, "is a folder")


def test_gpu_bench_checks_its_output_file_first(tmp_path: Path) -> None:
    out = vmmshare(env_for(tmp_path), "bench", "--gpu", "--json", str(tmp_path / "no" / "x.json"))
    refused(out, USAGE, "--json", "does not exist")


def test_bench_without_numpy_says_which_extra_to_install(tmp_path: Path) -> None:
    """`python -S` leaves site-packages out: this interpreter then has no numpy, as on a bare install."""
    env = env_for(tmp_path, PYTHONPATH=str(ROOT / "src"))
    probe = subprocess.run([sys.executable, "-S", "-c", "import numpy"], env=env, capture_output=True)
    if probe.returncode == 0:
        pytest.skip("numpy is importable without site-packages here")
    out = vmmshare(env, "bench", "--quick", cmd=[sys.executable, "-S", "-m", "vmmshare"])
    refused(out, USAGE, "numpy", "pip install 'vmmshare[bench]'")


def test_a_socket_path_longer_than_a_unix_socket_holds_is_refused_up_front(tmp_path: Path) -> None:
    long_path = str(tmp_path / ("x" * (120 - len(str(tmp_path)))) / "broker.sock")
    line = refused(vmmshare(env_for(tmp_path), "broker", "--socket", long_path), USAGE, "--socket", "107 bytes")
    assert "None" not in line
    refused(vmmshare(env_for(tmp_path, VMMSHARE_SOCKET=long_path), "ls"), USAGE, "VMMSHARE_SOCKET", "107 bytes")
    refused(vmmshare(env_for(tmp_path, VMMSHARE_SOCKET=long_path), "broker"), USAGE, "VMMSHARE_SOCKET")
    # a library call says the same (107000), never "cannot reach the broker at …: None"
    code = "import vmmshare.acl as acl; print(acl.rt.device_get_bare_tgid()[1]); print(acl.get_recent_err_msg())"
    lib = subprocess.run([sys.executable, "-c", code], env=env_for(tmp_path, VMMSHARE_SOCKET=long_path),
                         capture_output=True, text=True, timeout=HANG_GUARD)
    ret, message = lib.stdout.splitlines()
    assert ret == "107000" and "VMMSHARE_SOCKET" in message and "None" not in message, lib.stdout
    assert not Path(long_path).parent.exists()


@pytest.mark.parametrize("args, words", [
    (["--socket", ""], ["--socket", "empty"]),
    (["--idle", "-5"], ["--idle", "'-5'"]),
    (["--idle", "0"], ["--idle", "'0'"]),
    (["--idle", "nan"], ["--idle", "'nan'"]),
])
def test_broker_refuses_an_empty_socket_and_a_non_positive_idle(tmp_path: Path, args: list[str],
                                                                words: list[str]) -> None:
    refused(vmmshare(env_for(tmp_path), "broker", *args), USAGE, *words)
    assert not (tmp_path / "s").exists()


def test_broker_creates_only_the_socket_folder_not_a_missing_chain(tmp_path: Path) -> None:
    path = tmp_path / "nonexistent" / "dir" / "x.sock"
    refused(vmmshare(env_for(tmp_path), "broker", "--socket", str(path)), USAGE, "--socket",
            f"{tmp_path / 'nonexistent'} does not exist")
    assert not (tmp_path / "nonexistent").exists(), "the broker created a chain of folders"
    refused(vmmshare(env_for(tmp_path, VMMSHARE_SOCKET=str(path)), "broker"), USAGE, "VMMSHARE_SOCKET")
    (tmp_path / "file").write_text("")
    refused(vmmshare(env_for(tmp_path), "broker", "--socket", str(tmp_path / "file" / "x.sock")), USAGE,
            "is not a folder")


@pytest.mark.parametrize("command", [["demo", "--size", "2M"],
                                     ["bench", "--quick", "--no-torch", "--sizes", "4K", "--reps", "1"]])
def test_a_socket_variable_no_broker_could_serve_is_a_configuration_error(tmp_path: Path,
                                                                          command: list[str]) -> None:
    """VMMSHARE_SOCKET in a folder whose parent is missing: the broker the command would start could never serve
    there, so it is refused up front (exit 2, the variable named), as `vmmshare broker` refuses it, not run as a
    step that then fails; nothing is created."""
    path = tmp_path / "nonexistent" / "deeper" / "broker.sock"
    refused(vmmshare(env_for(tmp_path, VMMSHARE_SOCKET=str(path)), *command), USAGE, f"vmmshare {command[0]}",
            "VMMSHARE_SOCKET", f"{tmp_path / 'nonexistent'} does not exist")
    assert not (tmp_path / "nonexistent").exists()


@pytest.mark.parametrize("run", ["fuzz_api", "load", "faults"])
def test_stress_on_the_cuda_stand_in_without_cuda_bindings_names_the_extra(tmp_path: Path, run: str) -> None:
    """An install without vmmshare[cuda]: a `cuda` package that fails to import (first on the path, as a bare
    install's missing one) makes `--backend fakecuda` a usage error naming the extra, before anything runs."""
    shadow = tmp_path / "nocuda" / "cuda"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named cuda.bindings')\n")
    env = env_for(tmp_path, PYTHONPATH=f"{shadow.parent}:{ROOT / 'src'}")
    out = vmmshare(env, "stress", run, "--backend", "fakecuda")
    refused(out, USAGE, f"vmmshare stress {run}", "--backend fakecuda", "pip install 'vmmshare[cuda]'")
    assert out.stdout == "", out.stdout


def test_stress_on_the_cuda_stand_in_without_a_compiler_says_so(tmp_path: Path) -> None:
    out = vmmshare(env_for(tmp_path, CC="no-such-cc"), "stress", "fuzz_api", "--backend", "fakecuda")
    refused(out, USAGE, "vmmshare stress fuzz_api", "'no-such-cc' ($CC)")


def test_a_second_broker_on_a_live_socket_exits_3(broker: BrokerProc) -> None:
    out = vmmshare(broker.env, "broker", "--socket", str(broker.socket))
    refused(out, IN_USE, "already serves", str(broker.socket))
    out = vmmshare(broker.env, "broker")  # the same path, from VMMSHARE_SOCKET
    refused(out, IN_USE, "already serves")
    assert broker.alive()


# ---------------------------------------------------------------- bad VMMSHARE_* variables


@pytest.mark.parametrize("command", [["version"], ["--version"], ["ls"], ["ls", "--json"], ["demo"], ["bench"],
                                     ["bench", "--gpu"], ["broker"], ["stress", "fuzz_protocol"],
                                     ["cluster", "status"]])
@pytest.mark.parametrize("var, value", [("VMMSHARE_SPIN_US", "abc"), ("VMMSHARE_BROKER_SPIN_US", "-1"),
                                        ("VMMSHARE_DEVICE_MEMORY", "lots"), ("VMMSHARE_SERVER_ID", "xyz")])
def test_every_command_names_a_bad_variable(tmp_path: Path, command: list[str], var: str, value: str) -> None:
    out = vmmshare(env_for(tmp_path, **{var: value}), *command)
    refused(out, USAGE, var, repr(value))
    assert out.stdout == ""
    assert not (tmp_path / "s").exists(), "a broker was started despite the bad configuration"


@pytest.mark.parametrize("var, value", [("VMMSHARE_BACKEND", "bogus"), ("VMMSHARE_DEVICES", "0"),
                                        ("VMMSHARE_PREPOPULATE", "maybe"), ("VMMSHARE_BROKER_IDLE", "soon"),
                                        ("VMMSHARE_LOG", "LOUD")])
def test_other_bad_variables_are_named_too(tmp_path: Path, var: str, value: str) -> None:
    refused(vmmshare(env_for(tmp_path, **{var: value}), "ls"), USAGE, var, repr(value))


def test_doctor_reports_bad_variables_as_findings(tmp_path: Path) -> None:
    env = env_for(tmp_path, VMMSHARE_DEVICE_MEMORY="lots", VMMSHARE_BACKEND="bogus")
    out = vmmshare(env, "doctor", "--json")
    assert "Traceback" not in out.stderr and out.returncode == FAILED, out.stderr
    findings = {f["item"]: f for f in json.loads(out.stdout)}
    for var in ("VMMSHARE_DEVICE_MEMORY", "VMMSHARE_BACKEND"):
        assert findings[var]["status"] == "missing" and var in findings[var]["detail"] and findings[var]["fix"]
    assert "hugetlb 2 MiB pool" in findings, "a bad variable cut the report short"
    table = vmmshare(env, "doctor")
    assert table.returncode == FAILED and "Traceback" not in table.stderr
    assert "VMMSHARE_DEVICE_MEMORY='lots'" in table.stdout and "VMMSHARE_BACKEND='bogus'" in table.stdout


def test_doctor_calls_the_open_file_limit_a_limit(tmp_path: Path) -> None:
    findings = {f["item"]: f for f in json.loads(vmmshare(env_for(tmp_path), "doctor", "--json").stdout)}
    assert findings["open-file limit"]["status"] in ("ok", "limit")


# ---------------------------------------------------------------- the running broker's values count


def test_demo_says_the_running_brokers_capacity_counts(broker: BrokerProc) -> None:
    env = {**broker.env, "VMMSHARE_DEVICE_MEMORY": "64M"}
    line = refused(vmmshare(env, "demo", "--size", "16M"), FAILED, f"pid {broker.pid}", "8 MiB per device",
                   "started with", f"kill {broker.pid}")
    assert "64 MiB counts only for a broker started from it" in line
    env["VMMSHARE_DEVICE_MEMORY"] = "4M"
    refused(vmmshare(env, "demo", "--size", "16M"), FAILED, "Raise VMMSHARE_DEVICE_MEMORY", f"kill {broker.pid}")
    assert broker.alive()


def test_ls_does_not_count_itself_among_the_clients(broker: BrokerProc) -> None:
    assert vmmshare(broker.env, "ls").stdout.startswith(f"broker pid {broker.pid}, 0 client(s)")
    actor = Actor(broker.env)
    try:
        assert actor.call("rt.device_get_bare_tgid")[-1] == 0  # connected to the broker
        assert vmmshare(broker.env, "ls").stdout.startswith(f"broker pid {broker.pid}, 1 client(s)")
        assert json.loads(vmmshare(broker.env, "ls", "--json").stdout)["clients"] == 1
    finally:
        actor.kill()


# ---------------------------------------------------------------- help, version, the module entry


def test_version_and_module_entry(tmp_path: Path) -> None:
    from vmmshare import __version__

    for cmd, args in ((None, ["--version"]), (None, ["version"]), ([sys.executable, "-m", "vmmshare"], ["version"])):
        out = vmmshare(env_for(tmp_path), *args, cmd=cmd)
        assert out.returncode == 0 and out.stdout == f"vmmshare {__version__}\n", out
    refused(vmmshare(env_for(tmp_path)), USAGE, "give a command")


def test_help_texts_are_plain_and_complete(tmp_path: Path) -> None:
    doctor = vmmshare(env_for(tmp_path), "doctor", "--help").stdout
    assert "--json      print the findings as JSON" in doctor
    for args in (["bench", "--help"], ["bench", "--gpu", "--help"], ["demo", "--help"], ["--help"]):
        out = vmmshare(env_for(tmp_path), *args)
        assert out.returncode == 0 and "``" not in out.stdout, (args, out.stdout)
    top = vmmshare(env_for(tmp_path), "--help").stdout
    for command in ("broker", "ls", "demo", "bench", "stress", "doctor", "version"):
        assert f"    {command}" in top, command


STRESS_RUNS = ("faults", "fabric_faults", "flood", "fuzz_api", "fuzz_protocol", "identity", "load", "mutate_ledger")
HELPS = [["--help"], ["broker", "--help"], ["demo", "--help"], ["demo", "--fabric", "--help"], ["bench", "--help"],
         ["bench", "--gpu", "--help"], ["bench", "--torch", "--help"], ["bench", "--fabric", "--help"],
         ["bench", "--fabric", "--servers", "4", "--help"], ["cluster", "--help"], ["doctor", "--help"],
         ["ls", "--help"], ["stress"], *(["stress", run, "--help"] for run in STRESS_RUNS)]


@pytest.mark.parametrize("columns", ["", "80", "250"])
def test_help_and_doctor_lines_fit_100_columns(tmp_path: Path, columns: str) -> None:
    """Every help text and doctor's report keep their lines to 100 columns, on a terminal of any width (COLUMNS,
    which argparse reads; unset: not a terminal): the descriptions written as lists and tables are wrapped too,
    and doctor's long details and fixes wrap under themselves."""
    env = env_for(tmp_path, COLUMNS=columns) if columns else env_for(tmp_path)
    widest: dict[str, tuple[int, str]] = {}
    for args in [*HELPS, ["doctor"]]:
        out = vmmshare(env, *args)
        assert "Traceback" not in out.stderr and out.stdout, (args, out.stderr)
        line = max(out.stdout.splitlines(), key=len)
        widest[" ".join(args)] = (len(line), line)
    assert all(n <= 100 for n, _ in widest.values()), {k: v for k, v in widest.items() if v[0] > 100}
    wrapped = vmmshare(env, "stress", "faults", "--help").stdout
    assert "\nexporter  A fresh exporter loops" in wrapped and "\n          t" in wrapped, wrapped  # hung


def test_gpu_example_without_gpu_memory_says_so(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "gpu_share.py")], env=env_for(tmp_path),
                         capture_output=True, text=True, timeout=HANG_GUARD)
    refused(out, FAILED, "gpu_share.py", "VMMSHARE_BACKEND=cuda")


def test_the_library_answers_a_bad_variable_with_107000_naming_it(tmp_path: Path) -> None:
    """docs/configuration.md: an invalid variable makes `vmmshare.acl` calls return 107000 with a message that names
    it; the Pythonic API raises InvalidParamError with that message."""
    code = """if True:
        import vmmshare, vmmshare.acl as acl
        print(acl.rt.set_device(0), acl.get_recent_err_msg())
        try:
            vmmshare.Device(0).allocate(2 << 20)
        except vmmshare.InvalidParamError as exc:
            print(exc.code, exc.message)
    """
    out = subprocess.run([sys.executable, "-c", code], env=env_for(tmp_path, VMMSHARE_SERVER_ID="xyz"),
                         capture_output=True, text=True, timeout=HANG_GUARD)
    said = "configuration: VMMSHARE_SERVER_ID='xyz' is not an integer (such as 42 or 0x2a)"
    lines = out.stdout.splitlines()
    assert lines == [f"107000 set_device: {said}", f"107000 {said}"], out.stdout + out.stderr
    assert not (tmp_path / "s").exists(), "a broker was started despite the bad configuration"
