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

from ..common.cudart import KDL_CPU, KDL_CUDA, STREAM_LEGACY, STREAM_PER_THREAD, device_index
from ..common.descriptors import TensorDesc, compact_strides
from ..common.dtypes import DTYPES, DType
from ..common.errors import InvalidRequest
from . import _dlpack
from .cuda import DeviceLink, Opened, dlpack_stream
from .shm import Mapping
from .views import numpy_view

if TYPE_CHECKING:
    import jax
    import torch


class Lease:
    """One lease of the broker on one object, alive while anything reads it. `mapping` is
    what holds its memory in this process (a mapped segment, an opened device chunk, or a
    local copy's array) and has its `address`; a local copy has no lease id."""

    __slots__ = ("id", "mapping", "_releases", "__weakref__")

    def __init__(
        self, lease_id: int | None, mapping: Any, releases: queue.SimpleQueue[int] | None
    ) -> None:
        self.id = lease_id
        self.mapping: Mapping | Opened | Any = mapping
        self._releases = releases

    def disarm(self) -> None:
        """Its end sends nothing: the caller gives the lease back another way."""
        self._releases = None

    def __del__(self) -> None:
        releases, self._releases = self._releases, None
        if releases is not None and self.id is not None:
            releases.put(self.id)


class SlotLease(Lease):
    """A lease taken without the broker: the object's id in one of this client's lease slots
    (Note [directory and lease slots] in common/directory.py). Letting go clears the slot;
    no message is sent."""

    __slots__ = ("_slot", "_slots")

    def __init__(self, mapping: Any, slot: int, slots: Any) -> None:
        # Lease's fields set here, not through super(): one per object of a get_many
        self.id, self.mapping, self._releases = None, mapping, None
        self._slot, self._slots = slot, slots

    def __del__(self) -> None:
        slots, self._slots = self._slots, None
        if slots is not None:
            slots.give_back(self._slot)


class DeviceLease(Lease):
    """A lease on a device object: it knows the object's write event, the streams this
    process read (or wrote) on, and, for a reader, the read-done event to record on them
    before the release (Note [device handoff] in cuda.py)."""

    __slots__ = ("device", "write", "read", "streams", "unknown", "link")

    def __init__(
        self,
        lease_id: int,
        chunk: Opened,
        releases: queue.SimpleQueue[int],
        link: DeviceLink,
        write: Opened,
        read: Opened | None,
    ) -> None:
        super().__init__(lease_id, chunk, releases)
        self.device, self.link, self.write, self.read = chunk.device, link, write, read
        self.streams: set[int] = set()
        self.unknown = False  # taken with stream=-1: its streams are the consumer's secret

    def export(self, stream: Any, writing: bool) -> None:
        """A consumer takes the tensor on `stream` (DLPack's value): the stream waits for the
        producer's write (not a buffer being written), and the release covers its reads."""
        handle = dlpack_stream(stream)
        if handle is None:  # -1: the consumer orders its own work, on streams we never see
            self.unknown = True
            return
        if not writing:
            self.link.runtime("reading a device tensor").wait(
                self.device, handle, self.write.address
            )
        # The read-done event is recorded later, on the release thread, where 2 would name
        # that thread's stream. The legacy default stream orders after every blocking stream,
        # per-thread default streams included.
        self.streams.add(STREAM_LEGACY if handle == STREAM_PER_THREAD else handle)

    def __del__(self) -> None:
        releases, self._releases = self._releases, None
        if releases is None or self.id is None:
            return
        if self.streams or self.unknown:  # the release thread records, then releases
            self.link.finish(self, releases)
        else:
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
        "_dt",
        "_ptr",
        "_lease",
        "_writable",
        "device",
        "__weakref__",
    )

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
        self.device = desc.device
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
    def lease(self) -> Lease:
        """The broker lease this tensor reads under (ends when it and its arrays are gone)."""
        return self._lease

    @property
    def nbytes(self) -> int:
        """Its size in bytes."""
        return self._dt.nbytes(self.shape)

    @property
    def data_ptr(self) -> int:
        """The address of element 0 in this process (a device address for a CUDA tensor)."""
        return self._ptr

    # -- DLPack ----------------------------------------------------------------------------

    def __dlpack_device__(self) -> tuple[int, int]:
        if self.device == "cpu":
            return (KDL_CPU, 0)
        return (KDL_CUDA, device_index(self.device))

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        if stream is None and dl_device is None and not copy and self.device == "cpu":
            dt = self._dt  # the common case first: zero copy of host memory
            return _dlpack.make_capsule(
                self._lease, self._ptr, self.shape, self.strides, dt.code, dt.bits, 1, KDL_CPU,
                0, max_version is not None and max_version[0] >= 1, not self._writable,
            )  # fmt: skip
        here = self.__dlpack_device__()
        if dl_device is not None and tuple(dl_device) != here:
            raise BufferError(
                f"tensor {self.key!r} is on {self.device}; it cannot be exported to DLPack "
                f"device {tuple(dl_device)}: get it with device=..., copy=True instead"
            )
        versioned = max_version is not None and max_version[0] >= 1
        if here[0] == KDL_CUDA:
            return self._device_capsule(stream, versioned, copy)
        if stream is not None:  # the array API: on a device without streams, only None
            raise BufferError(
                f"tensor {self.key!r} is in host memory, which has no streams: pass "
                f"stream=None, not {stream!r}"
            )
        if copy:
            owner: Any = np.array(self._bytes(), copy=True)
            ptr, strides = owner.ctypes.data, compact_strides(self.shape)
            readonly = False
        else:
            owner, ptr, strides, readonly = self._lease, self._ptr, self.strides, not self._writable
        dt = self._dt
        return _dlpack.make_capsule(
            owner, ptr, self.shape, strides, dt.code, dt.bits, 1, KDL_CPU, 0, versioned, readonly,
            copied=bool(copy),
        )  # fmt: skip

    def _device_capsule(self, stream: Any, versioned: bool, copy: bool | None) -> Any:
        lease = self._lease
        if copy:
            raise BufferError(
                f"tensor {self.key!r} is on {self.device}: copy=True is not offered here; "
                "take it zero-copy and copy in your library (t.torch().clone())"
            )
        if isinstance(lease, DeviceLease):
            lease.export(stream, writing=self._writable)
        dt, index = self._dt, device_index(self.device)
        return _dlpack.make_capsule(
            lease, self._ptr, self.shape, self.strides, dt.code, dt.bits, 1, KDL_CUDA, index,
            versioned, not self._writable,
        )  # fmt: skip

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
        if self.device != "cpu":
            raise InvalidRequest(
                f"tensor {self.key!r} is on {self.device} and NumPy arrays live in host memory: "
                "use .torch(), .cupy() or .jax(), or get it with device='cpu', copy=True"
            )
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
        """A CuPy array over the same device memory, ordered after the producer's write on
        CuPy's current stream."""
        if self.device == "cpu":
            raise InvalidRequest(
                f"tensor {self.key!r} is in host memory and CuPy arrays live on a GPU: use "
                ".numpy(), or get it with device='cuda:0', copy=True"
            )
        import cupy

        if self.dtype == "bfloat16":
            raise InvalidRequest(
                f"tensor {self.key!r} is bfloat16, which CuPy cannot describe: use .torch() or "
                ".jax()"
            )
        return cupy.from_dlpack(self)
