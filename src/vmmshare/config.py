"""Configuration read from the environment (SPEC §7): the one module that reads it.

Each variable has one reader; a value it cannot use raises `ConfigError`, whose message names the variable. An entry
point (the process's runtime, the broker, a command) reads them once, into a `Config`, and passes it down; nothing
reads them when it is imported, so a test can change them, and a bad one is refused where it is read.
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import os
import pwd
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
BACKENDS = ("host", "cuda", "auto")
MAX_SOCKET_PATH = 107  # bytes: sun_path holds 108, with the terminating NUL
CLIENT_SPIN_US = 100  # default of VMMSHARE_SPIN_US
BROKER_SPIN_US = 200  # default of VMMSHARE_BROKER_SPIN_US
VISIBLE_DEVICES = "ASCEND_RT_VISIBLE_DEVICES"  # the runtime's own variable: which devices this process sees
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


class ConfigError(ValueError):
    """A VMMSHARE_* variable (or option) whose value cannot be used; the message names it, `.name` holds it."""

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.name = name


def parse_size(text: str) -> int:
    """Parse a byte count such as ``65536``, ``64G`` or ``512MiB``; raise ValueError otherwise."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (use bytes, or a number with K, M, G or T)")
    return int(m.group(1)) * _SUFFIX[m.group(2).upper()]


def _raw(name: str) -> str | None:
    """The variable's value, or None when it is unset or blank."""
    raw = os.environ.get(name)
    return None if raw is None or raw.strip() == "" else raw


def _env_int(name: str, default: int, lo: int, hi: int) -> int:
    raw = _raw(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer", name) from None
    if not lo <= value <= hi:
        raise ConfigError(f"{name}={raw!r} is out of range [{lo}, {hi}]", name)
    return value


def devices() -> int:
    """$VMMSHARE_DEVICES: how many devices, 1 to 1024 (default 8)."""
    return _env_int("VMMSHARE_DEVICES", 8, 1, 1024)


def device_memory() -> int:
    """$VMMSHARE_DEVICE_MEMORY: each device's capacity in bytes (default 64G)."""
    raw = _raw("VMMSHARE_DEVICE_MEMORY") or "64G"
    try:
        value = parse_size(raw)
    except ValueError:
        raise ConfigError(f"VMMSHARE_DEVICE_MEMORY={raw!r} is not a size (use bytes, or a number with K, M, G "
                          "or T, such as 64G)", "VMMSHARE_DEVICE_MEMORY") from None
    if value <= 0:
        raise ConfigError(f"VMMSHARE_DEVICE_MEMORY={raw!r} must be positive", "VMMSHARE_DEVICE_MEMORY")
    return value


def backend() -> str:
    """$VMMSHARE_BACKEND: host, cuda or auto (default host)."""
    raw = os.environ.get("VMMSHARE_BACKEND", "")
    value = raw.strip().lower() or "host"
    if value not in BACKENDS:
        raise ConfigError(f"VMMSHARE_BACKEND={raw!r}: use 'host', 'cuda' or 'auto'", "VMMSHARE_BACKEND")
    return value


def broker_idle() -> float:
    """$VMMSHARE_BROKER_IDLE: seconds an auto-started broker lingers with nothing to do (default 60)."""
    raw = _raw("VMMSHARE_BROKER_IDLE") or "60"
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if math.isnan(value):
        raise ConfigError(f"VMMSHARE_BROKER_IDLE={raw!r} is not a number of seconds", "VMMSHARE_BROKER_IDLE")
    return max(0.0, value)


def _flag(name: str) -> bool:
    """$name as a yes/no setting (default off); any other value is a ConfigError naming it."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value not in _TRUE + _FALSE:
        raise ConfigError(f"{name}={raw!r}: use 1, true, yes or on; or 0, false, no or off", name)
    return value in _TRUE


def prepopulate() -> bool:
    """$VMMSHARE_PREPOPULATE: fault every mapping in when it is made (default off)."""
    return _flag("VMMSHARE_PREPOPULATE")


def pure_python() -> bool:
    """$VMMSHARE_PURE_PYTHON: packets through pure Python even where the compiled fast path is built (default off)."""
    return _flag("VMMSHARE_PURE_PYTHON")


def log_level() -> str:
    """$VMMSHARE_LOG: the broker's log level (default INFO)."""
    raw = os.environ.get("VMMSHARE_LOG", "")
    value = raw.strip().upper() or "INFO"
    if value not in LOG_LEVELS:
        raise ConfigError(f"VMMSHARE_LOG={raw!r} is not a log level: use one of {', '.join(LOG_LEVELS)}",
                          "VMMSHARE_LOG")
    return value


def visible_devices() -> str | None:
    """$ASCEND_RT_VISIBLE_DEVICES as given (None when unset); the runtime's device table parses and checks it."""
    return os.environ.get(VISIBLE_DEVICES)


def socket_activated() -> bool:
    """Whether systemd passed this very process its listening socket ($LISTEN_PID names it)."""
    return os.environ.get("LISTEN_PID") == str(os.getpid())


def spin_seconds(name: str, default_us: float) -> float:
    """A polling window given in microseconds by the variable `name` (VMMSHARE_SPIN_US, VMMSHARE_BROKER_SPIN_US)."""
    raw = _raw(name)
    if raw is None:
        return default_us / 1e6
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{name}={raw!r} is not a number of microseconds (0 or more)", name)
    return value / 1e6


# ---------------------------------------------------------------- the broker's limits per user (docs/security.md)

QUOTA_DEFAULTS = {  # variable -> default: sized so that a workload of thousands of exports fits
    "VMMSHARE_QUOTA_CONNECTIONS": 1024,  # connections open at once
    "VMMSHARE_QUOTA_EXPORTS": 16384,  # live exports (each holds one file descriptor in the broker)
    "VMMSHARE_QUOTA_HOLDS": 65536,  # allocations and imports held at once
    "VMMSHARE_QUOTA_TRUSTLIST": 262144,  # trustlist entries over all live exports
}


@dataclass(frozen=True)
class Quotas:
    """What the processes of one user may hold in the broker at once; `memory` is per device (None: a device's
    whole capacity)."""

    connections: int = QUOTA_DEFAULTS["VMMSHARE_QUOTA_CONNECTIONS"]
    exports: int = QUOTA_DEFAULTS["VMMSHARE_QUOTA_EXPORTS"]
    holds: int = QUOTA_DEFAULTS["VMMSHARE_QUOTA_HOLDS"]
    trustlist: int = QUOTA_DEFAULTS["VMMSHARE_QUOTA_TRUSTLIST"]
    memory: int | None = None


def _quota(name: str) -> int:
    raw = _raw(name)
    if raw is None:
        return QUOTA_DEFAULTS[name]
    try:
        value = int(raw.strip())
    except ValueError:
        value = 0
    if not 1 <= value <= 1 << 31:
        raise ConfigError(f"{name}={raw!r} is not a count from 1 to {1 << 31}", name)
    return value


def quota_memory() -> int | None:
    """$VMMSHARE_QUOTA_MEMORY: device memory one user may charge on each device (default: the whole device)."""
    raw = _raw("VMMSHARE_QUOTA_MEMORY")
    if raw is None:
        return None
    try:
        value = parse_size(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigError(f"VMMSHARE_QUOTA_MEMORY={raw!r} is not a positive size (such as 16G)",
                          "VMMSHARE_QUOTA_MEMORY")
    return value


def quotas() -> Quotas:
    """The broker's per-user limits, from the VMMSHARE_QUOTA_* variables."""
    return Quotas(_quota("VMMSHARE_QUOTA_CONNECTIONS"), _quota("VMMSHARE_QUOTA_EXPORTS"),
                  _quota("VMMSHARE_QUOTA_HOLDS"), _quota("VMMSHARE_QUOTA_TRUSTLIST"), quota_memory())


def broker_user() -> int | None:
    """$VMMSHARE_BROKER_USER: the account (name or uid) a shared broker runs as, which clients trust besides
    themselves and root (default: none)."""
    raw = _raw("VMMSHARE_BROKER_USER")
    if raw is None:
        return None
    text = raw.strip()
    if text.isdigit():
        return int(text)
    try:
        return pwd.getpwnam(text).pw_uid
    except KeyError:
        raise ConfigError(f"VMMSHARE_BROKER_USER={raw!r} is neither a uid nor a user of this machine",
                          "VMMSHARE_BROKER_USER") from None


def trusted_uids() -> frozenset[int]:
    """Whose broker a client may talk to, and who may own the socket's folder: this user, root, and
    VMMSHARE_BROKER_USER."""
    extra = broker_user()
    return frozenset({os.getuid(), 0} | ({extra} if extra is not None else set()))


def check_socket_path(path: Path | str, name: str) -> Path:
    """`path` if a Unix socket can be bound there (not empty, at most 107 bytes); `name` is the option or variable
    it came from, for the message."""
    text = os.fspath(path)
    said = f"{name} {text!r}" if name.startswith("-") else f"{name}={text!r}"
    if text == "":
        raise ConfigError(f"{said}: the socket path is empty", name)
    size = len(os.fsencode(text))
    if size > MAX_SOCKET_PATH:
        raise ConfigError(f"{said} is {size} bytes long: a Unix socket path holds at most {MAX_SOCKET_PATH} bytes; "
                          "choose a shorter one", name)
    return Path(text)


def socket_path() -> Path:
    """The broker socket: $VMMSHARE_SOCKET, else $XDG_RUNTIME_DIR/vmmshare/, else /tmp/vmmshare-<uid>/."""
    explicit = os.environ.get("VMMSHARE_SOCKET")
    if explicit:
        return check_socket_path(explicit, "VMMSHARE_SOCKET")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        path = Path(xdg) / "vmmshare" / "broker.sock"
        if len(os.fsencode(str(path))) > MAX_SOCKET_PATH:
            raise ConfigError(f"XDG_RUNTIME_DIR={xdg!r} makes the socket path {str(path)!r}, longer than "
                              f"{MAX_SOCKET_PATH} bytes: set VMMSHARE_SOCKET to a shorter path", "XDG_RUNTIME_DIR")
        return path
    return Path(f"/tmp/vmmshare-{os.getuid()}") / "broker.sock"


def server_id() -> int:
    """This server's 32-bit id: $VMMSHARE_SERVER_ID, else derived from /etc/machine-id."""
    raw = _raw("VMMSHARE_SERVER_ID")
    if raw is not None:
        try:
            value = int(raw, 0)
        except ValueError:
            raise ConfigError(f"VMMSHARE_SERVER_ID={raw!r} is not an integer (such as 42 or 0x2a)",
                              "VMMSHARE_SERVER_ID") from None
        if not 0 <= value < 1 << 32:
            raise ConfigError(f"VMMSHARE_SERVER_ID={raw!r} must fit in 32 bits", "VMMSHARE_SERVER_ID")
        return value
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text:
            return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")
    return int.from_bytes(hashlib.sha256(os.uname().nodename.encode()).digest()[:4], "little")


# ---------------------------------------------------------------- the cross-server transport (SPEC §7, §8)

FABRIC_MODES = ("off", "tcp", "rdma")
FABRIC_PORT = 17017


def fabric() -> str:
    """$VMMSHARE_FABRIC: off, or the engine's protocol, tcp or rdma (default off)."""
    raw = os.environ.get("VMMSHARE_FABRIC", "")
    value = raw.strip().lower() or "off"
    if value not in FABRIC_MODES:
        raise ConfigError(f"VMMSHARE_FABRIC={raw!r}: use 'off', 'tcp' or 'rdma'", "VMMSHARE_FABRIC")
    return value


def fabric_addr() -> str:
    """$VMMSHARE_FABRIC_ADDR: the IP address this node is reached at on the fabric network ("" when unset)."""
    raw = _raw("VMMSHARE_FABRIC_ADDR")
    if raw is None:
        return ""
    try:
        address = ipaddress.ip_address(raw.strip())
    except ValueError:
        raise ConfigError(f"VMMSHARE_FABRIC_ADDR={raw!r} is not an IP address (such as 10.0.0.1): the engine "
                          "advertises it to peers, so it must be one they can reach", "VMMSHARE_FABRIC_ADDR") from None
    if address.is_unspecified or address.is_multicast:
        raise ConfigError(f"VMMSHARE_FABRIC_ADDR={raw!r} is not an address peers can reach: give this node's own "
                          "address on the fabric network", "VMMSHARE_FABRIC_ADDR")
    return str(address)


def fabric_port() -> int:
    """$VMMSHARE_FABRIC_PORT: the broker's cross-server control port (default 17017)."""
    return _env_int("VMMSHARE_FABRIC_PORT", FABRIC_PORT, 1, 65535)


def cluster_key_file() -> Path | None:
    """$VMMSHARE_CLUSTER_KEY_FILE: the file holding the cluster's shared secret (None when unset)."""
    raw = _raw("VMMSHARE_CLUSTER_KEY_FILE")
    return None if raw is None else Path(raw)


def fabric_timeout() -> float:
    """$VMMSHARE_FABRIC_TIMEOUT: seconds a cross-server call may take before it fails (default 5)."""
    raw = _raw("VMMSHARE_FABRIC_TIMEOUT") or "5"
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0.2 <= value <= 3600:
        raise ConfigError(f"VMMSHARE_FABRIC_TIMEOUT={raw!r} is not a number of seconds in [0.2, 3600]",
                          "VMMSHARE_FABRIC_TIMEOUT")
    return value


def fabric_problem() -> None:
    """Raise ConfigError when the fabric is on without what it needs (its address and the cluster key file)."""
    if fabric() == "off":
        return
    if not fabric_addr():
        raise ConfigError("VMMSHARE_FABRIC is on but VMMSHARE_FABRIC_ADDR is not set: give this node's address on "
                          "the fabric network", "VMMSHARE_FABRIC_ADDR")
    if cluster_key_file() is None:
        raise ConfigError("VMMSHARE_FABRIC is on but VMMSHARE_CLUSTER_KEY_FILE is not set: name a file holding the "
                          "cluster's shared secret (32 or more random bytes, mode 0600)", "VMMSHARE_CLUSTER_KEY_FILE")


_READERS: tuple[Callable[[], object], ...] = (
    devices, device_memory, socket_path, server_id, backend, broker_idle, prepopulate, log_level, pure_python,
    lambda: spin_seconds("VMMSHARE_SPIN_US", CLIENT_SPIN_US),
    lambda: spin_seconds("VMMSHARE_BROKER_SPIN_US", BROKER_SPIN_US),
    fabric, fabric_addr, fabric_port, fabric_timeout, fabric_problem,
    *(lambda name=name: _quota(name) for name in QUOTA_DEFAULTS), quota_memory, broker_user,
)


def problems() -> list[ConfigError]:
    """Every VMMSHARE_* variable that cannot be used, each as the error that names it (empty: all are usable)."""
    found = []
    for read in _READERS:
        try:
            read()
        except ConfigError as exc:
            found.append(exc)
    return found


@dataclass(frozen=True)
class Config:
    """One reading of the VMMSHARE_* variables, made by an entry point and passed down."""

    devices: int
    device_memory: int
    socket_path: Path
    server_id: int
    backend: str
    broker_idle: float
    prepopulate: bool
    log_level: str = "INFO"
    pure_python: bool = False  # packets through pure Python, not the compiled fast path (VMMSHARE_PURE_PYTHON)
    fabric: str = "off"  # the cross-server transport: off, tcp or rdma
    fabric_addr: str = ""
    fabric_port: int = FABRIC_PORT
    cluster_key_file: Path | None = None
    fabric_timeout: float = 5.0
    visible_devices: str | None = None  # $ASCEND_RT_VISIBLE_DEVICES, unparsed
    # a client's own setting, read only for a client, and the broker's own, read only for a broker: a bad value of
    # one side's variable leaves the other side running
    spin: float = CLIENT_SPIN_US / 1e6  # seconds a client may poll for the broker's reply before it sleeps
    broker_spin: float = BROKER_SPIN_US / 1e6  # seconds the broker may poll for more requests before it sleeps
    quotas: Quotas = Quotas()

    @classmethod
    def from_env(cls, broker: bool = False) -> Config:
        """Read the variables (a client's, or for a `broker` the broker's); the first that cannot be used raises
        `ConfigError` (a ValueError) naming it."""
        config = cls(
            devices=devices(),
            device_memory=device_memory(),
            socket_path=socket_path(),
            server_id=server_id(),
            backend=backend(),
            broker_idle=broker_idle(),
            prepopulate=prepopulate(),
            log_level=log_level(),
            pure_python=pure_python(),
            fabric=fabric(),
            fabric_addr=fabric_addr(),
            fabric_port=fabric_port(),
            cluster_key_file=cluster_key_file(),
            fabric_timeout=fabric_timeout(),
            visible_devices=visible_devices(),
        )
        if broker:
            return replace(config, broker_spin=spin_seconds("VMMSHARE_BROKER_SPIN_US", BROKER_SPIN_US),
                           quotas=quotas())
        return replace(config, spin=spin_seconds("VMMSHARE_SPIN_US", CLIENT_SPIN_US))
