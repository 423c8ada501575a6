"""The CUDA side of a client: IPC handles and events opened once, the DLPack stream rules,
copies into device memory, and the events that order producers, readers and reuse.

Note [device handoff]

    producer: copy on its stream S ─> record write event W on S ─> seal     (no host wait)
    reader:   __dlpack__(stream=R) ─> R waits on W ─> kernels read on R
              last array gone ─> record read-done event D on R ─> release
    broker:   block reused only once W and every D have completed

The events are the broker's (Note [broker-owned events] in common/cudart.py); this process
opens each one, and each chunk's memory handle, once per Client and keeps it open. Read-done
events are recorded by the release thread, never in a finaliser: a finaliser only queues.
Recording later than the read is conservative (the event then also covers later work on R),
never early.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ..common import cudart
from ..common.cudart import STREAM_LEGACY, VMM_HANDLE, CudaUnavailable, Runtime
from ..common.descriptors import compact_strides
from ..common.dtypes import DType
from ..common.errors import BrokerUnavailable, InvalidRequest, ProtocolError
from ..common.protocol import Op

log = logging.getLogger(__name__)

DRAIN_TIMEOUT = 30.0  # a closing client waits this long for its puts' copies to run


class Opened:
    """A chunk's memory or an event, opened from its IPC handle in this process. Closed when
    the last holder (the cache, a lease) lets go: a live array never loses its memory."""

    __slots__ = ("runtime", "device", "address", "is_event", "size", "__weakref__")

    def __init__(
        self, runtime: Runtime, device: int, address: int, is_event: bool, size: int = 0
    ) -> None:
        """`size`: a VMM chunk's, mapped from its descriptor (0: opened by an IPC handle)."""
        self.runtime, self.device, self.address, self.is_event = runtime, device, address, is_event
        self.size = size

    def __del__(self) -> None:
        if sys.is_finalizing():
            return  # the process is ending, and the driver with it
        try:
            if self.is_event:
                self.runtime.destroy_event(self.device, self.address)
            else:  # only after its Client closed: kernels may still read the memory
                self.runtime.synchronize(self.device)
                if self.size:
                    self.runtime.vmm_close(self.device, self.address, self.size)
                else:
                    self.runtime.close_mem(self.device, self.address)
        except Exception as exc:  # nothing to do about it in a finaliser but say so
            log.debug("closing an IPC %s on cuda:%d: %s", "event" if self.is_event else "handle",
                      self.device, exc)  # fmt: skip


# Chunks opened in this process, by IPC handle, shared by its Clients while any holds one.
# Process-wide on purpose: CUDA maps an IPC handle once per context, and a process has one
# context per device (opening a handle twice fails), so the owner here is the process.
_OPEN_CHUNKS: weakref.WeakValueDictionary[bytes, Opened] = weakref.WeakValueDictionary()
_OPEN_LOCK = threading.Lock()


def dlpack_stream(stream: Any) -> int | None:
    """The CUDA stream a DLPack consumer named: None and 1 the legacy default stream, 2 the
    per-thread default stream, -1 none (the consumer synchronises itself), else a pointer."""
    if stream is None or stream == 1:
        return STREAM_LEGACY
    if stream == -1:
        return None
    if type(stream) is not int or stream == 0 or stream < -1:
        raise BufferError(
            f"stream={stream!r} is not a CUDA stream under the DLPack rules: pass None or 1 "
            "(legacy default), 2 (per-thread default), -1 (no synchronisation) or a pointer"
        )
    return stream


def producer_stream(obj: Any, device: int) -> int:
    """The stream `obj`'s library is working on: a put copies there, after its writes."""
    module = type(obj).__module__.partition(".")[0]
    stream = 0
    if module == "torch":
        import torch

        stream = int(torch.cuda.current_stream(device).cuda_stream)
    elif module == "cupy":
        import cupy

        with cupy.cuda.Device(device):
            stream = int(cupy.cuda.get_current_stream().ptr)
    # JAX (and any other producer) is asked to make the legacy default stream wait for it.
    return stream or STREAM_LEGACY


class DeviceSource:
    """A device tensor being put: where its elements are, and what keeps them alive."""

    __slots__ = ("device", "ptr", "shape", "strides", "stream", "owner")

    def __init__(
        self,
        device: int,
        ptr: int,
        shape: tuple[int, ...],
        strides: tuple[int, ...] | None,
        stream: int,
        owner: Any,
    ) -> None:
        self.device, self.ptr, self.shape, self.strides = device, ptr, shape, strides
        self.stream, self.owner = stream, owner

    @property
    def compact(self) -> bool:
        """Row-major without gaps; the stride of a dimension of size 1 does not matter
        (torch gives those stride 1)."""
        if self.strides is None:
            return True
        expect = compact_strides(self.shape)
        return all(
            n <= 1 or s == e for n, s, e in zip(self.shape, self.strides, expect, strict=True)
        )


class DeviceLink:
    """One Client's CUDA state: the runtime (loaded at first use), opened chunks and events,
    puts whose sources must outlive their copies, and read-done events to record."""

    def __init__(self, runtime: Runtime | None = None) -> None:
        self._runtime = runtime
        # The connection that asks the broker for a VMM chunk's descriptor (`ask_through`),
        # held weakly: the release thread holds this link, and must not keep a Client alive.
        self._asks: Callable[[], Any] = lambda: None
        self._lock = threading.Lock()
        self._chunks: dict[bytes, Opened] = {}  # by handle
        self._events: dict[tuple[int, int], Opened] = {}
        self._private: dict[int, int] = {}  # device -> this client's stream for joining others
        self._inflight: list[tuple[int, int, Any]] = []  # (device, local event, what to keep)
        self._finishing: queue.SimpleQueue[tuple[Any, queue.SimpleQueue[int]]] = queue.SimpleQueue()

    def runtime(self, what: str) -> Runtime:
        if self._runtime is None:
            try:
                self._runtime = cudart.load()
            except CudaUnavailable as exc:
                raise InvalidRequest(f"{what}: this process cannot use CUDA: {exc}") from None
        return self._runtime

    # -- opening ---------------------------------------------------------------------------

    def chunk(self, device: int, name: str, handle: bytes) -> Opened:
        """Chunk `name`, opened once (by its handle: a restarted broker's chunk of the same
        name is another)."""
        found = self._chunks.get(handle)
        if found is None:
            rt = self.runtime(f"mapping {name}")
            vmm = len(handle) != 64 and handle.startswith(VMM_HANDLE)
            with _OPEN_LOCK:  # one opening per process: CUDA maps a handle once per context
                found = _OPEN_CHUNKS.get(handle)
                if found is None and not vmm:
                    ptr = rt.open_mem(device, handle)
                    found = _OPEN_CHUNKS[handle] = Opened(rt, device, ptr, is_event=False)
            if found is None:  # its descriptor asked for outside the lock: a request
                mapped = self._map_fd(rt, device, name)
                with _OPEN_LOCK:  # (mapped by another thread meanwhile: ours is dropped)
                    found = _OPEN_CHUNKS.setdefault(handle, mapped)
            self._chunks[handle] = found
        return found

    def ask_through(self, connection: Any) -> None:
        """Ask `connection` (Connection.fetch_fd) for the descriptors of VMM chunks."""
        self._asks = weakref.ref(connection)

    def _map_fd(self, rt: Runtime, device: int, name: str) -> Opened:
        """A VMM chunk, mapped from the descriptor its broker passes this client over its
        lane (Note [device handles] in server/store/devices.py)."""
        connection = self._asks()
        if connection is None:
            raise BrokerUnavailable(f"{name}: the client this link belongs to is gone")
        reply, fd = connection.fetch_fd(Op.CHUNK, device=f"cuda:{device}", segment=name)
        try:
            size = int(reply["size"])
        except (KeyError, TypeError, ValueError):
            os.close(fd)
            raise ProtocolError(f"chunk {name!r}: the broker's reply has no size") from None
        try:
            ptr = rt.vmm_open(device, fd, size)
        except Exception as exc:
            raise InvalidRequest(
                f"cuda:{device} could not map {name} from the descriptor its broker passed: "
                f"{exc} (the broker serves it with --cuda-handles vmm; a driver without VMM "
                "here needs the broker's legacy handles)"
            ) from None
        finally:
            os.close(fd)
        return Opened(rt, device, ptr, is_event=False, size=size)

    def event(self, device: int, event_id: int, handle: bytes) -> Opened:
        found = self._events.get((device, event_id))
        if found is None:
            rt = self.runtime("opening an event")
            with self._lock:
                found = self._events.get((device, event_id))
                if found is None:
                    ev = rt.open_event(device, handle)
                    found = self._events[device, event_id] = Opened(rt, device, ev, is_event=True)
        return found

    # -- ordering --------------------------------------------------------------------------

    def join(self, device: int, streams: set[int]) -> int:
        """One stream whose work from now on comes after all work enqueued so far on
        `streams` (the stream itself if there is one; else this client's own stream, made
        to wait on each)."""
        rt = self.runtime("joining streams")
        if len(streams) == 1:
            return next(iter(streams))
        with self._lock:
            private = self._private.get(device)
            if private is None:
                private = self._private[device] = rt.new_stream(device)
        for stream in streams:
            marker = rt.new_event(device, interprocess=False)
            rt.record(device, marker, stream)
            rt.wait(device, private, marker)
            rt.destroy_event(device, marker)  # freed by CUDA once the wait no longer needs it
        return private

    def record_after(self, device: int, event: Opened, streams: set[int]) -> int:
        """Record `event` after the work enqueued so far on `streams` (the legacy default
        stream if none); the stream it was recorded on."""
        stream = self.join(device, streams or {STREAM_LEGACY})
        self.runtime("recording an event").record(device, event.address, stream)
        return stream

    def keep_until_done(self, device: int, stream: int, keep: Any) -> None:
        """Hold `keep` (a put's sources) until the work enqueued on `stream` has run."""
        rt = self.runtime("tracking a copy")
        fence = rt.new_event(device, interprocess=False)
        rt.record(device, fence, stream)
        with self._lock:
            self._inflight.append((device, fence, keep))

    def finish(self, lease: Any, releases: queue.SimpleQueue[int]) -> None:
        """From a lease's finaliser: record its read-done event later, then release it."""
        self._finishing.put((lease, releases))

    def settle(self) -> None:
        """On the release thread: record the read-done events of leases let go of, pass them
        on to be released, and drop the sources of puts whose copies have run."""
        while not self._finishing.empty():
            lease, releases = self._finishing.get_nowait()
            try:
                if lease.unknown:  # work on streams we cannot name: let the device finish it
                    self.runtime("releasing").synchronize(lease.device)
                # A reader's read-done event; a `create` writer's lease (it may have used the
                # buffer after the seal) records the write event again, which readers and
                # the broker wait on too.
                event = lease.read if lease.read is not None else lease.write
                self.record_after(lease.device, event, lease.streams)
            except Exception as exc:  # a stream destroyed since, say: wait for the device
                log.warning("recording a read-done event failed (%s); synchronising cuda:%d "
                            "before the release instead", exc, lease.device)  # fmt: skip
                self.runtime("synchronising").synchronize(lease.device)
            releases.put(lease.id)
        if self._inflight:
            rt = self.runtime("tracking copies")
            still: list[tuple[int, int, Any]] = []
            done: list[tuple[int, int, Any]] = []
            with self._lock:
                for item in self._inflight:
                    (done if rt.event_done(item[0], item[1]) else still).append(item)
                self._inflight = still
            for device, fence, _ in done:
                rt.destroy_event(device, fence)

    def drain(self) -> None:
        """Wait until the copies of this client's puts have run: a process that exits with a
        copy still queued takes it with it (Note [a producer that dies with its copy queued]
        in server/store/registry.py). Called at close; the one host wait of a producer."""
        with self._lock:
            pending = list(self._inflight)
        if not pending:
            return
        rt = self.runtime("closing")
        deadline = time.monotonic() + DRAIN_TIMEOUT
        for device, fence, _ in pending:
            while not rt.event_done(device, fence):
                if time.monotonic() > deadline:
                    log.warning("closing with puts whose copies still wait on the GPU after "
                                "%.0fs: if this process exits first, the broker removes "
                                "their objects", DRAIN_TIMEOUT)  # fmt: skip
                    return
                time.sleep(0.0005)
        self.settle()

    # -- copying ---------------------------------------------------------------------------

    def copy(self, device: int, copies: list[tuple[int, Any, DType, int]]) -> None:
        """Enqueue copies of sources (each a DeviceSource on `device`, or a compact host
        array) to compact device memory: (destination, source, dtype, stream) each. Compact
        sources that lie end to end, copied on one stream to memory end to end (a flat
        parameter buffer's tensors, say), go in one copy; the others in one call into the
        runtime (`copy_batch`), in order."""
        rt = self.runtime("copying")
        runs: list[list[int]] = []  # [destination, source, bytes, stream] each
        for dst, src, dt, stream in copies:
            if isinstance(src, np.ndarray):
                ptr, nbytes = src.ctypes.data, src.nbytes
            elif src.compact:
                ptr, nbytes = src.ptr, dt.nbytes(src.shape)
            else:  # (the runs before it first: copies on one stream keep their order)
                if runs:
                    rt.copy_batch(device, runs)
                runs = []
                _strided_copy(device, dst, src, dt, stream)
                continue
            run = runs[-1] if runs else None
            if run and run[3] == stream and run[0] + run[2] == dst and run[1] + run[2] == ptr:
                run[2] += nbytes
                continue
            runs.append([dst, ptr, nbytes, stream])
        if len(runs) == 1:
            rt.copy_async(device, *runs[0])
        elif runs:
            rt.copy_batch(device, runs)

    def clear(self) -> None:
        """Forget what this client opened; each closes once no array uses it."""
        with self._lock:
            self._chunks.clear()
            self._events.clear()


def _strided_copy(device: int, dst: int, src: DeviceSource, dt: DType, stream: int) -> None:
    """A non-compact device tensor into compact memory: CuPy's elementwise copy."""
    try:
        import cupy
    except ImportError:
        raise InvalidRequest(
            "putting a non-contiguous CUDA tensor needs CuPy (pip install "
            "'tensorbroker[cuda12]' or [cuda13]); or make it contiguous first (.contiguous())"
        ) from None
    storage = np.dtype(dt.typestr)  # bfloat16 moves as uint16: same bytes
    strides = src.strides or compact_strides(src.shape)
    low = sum((n - 1) * s for n, s in zip(src.shape, strides, strict=True) if s < 0)
    high = sum((n - 1) * s for n, s in zip(src.shape, strides, strict=True) if s > 0)
    span = (high - low + 1) * dt.itemsize
    nbytes = dt.nbytes(src.shape)
    with cupy.cuda.Device(device), cupy.cuda.ExternalStream(stream):
        mem = cupy.cuda.UnownedMemory(src.ptr + low * dt.itemsize, span, src.owner, device)
        source = cupy.ndarray(
            src.shape, storage, cupy.cuda.MemoryPointer(mem, -low * dt.itemsize),
            strides=tuple(s * dt.itemsize for s in strides),
        )  # fmt: skip
        target = cupy.ndarray(
            src.shape, storage,
            cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(dst, nbytes, None, device), 0),
        )  # fmt: skip
        target[...] = source
