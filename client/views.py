"""NumPy views over raw memory that keep its owner alive."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..common.dtypes import DType


class _Owned:
    """Becomes the view's base: the view keeps `owner` (a lease, a producer's capsule) alive."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, interface: dict[str, Any], owner: Any) -> None:
        self.__array_interface__ = interface
        self.owner = owner


def numpy_view(
    ptr: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...] | None,
    dt: DType,
    *,
    readonly: bool,
    owner: Any,
) -> np.ndarray[Any, Any]:
    """The elements at `ptr` as NumPy sees their bytes (bfloat16 as uint16); strides in
    elements, None for compact row-major. No copy."""
    interface = {
        "version": 3,
        "shape": shape,
        "typestr": dt.typestr,
        "data": (ptr, readonly),
        "strides": None if strides is None else tuple(s * dt.itemsize for s in strides),
    }
    return np.asarray(_Owned(interface, owner))
