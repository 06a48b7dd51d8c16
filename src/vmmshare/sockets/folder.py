"""The socket's folder, as the broker and its clients must find it: whoever can write in it can put a socket of
their own there, or a link where the start lock or the log should be.

- A broker serves only in a folder its own user owns that nobody else may write to; with `--multi-user` also in
  a root-owned one (others may write there only if it has the sticky bit, like /tmp). It creates the folder (and
  only that folder) when it is missing.
- A client talks only to a socket in a folder owned by itself, root or VMMSHARE_BROKER_USER (one that others may
  write to must have the sticky bit), and auto-starts a broker only in a folder of its own.
- The start lock and the log are opened without following links, and must be files of the right user.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Collection
from pathlib import Path


class FolderError(OSError):
    """A folder, lock or log file that must not be used; the message names it and its owner."""


def _lstat(folder: Path) -> os.stat_result:
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode):
        raise FolderError(f"{folder} is a symbolic link (to {os.readlink(folder)}): use the folder itself")
    if not stat.S_ISDIR(st.st_mode):
        raise FolderError(f"{folder} is not a folder")
    return st


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def check_serving_folder(folder: Path, multi_user: bool) -> None:
    """Raise FolderError unless a broker of this user may serve in `folder` (an existing folder)."""
    st = _lstat(folder)
    me = os.getuid()
    loose = st.st_mode & 0o022
    if st.st_uid == me and not loose:
        return
    if multi_user and st.st_uid == 0 and (not loose or st.st_mode & stat.S_ISVTX):
        return
    if st.st_uid != me and not (multi_user and st.st_uid == 0):
        raise FolderError(f"{folder} belongs to {_owner(st.st_uid)}, not to this broker's user ({_owner(me)}): "
                          "whoever owns it could replace the socket; use a folder of your own")
    raise FolderError(f"others can write to {folder} (mode {stat.S_IMODE(st.st_mode):04o}): they could replace the "
                      "socket; use a folder of your own (mode 0700), or a root-owned one with --multi-user")


def make_serving_folder(folder: Path, multi_user: bool) -> None:
    """Create the socket's own folder with SPEC §5's mode (never the folders above it), or check the existing one."""
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        check_serving_folder(folder, multi_user)
        return
    except FileNotFoundError:
        raise FolderError(f"{folder.parent} does not exist: the broker creates only the socket's own folder "
                          f"({folder.name}), so create its parent first") from None
    os.chmod(folder, 0o755 if multi_user else 0o700)


def check_client_folder(folder: Path, trusted: Collection[int]) -> None:
    """Raise FolderError unless a client may talk to a socket in `folder` (FileNotFoundError when it is missing)."""
    st = os.stat(folder)
    if st.st_uid not in trusted:
        raise FolderError(f"the broker's folder {folder} belongs to {_owner(st.st_uid)}, not to you, root or "
                          "VMMSHARE_BROKER_USER: a broker there is not to be trusted with your memory (remove the "
                          "folder, or set VMMSHARE_SOCKET to a path of your own)")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise FolderError(f"others can write to the broker's folder {folder} (mode {stat.S_IMODE(st.st_mode):04o}) "
                          "and could replace its socket: make it 0700, or use a folder of your own")


def check_starting_folder(folder: Path) -> None:
    """Raise FolderError unless this user may auto-start a broker in `folder`: the broker would refuse any other."""
    try:
        check_serving_folder(folder, multi_user=False)
    except FolderError as exc:
        raise FolderError(f"will not start a broker there: {exc}") from None


def open_private(path: Path, flags: int) -> int:
    """Open (creating, mode 0600) a file of this user without following a link: the start lock, the log."""
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    except OSError as exc:
        why = "it is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise FolderError(f"cannot open {path}: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FolderError(f"{path} is not a regular file")
        if st.st_uid != os.getuid():
            raise FolderError(f"{path} belongs to {_owner(st.st_uid)}, not to you: another user is squatting the "
                              "broker's folder; remove the file, or use a folder of your own")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
