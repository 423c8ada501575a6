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


def _owner_alive(segment: str) -> bool:
    """Whether the broker that made /dev/shm/tb-PID-... still runs (another test run's)."""
    try:
        os.kill(int(segment.split("-")[1]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, IndexError):
        pass
    return True


@pytest.fixture(scope="session", autouse=True)
def _leaves_nothing_behind() -> Iterator[None]:
    """After the suite: no segment of a broker that has exited, no broker still running."""
    before = _segments()
    yield
    new = _segments() - before
    unstopped = tb.BrokerProcess.unstopped()
    ours = {s for s in new if not _owner_alive(s) or int(s.split("-")[1]) in unstopped}
    assert not ours, f"the test suite left shared-memory segments behind: {sorted(ours)}"
    running = [pid for pid in unstopped if _owner_alive(f"tb-{pid}-")]
    assert not running, f"the test suite left brokers running: {running}"


@pytest.fixture(scope="module")
def broker() -> Iterator[tb.BrokerProcess]:
    """A broker shared by the tests of one module (256 MiB, its own temporary address)."""
    with tb.start_broker(memory="256MiB") as b:
        yield b
        assert b.alive, f"the broker died during the tests (exit code {b.returncode})"
    assert not os.path.exists(b.address[len("ipc://") :])


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
