"""The GPUs a broker serves: device memory in IPC-exported chunks, the interprocess events,
and blocks that wait for GPU work to finish before they are reused.

Note [device memory]

Each device has an arena like the host's, over chunks the broker allocates with plain
`cudaMalloc` (whole 2 MiB pages, never from a caching pool: an IPC handle exports the whole
allocation it points into). A chunk's IPC handle is taken once; a client opens it once and
keeps it open, so a get costs no `cudaIpcOpenMemHandle`. Chunks live until the broker stops,
so no client ever holds a handle to freed memory.

An object on a device carries events (Note [broker-owned events] in common/cudart.py): the
write event its producer records after the copy, and one read-done event per lease, which
its reader records on the streams it read on before it lets go. When the registry frees the
object, its block is *quarantined* until every one of those events has completed, and only
then goes back to the arena (and its events back to the pool):

    seal ─> live ─> retired, last lease released ─> quarantined ─events done─> free

Note [device handles]

A legacy IPC memory handle (`cudaIpcGetMemHandle`) is a bearer token: any process of any
user that sees its 64 bytes can map the memory, whatever this broker's uid and group checks
say. With `serve --cuda-handles vmm` a device's chunks are made with the driver's virtual
memory management instead (`cuMemCreate`, a POSIX file descriptor as the shareable handle:
common/cuvmm.py); a chunk's `handle` in replies is then only a name, and a client maps the
chunk from its descriptor, which it asks for once per process (`chunk`, server/store/chunks.py)
and which the broker passes with the reply over the client's lane (SCM_RIGHTS), so only a
process that passed hello gets it. A device whose driver makes no such memory keeps legacy
handles (logged; `stats()["devices"][...]["handles"]` says which). Measured on an H100 by
issue 36's probe: a VMM chunk's descriptor maps in another uid and in other namespaces,
where a legacy event does not open. Not yet: the ordering of a reader of another uid, which
still needs the legacy interprocess events; and this path has not run on a GPU here (the
default stays legacy until it has).

Note [events of dead processes]

An event recorded by a process that dies with the recorded work still queued never
completes: on an H100 it stayed "not ready" for as long as it was watched, and a record of
it by another, live process did not bring it back (still "not ready" 5 s after a record
behind a 0.5 s kernel; bench/gpu_probes.py). So when the broker learns of such a death
(the client's pidfd), it counts that process's events as done (`forget`), which frees the
memory they held back, and destroys them instead of pooling them: a reused one would make
every reader of the next object wait on the GPU forever. What a dead producer's sealed
objects lose is in Note [a producer that dies with its copy queued] (registry.py).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ...common.config import format_size
from ...common.cudart import CHUNK_ALIGN, VMM_HANDLE, CudaUnavailable, Runtime, device_index
from ...common.errors import InvalidRequest
from .arena import Arena, Block
from .segments import Segment, ShmExhausted

log = logging.getLogger(__name__)

DEFAULT_FRACTION = 0.5  # of each device's free memory, when --cuda-memory names no size
RECLAIM_POLL = 0.001  # how often the broker looks at the events of blocks waiting for GPU work


class DeviceChunk(Segment):
    """One chunk of a device's memory, and what a client opens it by: a cudaMalloc'd chunk's
    IPC handle, or (`fd` >= 0) a VMM chunk's file descriptor, passed to each client that asks
    (Note [device handles]), its `handle` then only a name unique to it."""

    runtime: Runtime
    device: int = 0
    ptr: int = 0
    handle: bytes = b""
    fd: int = -1

    @classmethod
    def allocate(
        cls, runtime: Runtime, device: int, name: str, size: int, vmm: bool = False
    ) -> DeviceChunk:
        chunk = cls()
        chunk.runtime, chunk.device, chunk.name, chunk.size = runtime, device, name, size
        if vmm:
            chunk.ptr, chunk.fd = runtime.vmm_malloc(device, size)
            chunk.handle = VMM_HANDLE + os.urandom(8).hex().encode() + b":" + name.encode()
        else:
            chunk.ptr = runtime.malloc(device, size)
            try:
                chunk.handle = runtime.mem_handle(device, chunk.ptr)
            except BaseException:
                runtime.free(device, chunk.ptr)
                raise
        kind = "a VMM chunk" if vmm else "an IPC chunk"
        log.info("allocated %s on cuda:%d (%s, %s)", name, device, format_size(size), kind)
        return chunk

    def unlink(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            if self.fd >= 0:
                self.runtime.vmm_close(self.device, ptr, self.size)
                os.close(self.fd)
                self.fd = -1
            else:
                self.runtime.free(self.device, ptr)


class DeviceArena(Arena):
    """The best-fit arena over one device's chunks."""

    def __init__(self, runtime: Runtime, device: int, capacity: int, vmm: bool = False) -> None:
        capacity = capacity // CHUNK_ALIGN * CHUNK_ALIGN  # so every chunk is whole pages
        if capacity < CHUNK_ALIGN:
            raise ValueError(f"cuda:{device} needs at least 2 MiB of memory, got {capacity} B")
        super().__init__(capacity, prefix=f"cuda:{device}/")
        self.runtime, self.device, self.vmm = runtime, device, vmm
        self._chunks = 0

    def _new_segment(self, size: int) -> Segment:
        self._chunks += 1
        try:
            return DeviceChunk.allocate(
                self.runtime, self.device, f"{self._prefix}{self._chunks}", size, self.vmm
            )
        except Exception as exc:  # CUDARuntimeError: the GPU's memory is taken (torch's cache?)
            raise ShmExhausted(
                f"cuda:{self.device} could not allocate a chunk of {format_size(size)}: {exc}"
            ) from None

    def chunk(self, name: str) -> DeviceChunk:
        chunk = self._segments[self._seg_index[name]]
        assert isinstance(chunk, DeviceChunk)
        return chunk

    def handle(self, name: str) -> bytes:
        return self.chunk(name).handle


@dataclass(eq=False, slots=True)
class Quarantined:
    device: int
    block: Block
    events: list[int]
    then: Callable[[], None]


@dataclass(eq=False)
class DeviceMemory:
    """Every device this broker serves, or why it serves none.

    `spec` maps device index -> bytes (0: the default fraction of its free memory); None
    serves every device CuPy finds, at the default fraction. `load` gives the runtime, and
    is called at most once.
    """

    load: Callable[[], Runtime] | None
    spec: dict[int, int] | None = None
    runtime: Runtime | None = None
    unavailable: str = "it serves host memory only"  # why CUDA requests are refused
    arenas: dict[int, DeviceArena] = field(default_factory=dict)
    quarantine: list[Quarantined] = field(default_factory=list)
    _count: int = 0  # devices CuPy sees
    on_free: Callable[[], None] | None = None  # told when blocks come back (puts may wait)
    on_chunk: Callable[[DeviceChunk], None] | None = None  # told of each new chunk (NIXL)
    handles: str = "legacy"  # or "vmm": how clients open the chunks (Note [device handles])
    _dead: set[int] = field(default_factory=set)  # events whose recorder died
    _events: dict[int, tuple[int, int, bytes]] = field(
        default_factory=dict
    )  # id -> dev, ev, handle
    _pool: dict[int, list[int]] = field(default_factory=dict)  # device -> idle event ids
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def start(self) -> None:
        """Find the devices (at broker start, so the log says what is served)."""
        if self.load is None or self.spec == {}:
            self.unavailable = "the broker was started with --cuda-memory off"
            return
        try:
            self.runtime = self.load()
        except CudaUnavailable as exc:
            self.unavailable = f"the broker cannot use CUDA: {exc}"
            log.info("serving host memory only: %s", exc)
            return
        count = self.runtime.device_count()
        wanted = self.spec if self.spec is not None else {i: 0 for i in range(count)}
        missing = sorted(i for i in wanted if i >= count)
        if missing:
            log.warning("--cuda-memory names cuda:%s, but CuPy sees %d device(s)", missing, count)
        self.spec = {i: size for i, size in wanted.items() if i < count}
        self._count = count
        log.info("serving CUDA devices %s", ", ".join(f"cuda:{i}" for i in self.spec) or "none")

    def arena(self, device: str) -> DeviceArena:
        """The arena of 'cuda:N', made at first use; InvalidRequest says why there is none."""
        index = device_index(device)
        found = self.arenas.get(index)
        if found is not None:
            return found
        if self.runtime is None or self.spec is None:
            raise InvalidRequest(f"cannot place a tensor on {device}: {self.unavailable}")
        if index not in self.spec:
            if index >= self._count:
                raise InvalidRequest(
                    f"cannot place a tensor on {device}: there is no such device; the broker "
                    f"sees {self._count} (cuda:0 to cuda:{self._count - 1})"
                )
            served = ", ".join(f"cuda:{i}" for i in self.spec) or "none"
            raise InvalidRequest(
                f"cannot place a tensor on {device}: this broker serves {served} "
                "(see its --cuda-memory)"
            )
        size = self.spec[index]
        if size == 0:
            free, _ = self.runtime.mem_info(index)
            size = int(free * DEFAULT_FRACTION)
        vmm = self.handles == "vmm" and self.runtime.vmm_supported(index)
        if self.handles == "vmm" and not vmm:
            log.warning("cuda:%d makes no memory a file descriptor names: IPC handles", index)
        found = self.arenas[index] = DeviceArena(self.runtime, index, size, vmm)
        found._on_segment = self._chunk_made
        log.info("cuda:%d: up to %s", index, format_size(found.capacity))
        return found

    def _chunk_made(self, chunk: Segment) -> None:
        if self.on_chunk is not None and isinstance(chunk, DeviceChunk):
            self.on_chunk(chunk)

    # -- events --------------------------------------------------------------------------

    def event(self, device: int) -> tuple[int, bytes]:
        """An idle interprocess event of `device`: its id and IPC handle."""
        pool = self._pool.setdefault(device, [])
        if pool:
            event_id = pool.pop()
            return event_id, self._events[event_id][2]
        assert self.runtime is not None
        ev = None
        try:
            ev = self.runtime.new_event(device, interprocess=True)
            handle = self.runtime.event_handle(device, ev)
        except Exception as exc:  # (a CUDA error: out of resources, say) the request says so
            if ev is not None:
                with contextlib.suppress(Exception):
                    self.runtime.destroy_event(device, ev)
            raise ShmExhausted(f"cuda:{device} could not make an event: {exc}") from None
        event_id = next(self._ids)
        self._events[event_id] = (device, ev, handle)
        return event_id, handle

    def handle(self, event_id: int) -> bytes:
        return self._events[event_id][2]

    def settle(self, events: list[int], read_done: int) -> None:
        """A reader let go: keep its read-done event with the object's (`events`, the write
        event first) until it completes, and give back those of earlier readers that have."""
        for event_id in events[1:]:
            if self.finished(event_id):
                events.remove(event_id)
                self._recycle(event_id)
        events.append(read_done)

    def _recycle(self, event_id: int) -> None:
        """An event whose work is done goes back to the pool; one a dead process recorded is
        destroyed instead (Note [events of dead processes])."""
        device, ev, _ = self._events[event_id]
        if event_id not in self._dead:
            self._pool.setdefault(device, []).append(event_id)
            return
        self._dead.discard(event_id)
        del self._events[event_id]
        assert self.runtime is not None
        try:
            self.runtime.destroy_event(device, ev)
        except Exception as exc:
            log.debug("destroying an event on cuda:%d: %s", device, exc)

    # -- freeing ---------------------------------------------------------------------------

    def retire(
        self, device: int, block: Block, events: list[int], then: Callable[[], None]
    ) -> None:
        """Free `block` once its events have completed, then call `then`."""
        self.quarantine.append(Quarantined(device, block, events, then))
        self.reclaim()

    def reclaim(self) -> int:
        """Free the quarantined blocks whose GPU work is done; how many were freed."""
        if not self.quarantine:
            return 0
        waiting: list[Quarantined] = []
        done: list[Quarantined] = []
        for q in self.quarantine:
            (done if all(self.finished(e) for e in q.events) else waiting).append(q)
        self.quarantine = waiting
        for q in done:
            self.arenas[q.device].free(q.block)
            for event_id in q.events:
                self._recycle(event_id)
            q.then()
        if done and self.on_free is not None:
            self.on_free()
        return len(done)

    def forget(self, events: list[int]) -> None:
        """The process that recorded these events died: count them as done, and never hand
        them out again (Note [events of dead processes])."""
        self._dead.update(events)

    def finished(self, event_id: int) -> bool:
        """Whether the work an event last captured has run (or its recorder died)."""
        if event_id in self._dead:
            return True
        device, ev, _ = self._events[event_id]
        assert self.runtime is not None
        try:
            return self.runtime.event_done(device, ev)
        except Exception as exc:  # a broken context: nothing will ever complete the event
            log.warning(
                "querying an event on cuda:%d failed (%s): counting it as done", device, exc
            )
            return True

    def stats(self) -> dict[str, dict[str, Any]]:
        return {
            f"cuda:{i}": {
                **a.stats(),  # its segments are its chunks
                "waiting_bytes": sum(q.block.size for q in self.quarantine if q.device == i),
                "handles": "vmm" if a.vmm else "legacy",  # (Note [device handles])
            }
            for i, a in self.arenas.items()
        }

    def close(self) -> None:
        """Free every chunk and event. Clients' handles to them become invalid."""
        for arena in self.arenas.values():
            arena.close()
        self.arenas.clear()
        if self.runtime is not None:
            for device, ev, _ in self._events.values():
                try:
                    self.runtime.destroy_event(device, ev)
                except Exception as exc:
                    log.debug("destroying an event on cuda:%d: %s", device, exc)
        self._events.clear()
        self._pool.clear()
        self.quarantine.clear()
