"""Three rules of DLPack 1.0 and the array API that `tb.Tensor` keeps, in their words."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest

import tensorbroker as tb
from tensorbroker.client import _dlpack

_CAPI = ctypes.PyDLL(None)
_CAPI.PyCapsule_GetPointer.restype = ctypes.c_void_p
_CAPI.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
FLAGS_OFFSET = 24  # DLManagedTensorVersioned: version (8 bytes), manager_ctx, deleter, flags


def _flags(capsule: Any) -> int:
    ptr = _CAPI.PyCapsule_GetPointer(capsule, b"dltensor_versioned")
    return ctypes.c_uint64.from_address(ptr + FLAGS_OFFSET).value


def test_a_copy_carries_the_is_copied_flag(client: tb.Client) -> None:
    """ "When a copy happens, the flag DLPACK_FLAG_BITMASK_IS_COPIED must be set"."""
    client.put("x", np.arange(6, dtype=np.float32))
    t = client.get("x")
    assert isinstance(t, tb.Tensor)
    copied = t.__dlpack__(copy=True, max_version=(1, 0))
    assert _flags(copied) & _dlpack.FLAG_IS_COPIED
    assert not _flags(copied) & _dlpack.FLAG_READ_ONLY  # the copy is the consumer's own
    shared = t.__dlpack__(max_version=(1, 0))
    assert _flags(shared) == _dlpack.FLAG_READ_ONLY
    assert _dlpack.capsule_info(copied)[0] != t.data_ptr == _dlpack.capsule_info(shared)[0]


@pytest.mark.parametrize("stream", [1, 2, -1, 0, 0x7F00_0000])
def test_a_host_tensor_takes_only_stream_none(client: tb.Client, stream: int) -> None:
    """ "If the device has no streams, stream must be None" (as NumPy and torch refuse)."""
    client.put("h", np.ones(4, dtype=np.float32))
    t = client.get("h")
    assert isinstance(t, tb.Tensor)
    with pytest.raises(BufferError, match="stream=None"):
        t.__dlpack__(stream=stream)
    assert np.from_dlpack(t).sum() == 4.0  # consumers pass None


@pytest.mark.parametrize("shape", [(0,), (3, 0)])
def test_a_size_zero_tensor_has_a_null_data_pointer(
    client: tb.Client, shape: tuple[int, ...]
) -> None:
    """ "For a tensor with size 0, data should be NULL"; NumPy, torch and JAX take it."""
    import jax.numpy as jnp
    import torch

    client.put("empty", np.zeros(shape, dtype=np.float32))
    t = client.get("empty")
    assert isinstance(t, tb.Tensor)
    for versioned in (None, (1, 0)):
        assert _dlpack.capsule_info(t.__dlpack__(max_version=versioned))[0] == 0
    assert np.from_dlpack(t).shape == torch.from_dlpack(t).shape == jnp.from_dlpack(t).shape
