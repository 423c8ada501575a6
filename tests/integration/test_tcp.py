"""tcp:// (issue 14, item 8): refused without keys unless --insecure-tcp on loopback; with
CurveZMQ keys (`tensorbroker keys`, serve --curve-secret) end to end, a client without the
broker's key or with a wrong one refused with a clear error, and --curve-clients letting in
only the clients it lists."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
from support import free_tcp_address

import tensorbroker as tb
from tensorbroker.common.curve import CLIENT_KEY_ENV, SERVER_KEY_ENV


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    """`tensorbroker serve` that is expected to refuse to start."""
    return subprocess.run(
        [sys.executable, "-m", "tensorbroker", "serve", "--memory", "16MiB", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def make_keys(folder: str, name: str) -> tuple[str, str]:
    run = subprocess.run(
        [sys.executable, "-m", "tensorbroker", "keys", "--out", folder, "--name", name],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert "--curve-secret" in run.stdout
    return os.path.join(folder, f"{name}.key"), os.path.join(folder, f"{name}.key_secret")


@pytest.fixture
def keys(tmp_path: object) -> Iterator[str]:
    folder = os.path.join(str(tmp_path), "keys")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_tcp_without_keys_is_refused_unless_insecure_and_on_loopback() -> None:
    address = free_tcp_address()
    refused = serve("--address", address)
    assert refused.returncode == 2
    assert "without keys" in refused.stderr and "tensorbroker keys" in refused.stderr
    assert "--insecure-tcp" in refused.stderr and "Traceback" not in refused.stderr

    port = address.rsplit(":", 1)[1]
    wide = serve("--address", f"tcp://0.0.0.0:{port}", "--insecure-tcp")
    assert wide.returncode == 2 and "loopback" in wide.stderr, wide.stderr

    with tb.start_broker("16MiB", address, options=["--insecure-tcp"]) as b:
        with tb.connect(b.address) as c:
            c.put("k", np.arange(3))
            assert (c.get("k").numpy() == np.arange(3)).all()
        with open(b.log_path) as log:
            assert "WITHOUT KEYS" in log.read()


def test_curve_end_to_end_and_a_client_without_the_right_key_is_refused(keys: str) -> None:
    public, secret = make_keys(keys, "broker")
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    with tb.start_broker("16MiB", free_tcp_address(), options=["--curve-secret", secret]) as b:
        with tb.connect(b.address, server_key=public) as c:
            c.put("k", np.arange(5))
            reader = subprocess.run(  # another process, the key from the environment
                [sys.executable, "-c", READER, b.address],
                env={**os.environ, SERVER_KEY_ENV: public},
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert reader.returncode == 0 and reader.stdout == "[0 1 2 3 4]\n", reader.stderr

        with pytest.raises(tb.BrokerUnavailable, match="server_key"):
            tb.connect(b.address, timeout=1.0)  # no key
        other_public, _ = make_keys(keys, "other")
        with pytest.raises(tb.BrokerUnavailable, match="TENSORBROKER_SERVER_KEY"):
            tb.connect(b.address, timeout=1.0, server_key=other_public)  # a wrong key
        with open(public) as f:
            z85 = next(line for line in f if "public-key" in line).split('"')[1]
        with tb.connect(b.address, server_key=z85) as c:  # the key itself, not its file
            assert c.exists("k")


READER = """
import sys, numpy as np, tensorbroker as tb
with tb.connect(sys.argv[1]) as c:
    print(c.get("k").numpy())
"""


def test_curve_clients_lets_in_only_the_clients_listed(
    keys: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    public, secret = make_keys(keys, "broker")
    allowed = os.path.join(keys, "clients")
    os.makedirs(allowed)
    _, alice = make_keys(keys, "alice")
    _, mallory = make_keys(keys, "mallory")
    shutil.copy(os.path.join(keys, "alice.key"), allowed)
    options = ["--curve-secret", secret, "--curve-clients", allowed]
    with tb.start_broker("16MiB", free_tcp_address(), options=options) as b:
        monkeypatch.setenv(CLIENT_KEY_ENV, alice)
        with tb.connect(b.address, server_key=public) as c:
            c.put("k", np.arange(2))
        monkeypatch.setenv(CLIENT_KEY_ENV, mallory)
        with pytest.raises(tb.BrokerUnavailable, match="TENSORBROKER_CLIENT_KEY"):
            tb.connect(b.address, server_key=public, timeout=1.0)
        monkeypatch.delenv(CLIENT_KEY_ENV)
        with pytest.raises(tb.BrokerUnavailable):  # a pair of its own, not listed
            tb.connect(b.address, server_key=public, timeout=1.0)
