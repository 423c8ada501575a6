"""The few CUDA runtime calls tensorbroker makes, through CuPy, and the device names it reads.

Both sides use the same small surface: the broker allocates device chunks, exports their IPC
handles and owns the interprocess events; clients open those handles and events, copy, and
record and wait on events. CuPy is imported only when a CUDA path is used, so a host-only
install never needs it. Tests of the protocol logic substitute an object with the same
methods (see `Runtime`).

Note [broker-owned events]

    The broker creates every interprocess event (`cudaEventInterprocess |
    cudaEventDisableTiming`) and hands out their handles. A producer records the object's
    write event on the stream it copied on; a reader records its lease's read-done event on
    the streams it read on. CUDA allows `cudaEventRecord` on an event opened through IPC, and
    makes any use of an imported event after its exporter destroyed it undefined: so the
    exporter is the one process that outlives every producer and reader.

    Seen on an H100 (driver 580, CUDA 13; bench/gpu_probes.py, 2026-11-23):
    - A record is visible to the broker as soon as cudaEventRecord returns in the client: 20
      of 20 queries made right after a record behind a 50 ms kernel said "not ready", and
      each turned "done" 50.5 to 50.8 ms later. No flush is needed between record and seal.
    - An event recorded by a process that is then killed, its work still queued, stays
      "not ready" for good, and so does every later record of it by a live process (5 s
      after a record behind a 0.5 s kernel). See Note [events of dead processes] in
      server/store/devices.py.
    - Not observed (the machine had one GPU): whether `CupyRuntime._on`, which sets the
      device back to the thread's previous one, makes a context on cuda:0 in a process that
      only uses cuda:1.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any, Protocol

from .errors import InvalidRequest

KDL_CPU, KDL_CUDA, KDL_CUDA_HOST = 1, 2, 3

# Stream handles with a fixed meaning in the CUDA runtime.
STREAM_LEGACY = 1  # cudaStreamLegacy: the legacy default stream
STREAM_PER_THREAD = 2  # cudaStreamPerThread: the calling thread's default stream

EVENT_DISABLE_TIMING, EVENT_INTERPROCESS = 0x2, 0x4
IPC_LAZY_PEER_ACCESS = 0x1
STREAM_NON_BLOCKING = 0x1
MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from unified addressing
NOT_READY = 600  # cudaErrorNotReady

CHUNK_ALIGN = 2 * 2**20  # device chunks are whole 2 MiB pages
VMM_HANDLE = b"vmm:"  # a chunk's handle that names a VMM chunk: a client asks for its fd
# (a legacy IPC handle is 64 bytes; a VMM chunk's is shorter: devices.py DeviceChunk)
_DEVICE = re.compile(r"cuda(?::(\d+))?")


class CudaUnavailable(Exception):
    """This process cannot use CUDA; the message says why and what to do."""


def parse_device(device: Any, what: str) -> str:
    """'cpu', 'cuda' (= 'cuda:0'), 'cuda:N', a torch.device or an (kind, N) DLPack pair ->
    the canonical name ('cpu' or 'cuda:N'). InvalidRequest for anything else."""
    if isinstance(device, tuple) and len(device) == 2:
        kind, index = device
        if kind in (KDL_CPU, KDL_CUDA_HOST):
            return "cpu"
        if kind == KDL_CUDA:
            return f"cuda:{int(index)}"
    text = str(device)  # torch.device('cuda', 1) prints as cuda:1
    if text == "cpu":
        return "cpu"
    match = _DEVICE.fullmatch(text)
    if match is None:
        raise InvalidRequest(
            f"{what}: unknown device {device!r}; use 'cpu' or 'cuda:N' (N the GPU's index)"
        )
    return f"cuda:{int(match.group(1) or 0)}"


def device_index(device: str) -> int:
    """The N of 'cuda:N'."""
    return int(device.partition(":")[2])


class Runtime(Protocol):
    """The CUDA runtime calls tensorbroker uses (CupyRuntime; a simulated one in tests)."""

    def device_count(self) -> int: ...
    def mem_info(self, device: int) -> tuple[int, int]: ...
    def malloc(self, device: int, size: int) -> int: ...
    def free(self, device: int, ptr: int) -> None: ...
    def mem_handle(self, device: int, ptr: int) -> bytes: ...
    def open_mem(self, device: int, handle: bytes) -> int: ...
    def close_mem(self, device: int, ptr: int) -> None: ...
    def new_event(self, device: int, interprocess: bool) -> int: ...
    def event_handle(self, device: int, event: int) -> bytes: ...
    def open_event(self, device: int, handle: bytes) -> int: ...
    def destroy_event(self, device: int, event: int) -> None: ...
    def event_done(self, device: int, event: int) -> bool: ...
    def record(self, device: int, event: int, stream: int) -> None: ...
    def wait(self, device: int, stream: int, event: int) -> None: ...
    def new_stream(self, device: int) -> int: ...
    def copy_async(self, device: int, dst: int, src: int, size: int, stream: int) -> None: ...
    def copy_batch(self, device: int, copies: list[list[int]]) -> None: ...
    def synchronize(self, device: int) -> None: ...
    # Memory a file descriptor names (common/cuvmm.py, Note [device handles] in devices.py):
    def vmm_supported(self, device: int) -> bool: ...
    def vmm_malloc(self, device: int, size: int) -> tuple[int, int]: ...  # address, fd
    def vmm_open(self, device: int, fd: int, size: int) -> int: ...
    def vmm_close(self, device: int, ptr: int, size: int) -> None: ...
    def stream_synchronize(self, device: int, stream: int) -> None: ...


class CupyRuntime:
    """`Runtime` over `cupy.cuda.runtime`. Every call names its device and leaves the calling
    thread's current device as it found it (user code on this thread relies on it)."""

    def __init__(self) -> None:
        try:
            from cupy.cuda import runtime
        except ImportError as exc:
            raise CudaUnavailable(
                f"CuPy is not installed here ({exc}); install it where the broker and the "
                "clients run: pip install 'tensorbroker[cuda12]' (or [cuda13], after your CUDA)"
            ) from None
        self._rt = runtime
        try:
            self._count = int(runtime.getDeviceCount())
        except Exception as exc:  # CUDARuntimeError: no driver, no device
            raise CudaUnavailable(f"CuPy finds no usable CUDA device: {exc}") from None
        if self._count == 0:
            raise CudaUnavailable("CuPy finds no CUDA device on this machine")
        self._vmm_calls: Any = None  # common/cuvmm.py's, made at first use

    @contextlib.contextmanager
    def _on(self, device: int) -> Iterator[Any]:
        rt = self._rt
        previous = rt.getDevice()
        if previous != device:
            rt.setDevice(device)
        try:
            yield rt
        finally:
            if previous != device:
                rt.setDevice(previous)

    def device_count(self) -> int:
        return self._count

    def mem_info(self, device: int) -> tuple[int, int]:
        with self._on(device) as rt:
            free, total = rt.memGetInfo()
            return int(free), int(total)

    def malloc(self, device: int, size: int) -> int:
        with self._on(device) as rt:
            return int(rt.malloc(size))

    def free(self, device: int, ptr: int) -> None:
        with self._on(device) as rt:
            rt.free(ptr)

    def mem_handle(self, device: int, ptr: int) -> bytes:
        with self._on(device) as rt:
            return bytes(rt.ipcGetMemHandle(ptr))

    def open_mem(self, device: int, handle: bytes) -> int:
        with self._on(device) as rt:
            return int(rt.ipcOpenMemHandle(handle, IPC_LAZY_PEER_ACCESS))

    def close_mem(self, device: int, ptr: int) -> None:
        with self._on(device) as rt:
            rt.ipcCloseMemHandle(ptr)

    def new_event(self, device: int, interprocess: bool) -> int:
        flags = EVENT_DISABLE_TIMING | (EVENT_INTERPROCESS if interprocess else 0)
        with self._on(device) as rt:
            return int(rt.eventCreateWithFlags(flags))

    def event_handle(self, device: int, event: int) -> bytes:
        with self._on(device) as rt:
            return bytes(rt.ipcGetEventHandle(event))

    def open_event(self, device: int, handle: bytes) -> int:
        with self._on(device) as rt:
            return int(rt.ipcOpenEventHandle(handle))

    def destroy_event(self, device: int, event: int) -> None:
        with self._on(device) as rt:
            rt.eventDestroy(event)

    def event_done(self, device: int, event: int) -> bool:
        """True once the work the event last captured has finished (or it was never
        recorded). Any error but 'not ready' counts as done: its recorder is gone."""
        with self._on(device) as rt:
            return int(rt.eventQuery(event)) != NOT_READY

    def record(self, device: int, event: int, stream: int) -> None:
        with self._on(device) as rt:
            rt.eventRecord(event, stream)

    def wait(self, device: int, stream: int, event: int) -> None:
        with self._on(device) as rt:
            rt.streamWaitEvent(stream, event, 0)

    def new_stream(self, device: int) -> int:
        with self._on(device) as rt:
            return int(rt.streamCreateWithFlags(STREAM_NON_BLOCKING))

    def copy_async(self, device: int, dst: int, src: int, size: int, stream: int) -> None:
        with self._on(device) as rt:
            rt.memcpyAsync(dst, src, size, MEMCPY_DEFAULT, stream)

    def copy_batch(self, device: int, copies: list[list[int]]) -> None:
        """Enqueue [destination, source, bytes, stream] copies, in order, under one switch
        of the current device (a state_dict's hundreds of tensors paid one each)."""
        with self._on(device) as rt:
            memcpy = rt.memcpyAsync
            for dst, src, size, stream in copies:
                memcpy(dst, src, size, MEMCPY_DEFAULT, stream)

    def synchronize(self, device: int) -> None:
        with self._on(device) as rt:
            rt.deviceSynchronize()

    def stream_synchronize(self, device: int, stream: int) -> None:
        with self._on(device) as rt:
            rt.streamSynchronize(stream)

    def _vmm(self, rt: Any) -> Any:
        """The driver's VMM calls, with the device's primary context current (a runtime
        call makes it so)."""
        from .cuvmm import Vmm

        rt.memGetInfo()
        if self._vmm_calls is None:
            self._vmm_calls = Vmm()
        return self._vmm_calls

    def vmm_supported(self, device: int) -> bool:
        try:
            with self._on(device) as rt:
                return bool(self._vmm(rt).supported(device))
        except (OSError, RuntimeError):  # no libcuda.so.1 to load, or an old driver
            return False

    def vmm_malloc(self, device: int, size: int) -> tuple[int, int]:
        with self._on(device) as rt:
            return self._vmm(rt).create(device, size)  # type: ignore[no-any-return]

    def vmm_open(self, device: int, fd: int, size: int) -> int:
        with self._on(device) as rt:
            return int(self._vmm(rt).open_fd(device, fd, size))

    def vmm_close(self, device: int, ptr: int, size: int) -> None:
        with self._on(device) as rt:
            self._vmm(rt).close(ptr, size)


def load() -> Runtime:
    """The CUDA runtime of this process; CudaUnavailable says why there is none."""
    return CupyRuntime()
