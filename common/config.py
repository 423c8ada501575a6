"""Configuration: addresses, size strings, defaults. Read when called, never at import time."""

from __future__ import annotations

import contextlib
import grp
import os
import re
import tempfile

from .errors import BrokerError

ADDRESS_ENV = "TENSORBROKER_ADDRESS"
SHM_DIR = "/dev/shm"
SOCKET_NAME = "broker.sock"
IPC_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux
LANE_SUFFIX = ".lane"

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
# Shared-memory segments are named tb-<id of the broker state they belong to>-<random hex>.
SEGMENT_NAME = re.compile(r"tb-([0-9a-f]+)-[0-9a-f]+")


def round_up(n: int, multiple: int) -> int:
    """The least multiple of `multiple` that is >= n."""
    return -(-n // multiple) * multiple


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """'4GiB' -> 4294967296, '512MB' -> 512000000, 1024 -> 1024. ValueError says what it accepts."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative, got {text}")
        return text
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(
            f"cannot read size {text!r}: use a number with an optional unit, "
            "such as 1073741824, 512MiB, 4GiB or 2GB"
        )
    whole, _, decimals = match.group(1).partition(".")  # exact: '4.1GB' is 4100000000
    return int(int(whole + decimals) * _UNITS[unit] // 10 ** len(decimals))


def parse_cuda_memory(text: str | None) -> dict[int, int] | None:
    """--cuda-memory: None or 'auto' -> None (every GPU, half of its free memory); 'off' ->
    {} (host memory only); '0:8GiB,1:8GiB' -> {0: 8 GiB, 1: 8 GiB}; a bare index ('0,1')
    serves that GPU at the default share. ValueError says what it accepts."""
    if text is None or text.strip().lower() in ("", "auto"):
        return None
    if text.strip().lower() in ("off", "none", "0b"):
        return {}
    spec: dict[int, int] = {}
    for part in text.split(","):
        index, _, size = part.strip().partition(":")
        if not index.strip().isdigit():
            raise ValueError(
                f"cannot read --cuda-memory {text!r}: use DEVICE:SIZE pairs such as "
                "0:8GiB,1:8GiB, bare device indices (0,1), 'auto' or 'off'"
            )
        if int(index) in spec:
            raise ValueError(f"--cuda-memory {text!r} names device {int(index)} twice")
        spec[int(index)] = parse_size(size) if size.strip() else 0
        if size.strip() and spec[int(index)] < 2 * 2**20:
            raise ValueError(f"--cuda-memory {text!r}: give device {int(index)} at least 2MiB")
    return spec


def format_size(n: int | float) -> str:
    """1536 -> '1.5 KiB'; exact small sizes stay in bytes."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def runtime_dir() -> str:
    """A per-user directory for the default socket: $XDG_RUNTIME_DIR/tensorbroker, else
    /tmp/tensorbroker-UID. Created with mode 0700 (a broker serving a group opens it to
    that group, read-only: 0750) and checked without following links: a
    symbolic link, or a directory someone else owns, is refused (BrokerError, saying what
    to do), since /tmp lets anyone plant either."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = (
        os.path.join(base, "tensorbroker")
        if base and os.path.isdir(base)
        else os.path.join(tempfile.gettempdir(), f"tensorbroker-{os.getuid()}")
    )
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    fix = f"remove it, or set ${ADDRESS_ENV} (or pass --address) to a socket in a folder of yours"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        kind = "a symbolic link" if os.path.islink(path) else f"not a usable folder ({exc})"
        raise BrokerError(f"{path} is {kind}: {fix}") from None
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid():
            raise BrokerError(f"{path} belongs to uid {info.st_uid}, not to you: {fix}")
        if info.st_mode & 0o027:  # a group may be let in, read-only (serve --group)
            os.fchmod(fd, info.st_mode & 0o750)
    finally:
        os.close(fd)
    return path


def group_id(name: str) -> int:
    """The id of the group `name` (or a number); BrokerError if there is none."""
    try:
        return int(name) if name.isdigit() else grp.getgrnam(name).gr_gid
    except KeyError:
        raise BrokerError(
            f"no group {name!r} on this host: create it (groupadd), or name another"
        ) from None


def default_address() -> str:
    """$TENSORBROKER_ADDRESS, else the per-user ipc socket."""
    return os.environ.get(ADDRESS_ENV) or f"ipc://{os.path.join(runtime_dir(), SOCKET_NAME)}"


def default_state_dir(address: str) -> str:
    """Where a broker at `address` keeps its state unless told (--state-dir): next to its
    socket (broker.sock -> broker.state), or for a tcp address in the runtime directory."""
    path = ipc_path(address)
    if path is not None:
        return (path[: -len(".sock")] if path.endswith(".sock") else path) + ".state"
    where = address[len("tcp://") :].replace(":", "-").replace("/", "-")
    return os.path.join(runtime_dir(), f"tcp-{where}.state")


def ipc_path(address: str) -> str | None:
    """The socket file of an ipc:// address; None for any other address."""
    return address[len("ipc://") :] if address.startswith("ipc://") else None


def lane_path(address: str) -> str | None:
    """The lane beside an ipc:// address (Note [lanes] in server/sessions/lanes.py); None for any
    other address, or where the path would be too long for a Unix socket."""
    path = ipc_path(address)
    if path is None or len(path.encode()) + len(LANE_SUFFIX) > IPC_PATH_MAX:
        return None
    return path + LANE_SUFFIX


def check_address(address: str) -> str:
    """Accept ipc://PATH and tcp://HOST:PORT; ValueError says what is wrong."""
    path = ipc_path(address)
    if path is not None:
        if not path:
            raise ValueError(f"address {address!r} has no socket path")
        if len(path.encode()) > IPC_PATH_MAX:
            raise ValueError(
                f"ipc socket path is {len(path.encode())} bytes, over the limit of {IPC_PATH_MAX}: "
                f"{path!r}; choose a shorter path"
            )
        return address
    if address.startswith("tcp://") and ":" in address[len("tcp://") :]:
        return address
    raise ValueError(
        f"unsupported address {address!r}: use ipc:///path/to/socket or tcp://127.0.0.1:PORT"
    )


def shm_bytes_available(shm_dir: str = SHM_DIR) -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def total_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_capacity(shm_dir: str = SHM_DIR) -> int:
    """30% of RAM, capped at 90% of what the shared-memory filesystem can still hold."""
    return min(int(total_memory() * 0.3), int(shm_bytes_available(shm_dir) * 0.9))
