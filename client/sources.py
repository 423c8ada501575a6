"""What `put` accepts, seen as NumPy arrays over the caller's memory, or as `DeviceSource`s
over a GPU's (no copy yet).

Anything with `__dlpack__` (torch, JAX, CuPy, NumPy), the buffer protocol (bytes,
memoryview, array.array) or `__array_interface__`. The one copy happens later, from these
views into the broker's memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..common.cudart import KDL_CPU, KDL_CUDA, KDL_CUDA_HOST
from ..common.dtypes import DType, dtype, from_dlpack
from ..common.errors import InvalidRequest
from . import _dlpack
from .cuda import DeviceSource, producer_stream
from .views import numpy_view

Source = np.ndarray[Any, Any] | DeviceSource


def device_of(source: Source) -> str:
    return "cpu" if isinstance(source, np.ndarray) else f"cuda:{source.device}"


def host_array(
    key: str, obj: Any, streams: dict[tuple[str, int], int] | None = None
) -> tuple[Source, DType]:
    """A NumPy view of `obj`'s elements (bfloat16 as uint16), or a DeviceSource for a CUDA
    tensor, and its dtype. `streams`: the producers' streams found so far in this put, by
    library and device (a state_dict's hundreds of tensors ask once)."""
    if isinstance(obj, np.ndarray):
        return _from_numpy(key, obj)
    if hasattr(obj, "__dlpack__"):
        return _from_dlpack(key, obj, {} if streams is None else streams)
    if hasattr(obj, "__array_interface__"):
        return _from_numpy(key, np.asarray(obj))
    try:
        view = memoryview(obj)
    except TypeError:
        raise InvalidRequest(
            f"put {key!r}: cannot store a {type(obj).__name__}; pass an array or tensor "
            "(anything with __dlpack__, the buffer protocol or __array_interface__), or a dict "
            "of them; for a list use numpy.asarray first"
        ) from None
    return _from_numpy(key, np.asarray(view))


_BY_NUMPY: dict[np.dtype[Any], DType] = {}  # a dtype's name costs a microsecond per put


def _from_numpy(key: str, array: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], DType]:
    dt = _BY_NUMPY.get(array.dtype)
    if dt is None:
        try:
            dt = _BY_NUMPY[array.dtype] = dtype(array.dtype.name)
        except ValueError as exc:
            raise InvalidRequest(f"put {key!r}: {exc}") from None
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    if dt.name == "bfloat16":  # an ml_dtypes array
        array = array.view(np.uint16)
    return array, dt


def _from_dlpack(key: str, obj: Any, streams: dict[tuple[str, int], int]) -> tuple[Source, DType]:
    if getattr(obj, "requires_grad", False):  # a torch parameter: store its data
        obj = obj.detach()
    device_type, device_id = obj.__dlpack_device__()
    if device_type not in (KDL_CPU, KDL_CUDA_HOST, KDL_CUDA):
        raise InvalidRequest(
            f"put {key!r}: the tensor lives on DLPack device {(device_type, device_id)}; the "
            "broker stores host and CUDA tensors: move it to the host first"
        )
    # A CUDA producer makes our copy's stream wait for its pending writes to the tensor.
    stream = None
    if device_type == KDL_CUDA:
        library = (type(obj).__module__.partition(".")[0], device_id)
        stream = streams.get(library)
        if stream is None:
            stream = streams[library] = producer_stream(obj, device_id)
    try:
        capsule = obj.__dlpack__(stream=stream, max_version=(1, 0))
    except TypeError:  # a producer older than DLPack 1.0
        capsule = obj.__dlpack__(stream=stream) if stream is not None else obj.__dlpack__()
    ptr, shape, strides, code, bits, lanes, *_ = _dlpack.capsule_info(capsule)
    try:
        dt = from_dlpack(code, bits, lanes)
    except ValueError as exc:
        raise InvalidRequest(f"put {key!r}: {exc}") from None
    # The view holds the capsule (and the source) until the copy into shared memory is done.
    if stream is not None:
        return DeviceSource(device_id, ptr, shape, strides, stream, (capsule, obj)), dt
    return numpy_view(ptr, shape, strides, dt, readonly=True, owner=(capsule, obj)), dt


def entries(key: str, value: Any) -> tuple[list[tuple[str, Source, DType]], bool]:
    """[(name, view, dtype)] of a tensor ("" as the name) or of a bundle, and whether a bundle."""
    if isinstance(value, Mapping):
        if not value:
            raise InvalidRequest(f"put {key!r}: a bundle needs at least one tensor")
        out = []
        streams: dict[tuple[str, int], int] = {}
        for name, item in value.items():
            if not isinstance(name, str):
                raise InvalidRequest(f"put {key!r}: bundle names must be strings, got {name!r}")
            out.append((name, *host_array(f"{key}[{name!r}]", item, streams)))
        return out, True
    return [("", *host_array(key, value))], False
