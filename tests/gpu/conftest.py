"""GPU tests: real processes on a real NVIDIA GPU (torch, JAX and CuPy), marked `cuda`.
Without a GPU, CuPy or CUDA-enabled torch, each one is skipped and says which is missing."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

import tensorbroker as tb


def _why_no_gpu() -> str:
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed (pip install 'tensorbroker[cuda]')"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return ""


WHY = _why_no_gpu()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("cuda") and WHY:
            item.add_marker(pytest.mark.skip(reason=f"needs a GPU: {WHY}"))


@pytest.fixture
def gpu_broker() -> Iterator[tb.BrokerProcess]:
    with tb.start_broker(memory="256MiB", cuda_memory="0:2GiB") as b:
        yield b
