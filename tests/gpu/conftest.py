"""GPU tests: real processes on a real NVIDIA GPU (torch, JAX and CuPy), marked `cuda`.
Without a GPU, CuPy or CUDA-enabled torch, each one is skipped and says which is missing."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

import tensorbroker as tb
from tensorbroker.launcher import BrokerProcess, popen


def _why_no_gpu() -> str:
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed (pip install 'tensorbroker[cuda12]' or [cuda13])"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return ""


def _why_no_jax_gpu() -> str:
    if importlib.util.find_spec("jax") is None:
        return "JAX is not installed"
    probe = "import jax; print(jax.default_backend())"
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS" or v != "cpu"}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    backend = done.stdout.strip()
    return (
        "" if backend == "gpu" else f"JAX has no GPU backend here ({backend or done.stderr[-200:]})"
    )


WHY = _why_no_gpu()
# JAX takes 75% of a GPU at start unless told not to; its workers inherit this.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    jax_why = None
    for item in items:
        if item.get_closest_marker("cuda") and WHY:
            item.add_marker(pytest.mark.skip(reason=f"needs a GPU: {WHY}"))
        elif item.get_closest_marker("jax_gpu"):
            jax_why = _why_no_jax_gpu() if jax_why is None else jax_why
            if jax_why:
                item.add_marker(pytest.mark.skip(reason=f"needs JAX on the GPU: {jax_why}"))


@pytest.fixture(autouse=True)
def _brokers_as_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU tests' brokers run as the command, in a new interpreter, as they last ran on a
    GPU: the host suite's forked brokers (tests/conftest.py) have not run there yet."""
    monkeypatch.setattr(BrokerProcess, "spawn", popen)


@pytest.fixture(autouse=True)
def _jax_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers of GPU tests run JAX where it would run by itself (tests/conftest.py pins the
    host tests' JAX to the CPU)."""
    if os.environ.get("JAX_PLATFORMS") == "cpu":
        monkeypatch.delenv("JAX_PLATFORMS")


@pytest.fixture
def gpu_broker() -> Iterator[tb.BrokerProcess]:
    with tb.start_broker(memory="256MiB", cuda_memory="0:2GiB") as b:
        yield b
