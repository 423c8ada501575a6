"""A simulated CUDA runtime for testing the device protocol where there is no GPU.

It stands in for `common.cudart.CupyRuntime` inside ONE process (a broker thread and its
clients share it): "device memory" is host memory, an IPC handle names an allocation, and
copies happen at once. What it models faithfully is what the protocol must get right: which
stream each event is recorded on and which stream waits on which event, that handles are
opened once, and that an event recorded after work on a *busy* stream stays incomplete until
the test lets that stream finish (`finish`). It proves the bookkeeping, not the GPU: the
tests in tests/gpu run the same paths on a real device.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections import Counter
from typing import Any

from tensorbroker.common.cudart import STREAM_LEGACY


class SimRuntime:
    def __init__(self, devices: int = 2, memory: int = 1 << 30) -> None:
        self.devices, self.memory = devices, memory
        self.calls: list[tuple[Any, ...]] = []  # (name, device, args...) in order
        self.opened: Counter[bytes] = Counter()  # handle -> times opened
        self._lock = threading.Lock()
        self._buffers: dict[int, Any] = {}
        self._handles: dict[bytes, int] = {}  # memory or event handle -> pointer or event
        self._next_event = 0x1000
        self._busy: set[int] = set()  # streams with unfinished work
        self._pending: dict[int, int] = {}  # event -> busy stream it waits for
        self._next_stream = 0x7000
        self.shared: set[int] = set()  # interprocess events (the broker's)
        self._poisoned: set[int] = set()  # events recorded by a process that died
        self._mapped: dict[int, Any] = {}  # address -> mmap of a memfd (vmm_malloc, vmm_open)

    # -- test controls -----------------------------------------------------------------

    def busy(self, stream: int) -> None:
        """Pretend a long kernel is running on `stream`."""
        self._busy.add(stream)

    def finish(self, stream: int) -> None:
        """The kernels on `stream` are done: events recorded after them complete."""
        with self._lock:
            self._busy.discard(stream)
            self._pending = {e: s for e, s in self._pending.items() if s != stream}

    def kill(self, stream: int) -> None:
        """The process that queued the work on `stream` died: events recorded behind it never
        complete, not even when recorded again (seen on an H100: bench/gpu_probes.py)."""
        with self._lock:
            self._poisoned.update(e for e, s in self._pending.items() if s == stream)

    def called(self, name: str) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == name]

    def records(self) -> list[tuple[Any, ...]]:
        """Records of the broker's interprocess events (not clients' private fences)."""
        return [c for c in self.called("record") if c[2] in self.shared]

    def _log(self, *call: Any) -> None:
        with self._lock:
            self.calls.append(call)

    # -- Runtime -------------------------------------------------------------------------

    def device_count(self) -> int:
        return self.devices

    def mem_info(self, device: int) -> tuple[int, int]:
        return self.memory, self.memory

    def malloc(self, device: int, size: int) -> int:
        buffer = ctypes.create_string_buffer(size)
        ptr = ctypes.addressof(buffer)
        with self._lock:
            self._buffers[ptr] = buffer
        self._log("malloc", device, size)
        return ptr

    def free(self, device: int, ptr: int) -> None:
        with self._lock:
            del self._buffers[ptr]
        self._log("free", device, ptr)

    def mem_handle(self, device: int, ptr: int) -> bytes:
        handle = b"mem" + ptr.to_bytes(8, "little") + bytes(53)
        self._handles[handle] = ptr
        return handle

    def open_mem(self, device: int, handle: bytes) -> int:
        self.opened[handle] += 1
        self._log("open_mem", device, handle)
        return self._handles[handle]

    def close_mem(self, device: int, ptr: int) -> None:
        self._log("close_mem", device, ptr)

    def new_event(self, device: int, interprocess: bool) -> int:
        with self._lock:
            self._next_event += 1
            if interprocess:
                self.shared.add(self._next_event)
            return self._next_event

    def event_handle(self, device: int, event: int) -> bytes:
        handle = b"evt" + event.to_bytes(8, "little") + bytes(53)
        self._handles[handle] = event
        return handle

    def open_event(self, device: int, handle: bytes) -> int:
        self.opened[handle] += 1
        return self._handles[handle]

    def destroy_event(self, device: int, event: int) -> None:
        self._log("destroy_event", device, event)

    def event_done(self, device: int, event: int) -> bool:
        with self._lock:
            return event not in self._pending and event not in self._poisoned

    def record(self, device: int, event: int, stream: int) -> None:
        self._log("record", device, event, stream)
        with self._lock:
            waiting_for = [s for s in (stream,) if s in self._busy]
            if waiting_for:
                self._pending[event] = waiting_for[0]
            else:
                self._pending.pop(event, None)

    def wait(self, device: int, stream: int, event: int) -> None:
        self._log("wait", device, stream, event)
        with self._lock:  # a stream that waits on pending work is as busy as that work
            source = self._pending.get(event)
            if source is not None:
                self._busy.add(stream)
                self._pending.update({e: stream for e, s in self._pending.items() if s == source})

    def new_stream(self, device: int) -> int:
        with self._lock:
            self._next_stream += 1
            return self._next_stream

    def copy_async(self, device: int, dst: int, src: int, size: int, stream: int) -> None:
        self._log("copy", device, stream, size)
        ctypes.memmove(dst, src, size)

    def copy_batch(self, device: int, copies: list[list[int]]) -> None:
        self._log("copy_batch", device, len(copies))
        for dst, src, size, stream in copies:
            self.copy_async(device, dst, src, size, stream)

    # Memory a file descriptor names: a memfd, mapped where the broker made it and again
    # where a client opens the descriptor it was passed (the same pages: real sharing).
    vmm = True  # vmm_supported; a test may say no

    def vmm_supported(self, device: int) -> bool:
        return self.vmm

    def vmm_malloc(self, device: int, size: int) -> tuple[int, int]:
        fd = os.memfd_create(f"simcuda-{device}")
        os.ftruncate(fd, size)
        ptr = self._map(fd, size)
        self._log("vmm_malloc", device, size)
        return ptr, fd

    def vmm_open(self, device: int, fd: int, size: int) -> int:
        self._log("vmm_open", device, size)
        return self._map(fd, size)

    def vmm_close(self, device: int, ptr: int, size: int) -> None:
        self._log("vmm_close", device, ptr)
        with self._lock:
            self._mapped.pop(ptr).close()

    def _map(self, fd: int, size: int) -> int:
        mapping = mmap.mmap(fd, size)
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        with self._lock:
            self._mapped[ptr] = mapping
        return ptr

    def synchronize(self, device: int) -> None:
        self._log("synchronize", device)

    def stream_synchronize(self, device: int, stream: int) -> None:
        self._log("stream_synchronize", device, stream)


class SimCudaTensor:
    """A producer's CUDA tensor, as DLPack shows it: device (kDLCUDA, N), memory of the
    simulated device. Remembers the stream each consumer asked for."""

    def __init__(self, rt: SimRuntime, device: int, values: Any) -> None:
        import numpy as np

        from tensorbroker.client import _dlpack

        self._dlpack = _dlpack
        self.values = np.ascontiguousarray(values)
        self.device = device
        self.ptr = rt.malloc(device, max(self.values.nbytes, 1))
        ctypes.memmove(self.ptr, self.values.ctypes.data, self.values.nbytes)
        self.streams: list[Any] = []

    def view(self, start: int, stop: int) -> SimCudaTensor:
        """Elements [start, stop) of this 1-D tensor, over the same memory (a flat parameter
        buffer's tensors)."""
        v = object.__new__(SimCudaTensor)
        v._dlpack, v.device, v.streams = self._dlpack, self.device, []
        v.values = self.values[start:stop]
        v.ptr = self.ptr + start * self.values.itemsize
        return v

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, self.device)

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, **_: Any) -> Any:
        from tensorbroker.common.descriptors import compact_strides
        from tensorbroker.common.dtypes import dtype

        self.streams.append(stream)
        dt = dtype(self.values.dtype)
        versioned = max_version is not None and max_version[0] >= 1
        return self._dlpack.make_capsule(
            self, self.ptr, self.values.shape, compact_strides(self.values.shape), dt.code,
            dt.bits, 1, 2, self.device,
            versioned, False,
        )  # fmt: skip


__all__ = ["STREAM_LEGACY", "SimCudaTensor", "SimRuntime"]
