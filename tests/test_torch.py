"""vmmshare.torch: tensors on vmmshare memory sent to real second processes by handle (reduce_tensor/rebuild),
through torch.multiprocessing (install), across pid namespaces, without ptrace rights, and past the death of
either side (SPEC rules 11, 14, 15)."""

from __future__ import annotations

import ctypes
import gc
import json
import multiprocessing
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch_children  # noqa: E402
import vmmshare  # noqa: E402
import vmmshare.torch as vt  # noqa: E402
from conftest import require  # noqa: E402
from procs import host_children, python_c, refusal  # noqa: E402
from vmmshare._process import runtime  # noqa: E402

MiB = 1 << 20
PARAM, BAD_HANDLE, NO_PERMISSION = 107000, 107017, 207006

PEER = r"""
import gc, json, os, pickle, sys
import torch
import vmmshare.torch as vt
from vmmshare._process import runtime
print(json.dumps({"pid": vt.bare_pid(), "own": os.getpid()}), flush=True)
keep = {}
for line in sys.stdin:
    req = json.loads(line)
    try:
        if "tensor" in req:
            fn, args = pickle.loads(bytes.fromhex(req["tensor"]))
            keep[req.get("name", "x")] = fn(*args)
        env = {"torch": torch, "vt": vt, "keep": keep, "gc": gc, "runtime": runtime, "os": os}
        exec(req.get("code", "result = None"), env)
        out = {"ok": env.get("result")}
    except Exception as exc:
        out = {"err": f"{type(exc).__name__}: {exc}", "code": getattr(exc, "code", None)}
    print(json.dumps(out), flush=True)
"""


class Peer:
    """A second Python process that rebuilds tensors sent to it and runs code on them (`keep[name]`)."""

    def __init__(self, prefix: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        self.proc: Any = (python_c(PEER, env) if not prefix else  # forked from the zygote where it can be
                          subprocess.Popen([*prefix, sys.executable, "-c", PEER], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, text=True, bufsize=1, env=env))
        assert self.proc.stdout is not None
        hello = json.loads(self.proc.stdout.readline())
        self.pid: int = hello["pid"]  # the host pid, as the broker sees it
        self.own_pid: int = hello["own"]  # the pid it sees itself as (1 in its own pid namespace)

    def send(self, reduced: Any = None, code: str = "result = None", name: str = "x") -> Any:
        """Rebuild `reduced` (a (fn, args) pair) as keep[name], run `code`, return its `result`."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        req: dict[str, Any] = {"code": textwrap.dedent(code), "name": name}
        if reduced is not None:
            req["tensor"] = pickle.dumps(reduced).hex()
        self.proc.stdin.write(json.dumps(req) + "\n")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer died (exit {self.proc.wait(10)})")
        reply = json.loads(line)
        if "err" in reply:
            raise PeerError(reply["err"], reply["code"])
        return reply["ok"]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            assert self.proc.wait(10) == 0


class PeerError(RuntimeError):
    def __init__(self, message: str, code: int | None) -> None:
        super().__init__(message)
        self.code = code


@pytest.fixture
def peer() -> Iterator[Any]:
    made: list[Peer] = []

    def make(**kw: Any) -> Peer:
        p = Peer(**kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.kill()


def used() -> int:
    free, total = vmmshare.Device(0).mem_info()
    return total - free


# ---------------------------------------------------------------- tensors on vmmshare memory


def test_empty_zeros_and_empty_like_are_on_exportable_memory() -> None:
    gc.collect()  # earlier tests' garbage goes before the count, not during it
    before = runtime().counts()
    t = vt.empty(3, 5, dtype=torch.float16)
    z = vt.zeros((4, 4), dtype=torch.int64, requires_grad=False)
    g = vt.zeros(8, requires_grad=True)
    like = vt.empty_like(torch.empty(6, 2).t())
    assert t.shape == (3, 5) and t.dtype == torch.float16 and t.is_contiguous()
    assert torch.equal(z, torch.zeros(4, 4, dtype=torch.int64))
    assert g.requires_grad and g.is_leaf and g.dtype == torch.get_default_dtype()
    assert like.shape == (2, 6) and like.stride() == (1, 2)  # the strides torch.empty_like gives
    assert all(vt.is_shared(x) for x in (t, z, g, like)) and not vt.is_shared(torch.empty(3))
    del t, z, g, like
    gc.collect()
    assert runtime().counts() == before  # the last tensor over the memory unmapped and freed it


def test_share_moves_a_tensor_in_place_keeping_data_offset_and_strides() -> None:
    base = torch.arange(40, dtype=torch.float64).reshape(5, 8)
    view = base[1:, 2:].t()
    expect = view.clone()
    same = vt.share_(view)
    assert same is view and vt.is_shared(view)
    assert view.storage_offset() == 10 and view.stride() == (1, 8) and torch.equal(view, expect)
    assert vt.share_(view) is view  # already there: nothing moves
    p = torch.nn.Parameter(torch.ones(3))
    vt.share_(p)
    assert vt.is_shared(p) and p.requires_grad and isinstance(p, torch.nn.Parameter)


@pytest.mark.parametrize("call", [
    lambda: vt.empty(2, -1),
    lambda: vt.empty(2.0),
    lambda: vt.empty(2, dtype="float32"),
    lambda: vt.empty(2, device="meta"),
    lambda: vt.empty(2, device="nonsense"),
    lambda: vt.empty(2, device="cuda:0"),  # the host backend has no GPU memory
    lambda: vt.empty_like([1, 2]),
    lambda: vt.share_("x"),
])
def test_bad_arguments_are_clear_errors(call: Any) -> None:
    before = runtime().counts()
    with pytest.raises(vmmshare.InvalidParamError):
        call()
    assert runtime().counts() == before


def test_a_tensor_not_on_vmmshare_memory_is_refused_naming_share_() -> None:
    with pytest.raises(vmmshare.InvalidParamError, match=r"share_\(t\)") as info:
        vt.reduce_tensor(torch.ones(4))
    assert info.value.code == PARAM
    with pytest.raises(vmmshare.InvalidParamError):
        vt.reduce_tensor(vt.empty(4), pids=[0])
    with pytest.raises(vmmshare.InvalidParamError):
        vt.reduce_tensor(vt.empty(4), pids="12")


# ---------------------------------------------------------------- reduce / rebuild in another process


def test_rule_11_rebuild_in_another_process_is_the_same_memory(peer: Any) -> None:
    c = peer()
    t = vt.zeros(64, 32, dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad():
        t.copy_(torch.arange(64 * 32).reshape(64, 32))
    view = t[3:, 5:].t()
    total = view.detach().float().sum().item()
    got = c.send(vt.reduce_tensor(view, pids=[c.pid]), """
        x = keep["x"]
        result = [list(x.shape), list(x.stride()), x.storage_offset(), str(x.dtype), x.requires_grad,
                  x.detach().float().sum().item()]
        x.data[0, 0] = -1
    """)
    assert got == [[27, 61], [1, 32], 101, "torch.bfloat16", True, total]
    assert view[0, 0].item() == -1  # the consumer's write is the producer's memory: no copy on either side
    with torch.no_grad():
        t.fill_(3)
    assert c.send(code="result = keep['x'].float().mean().item()") == 3.0


def test_views_of_one_storage_share_one_export_and_one_import(peer: Any) -> None:
    c = peer()
    t = vt.zeros(1024, dtype=torch.int32)
    a, b = t[:512], t[512:].view(16, 32)
    fa, args_a = vt.reduce_tensor(a, pids=[c.pid])
    fb, args_b = vt.reduce_tensor(b, pids=[c.pid])
    assert args_a[1] == args_b[1]  # one handle
    c.send((fa, args_a), name="a")
    c.send((fb, args_b), name="b", code="result = runtime().counts()")
    counts = c.send(code="""
        keep["b"][0, 0] = 7
        result = [runtime().counts()["allocations"], keep["a"].untyped_storage().data_ptr() ==
                  keep["b"].untyped_storage().data_ptr(), keep["a"][0].item()]
    """)
    assert counts == [1, True, 0] and t[512].item() == 7  # one import, one mapping
    mine = my_export((fa, args_a))
    assert len(mine) == 1 and mine[0]["trustlist"] == [c.pid] and mine[0]["importer_count"] == 1


def test_parameters_rebuild_as_parameters(peer: Any) -> None:
    c = peer()
    p = torch.nn.Parameter(vt.zeros(4, 4))
    assert vt.is_shared(p)
    got = c.send(vt.reduce_tensor(p, pids=[c.pid]),
                 "x = keep['x']; result = [type(x).__name__, x.requires_grad, x.is_leaf]")
    assert got == ["Parameter", True, True]


@pytest.mark.slow
def test_rule_11_a_process_off_the_trustlist_is_refused_and_keeps_nothing(peer: Any) -> None:
    trusted, other = peer(), peer()
    t = vt.zeros(16)
    reduced = vt.reduce_tensor(t, pids=[trusted.pid])
    with pytest.raises(PeerError) as info:
        other.send(reduced)
    assert info.value.code == NO_PERMISSION and f"host pid is {other.pid}" in str(info.value)
    assert other.send(code="result = runtime().counts()['allocations']") == 0
    vt.reduce_tensor(t, pids=[other.pid])  # the trustlist grows on the same export
    assert other.send(reduced, "result = keep['x'].numel()") == 16


def test_validate_pids_false_lets_any_process_import(peer: Any) -> None:
    c = peer()
    t = vt.zeros(16)
    reduced = vt.reduce_tensor(t, validate_pids=False)
    assert c.send(reduced, "result = keep['x'].numel()") == 16
    other = vt.zeros(16)
    vt.reduce_tensor(other, pids=[c.pid])
    with pytest.raises(vmmshare.InvalidParamError, match="already exported with pid validation"):
        vt.reduce_tensor(other, validate_pids=False)


@pytest.mark.parametrize("change", [
    {1: "vmm:default:0123456789abcdef"},  # a handle nobody exported
    {2: "float128"},
    {3: (1 << 40,)},  # past the end of the memory
    {3: (4,), 4: (1, 1)},
    {5: -1},
    {0: 99},
    {1: 5},
])
def test_rule_16_a_lying_reduction_fails_cleanly(peer: Any, change: dict[int, Any]) -> None:
    c = peer()
    t = vt.zeros(16)
    fn, args = vt.reduce_tensor(t, pids=[c.pid])
    bad = list(args)
    for k, v in change.items():
        bad[k] = v
    with pytest.raises(PeerError) as info:
        c.send((fn, tuple(bad)))
    assert info.value.code in (PARAM, BAD_HANDLE)
    assert c.send(code="gc.collect(); result = runtime().counts()['allocations']") == 0
    assert c.send((fn, args), "result = keep['x'].numel()") == 16  # the real one still works


def test_the_producer_rebuilding_its_own_reduction_gets_its_own_memory() -> None:
    t = vt.zeros(8)
    fn, args = vt.reduce_tensor(t[2:], pids=[os.getpid()])
    before = runtime().counts()
    x = fn(*args)
    x[0] = 5
    assert t[2].item() == 5 and runtime().counts() == before  # no import of its own export


# ---------------------------------------------------------------- death of either side (SPEC rule 14)


@pytest.mark.slow
def test_rule_14_producer_death_leaves_the_consumers_tensor_valid(peer: Any) -> None:
    producer, consumer = peer(), peer()
    reduced = producer.send(code=f"""
        import pickle
        keep["w"] = vt.empty(256, 1024)
        keep["w"].copy_(torch.arange(256 * 1024, dtype=torch.float32).reshape(256, 1024))
        result = pickle.dumps(vt.reduce_tensor(keep["w"][1:], pids=[{consumer.pid}])).hex()
    """)
    fn_args = pickle.loads(bytes.fromhex(reduced))
    assert consumer.send(fn_args, "result = keep['x'][0, 0].item()") == 1024.0
    producer.kill()
    expect = float(torch.arange(1024, 256 * 1024, dtype=torch.float64).sum())
    assert consumer.send(code="result = keep['x'].double().sum().item()") == expect
    consumer.send(code="del keep['x']; gc.collect()")
    with pytest.raises(PeerError) as info:  # the export is revoked: a new import fails
        consumer.send(fn_args, name="again")
    assert info.value.code == BAD_HANDLE


def my_export(reduced: Any) -> list[dict[str, Any]]:
    """The export a reduction names, as the broker lists it (what `vmmshare ls --json` prints); [] once gone."""
    value = vmmshare.ShareableHandle.parse(reduced[1][1]).value
    return [e for e in runtime().node.listing()["exports"] if int(e["handle"], 16) == value]


@pytest.mark.slow
def test_rule_14_consumer_death_leaks_nothing(peer: Any) -> None:
    t = vt.zeros(8 * MiB // 4)
    consumers = [peer() for _ in range(3)]
    reduced = vt.reduce_tensor(t, pids=[c.pid for c in consumers])
    for c in consumers:
        assert c.send(reduced, "result = keep['x'].numel()") == t.numel()
    handle = reduced[1][1]
    [export] = my_export(reduced)
    assert export["importer_count"] == 3 and export["owner_pid"] == os.getpid()
    held = used()
    for c in consumers:
        c.kill()
    # the broker drops each dead consumer's hold when its connection closes: ask until it has (every answer is a
    # broker reply; no timing involved)
    for _ in range(10_000):
        if my_export(reduced)[0]["importer_count"] == 0:
            break
    assert my_export(reduced)[0]["importer_count"] == 0
    del t
    gc.collect()
    assert not my_export(reduced), handle
    assert used() <= held - 8 * MiB  # the memory went back: nobody holds it


def test_a_consumer_that_drops_its_tensors_gives_the_memory_back(peer: Any) -> None:
    c = peer()
    t = vt.zeros(4 * MiB // 4)
    c.send(vt.reduce_tensor(t, pids=[c.pid]))
    assert c.send(code="result = runtime().counts()['allocations']") == 1
    assert c.send(code="del keep['x']; gc.collect(); result = runtime().counts()") == c.send(
        code="result = runtime().counts()")
    assert c.send(code="result = runtime().counts()['allocations'] + runtime().counts()['mappings']") == 0


# ---------------------------------------------------------------- containers and ptrace


def test_rule_15_a_consumer_in_its_own_pid_namespace(peer: Any) -> None:
    prefix = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
    require(shutil.which("unshare"), "no unshare(1) here")
    why = refusal(prefix)
    require(not why, f"cannot start a process in a new pid namespace: {why}")
    c = peer(prefix=prefix)
    assert c.own_pid == 1  # it believes it is pid 1; the broker knows its host pid
    kids = host_children(c.proc.pid)
    assert kids == [c.pid]
    t = vt.zeros(1000)
    with pytest.raises(PeerError) as info:  # its namespace's pid is not the one that counts
        c.send(vt.reduce_tensor(t, pids=[1] if os.getpid() != 1 else [2]))
    assert info.value.code == NO_PERMISSION
    t += 4
    assert c.send(vt.reduce_tensor(t, pids=[c.pid]), "keep['x'] += 1; result = keep['x'].sum().item()") == 5000
    assert t.sum().item() == 5000


def _no_ptrace_prefix() -> list[str]:
    setpriv = shutil.which("setpriv")
    require(setpriv, "no setpriv(1) here")
    assert setpriv is not None
    return [setpriv, "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs"]


def test_no_ptrace_right_is_needed(peer: Any) -> None:
    """The producer is not dumpable and the consumer has no capability, so the consumer cannot take the producer's
    fds (pidfd_getfd, what torch's expandable segments need) — and rebuilds the tensor all the same."""
    prefix = _no_ptrace_prefix()
    why = refusal(prefix)
    require(not why, f"cannot drop capabilities: {why}")
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_dumpable, pr_get_dumpable = 4, 3
    was = libc.prctl(pr_get_dumpable, 0, 0, 0, 0)
    assert libc.prctl(pr_set_dumpable, 0, 0, 0, 0) == 0
    try:
        c = peer(prefix=prefix)
        probe = c.send(code=f"""
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.syscall(434, {os.getpid()}, 0)  # pidfd_open
            got = libc.syscall(438, fd, 0, 0) if fd >= 0 else -1  # pidfd_getfd: the producer's stdin
            result = [fd >= 0, got, ctypes.get_errno()]
        """)
        assert probe[0] and probe[1] == -1 and probe[2] == 1  # EPERM: no ptrace right over the producer
        t = vt.zeros(64)
        t += 2
        assert c.send(vt.reduce_tensor(t, pids=[c.pid]), "result = keep['x'].sum().item()") == 128
    finally:
        libc.prctl(pr_set_dumpable, was, 0, 0, 0)


# ---------------------------------------------------------------- install(): torch.multiprocessing by handle


@pytest.fixture
def installed() -> Iterator[None]:
    vt.install()
    try:
        yield
    finally:
        vt.uninstall()


def test_install_sends_tensors_through_torch_multiprocessing_queues(installed: None) -> None:
    ctx = torch.multiprocessing.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=torch_children.queue_child, args=(q, back))
    p.start()
    try:
        t = vt.zeros(100, 10)
        t += 2
        q.put(t[:, 1:])
        q.put(torch.ones(5))  # an ordinary tensor still goes torch's way
        assert back.get(timeout=120) == (True, 1800.0, [100, 9], (10, 1), 5.0)
        assert back.get(timeout=120) == "done"
        assert t[0, 0].item() == 2 and t[0, 1].item() == 3
    finally:
        p.join(60)
    assert p.exitcode == 0


def test_install_sends_tensors_through_pipes_and_uninstall_restores_torch(installed: None) -> None:
    ctx = multiprocessing.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=torch_children.pipe_child, args=(b,))
    p.start()
    try:
        t = vt.zeros(7)
        t += 1
        a.send(t)
        assert a.recv() is True and t.sum().item() == 70
    finally:
        p.join(60)
    vt.uninstall()
    assert not vt.installed()
    from torch.multiprocessing import reductions

    assert ForkingPickler._extra_reducers[torch.Tensor] is reductions.reduce_tensor  # type: ignore[attr-defined]


def test_install_pickles_to_bytes_alone_no_fd_side_channel(installed: None, peer: Any) -> None:
    """What install() writes is all a consumer needs: the bytes go through a plain pickle in a process that took
    no fd from this one, and the tensor appears."""
    c = peer()
    vt.trust([c.pid])
    t = vt.zeros(32)
    t += 9
    data = bytes(ForkingPickler.dumps(t))
    assert len(data) < 1024
    reduced = pickle.loads(data)  # the rebuilt tensor here: the same memory again
    assert vt.is_shared(reduced) and reduced.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    c.proc.stdin.write(json.dumps({"code": textwrap.dedent(f"""
        import pickle
        x = pickle.loads(bytes.fromhex({data.hex()!r}))
        result = [x.sum().item(), vt.is_shared(x)]
    """)}) + "\n")
    reply = json.loads(c.proc.stdout.readline())
    assert reply == {"ok": [288.0, True]}


def test_install_arguments_are_checked() -> None:
    with pytest.raises(vmmshare.InvalidParamError):
        vt.install(pids=[-3])
    with pytest.raises(vmmshare.InvalidParamError):
        vt.install(children="yes")  # type: ignore[arg-type]
    assert not vt.installed()


def test_a_killed_peer_is_not_waited_for() -> None:
    """The fixtures' hang guard: a peer killed mid-conversation reports its death instead of blocking."""
    p = Peer()
    os.kill(p.proc.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="peer died"):
        p.send(code="result = 1")
    p.kill()


# ---------------------------------------------------------------- under the CUDA backend (GPU memory)


@pytest.mark.slow
def test_cpu_tensors_beside_gpus_are_host_memory_and_gpu_ones_need_a_cuda_torch(tmp_path: Any) -> None:
    """With VMMSHARE_BACKEND=cuda, device memory is GPU memory: a "cpu" tensor is host memory (still exported and
    rebuilt by handle), and a "cuda" tensor with a CPU-only torch is refused (207000) with nothing kept. On the CPU
    stand-in for libcuda where there is no GPU."""
    import importlib.util

    import fakecuda
    from conftest import CUDA_GATE, require, run_child

    require(importlib.util.find_spec("cuda.bindings") is not None and shutil.which(os.environ.get("CC", "cc")),
            "the CPU stand-in for libcuda needs cuda-bindings and a C compiler", CUDA_GATE)
    env = {**fakecuda.build(tmp_path), "VMMSHARE_BACKEND": "cuda"}
    out = run_child("""
        import gc, pickle, subprocess, sys, torch
        import vmmshare.torch as vt
        from vmmshare import FeatureNotSupportedError
        from vmmshare._process import runtime
        t = vt.zeros(1000)
        t += 3
        memory = vt._tensors._by_ptr[t.untyped_storage().data_ptr()].mapping().memory
        assert not memory.on_gpu and memory.location["type"] == 0, memory.location  # ACL_MEM_LOCATION_TYPE_HOST
        gc.collect()  # earlier tests' garbage goes before the count, not during it
        before = runtime().counts()
        if torch.cuda.is_available():
            print("a CUDA torch: skipped the refusal")
        else:
            try:
                vt.empty(10, device="cuda:0")
            except FeatureNotSupportedError as exc:
                print("refused", exc.code)
            gc.collect()
            assert runtime().counts() == before, (before, runtime().counts())
        child = subprocess.Popen([sys.executable, "-c", "import sys, pickle, vmmshare.torch as vt; print(vt.bare_pid(),"
                                  " flush=True); fn, args = pickle.loads(bytes.fromhex(sys.stdin.readline()));"
                                  " print(fn(*args).sum().item())"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
        pid = int(child.stdout.readline())
        got, _ = child.communicate(pickle.dumps(vt.reduce_tensor(t, pids=[pid])).hex() + "\\n", timeout=120)
        print("rebuilt", got.strip())
    """, env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "refused 207000" in out.stdout or "a CUDA torch" in out.stdout
    assert "rebuilt 3000.0" in out.stdout


@pytest.mark.slow
def test_install_without_children_trusts_only_the_pids_given(installed: None) -> None:
    vt.install(children=False)
    ctx = multiprocessing.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=torch_children.refused_child, args=(b,))
    p.start()
    try:
        t = vt.zeros(4)  # kept alive until the child has tried: its export lives as long as the memory
        a.send(t)
        kind, code, message = a.recv()
        assert (kind, code) == ("refused", NO_PERMISSION) and f"host pid is {p.pid}" in message
    finally:
        p.join(60)
    assert p.exitcode == 0


def test_threads_reducing_one_storage_export_it_once() -> None:
    import threading

    t = vt.zeros(4096)
    got: list[str] = []
    lock = threading.Lock()

    def reduce(i: int) -> None:
        _, args = vt.reduce_tensor(t[i * 8:], pids=[1000 + i])
        with lock:
            got.append(args[1])

    threads = [threading.Thread(target=reduce, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(got) == 8 and len(set(got)) == 1
    [export] = my_export((None, (1, got[0])))
    assert export["trustlist"] == [1000 + i for i in range(8)]
