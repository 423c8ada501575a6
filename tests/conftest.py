"""Fixtures shared by every test: private brokers on temporary addresses, clients that are
always closed, and a check that the suite leaves no segment, socket or broker behind."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import pytest

import tensorbroker as tb

# The host tests run JAX on the CPU, also on a machine where JAX would pick a GPU (its arrays
# would be CUDA tensors there, stored in GPU memory): in this process and in every worker it
# spawns. tests/gpu/conftest.py gives its own workers the GPU back.
if "JAX_PLATFORMS" not in os.environ:
    os.environ["JAX_PLATFORMS"] = "cpu"


def _segments() -> set[str]:
    return set(glob.glob("/dev/shm/tb-*"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="session", autouse=True)
def _leaves_nothing_behind() -> Iterator[None]:
    """After the suite: no segment made during it is left, and no broker it started runs."""
    before = _segments()
    yield
    left = _segments() - before
    assert not left, f"the test suite left shared-memory segments behind: {sorted(left)}"
    running = [pid for pid in tb.BrokerProcess.unstopped() if _alive(pid)]
    assert not running, f"the test suite left brokers running: {running}"


@pytest.fixture(scope="module")
def broker() -> Iterator[tb.BrokerProcess]:
    """A broker shared by the tests of one module (256 MiB, its own temporary address)."""
    with tb.start_broker(memory="256MiB") as b:
        yield b
        assert b.alive, f"the broker died during the tests (exit code {b.returncode})"
    path = b.address[len("ipc://") :]
    assert not os.path.exists(path) and not os.path.exists(path + ".lane")


@pytest.fixture(params=["lanes", "zeromq"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test twice: with clients on lanes (Note [lanes] in server/lanes.py), and with
    ZeroMQ only, in this process and in the workers it spawns."""
    if request.param == "zeromq":
        monkeypatch.setenv("TENSORBROKER_LANES", "off")
    else:
        monkeypatch.delenv("TENSORBROKER_LANES", raising=False)
    return str(request.param)


@pytest.fixture
def fresh_broker() -> Iterator[tb.BrokerProcess]:
    """A broker of this test's own, for tests that count memory or kill things."""
    with tb.start_broker(memory="64MiB") as b:
        yield b


@pytest.fixture
def client(broker: tb.BrokerProcess) -> Iterator[tb.Client]:
    with tb.connect(broker.address) as c:
        yield c
        for key in c.keys():
            c.delete(key)
