"""API fuzzing, CI-sized (the full run is ``stress/fuzz_api.py``; numbers in docs/reliability.md §2).

5,000 seeded calls with random arguments to every function of acl.rt, acl.util and acl.init / finalize, in a
child process against a private broker: every ret is 0 or a documented code (507000 means an exception escaped
validation), failures leave neutral outputs and a message, util never raises, the child neither crashes nor
hangs, and once the fuzzer has freed what it created, the child's fds, VMAs and runtime tables and the broker's
fds and charges are back at baseline. The harness itself is checked too (a crash, a hang and a leak in the
child must each fail the run), and the defects the fuzzer found are pinned by regression tests at the end.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fuzz_api as FA
import vmmshare.acl as acl_module
from conftest import NO_MEMORY, fd_count, memfds, ret_of
from vmmshare._process import runtime

SEED = 20251130
CALLS = 5_000
INVALID_FILE = 100003


@pytest.fixture(scope="module")
def fuzz_result() -> dict[str, Any]:
    return FA.run(CALLS, SEED, seconds=60, hang_guard=120)


# ---------------------------------------------------------------- the CI-sized run


def test_every_function_is_fuzzed(fuzz_result: dict[str, Any]) -> None:
    assert fuzz_result["child_returncode"] == 0, fuzz_result["child_stderr_tail"]
    assert fuzz_result["calls"] == CALLS
    names = set(fuzz_result["function_names"])
    rt_names = {n for n, f in vars(acl_module.rt).items()
                if callable(f) and getattr(f, "__module__", "") == acl_module.rt.__name__ and not n.startswith("_")}
    util_names = {n for n, f in vars(acl_module.util).items()
                  if callable(f) and getattr(f, "__module__", "") == acl_module.util.__name__ and not n.startswith("_")}
    assert rt_names | util_names | {"init", "finalize", "get_recent_err_msg"} == names
    assert set(fuzz_result["calls_per_function"]) == names, "some function was never called"
    # real objects were hit: the calls that create, map, share and free them succeeded many times
    ok = fuzz_result["ok_per_function"]
    for name in ("malloc_physical", "reserve_mem_address", "map_mem", "unmap_mem", "free_physical", "memcpy",
                 "memset", "mem_export_to_shareable_handle_v2", "mem_import_from_shareable_handle_v2",
                 "mem_set_access", "malloc_host", "free_host", "ptr_to_bytes"):
        assert ok.get(name, 0) > 0, f"{name} never succeeded: the fuzz did not reach real objects"
    assert fuzz_result["codes"].get("107000", 0) > CALLS // 10, "bad arguments were not bad enough"


def test_every_ret_is_documented(fuzz_result: dict[str, Any]) -> None:
    assert fuzz_result["child_returncode"] == 0, fuzz_result["child_stderr_tail"]
    assert not fuzz_result["internal_errors"], "507000: exceptions escaped validation"
    assert not fuzz_result["unexpected_codes"]
    assert set(fuzz_result["codes"]) <= {str(c) for c in FA.DOCUMENTED}


def test_failures_are_reported_and_nothing_raises(fuzz_result: dict[str, Any]) -> None:
    assert fuzz_result["child_returncode"] == 0, fuzz_result["child_stderr_tail"]
    assert fuzz_result["defects"] == 0, fuzz_result["defect_samples"][:10]
    assert not fuzz_result["warmup_defects"], fuzz_result["warmup_defects"][:10]
    assert fuzz_result["util_none"] > 0 and fuzz_result["util_values"] > 0
    assert fuzz_result["child_tracebacks"] == 0, fuzz_result["child_stderr_tail"]


def test_everything_returns_to_baseline(fuzz_result: dict[str, Any]) -> None:
    assert fuzz_result["child_returncode"] == 0, fuzz_result["child_stderr_tail"]
    base, after = fuzz_result["baseline"], fuzz_result["after"]
    assert after["counts"] == base["counts"]
    assert after["fds"] == base["fds"]
    assert after["library_maps"] == base["library_maps"]
    assert not fuzz_result["maps_diff"]["unexplained"], fuzz_result["maps_diff"]
    assert fuzz_result["broker_alive"]
    assert fuzz_result["broker_fds"]["after"] == fuzz_result["broker_fds"]["before"]
    assert fuzz_result["broker_state_after"]["all_free"] and fuzz_result["broker_state_after"]["exports"] == 0
    assert fuzz_result["broker_log_tracebacks"] == 0
    assert sum(fuzz_result["live_at_end"].values()) > 0, "the fuzzer held nothing at the end: cleanup untested"


# ---------------------------------------------------------------- the harness notices what it should


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "violation"), [
    ("crash", "did not finish cleanly: exit -11"),
    ("hang", "did not finish cleanly: exit timeout"),
    ("leak", "fds did not return to baseline"),
])
def test_harness_fails_the_run(kind: str, violation: str) -> None:
    """A child that crashes, hangs or leaks makes a failing run (not a dead or passing harness)."""
    hang_guard = 3 if kind == "hang" else 60  # the guard only decides when to give up on a hung child
    r = FA.run(300, SEED, seconds=30, hang_guard=hang_guard, extra_env={"VMMSHARE_FUZZ_SELFTEST": kind})
    assert not r["ok"]
    assert any(violation in v for v in r["violations"]), r["violations"]


@pytest.fixture
def fuzzer(tmp_path: Path) -> Iterator[FA.Fuzzer]:
    yield FA.Fuzzer(1, [], 1, tmp_path)


def test_checks_flag_bad_results(fuzzer: FA.Fuzzer) -> None:
    """Positive controls for the per-call checks: 507000, an undocumented code, non-neutral outputs on failure,
    a ret that is not an int, and a util value of the wrong type are each a defect."""
    acl_module.rt.free_physical(1)  # leaves a message naming free_physical
    fuzzer._check_ret("free_physical", [1], {}, 507000)
    fuzzer._check_ret("free_physical", [1], {}, 507022)
    fuzzer._check_ret("free_physical", [1], {}, (5, 107017))
    fuzzer._check_ret("free_physical", [1], {}, "0")
    fuzzer._check_util("ptr_to_bytes", [1, 1], {}, 5)
    assert [d["what"] for d in fuzzer.defects] == [
        "507000: an exception escaped validation", "undocumented code 507022", "failure with non-neutral outputs",
        "ret is not an int", "util returned a value of the wrong type",
    ]
    assert fuzzer.internal and fuzzer.unexpected


def test_verdict_lists_each_violation() -> None:
    good = {"child_returncode": 0, "defects": 0, "baseline": {"fds": 5, "library_maps": 1, "counts": {}},
            "after": {"fds": 5, "library_maps": 1, "counts": {}}, "maps_diff": {"unexplained": []},
            "broker_alive": True, "broker_fds": {"before": 9, "after": 9},
            "broker_state_after": {"all_free": True, "exports": 0}}
    assert FA.verdict(good) == []
    assert FA.verdict({**good, "child_returncode": -11})
    assert FA.verdict({**good, "after": {**good["after"], "counts": {"handles": 1}}})
    assert FA.verdict({**good, "maps_diff": {"unexplained": ["1000-2000 rw-s 0 00:01 5 /memfd:vmmshare"]}})
    assert FA.verdict({**good, "broker_fds": {"before": 9, "after": 10}})
    assert FA.verdict({**good, "broker_state_after": {"all_free": False, "exports": 0}})
    assert FA.verdict({**good, "internal_errors": {"x": 1}})


def test_interpreter_vmas_are_told_from_the_runtimes() -> None:
    assert FA._interpreter_vma("55ca6e3c3000-55ca6eb6a000 rw-p 00000000 00:00 0      [heap]")
    assert FA._interpreter_vma("7f3571f00000-7f3572000000 rw-p 00000000 00:00 0 ")
    assert not FA._interpreter_vma("100000000000-100000200000 rw-s 00000000 00:01 7   /memfd:vmmshare:dev0 (deleted)")
    assert not FA._interpreter_vma(f"{FA.ARENA_START:x}-{FA.ARENA_START + 4096:x} rw-p 00000000 00:00 0 ")
    assert not FA._interpreter_vma("7f00-8f00 r--p 00000000 08:01 5  /usr/lib/libc.so.6")


# ---------------------------------------------------------------- defects the fuzzer found (regression tests)


def test_init_with_an_array_as_config_path_is_refused_like_any_non_str() -> None:
    """acl.init(numpy.zeros(2)) returned 507000: `if config_path:` asked an array for its truth value, which
    raises. A config path that is not a str is an invalid file (100003), as for any other type."""
    rt = runtime()
    was = rt.initialized
    try:
        rt.initialized = False
        ret = acl_module.init(np.zeros(2))
        assert ret == INVALID_FILE, acl_module.get_recent_err_msg()
        assert "init" in acl_module.get_recent_err_msg()
        assert not rt.initialized
        assert acl_module.init(5) == INVALID_FILE  # the same as another non-str path
    finally:
        rt.initialized = was


def test_malloc_physical_of_a_host_size_beyond_off_t_is_a_memory_error(acl) -> None:
    """malloc_physical(2**63, <host location>, 0) returned 507000 (OverflowError from ftruncate: the size is a
    multiple of the granularity, and host allocations are not capped by VMMSHARE_DEVICE_MEMORY). Memory that
    cannot be created is ACL_ERROR_RT_MEMORY_ALLOCATION (207001), like any other size the host cannot back,
    and nothing is left behind."""
    host_prop = {"handleType": 0, "allocationType": 0, "memAttr": 12, "location": {"id": 0, "type": 0},
                 "reserve": 0}
    acl_module.rt.get_mem_info(0)  # the broker connection is made before the baseline is taken
    fds, mfds = fd_count(), memfds()
    for size in (1 << 63, (1 << 64) - (2 << 20)):
        result = acl_module.rt.malloc_physical(size, host_prop, 0)
        assert ret_of(result) == NO_MEMORY, (hex(size), result, acl_module.get_recent_err_msg())
        assert result[0] == 0
        assert "malloc_physical" in acl_module.get_recent_err_msg()
    assert fd_count() == fds and memfds() == mfds
