"""`Tensor`: a DLPack producer over shared memory, and `Lease`, which ends a broker lease.

Note [leases and capsules]

    get ─> Lease(id) <─ Tensor ─> capsule ─> consumer array (torch / jax / numpy)
              │ holds the Mapping (the mmap stays mapped while anything reads it)
              └─ __del__: lease id -> client's release queue -> broker (batched)

Every capsule's managed tensor holds a strong reference to the Lease, dropped by its DLPack
deleter. So the lease ends exactly when the Tensor and every array built from it are gone.
The finaliser only queues the id (SimpleQueue.put is reentrant): releases are sent by the
client, never from a finaliser.
"""

from __future__ import annotations

import queue
from typing import TYPE_CHECKING, Any

import numpy as np

from ..common.descriptors import TensorDesc, compact_strides
from ..common.dtypes import DTYPES, DType
from ..common.errors import InvalidRequest
from . import _dlpack
from .shm import Mapping
from .views import numpy_view

if TYPE_CHECKING:
    import jax
    import torch

KDL_CPU = 1


class Lease:
    """One lease of the broker on one object, alive while anything reads it."""

    __slots__ = ("id", "mapping", "_releases", "__weakref__")

    def __init__(self, lease_id: int, mapping: Mapping, releases: queue.SimpleQueue[int]) -> None:
        self.id = lease_id
        self.mapping = mapping
        self._releases: queue.SimpleQueue[int] | None = releases

    def __del__(self) -> None:
        releases, self._releases = self._releases, None
        if releases is not None:
            releases.put(self.id)


class Tensor:
    """A tensor in the broker's shared memory, as one `get` (or `create`) sees it.

    Pass it to `torch.from_dlpack`, `jax.numpy.from_dlpack`, `numpy.from_dlpack` or
    `cupy.from_dlpack`, or call `.torch()`, `.jax()`, `.numpy()`: none of them copies.
    Sealed objects are immutable: NumPy views are read-only; torch cannot be told so, and
    writing through it changes the object for every reader.
    """

    __slots__ = (
        "key",
        "version",
        "name",
        "shape",
        "strides",
        "dtype",
        "nbytes",
        "_dt",
        "_ptr",
        "_lease",
        "_writable",
        "__weakref__",
    )
    device = "cpu"

    def __init__(
        self, key: str, version: int, desc: TensorDesc, lease: Lease, *, writable: bool = False
    ) -> None:
        self.key = key
        self.version = version
        self.name = desc.name
        self.shape = desc.shape
        self.strides = desc.strides
        self.dtype = desc.dtype
        self._dt: DType = DTYPES[desc.dtype]
        self.nbytes = desc.nbytes
        self._ptr = lease.mapping.address + desc.offset
        self._lease = lease
        self._writable = writable

    def __repr__(self) -> str:
        name = f"[{self.name!r}]" if self.name else ""
        return (
            f"<tb.Tensor {self.key!r}{name} v{self.version} {self.dtype}{list(self.shape)} "
            f"on {self.device}>"
        )

    @property
    def data_ptr(self) -> int:
        """The address of element 0 in this process."""
        return self._ptr

    # -- DLPack ----------------------------------------------------------------------------

    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDL_CPU, 0)

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        if dl_device is not None and tuple(dl_device) != (KDL_CPU, 0):
            raise BufferError(
                f"tensor {self.key!r} is in host memory; it cannot be exported to device "
                f"{tuple(dl_device)}"
            )
        versioned = max_version is not None and max_version[0] >= 1
        if copy:
            owner: Any = np.array(self._bytes(), copy=True)
            ptr, strides = owner.ctypes.data, compact_strides(self.shape)
            readonly = False
        else:
            owner, ptr, strides, readonly = self._lease, self._ptr, self.strides, not self._writable
        dt = self._dt
        return _dlpack.make_capsule(
            owner, ptr, self.shape, strides, dt.code, dt.bits, 1, KDL_CPU, 0, versioned, readonly
        )

    def _bytes(self) -> np.ndarray[Any, Any]:
        """A NumPy view of the elements' bytes (bfloat16 as uint16), read-only unless writable."""
        return numpy_view(
            self._ptr, self.shape, self.strides, self._dt,
            readonly=not self._writable, owner=self._lease,
        )  # fmt: skip

    # -- conveniences ----------------------------------------------------------------------

    def numpy(self) -> np.ndarray[Any, Any]:
        """A NumPy view, no copy; read-only unless this is a `create` buffer. bfloat16 comes
        as an `ml_dtypes.bfloat16` array."""
        array = self._bytes()
        if self.dtype == "bfloat16":
            try:
                import ml_dtypes
            except ImportError:
                raise InvalidRequest(
                    f"tensor {self.key!r} is bfloat16, which NumPy cannot describe without "
                    "ml_dtypes: pip install ml_dtypes, or use .torch() / .jax()"
                ) from None
            array = array.view(ml_dtypes.bfloat16)
        return array

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray[Any, Any]:
        array = self.numpy()
        if dtype is not None and np.dtype(dtype) != array.dtype:
            if copy is False:
                raise ValueError(f"converting {self.dtype} to {dtype} needs a copy")
            return array.astype(dtype)
        return array.copy() if copy else array

    def torch(self) -> torch.Tensor:
        """A torch tensor over the same memory (torch has no read-only tensors: do not write)."""
        from torch.utils.dlpack import from_dlpack

        return from_dlpack(self)

    def jax(self) -> jax.Array:
        """A JAX array over the same memory (zero copy: the memory is 64-byte aligned)."""
        import jax.numpy as jnp

        return jnp.from_dlpack(self)

    def cupy(self) -> Any:
        raise InvalidRequest(
            f"tensor {self.key!r} is in host memory and CuPy arrays live on a GPU: use "
            ".numpy(), or copy it with cupy.asarray(t.numpy())"
        )
