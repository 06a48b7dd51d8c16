"""The C library (SPEC §9): its headers, its two libraries and their symbols, the CANN-like root `vmmshare prefix`
prints, the C programs of tests/c/ built with the sanitizers, its client against real and lying brokers, its codec
against the golden frames and a fuzzer, the examples, and C and Python processes sharing through one broker.

(The rules of SPEC §4 run on both surfaces in their own modules: test_memory_rules, test_sharing_rules,
test_acl_layer, test_ipc, test_device_ids.)
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import Node
from procs import PROP, Actor, MiB2, clean_env, fails, ok
from vmmshare import constants as C
from vmmshare.acl import _unsupported
from vmmshare.sdk import LIBRARIES, ROOT, arch_folder

REPO = Path(__file__).resolve().parent.parent
CLIB = REPO / "src" / "vmmshare" / "clib"
INCLUDE = ROOT / "include"
LIB64 = ROOT / "lib64"
TESTS_C = REPO / "tests" / "c"
SOURCES = sorted(str(p) for p in CLIB.glob("*.c"))
SANITIZE = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"]
CFLAGS = ["-std=c11", "-D_GNU_SOURCE", "-g", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{INCLUDE}", "-pthread",
          f'-DVS_PYTHON="{sys.executable}"']
RUN_ENV = {"ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0", "UBSAN_OPTIONS": "print_stacktrace=1"}
PARAM, IPC_ERROR, NO_PERMISSION = 107000, 507022, 207006

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


def cc(out: Path, *sources: str | Path, flags: tuple[str, ...] = (), with_library: bool = True) -> Path:
    """Build a test program with the sanitizers, the library's own sources linked in (so they are checked too)."""
    cmd = ["cc", *CFLAGS, *SANITIZE, *flags, *map(str, sources), *(SOURCES if with_library else []), "-ldl", "-o",
           str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr}"
    return out


def run(cmd: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, env={**env, **RUN_ENV}, timeout=timeout)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("c")


@pytest.fixture
def private_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """An environment whose broker socket is in a fresh folder: the C library starts the broker itself (it exits
    once idle), as a program's first call would; the broker started is stopped at the end."""
    env = clean_env(VMMSHARE_SOCKET=str(tmp_path / "b" / "broker.sock"), VMMSHARE_BROKER_IDLE="2")
    yield env
    pidfile = tmp_path / "b" / "broker.log"
    if pidfile.exists():
        for pid in {int(m) for m in re.findall(r"broker\[(\d+)\]", pidfile.read_text())}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 15)


# ---------------------------------------------------------------- headers


@pytest.mark.parametrize("std", ["c11", "c++11", "c++17"])
@pytest.mark.parametrize("header", ["acl/acl.h", "acl/acl_base.h", "acl/acl_rt.h", "error_codes/rt_error_codes.h"])
def test_each_header_compiles_alone_without_warnings(tmp_path: Path, std: str, header: str) -> None:
    compiler = "c++" if std.startswith("c++") else "cc"
    src = tmp_path / ("t.cpp" if compiler == "c++" else "t.c")
    src.write_text(f'#include "{header}"\nint main(void) {{ return 0; }}\n')
    proc = subprocess.run([compiler, f"-std={std}", "-Wall", "-Wextra", "-Werror", "-pedantic", f"-I{INCLUDE}",
                           "-c", str(src), "-o", str(tmp_path / "t.o")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_a_build_reading_the_header_text_finds_the_fabric_call() -> None:
    """A transfer engine enables its fabric path only when acl/acl_rt.h names aclrtMemRetainAllocationHandle."""
    assert "aclrtMemRetainAllocationHandle" in (INCLUDE / "acl" / "acl_rt.h").read_text()


LAYOUTS = {  # struct: (size, {field: offset}), as the runtime's C interface has them on x86-64
    "aclrtMemLocation": (8, {"id": 0, "type": 4}),
    "aclrtPhysicalMemProp": (32, {"handleType": 0, "allocationType": 4, "memAttr": 8, "location": 12, "reserve": 24}),
    "aclrtMemAccessDesc": (24, {"flags": 0, "location": 4, "rsv": 12}),
    "aclrtMemFabricHandle": (128, {"data": 0}),
    "aclrtServerPid": (24, {"sdid": 0, "pid": 8, "num": 16}),
    "aclrtPtrAttributes": (28, {"location": 0, "pageSize": 8, "rsv": 12}),
    "aclrtIpcEventHandle": (64, {"reserved": 0}),
}


def test_struct_layouts_and_every_constant_match_the_runtime_and_vmmshare_constants(tmp_path: Path) -> None:
    """sizeof/offsetof of each struct as the facts give them, and every ACL_* constant the headers define has
    vmmshare.constants' value (enums, macros and the acl layer's static const ints alike)."""
    text = "".join(p.read_text() for p in INCLUDE.rglob("*.h"))
    names = sorted(n for n in dir(C) if n.startswith("ACL_") and isinstance(getattr(C, n), int)
                   and re.search(rf"\b{n}\b", text))
    assert len(names) > 250, names
    lines = ['#include <stddef.h>', '#include <stdio.h>', '#include "acl/acl.h"', "int main(void) {"]
    for struct_name, (_, fields) in LAYOUTS.items():
        lines.append(f'printf("sizeof {struct_name} %zu\\n", sizeof({struct_name}));')
        lines += [f'printf("offsetof {struct_name}.{f} %zu\\n", offsetof({struct_name}, {f}));' for f in fields]
    lines += [f'printf("const {n} %lld\\n", (long long)({n}));' for n in names]
    lines += ['printf("sizeof aclError %zu\\n", sizeof(aclError));',
              'printf("sizeof enum %zu\\n", sizeof(aclrtMemAttr));', "return 0; }"]
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    exe = cc(tmp_path / "layout", src, with_library=False)
    out = run([str(exe)], dict(os.environ)).stdout.splitlines()
    got = {" ".join(line.split()[:2]): int(line.split()[2]) for line in out}
    for struct_name, (size, fields) in LAYOUTS.items():
        assert got[f"sizeof {struct_name}"] == size, struct_name
        for f, off in fields.items():
            assert got[f"offsetof {struct_name}.{f}"] == off, f"{struct_name}.{f}"
    assert got["sizeof aclError"] == 4 and got["sizeof enum"] == 4
    wrong = {n: (got[f"const {n}"], getattr(C, n)) for n in names if got[f"const {n}"] != getattr(C, n)}
    assert not wrong, wrong
    codes = [n for n in dir(C) if n.startswith("ACL_ERROR") and isinstance(getattr(C, n), int)]
    missing = [n for n in codes if not re.search(rf"\b{n}\b", text)]
    assert not missing, f"error codes vmmshare.constants has and the headers do not: {missing}"


# ---------------------------------------------------------------- the libraries and the root


def exported(path: Path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def test_both_libraries_export_the_same_calls_by_plain_name_and_nothing_else() -> None:
    first, second = (exported(LIB64 / name) for name in LIBRARIES)
    assert first == second
    assert all(name.startswith("acl") for name in first), sorted(n for n in first if not n.startswith("acl"))
    assert not any("@" in name for name in first)  # no symbol versions
    for name in LIBRARIES:
        soname = subprocess.run(["readelf", "-d", str(LIB64 / name)], capture_output=True, text=True).stdout
        assert f"[{name}]" in soname  # an unversioned SONAME


def test_every_call_of_vmmshare_acl_has_its_c_name() -> None:
    """Every acl.rt call (those it provides and those it answers with 207000) and acl.* call is exported, so a
    program that looks many names up finds them all."""
    import vmmshare.acl as acl
    from cacl import c_name

    symbols = exported(LIB64 / LIBRARIES[0])
    words = {re.sub(r"^aclrt|^acl", "", s).lower(): s for s in symbols}
    pyonly = {"set_context", "get_context"}  # pyACL's names of aclrtSetCurrentContext / aclrtGetCurrentContext
    missing = [n for n in acl.rt.__all__ if n not in pyonly and c_name(n) not in symbols
               and n.replace("_", "").lower() not in words]
    assert not missing, missing
    for n in ("aclInit", "aclFinalize", "aclGetRecentErrMsg", "aclrtGetSocName", "aclrtGetVersion",
              "aclFloat16ToFloat", "aclFloatToFloat16", "aclAppLog"):
        assert n in symbols
    stand_ins = [n for n in _unsupported.ACL if n.replace("_", "").lower() not in words]
    assert not stand_ins, stand_ins


def test_prefix_prints_a_cann_like_root(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "vmmshare", "prefix"], capture_output=True, text=True, check=True)
    root = Path(out.stdout.strip())
    assert root == ROOT and root.is_absolute()
    for rel in ("include/acl/acl.h", "include/acl/acl_base.h", "include/acl/acl_rt.h",
                "include/error_codes/rt_error_codes.h", "lib64/libascendcl.so", "lib64/libacl_rt.so",
                "lib64/cmake/vmmshare/vmmshareConfig.cmake", "lib64/pkgconfig/ascendcl.pc", "set_env.sh"):
        assert (root / rel).is_file(), rel
    arch = root / arch_folder()
    assert (arch / "include" / "acl" / "acl.h").samefile(root / "include" / "acl" / "acl.h")
    assert (arch / "lib64" / "libascendcl.so").samefile(root / "lib64" / "libascendcl.so")
    # sourcing set_env.sh: the two homes, and lib64 and its cmake folder first, keeping what was there
    script = (f'export LD_LIBRARY_PATH=/keep/ld CMAKE_PREFIX_PATH=/keep/cm; source "{root}/set_env.sh"; '
              'echo "$ASCEND_HOME_PATH|$ASCEND_TOOLKIT_HOME|$LD_LIBRARY_PATH|$CMAKE_PREFIX_PATH"')
    home, toolkit, ld, cm = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                                           check=True).stdout.strip().split("|")
    assert home == toolkit == str(root)
    assert ld == f"{root}/lib64:/keep/ld" and cm == f"{root}/lib64/cmake:/keep/cm"
    if shutil.which("pkg-config"):
        flags = subprocess.run(["pkg-config", "--cflags", "--libs", "ascendcl"], capture_output=True, text=True,
                               env={**os.environ, "PKG_CONFIG_PATH": str(root / "lib64" / "pkgconfig")}, check=True)
        assert f"-I{root}/include" in flags.stdout.replace("/lib64/pkgconfig/../..", "") or "-I" in flags.stdout
        assert "-lascendcl" in flags.stdout


# ---------------------------------------------------------------- C programs


def test_the_sanitized_c_program_shares_refuses_and_leaks_nothing(built: Path, private_env: dict[str, str]) -> None:
    """tests/c/acl_test.c: two processes with and without a trustlist, IPC keys, every kind of bad argument, streams,
    eight threads at once; its first call starts the broker (none runs at its socket yet)."""
    exe = cc(built / "acl_test", TESTS_C / "acl_test.c")
    assert not Path(private_env["VMMSHARE_SOCKET"]).exists()
    proc = run([str(exe)], private_env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ", 0 failures" in proc.stdout, proc.stdout
    assert "runtime error" not in proc.stderr and "ERROR: AddressSanitizer" not in proc.stderr, proc.stderr
    assert (Path(private_env["VMMSHARE_SOCKET"]).parent / "broker.log").exists()  # the broker it started


def test_a_batch_whose_counts_exceed_its_arrays_is_refused_before_they_are_read(built: Path,
                                                                                private_env: dict[str, str]) -> None:
    """tests/c/batch_counts.c: numAttrs past numBatches is 107000 from the counts (as the Python runtime checks
    them), never a read past the caller's attribute array."""
    proc = run([str(cc(built / "batch_counts", TESTS_C / "batch_counts.c"))], private_env)
    assert "runtime error" not in proc.stderr and "ERROR: AddressSanitizer" not in proc.stderr, proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"{PARAM} ") and "numAttrs 4 must be less than or equal to count 1" in proc.stdout


def test_a_peer_holding_a_notifys_page_lock_stalls_its_record_and_nothing_else(built: Path,
                                                                                private_env: dict[str, str]) -> None:
    """tests/c/sync_peer_lock.c: an importer of a notify holds its page's record lock; the exporter's record of it
    blocks (its thread shows in /proc/locks) while its other threads create streams and events and allocate; once
    the importer lets go the record completes."""
    proc = run([str(cc(built / "sync_peer_lock", TESTS_C / "sync_peer_lock.c"))], private_env)
    assert "runtime error" not in proc.stderr and "ERROR: AddressSanitizer" not in proc.stderr, proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr  # (an alarm ends it at 60 s: a stalled call)
    assert proc.stdout.split("\n")[:5] == ["create 0", "key 0", "others 0 0 0 0 while the record waits 1",
                                           "record 0 child 0", "destroy 0"], proc.stdout


def test_a_program_bound_only_by_dlopen_finds_every_name_and_shares(built: Path, private_env: dict[str, str]) -> None:
    exe = cc(built / "dlopen_probe", TESTS_C / "dlopen_probe.c", flags=("-ldl",), with_library=False)
    proc = run([str(exe)], {**private_env, "LD_LIBRARY_PATH": str(LIB64)})
    assert proc.returncode == 0 and "dlsym ok" in proc.stdout, proc.stdout + proc.stderr
    proc = run([str(exe), "libacl_rt.so"], {**private_env, "LD_LIBRARY_PATH": str(LIB64)})
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_weak_declarations_of_newer_calls_resolve(built: Path, private_env: dict[str, str]) -> None:
    exe = cc(built / "weak_probe", TESTS_C / "weak_probe.c", flags=(f"-L{LIB64}", "-lascendcl", f"-Wl,-rpath,{LIB64}"),
             with_library=False)
    proc = run([str(exe)], private_env)
    assert proc.returncode == 0 and "weak ok" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("example", ["share_with_trustlist", "ipc_keys"])
def test_c_examples_build_with_pkg_config_and_run(tmp_path: Path, private_env: dict[str, str], example: str) -> None:
    cflags = subprocess.run(["pkg-config", "--cflags", "--libs", "ascendcl"], capture_output=True, text=True,
                            env={**os.environ, "PKG_CONFIG_PATH": str(LIB64 / "pkgconfig")}, check=True).stdout.split()
    exe = tmp_path / example
    subprocess.run(["cc", "-Wall", "-Wextra", "-Werror", str(REPO / "examples" / "c" / f"{example}.c"), *cflags, "-o",
                    str(exe)], check=True)
    proc = run([str(exe)], private_env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "importer" in proc.stdout and "done" in proc.stdout


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
def test_a_cmake_project_finds_the_runtime_from_ascend_home_path(tmp_path: Path, private_env: dict[str, str]) -> None:
    """examples/c/cmake builds as the runtime's own samples do (include/ and lib64/ of ASCEND_HOME_PATH, -lascendcl)
    after sourcing set_env.sh, and its program runs with the LD_LIBRARY_PATH that set_env.sh gives."""
    build = tmp_path / "build"
    script = (f'source "{ROOT}/set_env.sh" && cmake -S "{REPO}/examples/c/cmake" -B "{build}" >/dev/null && '
              f'cmake --build "{build}" >/dev/null && "{build}/vmm_share"')
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=private_env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "written through the first mapping" in proc.stdout


# ---------------------------------------------------------------- the codec


def test_the_c_codec_reads_and_writes_the_golden_frames(built: Path) -> None:
    """Every local frame of tests/wire_golden.json decodes in C to the fields it records and encodes back to the
    same bytes: the two codecs agree byte for byte."""
    exe = cc(built / "wire_golden", TESTS_C / "wire_golden.c", CLIB / "wire.c", with_library=False)
    cases = [c for c in json.loads((REPO / "tests" / "wire_golden.json").read_text())["frames"]
             if c["protocol"] == "local"]
    proc = subprocess.run([str(exe)], input="".join(c["frame"] + "\n" for c in cases), capture_output=True,
                          text=True, check=True)
    lines = proc.stdout.splitlines()
    assert len(lines) == len(cases)
    for case, line in zip(cases, lines, strict=True):
        assert line.endswith(" same"), (case, line)
        args = ast.literal_eval(case["args"])
        args = args if isinstance(args, tuple) else (args,)
        _, req, *fields = line.split()[:-1]
        assert int(req) == case["req"]
        tail = fields.pop()
        assert tail.startswith("t:")
        ints = [int(f) for f in fields if not f.startswith("b:")]
        fixed = [a for a in args if not isinstance(a, (bytes, str, tuple))]
        assert ints == fixed, (case, line)
        rest = [a for a in args if isinstance(a, (bytes, str, tuple))]
        if rest:
            last = rest[-1]
            raw = (last.encode() if isinstance(last, str) else
                   b"".join(struct.pack("<I", p) for p in last) if isinstance(last, tuple) else last)
            if not any(f.startswith("b:") for f in fields):
                assert bytes.fromhex(tail[2:]) == raw


def test_the_c_reply_parser_survives_fuzzing(built: Path) -> None:
    exe = cc(built / "fuzz_wire", TESTS_C / "fuzz_wire.c", CLIB / "wire.c", with_library=False)
    proc = subprocess.run([str(exe), "300000"], capture_output=True, text=True, env={**os.environ, **RUN_ENV},
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    decoded, refused = map(int, re.findall(r"\d+", proc.stdout))
    assert decoded > 10000 and refused > 10000  # both ways taken, often


# ---------------------------------------------------------------- a broker that lies


def lying_broker(folder: Path, answer: Callable[[socket.socket, bytes], None]) -> Callable[[], None]:
    """A server at folder/broker.sock that reads each request and answers with `answer(connection, request)`;
    returns its stop."""
    folder.mkdir(mode=0o700)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(str(folder / "broker.sock"))
    server.listen(8)
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    while True:
                        request = conn.recv(70000)
                        if not request:
                            break
                        answer(conn, request)
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    def close() -> None:
        stop.set()
        server.close()
        thread.join(10)

    return close


def _reply(request: bytes, kind: int, body: bytes) -> bytes:
    req = struct.unpack_from("<I", request, 4)[0]
    return b"VB\x02" + bytes([kind]) + struct.pack("<II", req, len(body)) + body


def _short(conn: socket.socket, request: bytes) -> None:
    conn.send(_reply(request, 67, b"")[:7])


def _wrong_size(conn: socket.socket, request: bytes) -> None:
    conn.send(_reply(request, 67, b"\0" * 12))  # MEM is 16 bytes


def _wrong_request(conn: socket.socket, request: bytes) -> None:
    conn.send(b"VB\x02\x43" + struct.pack("<II", 999_999, 16) + b"\0" * 16)


def _close_mid_call(conn: socket.socket, request: bytes) -> None:
    conn.shutdown(socket.SHUT_RDWR)
    raise OSError("closed")


def _garbage(conn: socket.socket, request: bytes) -> None:
    conn.send(os.urandom(40))


def _not_a_memfd(conn: socket.socket, request: bytes) -> None:
    """An IMPORTED with a pipe attached where the memory's memfd should be."""
    r, w = os.pipe()
    body = struct.pack("<QQB", 7, MiB2, 0) + struct.pack("<BBBBi", 0, 0, 4, 1, 0)
    try:
        conn.sendmsg([_reply(request, 69, body)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", r))])
    finally:
        os.close(r), os.close(w)


def _refuse(conn: socket.socket, request: bytes) -> None:
    text = b"this broker refuses you (a test)"
    conn.send(b"VB\x02\x41" + struct.pack("<II", 0, 4 + len(text)) + struct.pack("<I", 207006) + text)
    raise OSError("closed")


@pytest.mark.parametrize(("answer", "call", "code"), [
    (_short, "mem_info", IPC_ERROR), (_wrong_size, "mem_info", IPC_ERROR), (_wrong_request, "mem_info", IPC_ERROR),
    (_close_mid_call, "mem_info", IPC_ERROR), (_garbage, "mem_info", IPC_ERROR), (_not_a_memfd, "import", IPC_ERROR),
    (_refuse, "mem_info", NO_PERMISSION),
], ids=["short-frame", "wrong-size", "wrong-request-id", "closed-mid-call", "garbage", "not-a-memfd", "refusal"])
def test_a_lying_broker_gets_an_error_and_a_message_never_a_crash_a_hang_or_a_leak(
        built: Path, tmp_path: Path, answer: Callable[[socket.socket, bytes], None], call: str, code: int) -> None:
    exe = built / "call_probe"
    if not exe.exists():
        cc(exe, TESTS_C / "call_probe.c")
    stop = lying_broker(tmp_path / "b", answer)
    try:
        proc = run([str(exe), call], clean_env(VMMSHARE_SOCKET=str(tmp_path / "b" / "broker.sock")), timeout=120)
    finally:
        stop()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    for line in lines[:2]:
        got, message = line.split(" ", 1)
        assert int(got) == code, proc.stdout
        assert len(message) > 20, message
    assert lines[2] == "fds 0", proc.stdout  # nothing kept of what the broker sent
    assert "runtime error" not in proc.stderr and "AddressSanitizer" not in proc.stderr, proc.stderr


# ---------------------------------------------------------------- C and Python on one broker


@pytest.mark.parametrize(("exporter", "importer"), [("c", "python"), ("python", "c")])
def test_c_and_python_processes_share_with_trustlists_default_handles_and_ipc_keys(
        node: Node, exporter: str, importer: str) -> None:
    e, i, stranger = node.actor(exporter), node.actor(importer), node.actor(importer)
    h = ok(e, "rt.malloc_physical", MiB2, PROP, 0)
    p = ok(e, "rt.reserve_mem_address", MiB2, 0, 0, 0)
    ok(e, "rt.map_mem", p, MiB2, 0, h, 0)
    e.call("!write", p, 0x6B, MiB2)
    sh = ok(e, "rt.mem_export_to_shareable_handle_v2", h, 0, 1)
    fails(i, NO_PERMISSION, "rt.mem_import_from_shareable_handle_v2", sh, 1, 0)  # not trusted yet
    ok(e, "rt.mem_set_pid_to_shareable_handle_v2", sh, 1, [i.pid])
    ih = ok(i, "rt.mem_import_from_shareable_handle_v2", sh, 1, 0)
    ip = ok(i, "rt.reserve_mem_address", MiB2, 0, 0, 0)
    ok(i, "rt.map_mem", ip, MiB2, 0, ih, 0)
    assert i.call("!sha256", ip, MiB2) == e.call("!sha256", p, MiB2)
    i.call("!write", ip, 0x11, 16)
    assert e.call("!read", p, 16) == b"\x11" * 16
    fails(stranger, NO_PERMISSION, "rt.mem_import_from_shareable_handle_v2", sh, 1, 0)
    row = next(r for r in node.ls()["exports"] if r["owner_pid"] == e.pid)  # `vmmshare ls` shows it
    assert row["trustlist"] == [i.pid] and row["importers"] == [i.pid]
    # IPC keys, the older calls, between the same two
    block = ok(e, "rt.malloc", 3 << 20, 0)
    e.call("!write", block, 0x2C, 3 << 20)
    key = ok(e, "rt.ipc_mem_get_export_key", block, 3 << 20, 65, 0)
    ok(e, "rt.ipc_mem_set_import_pid", key, [i.pid])
    q = ok(i, "rt.ipc_mem_import_by_key", key, 0)
    assert i.call("!read", q + (3 << 20) - 4, 4) == b"\x2c" * 4
    ok(i, "rt.ipc_mem_close", key)
    ok(e, "rt.ipc_mem_close", key)
    ok(e, "rt.free", block)
    for actor, ptr, handle in ((i, ip, ih), (e, p, h)):
        ok(actor, "rt.unmap_mem", ptr)
        ok(actor, "rt.release_mem_address", ptr)
        ok(actor, "rt.free_physical", handle)


def test_the_rule_tests_binding_reaches_the_c_library(node: Node) -> None:
    """The binding the rule tests use reaches the C library (its messages name C calls), not vmmshare.acl."""
    a = node.actor("c")
    msg = fails(a, 100000, "rt.malloc_physical", 0, PROP, 0)
    assert msg.startswith("aclrtMallocPhysical:"), msg
    assert a.call("get_soc_name") == "vmmshare-host"
    assert a.call("rt.launch_kernel") == 207000  # a call the C library answers with 207000, as Python does



# ---------------------------------------------------------------- from a wheel


@pytest.mark.slow
def test_a_wheel_builds_the_libraries_and_prefix_completes_its_root(tmp_path: Path) -> None:
    """A wheel carries both libraries, built at install time with the system compiler, and no `<arch>-linux`
    copies; `vmmshare prefix` of the installed package makes those folders as links, and a program builds from the
    root and runs."""
    tree = tmp_path / "tree"
    shutil.copytree(REPO, tree, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.so", "__pycache__",
                                                               ".mypy_cache", ".ruff_cache", ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(tree)], check=True, capture_output=True, timeout=600)
    (wheel,) = (tmp_path / "dist").glob("vmmshare-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(site)
    assert {f"vmmshare/sdk/lib64/{name}" for name in LIBRARIES} <= set(names)
    assert not any("-linux/" in n for n in names), [n for n in names if "-linux/" in n]
    for name in LIBRARIES:  # (zip files keep no modes: what pip would set)
        os.chmod(site / "vmmshare" / "sdk" / "lib64" / name, 0o755)
    env = {**os.environ, "PYTHONPATH": str(site)}
    root = Path(subprocess.run([sys.executable, "-m", "vmmshare", "prefix"], env=env, capture_output=True, text=True,
                               check=True).stdout.strip())
    assert root == site / "vmmshare" / "sdk"
    assert (root / arch_folder() / "lib64" / "libascendcl.so").samefile(root / "lib64" / "libascendcl.so")
    exe = tmp_path / "probe"
    subprocess.run(["cc", str(TESTS_C / "weak_probe.c"), f"-I{root / arch_folder() / 'include'}",
                    f"-L{root / 'lib64'}", "-lascendcl", f"-Wl,-rpath,{root / 'lib64'}", "-o", str(exe)], check=True)
    proc = run([str(exe)], clean_env(VMMSHARE_SOCKET=str(tmp_path / "b" / "broker.sock"), VMMSHARE_BROKER_IDLE="1"))
    assert proc.returncode == 0 and "weak ok" in proc.stdout, proc.stdout + proc.stderr


# ---------------------------------------------------------------- attacks found by review


def _memfd_reply(conn: socket.socket, request: bytes) -> None:
    """A well-formed IMPORTED: 2 MiB of sealed host memory."""
    fd = os.memfd_create("m", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, MiB2)
        body = struct.pack("<QQBBBBBi", 7, MiB2, 0, 0, 0, 0, 1, 0)
        conn.sendmsg([_reply(request, 69, body)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))])
    finally:
        os.close(fd)


def _answer_plain(conn: socket.socket, request: bytes) -> bool:
    """TOKEN, OK and MEM as a broker would; True when it answered."""
    kind = request[3]
    if kind == 1:
        conn.send(_reply(request, 66, struct.pack("<Q", 9)))
    elif kind in (2, 5, 6):
        conn.send(_reply(request, 64, b""))
    elif kind == 3:
        conn.send(_reply(request, 67, struct.pack("<QQ", 1 << 30, 1 << 30)))
    else:
        return False
    return True


def _refuse_with_code_0(conn: socket.socket, request: bytes) -> None:
    """An ERROR to request 0 (a refusal of the connection) whose code is 0."""
    conn.send(b"VB\x02\x41" + struct.pack("<II", 0, 5) + struct.pack("<I", 0) + b"x")
    raise OSError("closed")


@pytest.mark.parametrize("call", ["mem_info", "import"])
def test_a_refusal_with_code_0_fails_the_call_and_closes_no_fd_of_the_program(
        built: Path, tmp_path: Path, call: str) -> None:
    """A refusal is never a success, whatever code it carries, and nothing of an earlier reply is touched again
    (before: code 0 read as success, and the import closed whatever fd held the number of an earlier reply's)."""
    exe = built / "call_probe"
    if not exe.exists():
        cc(exe, TESTS_C / "call_probe.c")
    stop = lying_broker(tmp_path / "b", _refuse_with_code_0)
    try:
        with open(os.devnull) as null:  # the program's stdin: a file of its own the library must leave alone
            proc = subprocess.run([str(exe), call], capture_output=True, text=True, stdin=null, timeout=120,
                                  env={**clean_env(VMMSHARE_SOCKET=str(tmp_path / "b" / "broker.sock")), **RUN_ENV})
    finally:
        stop()
    lines = proc.stdout.splitlines()
    assert all(int(line.split(" ", 1)[0]) == IPC_ERROR for line in lines[:2]), proc.stdout
    assert lines[2] == "fds 0", proc.stdout


def test_an_import_racing_a_double_free_touches_no_freed_allocation(built: Path, tmp_path: Path) -> None:
    """A second import of a held handle is at the broker while the handle is freed twice: the second free gets
    107017 and the import neither reads nor drops the freed allocation (before: a use after free). Stepped by
    events, not timing: the broker holds the import's answer until both frees are done."""
    at_broker, freed = threading.Event(), threading.Event()
    imports: list[int] = []

    def answer(conn: socket.socket, request: bytes) -> None:
        if _answer_plain(conn, request):
            return
        if request[3] == 7:
            imports.append(1)
            if len(imports) == 2:
                at_broker.set()
                assert freed.wait(60)  # (a hang guard)
            _memfd_reply(conn, request)
            return
        conn.send(_reply(request, 65, struct.pack("<I", 507899) + b"no"))

    exe = cc(built / "import_free_race", TESTS_C / "import_free_race.c")
    stop = lying_broker(tmp_path / "b", answer)
    proc = subprocess.Popen([str(exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**clean_env(VMMSHARE_SOCKET=str(tmp_path / "b" / "broker.sock")),
                                            **RUN_ENV})
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "import 0"
        assert at_broker.wait(60)
        proc.stdin.write("g")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "free 0"
        assert proc.stdout.readline().strip() == f"free-again {107017}"
        freed.set()
        out, err = proc.communicate(timeout=60)
    finally:
        freed.set()
        stop()
        if proc.poll() is None:
            proc.kill()
    assert "AddressSanitizer" not in err and "runtime error" not in err, err[-3000:]
    assert proc.returncode == 0, out + err[-3000:]
    assert out.strip() == "import-again 107017", out  # the import it joined was freed under it: import anew


def test_the_c_library_starts_a_broker_wherever_the_python_client_does(built: Path, tmp_path: Path) -> None:
    """A folder of one's own that others can read but not write (0755, as `vmmshare broker --multi-user` makes
    it): the Python client starts a broker there, and so does the C library (before: it wanted 0700)."""
    folder = tmp_path / "s"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    exe = built / "call_probe"
    if not exe.exists():
        cc(exe, TESTS_C / "call_probe.c")
    env = clean_env(VMMSHARE_SOCKET=str(folder / "broker.sock"), VMMSHARE_BROKER_IDLE="1")
    try:
        proc = run([str(exe), "mem_info"], env)
        assert proc.stdout.startswith("0 "), proc.stdout + proc.stderr
    finally:
        log = folder / "broker.log"
        for pid in {int(m) for m in re.findall(r"broker\[(\d+)\]", log.read_text() if log.exists() else "")}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 15)


@pytest.mark.parametrize(("value", "server"), [("42", 42), ("0x2a", 42), ("0o52", 42), ("0b101010", 42),
                                               ("4_2", 42), (" 42 ", 42), ("010", None), ("1__0", None),
                                               ("_1", None), ("0x", None), ("4294967296", None)])
def test_the_server_id_is_read_as_python_reads_it(node: Node, value: str, server: int | None) -> None:
    """VMMSHARE_SERVER_ID as Python's int(text, 0) reads it: C and Python processes of a node agree on the ids
    their IPC keys carry (before: C read 010 as 8 and refused 0o52 and 4_2)."""
    a = Actor({**node.broker.env, "VMMSHARE_ACTOR_SURFACE": "c", "VMMSHARE_SERVER_ID": value}, device=None)
    node.made.append(a)
    got = a.call("rt.set_device", 0)
    if server is None:
        assert got == PARAM and "VMMSHARE_SERVER_ID" in a.last_err, a.last_err
        return
    assert got == 0, a.last_err
    block = ok(a, "rt.malloc", 4096, 0)
    key = ok(a, "rt.ipc_mem_get_export_key", block, 4096, 65, 0)
    assert int(key[16:], 16) == server
    ok(a, "rt.ipc_mem_close", key)
    ok(a, "rt.free", block)
