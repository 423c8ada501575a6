"""Code that runs in the child processes of the integration tests (tests/support.py CHILDREN).

Each worker reports through a multiprocessing queue and exits 0 only if it got that far.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

# dtype name -> values every framework can build: small integers, exact in every dtype.
DTYPE_NAMES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
]
SHAPE = (3, 8)


def reference(name: str) -> np.ndarray[Any, Any]:
    """The array every producer puts for dtype `name` (ml_dtypes for bfloat16)."""
    import ml_dtypes

    values = np.arange(np.prod(SHAPE)).reshape(SHAPE)
    if name == "bool":
        return (values % 2).astype(bool)
    dt = ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)
    values = values % 7 if name.startswith("uint") else values % 7 - 3
    return values.astype(dt)


def shm_mapping(ptr: int) -> str | None:
    """The file mapped at address `ptr` in this process, if it is under /dev/shm."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start <= ptr < end:
                path = parts[5] if len(parts) > 5 else ""
                return path if path.startswith("/dev/shm/") else None
    return None


def file_offset(ptr: int) -> tuple[str, int]:
    """(path, offset in the file) of the mapped address `ptr` in this process."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start <= ptr < end and len(parts) > 5:
                return parts[5], ptr - start + int(parts[2], 16)
    raise LookupError(f"address {ptr:#x} is not in a mapped file")


# -- framework adapters: build an array of a reference, and read one back as NumPy bytes ----


def make(framework: str, name: str) -> Any:
    ref = reference(name)
    if framework == "numpy":
        return ref
    if framework == "torch":
        import torch

        if name == "bfloat16":
            return torch.from_numpy(ref.view(np.uint16).copy()).view(torch.bfloat16)
        return torch.from_numpy(ref.copy())
    import jax.numpy as jnp

    return jnp.asarray(ref)


def data_ptr(framework: str, array: Any) -> int:
    if framework == "torch":
        return int(array.data_ptr())
    if framework == "jax":
        return int(array.unsafe_buffer_pointer())
    return int(array.ctypes.data)


def to_bytes(framework: str, array: Any) -> bytes:
    if framework == "torch":
        import torch

        if array.dtype == torch.bfloat16:
            array = array.view(torch.int16)
        return bytes(array.contiguous().numpy().tobytes())
    return bytes(np.asarray(array).tobytes())


def consume(framework: str, tensor: Any) -> Any:
    if framework == "torch":
        import torch

        return torch.from_dlpack(tensor)
    if framework == "jax":
        import jax.numpy as jnp

        return jnp.from_dlpack(tensor)
    if tensor.dtype == "bfloat16":  # NumPy cannot describe it; .numpy() gives ml_dtypes
        return tensor.numpy()
    return np.from_dlpack(tensor)


# -- workers ---------------------------------------------------------------------------------


def dtype_roundtrip(
    framework: str, address: str, others: list[str], results: Any, produced: Any
) -> None:
    """Put every dtype with `framework`, then read every other framework's puts."""
    os.environ["JAX_ENABLE_X64"] = "1"
    import tensorbroker as tb

    with tb.connect(address) as c:
        for name in DTYPE_NAMES:
            c.put(f"{framework}/{name}", make(framework, name))
        produced.put(framework)
        report = {}
        for other in others:
            for name in DTYPE_NAMES:
                t = c.get(f"{other}/{name}", timeout=60)
                array = consume(framework, t)
                report[(other, name)] = (
                    to_bytes(framework, array) == reference(name).tobytes(),
                    data_ptr(framework, array) == t.data_ptr,
                    t.dtype,
                )
        results.put((framework, report))


def torch_producer(address: str, done: Any) -> None:
    import torch

    import tensorbroker as tb

    with tb.connect(address) as c:
        c.put("f32", torch.arange(1024, dtype=torch.float32) * 0.5)
        c.put("bf16", torch.linspace(-4, 4, 64).to(torch.bfloat16))
    done.set()


def reader(framework: str, address: str, results: Any, holding: Any, modified: Any) -> None:
    """Get both tensors, report values, where their memory is, and what it reads after the
    parent changed the bytes underneath."""
    import tensorbroker as tb

    with tb.connect(address) as c:
        f32 = consume(framework, c.get("f32", timeout=60))
        bf16 = consume(framework, c.get("bf16", timeout=60))
        results.put((framework, "values", to_bytes(framework, f32), to_bytes(framework, bf16)))
        results.put(
            (
                framework,
                "where",
                shm_mapping(data_ptr(framework, f32)),
                shm_mapping(data_ptr(framework, bf16)),
            )
        )
        holding.put(framework)
        if not modified.wait(60):
            raise TimeoutError("the parent never changed the bytes")
        results.put((framework, "after", float(f32[1]), float(f32[2])))


def hold_then_wait(address: str, key: str, holding: Any) -> None:
    """Get `key`, keep a torch view of it, and wait to be killed."""
    import time

    import tensorbroker as tb

    c = tb.connect(address)
    view = c.get(key).torch()
    holding.put(float(view.sum()))
    time.sleep(600)


def create_then_wait(address: str, key: str, holding: Any) -> None:
    """Start writing `key` in place and wait to be killed before sealing it."""
    import time

    import tensorbroker as tb

    c = tb.connect(address)
    with c.create(key, (1024, 1024), "float32") as buf:
        buf.numpy()[:] = 1.0
        holding.put("writing")
        time.sleep(600)
