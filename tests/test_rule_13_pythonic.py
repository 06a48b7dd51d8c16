"""Rule 13 in the Pythonic API: `vmmshare.import_handle` in the exporting process gives an object over the same
memory (as HIXL's self-import, and cuda.core's alias in the same process), a second import of one handle gives
another object over the same memory, each object is closed on its own and the memory stays until the last; a
handle whose exporter closed its memory is refused in Pythonic terms."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import vmmshare
from vmmshare import constants as C
from vmmshare._process import runtime

MiB = 1 << 20


def counts() -> dict[str, int]:
    return runtime().counts()


@pytest.mark.parametrize("share_type", ["default", "fabric"])
@pytest.mark.parametrize("validate_pids", [True, False])
def test_rule_13_import_in_the_exporting_process(share_type: str, validate_pids: bool) -> None:
    before = counts()
    mem = vmmshare.Device(0).allocate(2 * MiB)
    mine = mem.map()
    h = mem.export(share_type=share_type, validate_pids=validate_pids)
    alias = vmmshare.import_handle(h)
    assert alias.imported and alias.size == mem.size and alias.handle != mem.handle
    again = vmmshare.import_handle(h)
    assert again.handle == alias.handle, "a second import of one handle is the same handle, a reference added"
    view = alias.map()
    mine.write(b"written through the exporter's own mapping")
    assert view.read(42) == b"written through the exporter's own mapping"
    view.fill(0x61, 4)
    assert mine.read(4) == b"aaaa"
    mine.close()
    mem.close()  # the exporter's object: revoked for new imports; the imports keep the memory
    alias.close()
    assert view.read(4) == b"aaaa" and not again.closed
    with again.map() as second:
        a, b = second.numpy(np.uint8), view.numpy(np.uint8)
        a[100] = 7
        assert b[100] == 7
        del a, b
    view.close()
    again.close()
    assert counts() == before, "the last close did not free the memory"


def test_rule_13_a_revoked_handle_is_refused_in_pythonic_terms() -> None:
    mem = vmmshare.Device(0).allocate(2 * MiB)
    h = mem.export(validate_pids=False)
    mem.close()
    with pytest.raises(vmmshare.InvalidHandleError) as info:
        vmmshare.import_handle(h)
    assert info.value.code == C.ACL_ERROR_RT_INVALID_HANDLE
    assert "close" in info.value.message and "free_physical" not in info.value.message


def test_rule_13_two_imports_in_another_process_are_one_memory() -> None:
    code = """
        import sys, vmmshare
        first = vmmshare.import_handle(sys.argv[1])
        second = vmmshare.import_handle(sys.argv[1])
        assert first.handle == second.handle
        m = first.map()
        first.close()  # one import closed: the other still maps the memory
        with second.map() as n:
            assert n.read(5) == m.read(5) == b"hello"
            n.write(b"HELLO")
        second.close()
        second.close()  # closing twice is a no-op
        assert m.read(5) == b"HELLO"
        m.close()
        print("ok")
    """
    with vmmshare.Device(0).allocate(2 * MiB) as mem, mem.map() as mapping:
        mapping.write(b"hello")
        h = mem.export(validate_pids=False)
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(h)], capture_output=True, text=True,
                             timeout=60)
        assert out.stdout.strip() == "ok", out.stderr
        assert mapping.read(5) == b"HELLO"
