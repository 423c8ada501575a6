"""Unit tests for configuration helpers (common/config.py): sizes, addresses, defaults."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tensorbroker.common import config
from tensorbroker.common.config import (
    ADDRESS_ENV,
    IPC_PATH_MAX,
    check_address,
    default_address,
    default_capacity,
    format_size,
    parse_size,
    shm_bytes_available,
)
from tensorbroker.common.errors import BrokerError

# -- parse_size -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("1073741824", 2**30),
        ("512", 512),
        ("512B", 512),
        ("1k", 1000),
        ("1KB", 1000),
        ("2MB", 2 * 10**6),
        ("512MB", 512 * 10**6),
        ("2GB", 2 * 10**9),
        ("1tb", 10**12),
        ("1KiB", 1024),
        ("512MiB", 512 * 2**20),
        ("4GiB", 4 * 2**30),
        ("4gib", 4 * 2**30),
        ("1TiB", 2**40),
        (" 4 GiB ", 4 * 2**30),
        ("1.5KiB", 1536),
        ("0.5GiB", 2**29),
        ("2.5GB", 2_500_000_000),
        ("1.25MiB", 1310720),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(("text", "expected"), [("4.1GB", 4_100_000_000), ("1.005KB", 1005)])
def test_parse_size_decimals_are_exact(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_parse_size_accepts_ints() -> None:
    assert parse_size(0) == 0
    assert parse_size(123456789) == 123456789
    with pytest.raises(ValueError, match="negative"):
        parse_size(-1)


@pytest.mark.parametrize(
    "text", ["", "GiB", "-1GiB", "4 GiBs", "4XB", "1e9", "four", "4 G iB", "1,000", "0x10", ".5GiB"]
)
def test_parse_size_refuses_bad_strings(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_size(text)
    message = str(info.value)
    assert repr(text) in message  # names what it could not read
    assert "GiB" in message and "MiB" in message  # and says what it accepts


# -- format_size ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (3 * 2**20, "3.0 MiB"),
        (256 * 2**20, "256.0 MiB"),
        (int(1.5 * 2**30), "1.5 GiB"),
        (2**40, "1.0 TiB"),
        (5 * 2**50, "5120.0 TiB"),
    ],
)
def test_format_size(n: int, expected: str) -> None:
    assert format_size(n) == expected


def test_format_size_reads_back_through_parse_size() -> None:
    for n in (2**20, 3 * 2**30, 2**40):
        assert parse_size(format_size(n).replace(" ", "")) == n


# -- addresses ------------------------------------------------------------------------------


def test_check_address_accepts_ipc_and_tcp() -> None:
    assert check_address("ipc:///tmp/tb.sock") == "ipc:///tmp/tb.sock"
    assert check_address("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5555"
    assert check_address("tcp://localhost:1") == "tcp://localhost:1"
    longest = "/" + "p" * (IPC_PATH_MAX - 1)
    assert check_address(f"ipc://{longest}") == f"ipc://{longest}"


def test_check_address_refuses_too_long_ipc_paths() -> None:
    path = "/" + "p" * IPC_PATH_MAX  # one byte over
    with pytest.raises(ValueError, match=f"{IPC_PATH_MAX + 1} bytes.*limit of {IPC_PATH_MAX}"):
        check_address(f"ipc://{path}")
    # the limit is in bytes, not characters
    with pytest.raises(ValueError, match="limit"):
        check_address("ipc:///" + "\u00e9" * 60)


@pytest.mark.parametrize(
    "address",
    ["ipc://", "tcp://127.0.0.1", "inproc://x", "udp://127.0.0.1:5", "/tmp/tb.sock", "", "ipc:/x"],
)
def test_check_address_refuses_other_forms(address: str) -> None:
    with pytest.raises(ValueError, match="address"):
        check_address(address)


def test_default_address_honours_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADDRESS_ENV, "tcp://127.0.0.1:7777")
    assert default_address() == "tcp://127.0.0.1:7777"


def test_default_address_is_a_private_ipc_socket(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(ADDRESS_ENV, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    address = default_address()
    assert address.startswith("ipc://")
    path = Path(address[len("ipc://") :])
    assert path.parent == tmp_path / "tensorbroker"
    assert check_address(address) == address
    info = path.parent.stat()
    assert stat.S_IMODE(info.st_mode) == 0o700
    assert info.st_uid == os.getuid()
    # stable: asking again gives the same socket
    assert default_address() == address


def test_default_address_tightens_a_loose_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(ADDRESS_ENV, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "tensorbroker").mkdir(mode=0o755)
    os.chmod(tmp_path / "tensorbroker", 0o777)
    default_address()  # no one else, and the group (serve --group) only into it
    assert stat.S_IMODE((tmp_path / "tensorbroker").stat().st_mode) == 0o750


def test_empty_address_variable_means_the_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(ADDRESS_ENV, "")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_address() == f"ipc://{tmp_path / 'tensorbroker' / 'broker.sock'}"


def test_default_address_without_a_runtime_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(ADDRESS_ENV, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "missing"))
    monkeypatch.setattr(config.tempfile, "gettempdir", lambda: str(tmp_path))
    address = default_address()
    directory = tmp_path / f"tensorbroker-{os.getuid()}"
    assert address == f"ipc://{directory / 'broker.sock'}"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700


# -- capacity -------------------------------------------------------------------------------


def test_default_capacity_fits_in_shared_memory() -> None:
    before = shm_bytes_available()
    capacity = default_capacity()
    after = shm_bytes_available()  # others may use /dev/shm meanwhile
    assert 0 < capacity <= 0.9 * max(before, after)
    assert capacity <= 0.3 * config.total_memory()


def test_default_capacity_follows_the_shm_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "shm_bytes_available", lambda shm_dir=config.SHM_DIR: 10 * 2**20)
    assert default_capacity() == int(10 * 2**20 * 0.9)


def test_a_planted_symlink_is_refused_and_its_target_left_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(ADDRESS_ENV, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o755)
    os.chmod(target, 0o755)
    (tmp_path / "tensorbroker").symlink_to(target)
    with pytest.raises(BrokerError, match="symbolic link.*TENSORBROKER_ADDRESS"):
        default_address()
    assert stat.S_IMODE(target.stat().st_mode) == 0o755  # not made ours


@pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another user takes root")
def test_a_folder_of_another_user_is_refused_with_what_to_do(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(ADDRESS_ENV, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "tensorbroker").mkdir(mode=0o777)
    os.chown(tmp_path / "tensorbroker", 65534, 65534)
    with pytest.raises(BrokerError, match="belongs to uid 65534.*--address"):
        default_address()


def test_the_cli_says_so_without_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "tensorbroker").symlink_to(tmp_path)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    env.pop(ADDRESS_ENV, None)
    done = subprocess.run(
        [sys.executable, "-m", "tensorbroker", "ping"], env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "symbolic link" in done.stderr and "Traceback" not in done.stderr, done.stderr
