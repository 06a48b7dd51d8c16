"""Compiled parts of vmmshare, built with the system C compiler where there is one.

- `vmmshare.sockets._fastpackets`: the compiled fast path of vmmshare.sockets.packets (optional: without a compiler
  or Python's headers the package installs all the same and uses the pure-Python packets).
- The C library (`src/vmmshare/clib/`): `libascendcl.so` and `libacl_rt.so`, the runtime's C interface, built into
  the CANN-like root `vmmshare prefix` prints (`vmmshare/sdk/lib64/`). Without a C compiler the package installs
  without them, and `vmmshare prefix` says so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
CLIB = Path("src/vmmshare/clib")
LIBRARIES = ("libascendcl.so", "libacl_rt.so")


def c_library_command(out: Path) -> list[str]:
    """The compiler line that builds the C library at `out`, named by its file name (its SONAME, unversioned)."""
    compiler = ["cc"]  # $CC, else the compiler Python was built with, where this machine has it, else cc
    for candidate in (os.environ.get("CC"), sysconfig.get_config_var("CC")):
        words = (candidate or "").split()
        if words and shutil.which(words[0]):
            compiler = words
            break
    sources = sorted(str(HERE / CLIB / name) for name in os.listdir(HERE / CLIB) if name.endswith(".c"))
    flags = ["-std=c11", "-D_GNU_SOURCE", "-O2", "-g", "-fPIC", "-shared", "-fvisibility=hidden", "-pthread",
             "-Wall", "-Wextra", f"-I{HERE / 'src/vmmshare/sdk/include'}", f'-DVS_PYTHON="{sys.executable}"',
             f"-Wl,--version-script={HERE / CLIB / 'exports.map'}", f"-Wl,-soname,{out.name}", "-Wl,--no-undefined"]
    # (no -Werror here: a new compiler's new warning must not leave an install without its library; the tests
    # build the same sources with -Werror)
    return [*compiler, *flags, *sources, "-ldl", "-o", str(out)]


class BuildWithCLibrary(build_ext):
    """build_ext, then the C library into the package's sdk/lib64 (in place for an editable install)."""

    def run(self) -> None:
        super().run()
        root = HERE / "src" if self.inplace else Path(self.build_lib)
        lib64 = root / "vmmshare" / "sdk" / "lib64"
        lib64.mkdir(parents=True, exist_ok=True)
        try:
            for name in LIBRARIES:  # the same calls under both names, each its own SONAME
                subprocess.run(c_library_command(lib64 / name), check=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            print(f"warning: the C library was not built ({exc}); `vmmshare prefix` will say so", file=sys.stderr)


setup(
    ext_modules=[Extension("vmmshare.sockets._fastpackets",
                           ["src/vmmshare/sockets/_fastpackets.c", "src/vmmshare/sockets/_fastfloor.c"],
                           extra_compile_args=["-O2", "-Wall", "-Wextra"], optional=True)],
    cmdclass={"build_ext": BuildWithCLibrary},
)
