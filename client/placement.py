"""Where an object is stored and where a reader wants it: the checks, and the copies that
`copy=True` allows. Zero copy is the rule; a copy is only ever made when asked for."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..common.cudart import STREAM_LEGACY, device_index, parse_device
from ..common.descriptors import TensorDesc, compact_strides
from ..common.dtypes import DType
from ..common.errors import InvalidRequest
from .cuda import DeviceLink, DeviceSource
from .sources import Source, device_of
from .tensor import DeviceLease, Lease, Tensor

Items = list[tuple[str, Source, DType]]


def place(link: DeviceLink, label: str, items: Items, device: Any, copy: bool) -> tuple[str, Items]:
    """The device a put stores `items` on, and the items as that put copies them."""
    where = {name: device_of(src) for name, src, _ in items}
    if device is None:
        if len(set(where.values())) > 1:
            listed = ", ".join(f"{name!r} on {dev}" for name, dev in where.items())
            raise InvalidRequest(
                f"put {label!r}: the bundle mixes devices ({listed}); put each device's "
                "tensors as an object of its own, or pass device= with copy=True"
            )
        return next(iter(where.values())), items
    target = parse_device(device, f"put {label!r}")
    out: Items = []
    for name, src, dt in items:
        here = where[name]
        if here != target:
            what = f"tensor {name!r}" if name else "the tensor"
            if not copy:
                raise InvalidRequest(
                    f"put {label!r}: {what} is on {here} and device={target!r} was asked: pass "
                    f"copy=True to copy it there, or leave device unset to store it on {here}"
                )
            if isinstance(src, DeviceSource):  # to the host first (then on, if a GPU)
                src = _to_host(link, label, src, dt)
            else:
                src = np.ascontiguousarray(src)
        out.append((name, src, dt))
    return target, out


def _to_host(link: DeviceLink, label: str, src: DeviceSource, dt: DType) -> np.ndarray[Any, Any]:
    if not src.compact:
        raise InvalidRequest(
            f"put {label!r}: copying a non-contiguous CUDA tensor across devices is not "
            "supported; make it contiguous first (.contiguous())"
        )
    rt = link.runtime(f"put {label!r}")
    host = np.empty(src.shape, np.dtype(dt.typestr))
    rt.copy_async(src.device, host.ctypes.data, src.ptr, host.nbytes, src.stream)
    rt.stream_synchronize(src.device, src.stream)
    return host


def move(
    link: DeviceLink, key: str, result: Tensor | dict[str, Tensor], want: str | None, copy: bool
) -> Tensor | dict[str, Tensor]:
    """`result` (a get's) on the device `want`: as it is if it is there, else a copy if
    copy=True allows one."""
    tensors = result if isinstance(result, dict) else {"": result}
    if want is None or all(t.device == want for t in tensors.values()):
        return result
    if not copy:
        stored = next(iter(tensors.values())).device
        raise InvalidRequest(
            f"get {key!r}: it is stored on {stored} and device={want!r} was asked: pass "
            f"copy=True for a copy there, or leave device unset to read it zero-copy on {stored}"
        )
    moved = {name: _copy(link, t, want) for name, t in tensors.items()}
    return moved if isinstance(result, dict) else moved[""]


class _Local:
    """Memory of this process's own that a copied Tensor reads: its address, and what frees
    it (a NumPy array, or device memory freed by `__del__`)."""

    __slots__ = ("address", "owner", "runtime", "device")

    def __init__(self, address: int, owner: Any = None, runtime: Any = None, device: int = -1):
        self.address, self.owner, self.runtime, self.device = address, owner, runtime, device

    def __del__(self) -> None:
        if self.runtime is not None:
            self.runtime.free(self.device, self.address)


def _copy(link: DeviceLink, t: Tensor, want: str) -> Tensor:
    """A private copy of `t` on `want` (one of them a GPU), made before this returns."""
    rt = link.runtime(f"get {t.key!r} with device={want!r}")
    src = t.data_ptr
    if t.device != "cpu":  # read after the producer's write, and let the release say so
        lease = t.lease
        if isinstance(lease, DeviceLease):
            lease.export(STREAM_LEGACY, writing=False)
        on = device_index(t.device)
    if want == "cpu":
        host = np.empty(t.nbytes, np.uint8)
        local = _Local(host.ctypes.data, host)
    else:
        on = device_index(want) if t.device == "cpu" else on
        dst_device = device_index(want)
        local = _Local(rt.malloc(dst_device, max(t.nbytes, 1)), None, rt, dst_device)
    rt.copy_async(on, local.address, src, t.nbytes, STREAM_LEGACY)
    rt.stream_synchronize(on, STREAM_LEGACY)
    desc = TensorDesc(t.name, t.dtype, t.shape, compact_strides(t.shape), "", 0, want)
    return Tensor(t.key, t.version, desc, Lease(None, local, None))
