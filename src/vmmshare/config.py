"""Configuration read from the environment (SPEC §7), parsed once per call so tests can change it."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Parse a byte count such as ``65536``, ``64G`` or ``512MiB``; raise ValueError otherwise."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (use bytes, or a number with K, M, G or T)")
    return int(m.group(1)) * _SUFFIX[m.group(2).upper()]


def _env_int(name: str, default: int, lo: int, hi: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value} is out of range [{lo}, {hi}]")
    return value


@dataclass(frozen=True)
class Config:
    """One reading of the VMMSHARE_* variables."""

    devices: int
    device_memory: int
    socket_path: Path
    server_id: int
    backend: str
    broker_idle: float
    prepopulate: bool

    @classmethod
    def from_env(cls) -> Config:
        mem_raw = os.environ.get("VMMSHARE_DEVICE_MEMORY", "64G")
        memory = parse_size(mem_raw)
        if memory <= 0:
            raise ValueError(f"VMMSHARE_DEVICE_MEMORY={mem_raw!r} must be positive")
        backend = os.environ.get("VMMSHARE_BACKEND", "host").strip().lower() or "host"
        if backend not in ("host", "cuda", "auto"):
            raise ValueError(f"VMMSHARE_BACKEND={backend!r}: use 'host', 'cuda' or 'auto'")
        idle_raw = os.environ.get("VMMSHARE_BROKER_IDLE", "60")
        try:
            idle = float(idle_raw)
        except ValueError:
            raise ValueError(f"VMMSHARE_BROKER_IDLE={idle_raw!r} is not a number of seconds") from None
        return cls(
            devices=_env_int("VMMSHARE_DEVICES", 8, 1, 1024),
            device_memory=memory,
            socket_path=socket_path(),
            server_id=server_id(),
            backend=backend,
            broker_idle=max(0.0, idle),
            prepopulate=os.environ.get("VMMSHARE_PREPOPULATE", "0").strip().lower() in ("1", "true", "yes"),
        )


def socket_path() -> Path:
    """The broker socket: $VMMSHARE_SOCKET, else $XDG_RUNTIME_DIR/vmmshare/, else /tmp/vmmshare-<uid>/."""
    explicit = os.environ.get("VMMSHARE_SOCKET")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "vmmshare" / "broker.sock"
    return Path(f"/tmp/vmmshare-{os.getuid()}") / "broker.sock"


def server_id() -> int:
    """This server's 32-bit id: $VMMSHARE_SERVER_ID, else derived from /etc/machine-id."""
    raw = os.environ.get("VMMSHARE_SERVER_ID")
    if raw:
        value = int(raw, 0)
        if not 0 <= value < 1 << 32:
            raise ValueError(f"VMMSHARE_SERVER_ID={raw!r} must fit in 32 bits")
        return value
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text:
            return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")
    return int.from_bytes(hashlib.sha256(os.uname().nodename.encode()).digest()[:4], "little")
