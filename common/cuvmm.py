"""GPU memory a file descriptor names: the CUDA driver's virtual memory management, through
ctypes (CuPy's runtime module has no binding for it). Note [device handles] in
server/store/devices.py says why and when it is used.

The broker makes a chunk with `cuMemCreate` (a POSIX file descriptor as its shareable
handle), maps it and exports the descriptor (`create`); a client that received that
descriptor over its Unix socket imports and maps it (`open_fd`). Unlike a legacy IPC
handle (64 bytes that any process of any user may open), a descriptor reaches only the
processes it is passed to, after the broker's own checks.

NOT YET RUN ON A GPU: written against the CUDA 12/13 driver API headers (cuda.h) and tested
only through the simulated runtime (tests/simcuda.py). `serve --cuda-handles vmm` turns it
on; the default stays the legacy handles until a GPU run checks it.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

ALLOCATION_PINNED = 0x1  # CU_MEM_ALLOCATION_TYPE_PINNED
HANDLE_POSIX_FD = 0x1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
LOCATION_DEVICE = 0x1  # CU_MEM_LOCATION_TYPE_DEVICE
ACCESS_READWRITE = 0x3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
GRANULARITY_MINIMUM = 0x0  # CU_MEM_ALLOC_GRANULARITY_MINIMUM
FD_SUPPORTED = 103  # CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
VMM_SUPPORTED = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class Vmm:
    """The driver calls, on the context the CUDA runtime made current (CupyRuntime._on)."""

    def __init__(self) -> None:
        self._cu: Any = ctypes.CDLL("libcuda.so.1")

    def _call(self, name: str, *args: Any) -> None:
        status = getattr(self._cu, name)(*args)
        if status != 0:
            raise RuntimeError(f"{name} failed: CUDA driver error {status}")

    def supported(self, device: int) -> bool:
        """Whether `device` makes memory a file descriptor can name."""
        for attribute in (VMM_SUPPORTED, FD_SUPPORTED):
            value = ctypes.c_int(0)
            self._call("cuDeviceGetAttribute", ctypes.byref(value), attribute, device)
            if not value.value:
                return False
        return True

    def _prop(self, device: int) -> _Prop:
        prop = _Prop()
        prop.type, prop.requestedHandleTypes = ALLOCATION_PINNED, HANDLE_POSIX_FD
        prop.location = _Location(LOCATION_DEVICE, device)
        return prop

    def _map(self, device: int, handle: ctypes.c_ulonglong, size: int) -> int:
        """Reserve addresses for `size` bytes, map the allocation there, allow the device."""
        ptr = ctypes.c_ulonglong(0)
        self._call("cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(size),
                   ctypes.c_size_t(0), ctypes.c_ulonglong(0), ctypes.c_ulonglong(0))  # fmt: skip
        try:
            self._call("cuMemMap", ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), handle,
                       ctypes.c_ulonglong(0))  # fmt: skip
            try:
                access = _Access(_Location(LOCATION_DEVICE, device), ACCESS_READWRITE)
                self._call("cuMemSetAccess", ptr, ctypes.c_size_t(size), ctypes.byref(access),
                           ctypes.c_size_t(1))  # fmt: skip
            except BaseException:
                self._cu.cuMemUnmap(ptr, ctypes.c_size_t(size))
                raise
        except BaseException:
            self._cu.cuMemAddressFree(ptr, ctypes.c_size_t(size))
            raise
        return int(ptr.value)

    def create(self, device: int, size: int) -> tuple[int, int]:
        """A new chunk of `size` bytes (a multiple of the granularity): its address here and
        a file descriptor naming it."""
        prop = self._prop(device)
        handle = ctypes.c_ulonglong(0)
        self._call("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(size),
                   ctypes.byref(prop), ctypes.c_ulonglong(0))  # fmt: skip
        try:
            fd = ctypes.c_int(-1)
            self._call("cuMemExportToShareableHandle", ctypes.byref(fd), handle,
                       HANDLE_POSIX_FD, ctypes.c_ulonglong(0))  # fmt: skip
            try:
                return self._map(device, handle, size), fd.value
            except BaseException:
                os.close(fd.value)
                raise
        finally:  # the mapping (and the descriptor) keep the memory
            self._cu.cuMemRelease(handle)

    def open_fd(self, device: int, fd: int, size: int) -> int:
        """Map the chunk `fd` names (`size` bytes) here: its address. The caller closes fd."""
        handle = ctypes.c_ulonglong(0)
        self._call("cuMemImportFromShareableHandle", ctypes.byref(handle),
                   ctypes.c_void_p(fd), HANDLE_POSIX_FD)  # fmt: skip
        try:
            return self._map(device, handle, size)
        finally:
            self._cu.cuMemRelease(handle)

    def close(self, ptr: int, size: int) -> None:
        """Unmap a chunk mapped by `create` or `open_fd` (its memory goes once every process
        unmapped it and every descriptor is closed)."""
        self._call("cuMemUnmap", ctypes.c_ulonglong(ptr), ctypes.c_size_t(size))
        self._call("cuMemAddressFree", ctypes.c_ulonglong(ptr), ctypes.c_size_t(size))
