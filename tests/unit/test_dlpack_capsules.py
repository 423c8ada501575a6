"""tensorbroker.client._dlpack against real consumers (NumPy, PyTorch, JAX), no mocks.

Capsules are built over NumPy buffers held by an ``Owner``; a weakref on the owner tells
when the last consumer let go of the memory.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import subprocess
import sys
import textwrap
import threading
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")

from tensorbroker.client import _dlpack  # noqa: E402

KDLCPU = 1
torch: Any = None  # and JAX: imported when this file's tests run (`frameworks`)
jax: Any = None
jnp: Any = None


@pytest.fixture(scope="module", autouse=True)
def frameworks() -> None:
    """PyTorch and JAX, imported when the first test here runs, not when the file is
    collected: every xdist worker collects every file, and these two cost 3 CPU-s each time."""
    global torch, jax, jnp
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")


@pytest.fixture(scope="module")
def dl() -> ModuleType:
    return _dlpack


# ---- helpers -------------------------------------------------------------------------


class Owner:
    """Stands for a mapped segment: keeps the buffer alive while a consumer may read it."""

    def __init__(self, buf: np.ndarray) -> None:
        self.buf = buf


def aligned(values: np.ndarray, align: int = 64) -> np.ndarray:
    """A copy of ``values`` whose data address is a multiple of ``align`` (JAX zero copy)."""
    raw = np.zeros(values.nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    out = raw[start : start + values.nbytes].view(values.dtype).reshape(values.shape)
    out[...] = values
    return out


def new_owner(buf: np.ndarray) -> tuple[Owner, weakref.ref[Owner]]:
    owner = Owner(buf)
    return owner, weakref.ref(owner)


def assert_alive(ref: weakref.ref[Owner]) -> None:
    gc.collect()
    assert ref() is not None, "owner released while a consumer still holds the memory"


def assert_released(ref: weakref.ref[Owner]) -> None:
    gc.collect()
    assert ref() is None, "owner still alive after the last consumer went away"


def elem_strides(buf: np.ndarray) -> tuple[int, ...]:
    return tuple(s // buf.itemsize for s in buf.strides)


class Producer:
    """A minimal DLPack producer over ``owner.buf``; honours max_version like a real one."""

    def __init__(
        self,
        dl: ModuleType,
        owner: Owner,
        code: int,
        bits: int,
        *,
        view: np.ndarray | None = None,
        readonly: bool = False,
        legacy_only: bool = False,
    ) -> None:
        self.dl, self.owner, self.code, self.bits = dl, owner, code, bits
        self.view = owner.buf if view is None else view
        self.readonly, self.legacy_only = readonly, legacy_only
        self.requests: list[Any] = []

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: Any = None,
        dl_device: Any = None,
        copy: Any = None,
    ) -> Any:
        self.requests.append(max_version)
        if copy:
            raise BufferError("this producer never copies")
        versioned = max_version is not None and max_version[0] >= 1 and not self.legacy_only
        v = self.view
        return self.dl.make_capsule(
            self.owner, v.ctypes.data, v.shape, elem_strides(v), self.code, self.bits, 1,
            KDLCPU, 0, versioned, self.readonly,
        )  # fmt: skip

    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDLCPU, 0)


class Handing:
    """Hands out one prepared capsule (to look at it again after a consumer took it)."""

    def __init__(self, capsule: Any) -> None:
        self.capsule = capsule

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDLCPU, 0)


BASE = np.arange(12).reshape(3, 4)
DTYPES: dict[str, tuple[Any, int, int, str, np.ndarray]] = {
    # name: (numpy dtype, DLPack code, bits, torch dtype's name, values)
    "float32": (np.float32, 2, 32, "float32", BASE * 0.5 - 2),
    "int64": (np.int64, 0, 64, "int64", BASE * 10**12 - 7),
    "bool": (np.bool_, 6, 8, "bool", BASE % 3 == 0),
    "complex64": (np.complex64, 5, 64, "complex64", BASE - 1j * BASE),
    "bfloat16": (ml_dtypes.bfloat16, 4, 16, "bfloat16", BASE * 0.25 - 1),
}


def consume_numpy(p: Producer) -> tuple[Any, int]:
    a = np.from_dlpack(p)
    return a, a.__array_interface__["data"][0]


def consume_torch(p: Producer) -> tuple[Any, int]:
    t = torch.from_dlpack(p)
    return t, t.data_ptr()


def consume_jax(p: Producer) -> tuple[Any, int]:
    with jax.enable_x64(True):  # int64 would otherwise be narrowed (copied) to int32
        j = jnp.from_dlpack(p)
    return j, j.unsafe_buffer_pointer()


CONSUMERS: dict[str, Callable[[Producer], tuple[Any, int]]] = {
    "numpy": consume_numpy,
    "torch": consume_torch,
    "jax": consume_jax,
}


def host_copy(x: Any) -> np.ndarray:
    """A NumPy copy of a consumer's array (bfloat16 as float32), holding no reference to it."""
    if isinstance(x, torch.Tensor):
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy().copy()
    out: np.ndarray = np.array(x, copy=True)
    return out.astype(np.float32) if out.dtype == ml_dtypes.bfloat16 else out


def expected_values(buf: np.ndarray) -> np.ndarray:
    return buf.astype(np.float32) if buf.dtype == ml_dtypes.bfloat16 else buf


# ---- consumers read our capsules ----------------------------------------------------


# NumPy has no bfloat16: that case is test_numpy_rejecting_bfloat16_keeps_interpreter_healthy.
@pytest.mark.parametrize(
    ("consumer", "dtype_name"),
    [(c, d) for c in CONSUMERS for d in DTYPES if (c, d) != ("numpy", "bfloat16")],
)
def test_consumer_zero_copy_and_release(dl: ModuleType, consumer: str, dtype_name: str) -> None:
    np_dtype, code, bits, torch_dtype, values = DTYPES[dtype_name]
    buf = aligned(values.astype(np_dtype))
    owner, ref = new_owner(buf)
    producer = Producer(dl, owner, code, bits)
    arr, address = CONSUMERS[consumer](producer)
    del owner, producer

    assert address == buf.ctypes.data  # zero copy
    assert tuple(arr.shape) == buf.shape
    if consumer == "torch":
        assert arr.dtype == getattr(torch, torch_dtype)
    else:
        assert arr.dtype == np.dtype(np_dtype)
    np.testing.assert_array_equal(host_copy(arr), expected_values(buf))
    assert_alive(ref)
    del arr
    assert_released(ref)


def test_numpy_asks_versioned_and_jax_asks_legacy(dl: ModuleType) -> None:
    buf = aligned(np.arange(4, dtype=np.float32))
    p = Producer(dl, Owner(buf), 2, 32)
    np.from_dlpack(p)
    jnp.from_dlpack(p)
    assert p.requests[0] is not None and tuple(p.requests[0])[0] >= 1
    assert p.requests[1] is None


@pytest.mark.parametrize(
    ("legacy_only", "readonly", "writeable"),
    [(False, True, False), (False, False, True), (True, False, False)],
    # NumPy >= 2.2.5 imports every legacy capsule read-only (numpy/numpy#28600, #28632):
    # the unversioned struct has no flag to say otherwise.
    ids=["versioned-readonly", "versioned-writable", "legacy-always-readonly"],
)
def test_numpy_honours_readonly_flag(
    dl: ModuleType, legacy_only: bool, readonly: bool, writeable: bool
) -> None:
    buf = np.arange(6, dtype=np.float32)
    p = Producer(dl, Owner(buf), 2, 32, readonly=readonly, legacy_only=legacy_only)
    arr = np.from_dlpack(p)
    assert arr.flags.writeable is writeable
    if writeable:
        arr[0] = 42
        assert buf[0] == 42


@pytest.mark.parametrize("consumer", ["numpy", "torch"])
def test_non_contiguous_strides(dl: ModuleType, consumer: str) -> None:
    buf = np.arange(24, dtype=np.float32).reshape(4, 6)
    view = buf[1:, ::2].T  # shape (3, 3), element strides (2, 6), starts at an offset
    owner, ref = new_owner(buf)
    arr, address = CONSUMERS[consumer](Producer(dl, owner, 2, 32, view=view))
    del owner
    assert address == view.ctypes.data
    np.testing.assert_array_equal(host_copy(arr), view)
    del arr
    assert_released(ref)


@pytest.mark.parametrize("consumer", list(CONSUMERS))
def test_zero_dim(dl: ModuleType, consumer: str) -> None:
    buf = aligned(np.array(7.5, dtype=np.float32))
    owner, ref = new_owner(buf)
    arr, address = CONSUMERS[consumer](Producer(dl, owner, 2, 32))
    del owner
    assert tuple(arr.shape) == ()
    assert address == buf.ctypes.data
    assert float(host_copy(arr)) == 7.5
    del arr
    assert_released(ref)


def test_owner_released_after_last_of_several_consumers(dl: ModuleType) -> None:
    buf = aligned(np.arange(8, dtype=np.float32))
    owner, ref = new_owner(buf)
    a = np.from_dlpack(Producer(dl, owner, 2, 32))
    a_view = a[2:]
    t = torch.from_dlpack(Producer(dl, owner, 2, 32))
    t_view = t[1:]
    j = jnp.from_dlpack(Producer(dl, owner, 2, 32))
    del owner, a, t
    assert_alive(ref)
    del a_view
    assert_alive(ref)
    del j
    assert_alive(ref)
    del t_view
    assert_released(ref)


def test_unconsumed_capsule_releases_owner(dl: ModuleType) -> None:
    buf = np.arange(4, dtype=np.float32)
    for versioned in (False, True):
        owner, ref = new_owner(buf)
        capsule = dl.make_capsule(
            owner, buf.ctypes.data, (4,), (1,), 2, 32, 1, 1, 0, versioned, False
        )
        del owner
        assert_alive(ref)
        del capsule
        assert_released(ref)


def test_owner_referenced_elsewhere_survives(dl: ModuleType) -> None:
    buf = np.arange(4, dtype=np.float32)
    owner, ref = new_owner(buf)
    before = sys.getrefcount(owner)
    arr = np.from_dlpack(Producer(dl, owner, 2, 32))
    t = torch.from_dlpack(Producer(dl, owner, 2, 32))
    capsule = dl.make_capsule(owner, buf.ctypes.data, (4,), (1,), 2, 32, 1, 1, 0, True, False)
    del arr, t, capsule
    gc.collect()
    assert ref() is owner
    assert sys.getrefcount(owner) == before
    np.testing.assert_array_equal(owner.buf, np.arange(4))


def test_torch_tensor_released_in_worker_thread(dl: ModuleType) -> None:
    buf = np.arange(16, dtype=np.float32)
    owner = Owner(buf)
    died_in: list[int] = []
    ref = weakref.ref(owner, lambda _: died_in.append(threading.get_ident()))
    box = [torch.from_dlpack(Producer(dl, owner, 2, 32))]
    del owner

    def drop() -> None:
        assert float(box[0].sum()) == 120.0
        box.clear()  # the last reference: the deleter runs on this thread

    worker = threading.Thread(target=drop)
    worker.start()
    worker.join()
    assert_released(ref)
    assert died_in == [worker.ident]


# ---- the C structs, read with ctypes as a consumer would ----------------------------


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # a plain C call: ctypes drops the GIL
_CAPI = ctypes.PyDLL(None)  # own instance, so these signatures do not leak into pythonapi
_CAPI.PyCapsule_GetPointer.restype = ctypes.c_void_p
_CAPI.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_CAPI.PyCapsule_SetName.restype = ctypes.c_int
_CAPI.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
USED_NAMES = {False: b"used_dltensor", True: b"used_dltensor_versioned"}  # must outlive capsules


@pytest.mark.parametrize("versioned", [False, True], ids=["legacy", "versioned"])
def test_deleter_called_without_gil_from_foreign_thread(dl: ModuleType, versioned: bool) -> None:
    # The mirror above has dlpack.h's offsets (x86-64/aarch64), so this also checks the C layout.
    assert ctypes.sizeof(DLTensor) == 48 and DLManagedTensor.deleter.offset == 56
    assert DLManagedTensorVersioned.dl_tensor.offset == 32
    buf = np.arange(6, dtype=np.int64).reshape(2, 3)
    owner, ref = new_owner(buf)
    capsule = dl.make_capsule(
        owner, buf.ctypes.data, (2, 3), (3, 1), 0, 64, 1, 1, 0, versioned, True
    )
    name = b"dltensor_versioned" if versioned else b"dltensor"
    ptr = _CAPI.PyCapsule_GetPointer(capsule, name)
    if versioned:
        mv = DLManagedTensorVersioned.from_address(ptr)
        assert (mv.version.major, mv.version.minor) == (1, 0) and mv.flags == 1
        tensor, ctx, deleter = mv.dl_tensor, mv.manager_ctx, mv.deleter
    else:
        m = DLManagedTensor.from_address(ptr)
        tensor, ctx, deleter = m.dl_tensor, m.manager_ctx, m.deleter
    assert ctx == id(owner)
    assert tensor.data == buf.ctypes.data and tensor.byte_offset == 0 and tensor.ndim == 2
    assert (tensor.device.device_type, tensor.device.device_id) == (1, 0)
    assert (tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes) == (0, 64, 1)
    assert tensor.shape[:2] == [2, 3] and tensor.strides[:2] == [3, 1]
    del owner, tensor
    # Consume the capsule as a C consumer does, then call the deleter with the GIL released.
    assert _CAPI.PyCapsule_SetName(capsule, USED_NAMES[versioned]) == 0
    assert_alive(ref)
    worker = threading.Thread(target=DELETER(deleter), args=(ptr,))
    worker.start()
    worker.join()
    assert_released(ref)
    with pytest.raises(ValueError, match="already consumed"):
        dl.capsule_info(capsule)
    del capsule  # renamed: its destructor must not run the deleter a second time


def test_numpy_rejecting_bfloat16_keeps_interpreter_healthy(dl: ModuleType) -> None:
    """NumPy destroys the capsule with its own exception pending; 1000 times, in a child."""
    child = textwrap.dedent(
        """
        import gc, sys, weakref
        import ml_dtypes, numpy as np
        from tensorbroker.client import _dlpack as dl

        released = 0

        class Owner:
            def __init__(self, buf):
                self.buf = buf
            def __del__(self):  # runs inside the capsule destructor, NumPy's error pending
                global released
                try:
                    raise KeyError("handled")
                except KeyError:
                    released += 1

        class P:
            def __init__(self, owner, legacy, code=4, bits=16):
                self.owner, self.legacy, self.code, self.bits = owner, legacy, code, bits
            def __dlpack__(self, max_version=None, **kwargs):
                b = self.owner.buf
                versioned = max_version is not None and not self.legacy
                return dl.make_capsule(self.owner, b.ctypes.data, b.shape, (1,), self.code,
                                       self.bits, 1, 1, 0, versioned, False)
            def __dlpack_device__(self):
                return (1, 0)

        buf = np.arange(8).astype(ml_dtypes.bfloat16)
        kinds = set()
        for i in range(1000):
            owner = Owner(buf)
            ref = weakref.ref(owner)
            p = P(owner, legacy=i % 2 == 1)
            del owner
            try:
                np.from_dlpack(p)
            except Exception as e:
                kinds.add(type(e).__name__)
            else:
                sys.exit("NumPy accepted a bfloat16 capsule")
            del p
            if ref() is not None:
                gc.collect()
            assert ref() is None, f"owner leaked at iteration {i}"
            assert sys.exc_info() == (None, None, None)
        assert released == 1000, released
        # Leave an unconsumed capsule and a consumer's array alive for interpreter shutdown.
        keep = dl.make_capsule(Owner(buf), buf.ctypes.data, (8,), (1,), 4, 16, 1, 1, 0,
                               False, False)
        f32 = np.arange(8, dtype=np.float32)
        f32_arr = np.from_dlpack(P(Owner(f32), legacy=False, code=2, bits=32))
        print(",".join(sorted(kinds)))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", child],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "returned NULL" not in proc.stderr and "SystemError" not in proc.stderr
    kinds = set(proc.stdout.strip().split(","))
    assert kinds and kinds <= {"BufferError", "RuntimeError", "TypeError", "ValueError"}, kinds


# ---- capsule_info on other producers' capsules --------------------------------------


def row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


def check_info(info: tuple[Any, ...], address: int, shape: tuple[int, ...], strides: Any,
               code: int, bits: int, readonly: bool = False) -> None:  # fmt: skip
    data, got_shape, got_strides, got_code, got_bits, lanes, dev_type, dev_id, ro = info
    assert data == address
    assert got_shape == shape
    assert (got_strides if got_strides is not None else row_major(shape)) == strides
    assert (got_code, got_bits, lanes, dev_type, dev_id, ro) == (code, bits, 1, 1, 0, readonly)


@pytest.mark.parametrize("max_version", [None, (1, 0)], ids=["legacy", "versioned"])
def test_capsule_info_numpy(dl: ModuleType, max_version: Any) -> None:
    a = np.arange(24, dtype=np.float64).reshape(4, 6)[1:]
    info = dl.capsule_info(a.__dlpack__(max_version=max_version))
    check_info(info, a.ctypes.data, (3, 6), (6, 1), 2, 64)
    ro = np.arange(3, dtype=np.int32)
    ro.flags.writeable = False
    if max_version is not None:
        check_info(dl.capsule_info(ro.__dlpack__(max_version=max_version)), ro.ctypes.data,
                   (3,), (1,), 0, 32, readonly=True)  # fmt: skip


@pytest.mark.parametrize("max_version", [None, (1, 0)], ids=["legacy", "versioned"])
def test_capsule_info_torch(dl: ModuleType, max_version: Any) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    view = base[1:, ::2]  # non-contiguous, at a storage offset
    info = dl.capsule_info(view.__dlpack__(max_version=max_version))
    assert info[2] is not None
    check_info(info, view.data_ptr(), (3, 3), (6, 2), 2, 32)
    bf = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    check_info(dl.capsule_info(bf.__dlpack__(max_version=max_version)), bf.data_ptr(),
               (2, 3), (3, 1), 4, 16)  # fmt: skip


@pytest.mark.parametrize("max_version", [None, (1, 0)], ids=["legacy", "versioned"])
def test_capsule_info_jax(dl: ModuleType, max_version: Any) -> None:
    j = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
    info = dl.capsule_info(j.__dlpack__(max_version=max_version))
    check_info(info, j.unsafe_buffer_pointer(), (3, 4), (4, 1), 2, 32)
    jb = jnp.ones((5,), dtype=jnp.bfloat16)
    info = dl.capsule_info(jb.__dlpack__(max_version=max_version))
    check_info(info, jb.unsafe_buffer_pointer(), (5,), (1,), 4, 16)


def test_capsule_info_reading_then_dropping_leaves_producer_intact(dl: ModuleType) -> None:
    t = torch.arange(10, dtype=torch.int64)
    for _ in range(100):
        capsule = t.__dlpack__()
        data = dl.capsule_info(capsule)[0]
        assert np.ctypeslib.as_array((ctypes.c_int64 * 10).from_address(data)).sum() == 45
        del capsule  # torch's destructor frees its managed tensor
    assert t.sum().item() == 45


@pytest.mark.parametrize("versioned", [False, True], ids=["legacy", "versioned"])
@pytest.mark.parametrize("readonly", [False, True], ids=["writable", "readonly"])
def test_capsule_info_on_own_capsule(dl: ModuleType, versioned: bool, readonly: bool) -> None:
    buf = np.zeros(64, np.uint8)
    capsule = dl.make_capsule(buf, buf.ctypes.data + 8, (2, 3), (-3, 1), 1, 8, 4, 1, 0,
                              versioned, readonly)  # fmt: skip
    ro = readonly and versioned  # a legacy capsule has no flag
    expected = (buf.ctypes.data + 8, (2, 3), (-3, 1), 1, 8, 4, 1, 0, ro)
    assert dl.capsule_info(capsule) == expected


@pytest.mark.parametrize("consumer", ["numpy", "torch"])
def test_capsule_info_consumed_capsule(dl: ModuleType, consumer: str) -> None:
    buf = np.arange(4, dtype=np.float32)
    versioned = consumer == "numpy"
    capsule = dl.make_capsule(
        Owner(buf), buf.ctypes.data, (4,), (1,), 2, 32, 1, 1, 0, versioned, False
    )
    arr = {"numpy": np.from_dlpack, "torch": torch.from_dlpack}[consumer](Handing(capsule))
    with pytest.raises(ValueError, match="already consumed"):
        dl.capsule_info(capsule)
    torch_capsule = torch.arange(3).__dlpack__()  # a producer's capsule, consumed by torch
    torch.from_dlpack(torch_capsule)
    with pytest.raises(ValueError, match="already consumed"):
        dl.capsule_info(torch_capsule)
    del arr


def test_capsule_info_rejects_non_dlpack(dl: ModuleType) -> None:
    with pytest.raises(TypeError, match="expected a DLPack capsule"):
        dl.capsule_info(np.arange(3))
    with pytest.raises(TypeError, match="not a DLPack capsule"):
        dl.capsule_info(datetime.datetime_CAPI)


def test_capsule_info_refuses_other_major_version(dl: ModuleType) -> None:
    buf = np.arange(4, dtype=np.float32)
    owner, ref = new_owner(buf)
    capsule = dl.make_capsule(owner, buf.ctypes.data, (4,), (1,), 2, 32, 1, 1, 0, True, False)
    del owner
    mv = DLManagedTensorVersioned.from_address(
        _CAPI.PyCapsule_GetPointer(capsule, b"dltensor_versioned")
    )
    mv.version.major = 2
    with pytest.raises(ValueError, match="unsupported DLPack version 2.0"):
        dl.capsule_info(capsule)
    mv.version.major = 1
    assert dl.capsule_info(capsule)[1] == (4,)
    del capsule, mv
    assert_released(ref)


# ---- argument validation -------------------------------------------------------------

GOOD: dict[str, Any] = dict(
    data=4096, shape=(2, 3), strides=(3, 1), code=2, bits=32, lanes=1,
    device_type=1, device_id=0, versioned=True, readonly=False,
)  # fmt: skip


@pytest.mark.parametrize(
    ("changes", "exc", "match"),
    [
        ({"strides": (1,)}, ValueError, "strides has 1 entries but shape has 2"),
        (
            {"shape": (1,) * 65, "strides": (1,) * 65},
            ValueError,
            "ndim 65 exceeds the maximum of 64",
        ),
        ({"shape": (2, -1)}, ValueError, r"shape\[1\] is negative"),
        ({"shape": [2, 3]}, TypeError, "tuple"),
        ({"strides": (3, "1")}, TypeError, r"strides\[1\] must be an int"),
        ({"shape": (2**63, 1)}, ValueError, "does not fit in int64"),
        ({"data": 1.5}, TypeError, "data must be an int"),
        ({"data": -1}, ValueError, "non-negative address"),
        ({"code": 256}, ValueError, "code must be in"),
        ({"bits": 0}, ValueError, "bits must be in"),
        ({"lanes": 0}, ValueError, "lanes must be in"),
        ({"device_type": 0}, ValueError, "device_type must be in"),
        ({"device_id": -1}, ValueError, "device_id must be in"),
    ],
)
@pytest.mark.parametrize("positional", [False, True], ids=["keywords", "positional"])
def test_make_capsule_validation(
    dl: ModuleType, changes: dict[str, Any], exc: type, match: str, positional: bool
) -> None:
    """The same checks whether the arguments come by keyword (the general parser) or as the
    eleven positional ones every __dlpack__ passes (a parser of their own)."""
    owner = Owner(np.zeros(1))
    before = sys.getrefcount(owner)
    args = {**GOOD, **changes}
    with pytest.raises(exc, match=match):
        if positional:
            dl.make_capsule(owner, *args.values())
        else:
            dl.make_capsule(owner, **args)
    assert sys.getrefcount(owner) == before


def test_make_capsule_positional_ints_are_range_checked(dl: ModuleType) -> None:
    args = list(GOOD.values())
    args[3] = 2**40  # code, past an int
    with pytest.raises(OverflowError):
        dl.make_capsule(None, *args)
    args[3] = 2.0
    with pytest.raises(TypeError):
        dl.make_capsule(None, *args)


def test_make_capsule_limits_accepted(dl: ModuleType) -> None:
    shape = (1,) * 64
    capsule = dl.make_capsule(None, 0, shape, shape, 2, 32, 1, 2, 3, False, True)
    assert dl.capsule_info(capsule) == (0, shape, shape, 2, 32, 1, 2, 3, False)
    empty = dl.make_capsule(None, 0, (0, 5), (5, 1), 2, 32, 1, 1, 0, True, False)
    assert dl.capsule_info(empty)[1] == (0, 5)
    assert dl.DLPACK_VERSION == (1, 0) and dl.FLAG_READ_ONLY == 1 and dl.MAX_NDIM == 64


def _flags(capsule: Any) -> int:
    ptr = _CAPI.PyCapsule_GetPointer(capsule, b"dltensor_versioned")
    return int(DLManagedTensorVersioned.from_address(ptr).flags)


@pytest.mark.parametrize("copied", [False, True])
@pytest.mark.parametrize("readonly", [False, True])
def test_is_copied_flag(dl: ModuleType, readonly: bool, copied: bool) -> None:
    """DLPack 1.0: "when a copy happens, the flag DLPACK_FLAG_BITMASK_IS_COPIED must be set"."""
    buf = aligned(np.arange(4, dtype=np.float32))
    capsule = dl.make_capsule(
        Owner(buf), buf.ctypes.data, (4,), (1,), 2, 32, 1, 1, 0, True, readonly, copied=copied
    )
    want = (dl.FLAG_READ_ONLY if readonly else 0) | (dl.FLAG_IS_COPIED if copied else 0)
    assert _flags(capsule) == want
    assert dl.FLAG_IS_COPIED == 2  # the bit the header defines


@pytest.mark.parametrize("consumer", list(CONSUMERS))
@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5, 2)])
def test_size_zero_tensor_has_null_data(
    dl: ModuleType, consumer: str, shape: tuple[int, ...]
) -> None:
    """DLPack: "for a tensor with size 0, data should be NULL"; every consumer takes it."""
    buf = aligned(np.zeros(8, dtype=np.float32))
    strides = row_major(shape)
    capsule = dl.make_capsule(Owner(buf), buf.ctypes.data, shape, strides, 2, 32, 1, 1, 0, False,
                              False)  # fmt: skip
    assert dl.capsule_info(capsule)[0] == 0
    view = buf[:0].reshape(shape)
    arr, _ = CONSUMERS[consumer](Producer(dl, Owner(buf), 2, 32, view=view))
    assert tuple(arr.shape) == shape and host_copy(arr).size == 0
