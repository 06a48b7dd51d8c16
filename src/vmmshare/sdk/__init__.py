"""The CANN-like root of vmmshare's C interface: headers, libascendcl.so / libacl_rt.so, CMake and pkg-config files
and set_env.sh, laid out as the runtime's install is (what ``vmmshare prefix`` prints).

The libraries are built from `vmmshare/clib/` with the system C compiler when the package is installed; the
``<arch>-linux`` folders point at the same include/ and lib64/ (made on first use where a wheel could not ship them).
"""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent
LIBRARIES = ("libascendcl.so", "libacl_rt.so")


class SdkError(RuntimeError):
    """The root is not usable (its libraries were not built, or its layout cannot be completed)."""


def arch_folder() -> str:
    """The runtime's name for this machine's folder beside include/ and lib64/ (x86_64-linux, aarch64-linux)."""
    return f"{platform.machine()}-linux"


def library(name: str = LIBRARIES[0]) -> Path:
    """One of the built libraries (SdkError when the package was installed without a C compiler)."""
    path = ROOT / "lib64" / name
    if not path.is_file():
        raise SdkError(f"{path} was not built: install vmmshare where a C compiler (cc) is available, "
                       "for example with `pip install --force-reinstall --no-deps vmmshare`")
    return path


def root() -> Path:
    """The root, checked: both libraries built, and ``<arch>-linux/{include,lib64}`` in place."""
    for name in LIBRARIES:
        library(name)
    arch = ROOT / arch_folder()
    for part in ("include", "lib64"):
        link = arch / part
        if link.is_symlink() and link.resolve() == (ROOT / part).resolve():
            continue
        try:
            arch.mkdir(exist_ok=True)
            if link.is_symlink() or link.is_file():
                link.unlink()
            elif link.is_dir():  # a copy some packaging made of the folder: the link takes its place
                shutil.rmtree(link)
            os.symlink(os.path.join("..", part), link)
        except OSError as exc:
            raise SdkError(f"cannot complete {arch}: {exc.strerror or exc} (run `vmmshare prefix` once as the user "
                           "that installed vmmshare)") from None
    return ROOT
